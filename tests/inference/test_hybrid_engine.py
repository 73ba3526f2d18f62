"""Generation from the model being trained (generate_from_training_model on the ZeRO engine and on the Megatron
path's model): greedy tokens equal
Hugging Face generate on the engine's current weights with different prompts, lengths and stopping points on each
data-parallel rank; stage 3 gathers each buffer once per call (not per token) and releases everything after;
training with generate calls between its steps is bitwise the training without them (dropout on, so a consumed
RNG or a forgotten eval mode shows); finetune_gpt.py --sample-every prints samples and trains as without them."""
import pytest
import torch
import torch.distributed as dist

from megatron.spawn import run_distributed
from tests.helpers import count_stage3_gathers
from tests.inference.test_generation import CONFIG, _hf_greedy
from tests.posttrain.test_sft import _finetune_args, setup  # noqa: F401  (setup: the SFT fixture)

THRESHOLD = 40                      # the LayerNorms (32) stay whole; every other parameter is partitioned
PROMPTS = {0: [[5, 9, 3, 17, 40, 2, 8], [11]], 1: [[60, 61, 7, 33], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]}
NEW = {0: 3, 1: 11}                 # data-parallel rank 1 decodes for longer: rank 0 finishes first
SAME = [[5, 9, 3], [11, 12]]        # the same prompts on every rank (the gather counts)


def _model(dropout=0.0, seed=1234):
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    torch.manual_seed(seed)
    mpu.model_parallel_cuda_manual_seed(seed)
    config = GPT2ModelConfig(**dict(CONFIG, hidden_dropout=dropout, attention_dropout=dropout,
                                    embedding_dropout=dropout))
    return GPT2Model(config, parallel_output=True)           # training mode, vocab-parallel logits


def _engine(stage, dropout=0.0):
    import mpu
    from megatron import zero
    model = _model(dropout)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": THRESHOLD}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config, mpu=mpu, dist_init_required=False)
    return engine


def _tokens(step):
    import mpu
    generator = torch.Generator().manual_seed(100 * step + mpu.get_data_parallel_rank())
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 9), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _engine_step(engine, step):
    inputs, labels = _tokens(step)
    loss = engine(inputs, labels=labels).mean()
    engine.backward(loss)
    engine.step()
    return loss.detach().clone()


def _buffer_bytes(engine, persistent=True):
    """Bytes of the gathered-parameter storage the stage-3 buffers hold now (the persistent one, allocated at its
    first use and kept, included unless `persistent` is False)."""
    return sum(b.storage.untyped_storage().nbytes() for b in engine.stage3.buffers if persistent or not b.persistent)


def _zero3_dp2():
    """ZeRO-3 at data-parallel 2 after one training step: gathers per call, storage, modes, tokens vs HF."""
    from megatron import zero
    from megatron.text_generation import generate_from_training_model, hybrid
    rank = dist.get_rank()
    engine = _engine(3)
    _engine_step(engine, 0)
    result = {"buffers": len(engine.stage3.buffers), "bytes_before": _buffer_bytes(engine),
              "released_buffers": sum(not b.persistent for b in engine.stage3.buffers)}
    calls, restore = count_stage3_gathers()
    live, inner = [], hybrid.generate

    def watched(*args, **kwargs):           # what is gathered while generating
        live.append(engine.stage3.live_parameter_elements())
        return inner(*args, **kwargs)
    hybrid.generate = watched
    try:
        for new in (2, 12, 2):               # the first call also refreshes the persistent buffer (stale)
            del calls[:]
            generate_from_training_model(engine, SAME, new, greedy=True)
            result.setdefault("gathers", []).append(len(calls))
        # here, not only in the test: gathers per token would make the different-length calls below mismatch
        assert result["gathers"][0] <= result["buffers"] and \
            result["gathers"][1:] == [result["released_buffers"]] * 2, result["gathers"]
        result["bytes_after"] = _buffer_bytes(engine)
        result["training_after"] = [m.training for m in engine.module.modules()]
        result["tokens"] = generate_from_training_model(engine, PROMPTS[rank], NEW[rank], greedy=True)
    finally:
        restore()
        hybrid.generate = inner
    result["live"] = live
    result["all_elements"] = sum(b.numel for b in engine.stage3.buffers)
    with zero.GatheredParameters(list(engine.module.parameters())):
        result["hf"] = _hf_greedy(engine.module, PROMPTS[rank], NEW[rank])
    result["lora"] = _lora_tokens(rank)
    return result


