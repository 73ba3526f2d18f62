"""The embedded default for fine-tuning: tools/prepare_sft_data.py builds data/sft/ from the chatterbot-corpus YAML
(deterministic, split by question), and scripts/finetune_gpt.sh (make finetune) LoRA-fine-tunes a pretrained
checkpoint under ZeRO-2, printing the validation perplexity and three held-out answers before and after."""
import json
import os
import re
import sys

import pytest

from tests.helpers import REPO, run_script, SCRIPT_TEST_SHAPE, spread_seeds
from tests import warm_python

sys.path.insert(0, os.path.join(REPO, "tools"))
import prepare_sft_data  # noqa: E402

yaml = pytest.importorskip("yaml")
pytest.importorskip("chatterbot_corpus")


def _jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def test_pairs_come_from_the_yaml_files():
    """Hand-checked against chatterbot_corpus/data/english/ai.yml and conversations.yml (1.3.3): the first pair of
    the first file; a multi-turn conversation gives one pair per consecutive turns; repeats are kept once."""
    pairs, skipped = prepare_sft_data.read_pairs(prepare_sft_data.corpus_dir())
    assert pairs[0] == ("ai.yml", "What is AI?", "Artificial Intelligence is the branch of engineering and science "
                        "devoted to constructing machines that think.")
    assert pairs[1][1:] == ("What is AI?", "AI is the field of science which concerns itself with building hardware "
                            "and software that replicates the functions of the human mind.")
    turns = ["Good morning, how are you?", "I am doing well, how about you?", "I'm also good.",
             "That's good to hear.", "Yes it is."]
    chained = [(p, r) for name, p, r in pairs if name == "conversations.yml"][:4]
    assert chained == list(zip(turns, turns[1:]))
    assert len(set((p, r) for _, p, r in pairs)) == len(pairs)
    overheating = [r for _, p, r in pairs if p == "My system is overheating."]
    assert overheating == ["Ensure air vents aren't blocked and clean any dust."]   # 4 times in tech_support.yml
    assert skipped == 1    # trivia.yml's one conversation written as a string
    assert len(pairs) == 1176


def test_split_is_deterministic_and_by_question(sft_dir, tmp_path, webtext_data):
    manifest = json.loads((sft_dir / "chatterbot.json").read_text())
    assert manifest["counts"] == {"train": 1058, "valid": 59, "test": 59} and manifest["split"] == "1058,59,59"
    splits = {name: _jsonl(sft_dir / f"{name}.jsonl") for name in prepare_sft_data.SPLITS}
    assert {name: len(rows) for name, rows in splits.items()} == manifest["counts"]
    questions = {name: {prepare_sft_data.question_key(row["prompt"]) for row in rows} for name, rows in splits.items()}
    assert not questions["train"] & questions["valid"] and not questions["train"] & questions["test"]
    assert not questions["valid"] & questions["test"]
    pairs, _ = prepare_sft_data.read_pairs(prepare_sft_data.corpus_dir())
    every = sorted((row["prompt"], row["response"]) for rows in splits.values() for row in rows)
    assert every == sorted((p, r) for _, p, r in pairs)
    assert min(len(splits["valid"]), len(splits["test"])) >= 0.05 * len(pairs)
    # The tokenized dataset holds train, then valid, then test, in the JSONL order: finetune_gpt.py's --split cuts
    # exactly there. Document 1058 is the first validation example, laid out by the deepspeed-chat template.
    from megatron.posttrain import open_sft_files
    from megatron.tokenizer import GPT2BPETokenizer
    ids, mask = open_sft_files(str(sft_dir / manifest["data_prefix"]))
    assert len(ids) == 1176
    tokenizer = GPT2BPETokenizer(os.path.join(webtext_data, "vocab.json"), os.path.join(webtext_data, "merges.txt"))
    first_valid = splits["valid"][0]
    text = tokenizer.detokenize([int(t) for t in ids[1058]])
    assert text == f" Human: {first_valid['prompt']} Assistant: {first_valid['response']}<|endoftext|>"
    answer = tokenizer.detokenize([int(t) for t, m in zip(ids[1058], mask[1058]) if m])
    assert answer == f" {first_valid['response']}<|endoftext|>"
    # Built again elsewhere: the same bytes; and a second call on a built directory is skipped.
    again = tmp_path / "again"
    assert prepare_sft_data.prepare(str(again), vocab_dir=webtext_data)["built"]
    for name in os.listdir(sft_dir):
        assert (again / name).read_bytes() == (sft_dir / name).read_bytes(), name
    assert not prepare_sft_data.prepare(str(again), vocab_dir=webtext_data)["built"]


def test_older_preference_pairs_are_rebuilt(sft_dir, tmp_path, webtext_data):
    """A data/sft/ whose preference pairs predate rejected_per_example (one random answer each) gets today's pairs
    on the next prepare, byte for byte a fresh build's, the SFT files untouched; another --rejected-per-example
    rebuilds them with that many pairs per example."""
    import shutil
    old = tmp_path / "old"
    shutil.copytree(sft_dir, old)
    manifest = json.loads((old / "chatterbot.json").read_text())
    del manifest["preference"]["rejected_per_example"]
    (old / "chatterbot.json").write_text(json.dumps(manifest))
    (old / "preference_valid.jsonl").write_text("")
    sft_files = {name: (old / name).read_bytes() for name in os.listdir(old) if "preference" not in name}
    assert not prepare_sft_data.prepare(str(old), vocab_dir=webtext_data)["built"]
    for name in os.listdir(sft_dir):
        assert (old / name).read_bytes() == (sft_dir / name).read_bytes(), name
    two = prepare_sft_data.prepare(str(old), vocab_dir=webtext_data, rejected_per_example=2)["preference"]
    assert two["counts"] == {"train": 2 * 1058, "valid": 2 * 59, "test": 2 * 59} and two["rejected_per_example"] == 2
    assert len(_jsonl(old / "preference_test.jsonl")) == 2 * 59
    assert {name: (old / name).read_bytes() for name in sft_files if name != "chatterbot.json"} == {
        name: data for name, data in sft_files.items() if name != "chatterbot.json"}


