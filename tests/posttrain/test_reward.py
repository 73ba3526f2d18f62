"""The reward model (train_reward_model.py, megatron/posttrain/reward.py) and its Hugging Face export.

- against a plain-PyTorch reward model on HF GPT2ForSequenceClassification with the same weights (HF's own pooling
  at the last token that is not pad_token_id; DeepSpeed-Chat's divergence loss as its reward_model.py loops over
  the pairs): two AdamW steps (lr 0.1, eps 1, clipping at 10, below the first step's norm, so the norm shapes that
  step) on the same pairs in the same order: the logged loss, accuracy, chosen and rejected scores and the gradient
  norm of both steps (1e-5), the weights' change over the two steps, the head's included (5e-5 of it), at mp1 (2
  micro-batches), mp2, ZeRO-3 dp2, and mp1 with --reward-loss divergence. At mp2 the gradient norm catches a head
  counted on both ranks, or a head whose input's gradient is summed over the ranks (the trunk's gradient doubled).
- the loss and its sign, the scored token (the last that is not end-of-text, not the first), no bias in the head.
- the export: tools/convert_to_hf.py writes a GPT2ForSequenceClassification whose scores of the validation pairs
  give exactly the validation loss, accuracy and scores the run printed (our model on the final weights).
- a start from an LM checkpoint (no head): the head starts fresh, the trunk is the checkpoint's.
- the default preference data (tools/prepare_sft_data.py: data/sft's chatterbot examples, each answer against 4
  answers from other topics): a tiny model fine-tuned on the SFT data, then trained as a reward model (200 + 200
  steps of 16, ~45 s here), scores held-out pairs well above chance (0.71-0.73 of 448; asserted >= 0.65).
- bad flags (pipeline parallelism, pretraining flags, no --load, an unknown loss) exit with one line.
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.spawn import run_distributed
from tests.helpers import spread_seeds  # (and puts tools/ on sys.path)
from tests.posttrain.test_preference import _preprocess, write_pairs
from tests.posttrain.test_sft import HF_SHAPE, _model_flags, _saved_weights_as_hf

import convert_to_hf  # noqa: E402

SEQ = 48
SPLIT = "8,4,0"          # 12 pairs: 8 train (two steps of 4), 4 valid (one global batch)
CLIP = 10.0
TWO_STEPS = ["--train-iters", "2", "--lr", "0.1", "--adam-eps", "1", "--weight-decay", "0", "--clip-grad", str(CLIP),
             "--lr-decay-style", "constant", "--warmup", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--eval-iters", "1", "--log-interval", "1", "--batch-size", "2", "--global-batch-size", "4"]
RUNS = {1: {"mp1": [], "divergence": ["--reward-loss", "divergence"]},
        2: {"mp2": ["--model-parallel-size", "2"], "zero3-dp2": ["--deepspeed", "--zero-stage", "3"]}}
METRICS = ("lm loss", "accuracy", "chosen score", "rejected score")


def _train(args_list):
    import train_reward_model
    return train_reward_model.main(args_list)


def _run_reward_jobs(jobs):
    """Run (name, args) train_reward_model.main jobs in order in this worker: {name: the history's loss and final
    validation}; model-parallel groups are rebuilt for each."""
    import mpu
    results = {}
    for name, payload in jobs:
        history = _train(payload)
        results[name] = {key: history.get(key) for key in ("lm loss", "final_valid")}
        mpu.destroy_model_parallel()
    return results


def _write_start(directory, hf, with_head=True, deepspeed=False):
    """Our release checkpoint of `hf` (a GPT2ForSequenceClassification): the trunk, and its score as our head
    (deepspeed: in the ZeRO layout)."""
    from megatron.checkpoint.full_checkpoint import write_full_checkpoint
    from megatron.model.hf_interchange import from_hf_state_dict
    state = {key: value.detach().clone() for key, value in hf.state_dict().items()}
    score = state.pop("score.weight")
    weights, model_config = from_hf_state_dict(state, hf.config.to_dict())
    if with_head:
        weights["score.weight"] = score
    write_full_checkpoint(directory, weights, model_config, 1, deepspeed=deepspeed)
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory, webtext_data):
    from transformers import GPT2Config, GPT2ForSequenceClassification
    root = tmp_path_factory.mktemp("reward")
    prefix = _preprocess(root, webtext_data, write_pairs(str(root / "pairs.jsonl")), "--seq-length", str(SEQ))
    torch.manual_seed(0)
    hf = GPT2ForSequenceClassification(GPT2Config(**HF_SHAPE, num_labels=1, pad_token_id=0, resid_pdrop=0.0,
                                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        hf.score.weight.mul_(20.0)   # scores of order 1: the pairs' margins are far from 0
    hf_dir = str(root / "hf")
    hf.save_pretrained(hf_dir, safe_serialization=True)
    zero3 = str(root / "zero3.json")
    with open(zero3, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
                   "zero_optimization": {"stage": 3}}, handle)
    return {"root": root, "prefix": prefix, "hf_dir": hf_dir, "start": _write_start(str(root / "start"), hf),
            "lm_start": _write_start(str(root / "lm_start"), hf, with_head=False), "zero3": zero3,
            "lm_start_zero": _write_start(str(root / "lm_start_zero"), hf, with_head=False, deepspeed=True),
            "webtext": webtext_data}


def _reward_args(setup, name, flags, load=None):
    extra = ["--deepspeed_config", setup["zero3"]] if "--deepspeed" in flags else []
    return _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"], "--split", SPLIT, "--load",
                                              load or setup["start"], "--save", str(setup["root"] / name),
                                              "--log-jsonl", str(setup["root"] / f"{name}.jsonl")] + \
        TWO_STEPS + flags + extra


def _logged(setup, name):
    records = [json.loads(line) for line in open(setup["root"] / f"{name}.jsonl")]
    return [dict(r["losses"], grad_norm=r["grad_norm"]) for r in records if r.get("type") == "train"]


@pytest.fixture(scope="module")
def runs(setup):
    results = {}
    for world, named in RUNS.items():
        jobs = [(name, _reward_args(setup, name, flags)) for name, flags in named.items()]
        if world == 1:
            jobs.append(("fresh", _reward_args(setup, "fresh", ["--train-iters", "0"], load=setup["lm_start"])))
        else:   # the ZeRO engine's own load of a ZeRO LM checkpoint, at stage 3
            jobs.append(("fresh-zero3", _reward_args(setup, "fresh-zero3", ["--train-iters", "0", "--deepspeed",
                                                                            "--zero-stage", "3"],
                                                     load=setup["lm_start_zero"])))
        results.update(run_distributed(_run_reward_jobs, world, args=(jobs,), timeout=900)[0])
    return results


# ---------------------------------------------------------------------------------------------------- reference

def _pairs(setup, split):
    """The split's pairs in our order: [(chosen ids, rejected ids)] (whole conversations, end-of-text included)."""
    from megatron.posttrain import build_preference_datasets
    datasets = build_preference_datasets(setup["prefix"], SPLIT, [8, 4, 0], SEQ, 5, 0)
    dataset = datasets[0 if split == "train" else 1]
    pairs = []
    for index in range(len(dataset)):
        sample = dataset[index]
        rows = [torch.from_numpy(sample["text"][row][sample["segments"][row] > 0]) for row in range(2)]
        assert all(len(row) <= SEQ for row in rows)     # nothing cut: the scored token is the answer's last
        pairs.append(rows)
    return pairs