def _lora_tokens(rank):
    """(plain generate, ZeRO-3 engine, the base model's) greedy tokens of a LoRA model whose adapters
    change the output (B drawn, not zero): the adapters are used unmerged, their frozen base weights gathered too."""
    import mpu
    from megatron import zero
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.text_generation import generate, generate_from_training_model
    torch.manual_seed(3)
    mpu.model_parallel_cuda_manual_seed(3)
    lora = mpu.LoRAConfig(rank=2, alpha=16.0, zero_init_b=False)
    model = GPT2Model(GPT2ModelConfig(**CONFIG, lora=lora), parallel_output=True)
    plain = generate(model, PROMPTS[rank], NEW[rank], greedy=True)
    with mpu.adapters_disabled(model):
        base = generate(model, PROMPTS[rank], NEW[rank], greedy=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD}}
    engine, _, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu,
                                      dist_init_required=False)
    return plain, generate_from_training_model(engine, PROMPTS[rank], NEW[rank], greedy=True), base


def test_zero3_generate_matches_huggingface_gathers_once_and_releases():
    for rank, r in enumerate(run_distributed(_zero3_dp2, 2, model_parallel_size=1)):
        assert r["tokens"] == r["hf"] and [len(t) for t in r["tokens"]] == [NEW[rank]] * len(PROMPTS[rank])
        # once per buffer per call, not per token: 2 and 12 new tokens cost the same gathers (checked in the worker)
        assert r["gathers"][1:] == [r["released_buffers"]] * 2, r
        assert r["bytes_after"] == r["bytes_before"], r                    # everything released after
        assert r["live"] and all(n == r["all_elements"] for n in r["live"]), r   # whole while generating
        assert all(r["training_after"])
        plain, zero3, base = r["lora"]
        assert zero3 == plain != base


def _mp2_dp2():
    import mpu
    from megatron.text_generation import generate_from_training_model
    engine = _engine(3)
    before = _buffer_bytes(engine, persistent=False)
    rank = mpu.get_data_parallel_rank()
    tokens = generate_from_training_model(engine, PROMPTS[rank], NEW[rank], greedy=True)
    return tokens, before == _buffer_bytes(engine, persistent=False) == 0


def _reference_at_mp1():
    """HF greedy on the same seed's initial weights (they are the same at model-parallel 1 and 2)."""
    model = _model()
    return {rank: _hf_greedy(model, PROMPTS[rank], NEW[rank]) for rank in PROMPTS}