def test_another_seed_deals_other_questions():
    pairs, _ = prepare_sft_data.read_pairs(prepare_sft_data.corpus_dir())
    one, other = (prepare_sft_data.split_pairs(pairs, seed, 5.0, 5.0) for seed in (1234, 1235))
    assert one["test"] != other["test"]
    assert one == prepare_sft_data.split_pairs(pairs, 1234, 5.0, 5.0)


def test_missing_corpus_is_one_line(tmp_path):
    script = ("import sys; sys.modules['chatterbot_corpus'] = None; sys.argv = ['x', '--output-dir', sys.argv[1]]; "
              "sys.path.insert(0, 'tools'); import prepare_sft_data; prepare_sft_data.main()")
    result = warm_python.run([sys.executable, "-c", script, str(tmp_path / "sft")], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: the chatterbot-corpus package is not installed: pip install "
                                     "chatterbot-corpus==1.3.3 PyYAML (make install does)")


@pytest.mark.parametrize("seed", spread_seeds(1234))
def test_finetune_gpt_sh(tmp_path, sft_dir, ds_pretrained, seed):
    """The session's 20-iteration ZeRO-2 pretraining (ds_pretrained), then 20 LoRA steps: the validation perplexity
    drops by at least 3% (LoRA cannot sharpen the frozen, barely trained embeddings much further), both sets of
    answers print. Run a second time (make finetune again), it only re-evaluates and appends to the log (see
    _rerun_appends_to_the_log). Spread of after / before (default data 845b8bad124aace2, --seed 1234, 1, 2, 3, 4): 0.946,
    0.932, 0.932, 0.936, 0.941 (min 0.932, median 0.936, max 0.946; 2689.55 -> 2506-2544): the worst clears the
    bound by 0.024, four times the spread's standard deviation (0.005)."""
    base, _ = ds_pretrained
    env = {**SCRIPT_TEST_SHAPE, "LOG_INTERVAL": "10", "TRAIN_ITERS": "20",
           "EVAL_ITERS": "4",   # 4 validation batches, not the whole split
           "SFT_DATA_DIR": str(sft_dir), "BASE_CHECKPOINT": str(base), "CHECKPOINT_PATH": str(tmp_path / "lora"),
           "EXTRA_ARGS": f"--seed {seed}"}
    stdout = run_script("finetune_gpt.sh", env)
    before = float(re.search(r"^validation perplexity before fine-tuning: ([0-9.]+)$", stdout, re.M).group(1))
    after = float(re.search(r"^validation perplexity after fine-tuning: ([0-9.]+)$", stdout, re.M).group(1))
    print(f"spread: finetune_perplexity_ratio seed={seed} before={before} after={after} ratio={after / before:.4f}")
    assert after < 0.97 * before, (before, after)
    test_rows = _jsonl(sft_dir / "test.jsonl")[:3]
    for number, row in enumerate(test_rows, 1):
        block = re.search(rf"^question {number}: (.*)\n  reference: (.*)\n  before: (.*)\n  after:  (.*)$", stdout,
                          re.M)
        assert block.group(1, 2) == (row["prompt"], row["response"])
    assert (tmp_path / "lora" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    lora = tmp_path / "lora"
    assert f"plot: {lora}/run.png and {lora}/run.html (from {lora}/log.jsonl)" in stdout
    assert (lora / "run.png").stat().st_size > 10_000 and "<svg" in (lora / "run.html").read_text()
    _rerun_appends_to_the_log(env, lora)


def _rerun_appends_to_the_log(env, lora):
    """The same command again: nothing to train, the checkpoint re-evaluated; its header and evaluations are
    appended to log.jsonl after every byte the first run wrote (its training records kept: the plot is redrawn),
    and the "after" perplexity printed is the re-evaluation's."""
    first_log, first_plot = (lora / "log.jsonl").read_text(), (lora / "run.png").stat().st_mtime_ns
    assert [r["iteration"] for r in map(json.loads, first_log.splitlines()) if r["type"] == "train"] == [10, 20]
    stdout = run_script("finetune_gpt.sh", env)
    log = (lora / "log.jsonl").read_text()
    assert log.startswith(first_log)
    appended = [json.loads(line) for line in log[len(first_log):].splitlines()]
    assert [(r["type"], r["iteration"], r.get("split")) for r in appended] == [
        ("header", 20, None), ("validation", 20, "valid"), ("validation", 20, "test")]
    after = re.search(r"^validation perplexity after fine-tuning: ([0-9.]+)$", stdout, re.M).group(1)
    assert after == f"{appended[1]['ppl']['lm loss']:.2f}"
    assert f"plot: {lora}/run.png and {lora}/run.html (from {lora}/log.jsonl)" in stdout
    assert (lora / "run.png").stat().st_mtime_ns > first_plot