def _padded(pairs):
    """[2n, SEQ + 1] rows c0 r0 c1 r1 ..., padded with end-of-text (0)."""
    ids = torch.zeros(2 * len(pairs), SEQ + 1, dtype=torch.long)
    for i, rows in enumerate(pairs):
        for j, row in enumerate(rows):
            ids[2 * i + j, :len(row)] = row
    return ids


def _divergence_loss(ids, rewards, pad_id=0):
    """DeepSpeed-Chat's RewardModel.forward loss (num_padding_at_beginning 0), one pair at a time."""
    chosen_ids, rejected_ids, chosen_rewards, rejected_rewards = ids[0::2], ids[1::2], rewards[0::2], rewards[1::2]
    seq_len = ids.size(1)
    loss = 0.0
    for i in range(chosen_ids.size(0)):
        c_inds = (chosen_ids[i] == pad_id).nonzero()
        c_ind = c_inds[0].item() if len(c_inds) > 0 else seq_len
        check_divergence = (chosen_ids[i] != rejected_ids[i]).nonzero()
        r_inds = (rejected_ids[i] == pad_id).nonzero()
        r_ind = r_inds[0].item() if len(r_inds) > 0 else seq_len
        end_ind = max(c_ind, r_ind)
        divergence_ind = check_divergence[0].item()
        assert 0 < divergence_ind < end_ind
        loss = loss + -F.logsigmoid(chosen_rewards[i, divergence_ind:end_ind]
                                    - rejected_rewards[i, divergence_ind:end_ind]).mean()
    return loss / chosen_ids.size(0)


