"""The embedded default for RLHF: scripts/rlhf.sh (make rlhf) runs GRPO with a verifiable reward (the answer's
length, megatron/posttrain/rlhf_rewards.py) and the mean reward of sampled validation answers rises."""
import json
import re

import pytest

from tests.helpers import run_script, SCRIPT_TEST_SHAPE, spread_seeds

pytest.importorskip("yaml")
pytest.importorskip("chatterbot_corpus")


@pytest.mark.parametrize("seed", spread_seeds(1234))
def test_rlhf_sh_reward_rises(tmp_path, sft_dir, ds_pretrained, seed):
    """The session's 20-iteration ZeRO-2 pretraining (ds_pretrained) as the base, 12 GRPO steps (full fine-tuning,
    32 completions of at most 16 tokens, lr 1e-2): the mean reward of 2 validation rollouts (fixed seeds) rises by
    at least 0.06, as does the training reward; both print, the validation points are in the log, the plot is
    written. Spread (default data 845b8bad124aace2, --seed 1234, 1, 2, 3, 4): rises 0.146, 0.135, 0.161, 0.161,
    0.138 (min 0.135, median 0.146, max 0.161): the bound is under half the smallest. With the advantages negated
    the reward falls (0.604 -> 0.539 on the previous corpus), so a rise of 0.06 is learnt, not drift. Not LoRA here:
    on this barely trained base, LoRA rank 8's 12 steps move the reward by about as much with the advantages
    negated (0.604 -> 0.688 and 0.677), so its rise would not show that the reward is learnt."""
    base, _ = ds_pretrained
    out = tmp_path / "grpo"
    # scripts/rlhf.sh's own DS_CONFIG (rollouts of 32 completions), not the script tests' micro-batch-8 one
    shape = {key: value for key, value in SCRIPT_TEST_SHAPE.items() if key != "DS_CONFIG"}
    stdout = run_script("rlhf.sh", {**shape, "TRAIN_ITERS": "12", "LOG_INTERVAL": "4", "EVAL_ITERS": "2",
                                    "LR": "1e-2", "MAX_PROMPT": "40", "MAX_COMPLETION": "16", "LORA_RANK": "0",
                                    "SFT_DATA_DIR": str(sft_dir), "BASE_CHECKPOINT": str(base),
                                    "CHECKPOINT_PATH": str(out), "EXTRA_ARGS": f"--seed {seed}"})
    print(stdout)
    rewards = {when: float(value) for when, value in
               re.findall(r"^ mean reward (before|after) training \(2 validation rollouts\): ([0-9.]+)$", stdout, re.M)}
    print(f"spread: rlhf_reward_rise seed={seed} before={rewards.get('before')} after={rewards.get('after')}")
    assert set(rewards) == {"before", "after"} and rewards["after"] > rewards["before"] + 0.06, rewards
    records = [json.loads(line) for line in open(out / "log.jsonl")]
    trained = [r["losses"]["reward"] for r in records if r.get("type") == "train"]
    validation = [r["losses"]["reward"] for r in records if r.get("type") == "validation"]
    assert len(trained) == 3 and trained[-1] > trained[0], trained
    assert validation == pytest.approx([rewards["before"], rewards["after"]], abs=1e-6)
    assert f"plot: {out}/run.png and {out}/run.html (from {out}/log.jsonl)" in stdout
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