def test_zero3_generate_at_model_parallel_2_data_parallel_2_matches_huggingface():
    reference = run_distributed(_reference_at_mp1, 1, model_parallel_size=1)[0]
    results = run_distributed(_mp2_dp2, 4, model_parallel_size=2)
    for rank, (tokens, released) in enumerate(results):
        assert tokens == reference[rank // 2], rank                        # ranks 0, 1: dp rank 0; 2, 3: dp 1
        assert released


def _megatron_step(model, optimizer, step):
    inputs, labels = _tokens(step)
    loss = model(inputs, labels=labels).mean()
    optimizer.zero_grad()
    loss.backward()
    model.allreduce_params()
    optimizer.step()
    return loss.detach().clone()


def _training(path, interleave):
    """3 steps with dropout on, a greedy and a sampled generate before each step when `interleave`: (losses,
    full parameters, tokens)."""
    import mpu
    from megatron.model import DistributedDataParallel
    from megatron.text_generation import generate_from_training_model
    rank = mpu.get_data_parallel_rank()
    if path == "megatron":
        model = DistributedDataParallel(_model(dropout=0.1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = lambda s: _megatron_step(model, optimizer, s)
    else:
        engine = model = _engine(path, dropout=0.1)
        step = lambda s: _engine_step(engine, s)
    torch.manual_seed(7)
    mpu.model_parallel_cuda_manual_seed(7)
    losses, tokens = [], []
    for s in range(3):
        if interleave:                       # before step 0 too: stage 3 has not recorded its forward order yet
            tokens.append(generate_from_training_model(model, PROMPTS[rank], NEW[rank], greedy=True))
            tokens.append(generate_from_training_model(model, PROMPTS[rank], NEW[rank], temperature=1.0, top_k=10))
        losses.append(step(s))
    state = model.module.state_dict() if path == "megatron" else engine.module_state_dict()
    return losses, {k: v.clone() for k, v in state.items()}, tokens


def _with_and_without():
    out = {}
    for path in ("megatron", 1, 3):
        plain, interleaved = _training(path, False), _training(path, True)
        out[path] = {"losses": all(torch.equal(a, b) for a, b in zip(plain[0], interleaved[0])),
                     "params": all(torch.equal(plain[1][k], interleaved[1][k]) for k in plain[1]),
                     "tokens": interleaved[2]}
    return out


def test_training_with_generate_between_steps_is_bitwise_unchanged():
    for r in run_distributed(_with_and_without, 2, model_parallel_size=1):
        for path, result in r.items():
            assert result["losses"] and result["params"], path
        # every path decodes the same prompts from the same weights: the greedy tokens agree across paths
        assert r[1]["tokens"][0::2] == r[3]["tokens"][0::2] == r["megatron"]["tokens"][0::2]


# ---- finetune_gpt.py --sample-every: generations from the training model during fine-tuning ----------------------


def _finetune_printing(jobs):
    """finetune_gpt.main on each (name, argv): {name: (lm losses, the [sample] lines this rank printed)}."""
    import contextlib
    import io
    import mpu
    import finetune_gpt
    results = {}
    for name, argv in jobs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            history = finetune_gpt.main(argv)
        mpu.destroy_model_parallel()
        results[name] = (history["lm loss"], [line for line in out.getvalue().splitlines()
                                              if line.startswith("[sample]")])
    return results


def test_finetune_sample_every_prints_samples_and_leaves_training_unchanged(setup, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 plus 3?\n\nAdd 4 and 5.\n")
    sampling = ["--sample-every", "2", "--sample-prompts", str(prompts), "--sample-length", "4"]
    base = ["--batch-size", "2", "--train-iters", "4", "--eval-iters", "1", "--eval-interval", "3", "--lr", "1e-3"]
    zero3 = ["--deepspeed", "--zero-stage", "3", "--deepspeed_config", setup["zero3"]]
    jobs = [(f"{path}-{name}", _finetune_args(setup, f"{path}-{name}", base + flags + extra))
            for path, flags in (("megatron", []), ("zero3", zero3)) for name, extra in (("plain", []),
                                                                                          ("sampled", sampling))]
    rank_0, rank_1 = run_distributed(_finetune_printing, 2, args=(jobs,), timeout=600)
    for path in ("megatron", "zero3"):   # dropout on (the default 0.1): a consumed RNG would change the losses
        assert rank_0[f"{path}-sampled"][0] == rank_0[f"{path}-plain"][0], path
        lines = rank_0[f"{path}-sampled"][1]
        # after 2 iterations and after the last (4), both prompts, printed by rank 0 only
        assert [line.split(": ")[0] for line in lines] == ["[sample] after 2 iterations"] * 2 + [
            "[sample] after 4 iterations"] * 2, lines
        assert "'What is 2 plus 3?' -> " in lines[0] and "'Add 4 and 5.' -> " in lines[1], lines
        assert rank_1[f"{path}-sampled"][1] == [] and rank_0[f"{path}-plain"][1] == []


def test_finetune_samples_and_logs_after_the_last_iteration(setup, tmp_path):
    """--train-iters 5 --sample-every 2: samples after 2, 4 and the last iteration, 5 (each once); --log-interval 3:
    training records at 3 and at the last iteration, 5 (the mean of iterations 4 and 5 alone)."""
    import json
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 plus 3?\n")
    log = tmp_path / "log.jsonl"
    flags = ["--batch-size", "2", "--train-iters", "5", "--eval-iters", "0", "--lr", "1e-3", "--sample-every", "2",
             "--sample-prompts", str(prompts), "--sample-length", "2", "--log-interval", "3", "--log-jsonl", str(log)]
    job = ("five", _finetune_args(setup, "five", flags))
    losses, lines = run_distributed(_finetune_printing, 1, args=([job],), timeout=600)[0]["five"]
    assert [line.split(": ")[0] for line in lines] == [f"[sample] after {n} iterations" for n in (2, 4, 5)], lines
    records = [record for record in map(json.loads, open(log)) if record["type"] == "train"]
    assert [record["iteration"] for record in records] == [3, 5]
    assert records[1]["losses"]["lm loss"] == pytest.approx(sum(losses[3:]) / 2, rel=1e-12)


def test_finetune_bad_sampling_flags_are_one_line(tmp_path, capsys):
    import finetune_gpt
    (tmp_path / "empty.txt").write_text("\n\n")
    base = ["--data-path", "x", "--vocab-file", "v", "--merge-file", "m"]
    for flags, message in ((["--sample-every", "2"], "--sample-every needs --sample-prompts FILE"),
                           (["--sample-every", "2", "--sample-prompts", str(tmp_path / "no.txt")], "no such file"),
                           (["--sample-every", "1", "--sample-prompts", str(tmp_path / "empty.txt")], "holds no prompt"),
                           (["--sample-length", "0"], "--sample-length (0) >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            finetune_gpt.starting_point(base + flags)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_finetune_samples_scored_by_a_reward_model_as_hugging_face_scores_them(setup, tmp_path):
    """--reward-model: each sample's reward (printed, and a 'sample' record in --log-jsonl with the scored tokens)
    equals HF GPT2ForSequenceClassification's score of those tokens with the same weights (1e-5); the training is
    bitwise the one without samples (dropout on: building the reward model at the first samples, after iteration 1,
    must leave every RNG as it found it, or iteration 2's dropout masks and loss change)."""
    import json
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint, write_full_checkpoint
    full = read_full_checkpoint(setup["start"])
    weights = full.weights()
    weights["score.weight"] = torch.randn(1, weights["word_embeddings.weight"].shape[1],
                                          generator=torch.Generator().manual_seed(5))
    reward_dir = str(tmp_path / "reward")
    write_full_checkpoint(reward_dir, weights, full.model_config, 1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 plus 3?\nAdd 4 and 5.\n")
    log = tmp_path / "scored.jsonl"
    base = ["--batch-size", "2", "--train-iters", "2", "--eval-iters", "0", "--lr", "1e-3"]
    flags = base + ["--sample-every", "1", "--sample-prompts", str(prompts), "--sample-length", "4",
                    "--reward-model", reward_dir, "--log-jsonl", str(log)]
    jobs = [("plain", _finetune_args(setup, "unscored", base)), ("scored", _finetune_args(setup, "scored", flags))]
    results = run_distributed(_finetune_printing, 1, args=(jobs,), timeout=600)[0]
    assert results["scored"][0] == results["plain"][0]          # the losses, bitwise (dropout 0.1, the default)
    lines = results["scored"][1]
    samples = [json.loads(line) for line in open(log) if '"sample"' in line]
    assert len(lines) == len(samples) == 4 and all("(reward " in line for line in lines), lines   # after 1 and 2
    assert [sample["iteration"] for sample in samples] == [1, 1, 2, 2]
    hf_lm = GPT2LMHeadModel.from_pretrained(setup["hf_dir"])
    hf = GPT2ForSequenceClassification(GPT2Config.from_pretrained(setup["hf_dir"], num_labels=1, pad_token_id=0))
    hf.transformer.load_state_dict(hf_lm.transformer.state_dict())
    with torch.no_grad():
        hf.score.weight.copy_(weights["score.weight"])
        for sample, line in zip(samples, lines):
            expected = hf(torch.tensor([sample["tokens"]])).logits[0, 0].item()
            assert abs(sample["reward"] - expected) <= 1e-5 * max(1.0, abs(expected)), (sample, expected)
            assert f"(reward {sample['reward']:.4f})" in line