def _hf_metrics(model, pairs, loss_kind):
    """(loss tensor, {metric: float}) of a GPT2ForSequenceClassification on the pairs."""
    ids = _padded(pairs)
    scores = model(input_ids=ids).logits[:, 0].view(-1, 2)           # HF's pooling: the last non-pad token
    chosen, rejected = scores[:, 0], scores[:, 1]
    if loss_kind == "divergence":
        rewards = model.score(model.transformer(input_ids=ids).last_hidden_state)[..., 0]   # [2n, S + 1]
        loss = _divergence_loss(ids, rewards)
    else:
        loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, {"lm loss": loss.item(), "accuracy": (chosen > rejected).float().mean().item(),
                  "chosen score": chosen.mean().item(), "rejected score": rejected.mean().item()}


def _hf_reward_training(setup, loss_kind):
    """Two AdamW steps (clipping at CLIP) of the plain-PyTorch reward model: ([per step metrics + grad_norm], weights
    before, after). The model of setup["hf_dir"]: GPT2ForSequenceClassification, or LlamaForSequenceClassification
    (test_llama_posttrain.py)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(setup["hf_dir"]).float()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, eps=1.0, weight_decay=0.0)
    train = _pairs(setup, "train")
    steps = []
    for step in range(2):
        loss, metrics = _hf_metrics(model, train[4 * step:4 * step + 4], loss_kind)
        optimizer.zero_grad()
        loss.backward()
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
        steps.append(metrics)
    return steps, before, model.state_dict()


@pytest.fixture(scope="module")
def hf_runs(setup):
    return {kind: _hf_reward_training(setup, kind) for kind in ("last-token", "divergence")}


def _close(ours, theirs, what):
    assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)), (what, ours, theirs)


@pytest.mark.parametrize("name", [name for named in RUNS.values() for name in named])
def test_reward_loss_scores_accuracy_and_steps_equal_hf(setup, runs, hf_runs, name):
    steps, before, after = hf_runs["divergence" if name == "divergence" else "last-token"]
    logged = _logged(setup, name)
    assert len(logged) == 2
    assert steps[0]["grad_norm"] > 2 * CLIP, steps   # the clipping shapes both steps
    for ours, theirs in zip(logged, steps):
        for key in METRICS + ("grad_norm",):
            _close(ours[key], theirs[key], (name, key))
    saved = _saved_weights_as_hf(str(setup["root"] / name))
    assert set(saved) == set(before)                              # the trunk and score.weight, nothing else
    worst = 0.0
    for key, tensor in saved.items():
        step_hf, step_ours = after[key] - before[key], tensor - before[key]
        if key == "transformer.ln_f.bias":   # it shifts every reward alike: no gradient from a pair difference
            assert step_hf.abs().max() < 1e-6 and step_ours.abs().max() < 1e-6, key
            continue
        assert step_hf.abs().max() > 0, key
        worst = max(worst, ((step_ours - step_hf).abs().max() / step_hf.abs().max()).item())
    print(f"{name}: losses {[r['lm loss'] for r in logged]} (HF {[s['lm loss'] for s in steps]}), accuracy "
          f"{[r['accuracy'] for r in logged]}, grad norms {[r['grad_norm'] for r in logged]}, two steps vs HF's: "
          f"{worst:.2e} relative")
    # fp32 noise of two implementations over two Adam steps (the metrics above hold 1e-5): under 5e-5 and 8.8e-5
    # (a layer norm's weight) on the two default vocabularies seen; a wrong loss, score or head moves it by >1e-2.
    assert worst <= 2e-4, f"{name}: the weights' change differs from HF's by {worst:.2e} (relative, worst tensor)"


@pytest.mark.parametrize("name", ["mp1", "zero3-dp2"])
def test_exported_sequence_classifier_gives_the_validation_scores(setup, runs, tmp_path, name):
    from transformers import GPT2ForSequenceClassification
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", str(setup["root"] / name), "--output", out, "--vocab-file",
                               os.path.join(setup["webtext"], "vocab.json"), "--merge-file",
                               os.path.join(setup["webtext"], "merges.txt")]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["GPT2ForSequenceClassification"] and config["pad_token_id"] == 0
    model = GPT2ForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1 and model.score.bias is None
    with torch.no_grad():
        _, metrics = _hf_metrics(model, _pairs(setup, "valid"), "last-token")
    printed = runs[name]["final_valid"]
    for key in METRICS:
        _close(printed[key], metrics[key], (name, key))
    print(f"{name}: validation {printed}, the export's {metrics}")


@pytest.mark.parametrize("name", ["fresh", "fresh-zero3"])
def test_lm_checkpoint_starts_a_fresh_head(setup, runs, name):
    """--load of an LM checkpoint (no score.weight): the trunk is the checkpoint's, the head its normal init
    (Megatron path: load_state_dict's pre-hook; ZeRO-3 of a ZeRO checkpoint: the engine's own load)."""
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    weights = read_full_checkpoint(str(setup["root"] / name)).fp32_weights()
    start = read_full_checkpoint(setup["start"]).fp32_weights()
    assert set(weights) == set(start)
    for key in start:
        if key != "score.weight":
            assert torch.equal(weights[key], start[key]), key
    head = weights["score.weight"]
    assert head.shape == (1, 32) and 0.005 < head.std().item() < 0.05       # normal(0, 0.02), not the start's
    assert not torch.allclose(head, start["score.weight"])


def test_bad_flags_are_one_line(setup, tmp_path, capsys):
    import train_reward_model
    base = _model_flags(setup["webtext"]) + ["--data-path", setup["prefix"]]
    cases = [([], "a reward model starts from a checkpoint: pass --load DIR"),
             (["--load", str(tmp_path)], f"{tmp_path} holds no latest_checkpointed_iteration.txt"),
             (["--load", setup["start"], "--pipeline-model-parallel-size", "2"], "drop --pipeline-model-parallel-size"),
             (["--load", setup["start"], "--train-data", "webtext"], "--train-data is a pretraining flag"),
             (["--load", setup["start"], "--reward-loss", "hinge"], "invalid choice: 'hinge'"),
             (["--load", setup["start"], "--eval-tasks", "hellaswag"], "a reward model outputs a score: drop it")]
    for flags, message in cases:
        with pytest.raises(SystemExit) as stop:
            train_reward_model.starting_point(base + flags)
        error = capsys.readouterr().err
        assert stop.value.code == 2 and len(error.strip().splitlines()) == 1 and message in error, error
    assert train_reward_model.starting_point(base + ["--load", setup["start"]]) == base + ["--load", setup["start"]]


# ---------------------------------------------------------------------------------------------------- default data

TINY_DEFAULT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                "--max-position-embeddings", "64", "--seed", "3", "--batch-size", "16", "--train-iters", "200",
                "--lr-decay-style", "cosine", "--warmup", "0.05", "--weight-decay", "0.01", "--log-interval", "100",
                "--eval-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0"]
HELD_OUT_PAIRS = 224     # of the 236 validation pairs: 14 batches of 16


@pytest.mark.parametrize("seed", spread_seeds(3))
def test_default_data_reward_model_generalises(tmp_path, webtext_data, sft_dir, seed):
    """The default chat pairs (tools/prepare_sft_data.py) train a reward model that scores held-out pairs well above
    chance. A tiny GPT-2 (h64, L2, from a random init) is fine-tuned on the default SFT data (200 steps of 16, lr
    3e-3: the embeddings learn which words go together), then trained as a reward model on the default pairs (200
    steps of 16, lr 1e-3): its accuracy on the 448 held-out pairs (224 of valid, 224 of test; 112 questions no
    training pair has) is >= 0.62 (chance is 0.5) and its training accuracy rises by more than 0.03. Spread
    (default data 845b8bad124aace2, --seed 3, 1, 2, 4, 5): held-out 0.703, 0.703, 0.712, 0.685, 0.699 (min 0.685,
    median 0.703, max 0.712; the bound is 0.065 under the smallest, seven standard deviations of 0.009); training
    accuracy rises 0.097, 0.082, 0.131, 0.076, 0.101 (min 0.076). The data: every held-out example has 4 pairs, together, each rejected answer one of its split's answers
    from another topic file, none the chosen one."""
    pytest.importorskip("yaml")
    pytest.importorskip("chatterbot_corpus")
    import functools
    import prepare_sft_data
    from megatron.checkpoint.full_checkpoint import write_full_checkpoint
    from megatron.model.hf_interchange import from_hf_state_dict
    from tests.posttrain.test_sft import _run_jobs
    from transformers import GPT2Config, GPT2Model as HFGPT2Model
    sft_dir = str(sft_dir)                   # the session's default chat data (conftest.py)
    with open(os.path.join(sft_dir, "chatterbot.json")) as handle:
        manifest = json.load(handle)
    preference = manifest["preference"]
    rows = [json.loads(line) for line in open(os.path.join(sft_dir, "preference_valid.jsonl"), encoding="utf-8")]
    examples = [json.loads(line) for line in open(os.path.join(sft_dir, "valid.jsonl"), encoding="utf-8")]
    assert preference["counts"]["valid"] == len(rows) == 4 * len(examples) >= HELD_OUT_PAIRS
    topic_of = {(prompt, response): name for name, prompt, response in
                prepare_sft_data.read_pairs(prepare_sft_data.corpus_dir())[0]}
    answer_topics = {}
    for row in examples:
        answer_topics.setdefault(row["response"], set()).add(topic_of[(row["prompt"], row["response"])])
    for example, group in zip(examples, zip(*[iter(rows)] * 4)):     # 4 pairs per example, together, in order
        assert {(row["prompt"], row["chosen"]) for row in group} == {(example["prompt"], example["response"])}
        rejected = [row["rejected"] for row in group]
        assert len(set(rejected)) == 4 and example["response"] not in rejected
        topic = topic_of[(example["prompt"], example["response"])]
        assert all(answer_topics[answer] - {topic} for answer in rejected), (topic, rejected)   # another topic's
    torch.manual_seed(0)
    seeded = [str(seed) if before == "--seed" else flag for before, flag in zip([None] + TINY_DEFAULT, TINY_DEFAULT)]
    vocab = len(json.load(open(os.path.join(webtext_data, "vocab.json"))))
    hf = HFGPT2Model(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=vocab,
                                activation_function="gelu_new"))
    weights, model_config = from_hf_state_dict(hf.state_dict(), hf.config.to_dict())
    write_full_checkpoint(str(tmp_path / "start"), weights, model_config, 1)
    tokenizer = ["--vocab-file", os.path.join(webtext_data, "vocab.json"), "--merge-file",
                 os.path.join(webtext_data, "merges.txt")]
    sft = seeded + tokenizer + ["--lr", "3e-3", "--eval-iters", "3", "--load", str(tmp_path / "start"),
                                      "--save", str(tmp_path / "sft_ckpt"), "--data-path",
                                      os.path.join(sft_dir, manifest["data_prefix"]), "--split", manifest["split"]]
    reward = seeded + tokenizer + ["--lr", "1e-3", "--eval-iters", str(HELD_OUT_PAIRS // 16), "--load",
                                         str(tmp_path / "sft_ckpt"), "--save", str(tmp_path / "rm"), "--data-path",
                                         os.path.join(sft_dir, preference["data_prefix"]), "--split",
                                         preference["split"], "--log-jsonl", str(tmp_path / "rm.jsonl")]
    jobs = [("sft", "finetune", sft), ("rm", "call", functools.partial(_train, reward))]
    run_distributed(_run_jobs, 1, args=(jobs,), timeout=900)
    records = [json.loads(line) for line in open(tmp_path / "rm.jsonl")]
    table = [(r["split"], r["iteration"], r["losses"]["accuracy"]) for r in records if r.get("type") == "validation"]
    trained = [(r["iteration"], r["losses"]["accuracy"]) for r in records if r.get("type") == "train"]
    print("held-out accuracy (split, iteration, accuracy):", table, "training accuracy:", trained)
    final = {split: accuracy for split, iteration, accuracy in table if iteration == 200}   # the end's, last
    print(f"spread: reward_heldout_accuracy seed={seed} valid={final.get('valid')} test={final.get('test')} "
          f"mean={(final.get('valid', 0) + final.get('test', 0)) / 2:.4f} train={trained[0][1]:.4f}->{trained[-1][1]:.4f}")
    assert set(final) == {"valid", "test"} and (final["valid"] + final["test"]) / 2 >= 0.62, (table, trained)
    assert trained[-1][1] > trained[0][1] + 0.03, (table, trained)
