"""Text generation: the KV cache, sampling on model-parallel rank 0, the real-vocabulary clamp, and
tools/generate_samples_gpt.py. Greedy tokens are compared with Hugging Face GPT2LMHeadModel.generate on the same
weights; at model-parallel 2 the model (built from the same seed) holds the same full weights as at mp 1."""
import os
import sys

import pytest
import torch

from megatron.spawn import free_port, run_distributed
from tests.model.test_gpt2_model import copy_into_hf

from tests.helpers import MOCK_VOCAB, REPO, TINY_SHAPE
from tests import warm_python


CONFIG = dict(num_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=4, max_sequence_length=24,
              init_method_std=0.1)
PROMPTS = [[5, 9, 3, 17, 40, 2, 8], [11], [60, 61, 7, 33]]
NEW = 10


def build_model(seed=1234, **overrides):
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(seed)
    return GPT2Model(GPT2ModelConfig(**dict(CONFIG, **overrides)), parallel_output=False).eval()


def _hf_greedy(model, prompts=PROMPTS, new=NEW):
    """HF GPT2LMHeadModel.generate (greedy) with `model`'s weights, each prompt alone: its new token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=CONFIG["vocab_size"], n_positions=CONFIG["max_sequence_length"],
                                    n_embd=CONFIG["hidden_size"], n_layer=CONFIG["num_layers"],
                                    n_head=CONFIG["num_attention_heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=None, pad_token_id=0)).eval()
    copy_into_hf(model, hf)
    out = []
    for prompt in prompts:   # one prompt at a time: no padding on the reference side
        ids = torch.tensor([prompt])
        generated = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                min_new_tokens=new, eos_token_id=None, pad_token_id=0)
        out.append(generated[0, len(prompt):].tolist())
    return out


def _greedy(with_hf):
    from megatron.text_generation import generate
    model = build_model()
    result = {"cache": generate(model, PROMPTS, NEW, greedy=True),
              "recompute": generate(model, PROMPTS, NEW, greedy=True, use_cache=False),
              "alone": [generate(model, [p], NEW, greedy=True)[0] for p in PROMPTS]}
    # Chunks of several new tokens after a cached prefix (causal over the new ones) == one full forward.
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    cache = model.new_inference_cache()
    with torch.no_grad():
        chunks = torch.cat([model(tokens[:, a:b], inference_cache=cache) for a, b in ((0, 3), (3, 4), (4, 12))], 1)
        result["chunk_error"] = (chunks - model(tokens)).abs().max().item()
    if with_hf:
        result["hf"] = _hf_greedy(model)
        with pytest.raises(ValueError, match=r"prompt 1 has 25 tokens, longer than the position table "
                                             r"\(max_sequence_length 24\)"):
            generate(model, [[1], [2] * 25], NEW, greedy=True)
    return result


def test_greedy_cache_matches_recompute_and_huggingface_at_mp_1_and_2():
    reference = run_distributed(_greedy, 1, args=(True,), model_parallel_size=1)[0]
    assert all(len(t) == NEW for t in reference["hf"])
    assert reference["cache"] == reference["recompute"] == reference["alone"] == reference["hf"]
    assert reference["chunk_error"] <= 1e-5
    for rank_result in run_distributed(_greedy, 2, args=(False,), model_parallel_size=2):
        assert rank_result["cache"] == rank_result["recompute"] == reference["hf"]
        assert rank_result["chunk_error"] <= 1e-5


def _sampled():
    import mpu
    from megatron.text_generation import generate
    model = build_model()
    rank = mpu.get_model_parallel_rank()
    # Each rank passes another seed: only model-parallel rank 0's generator draws, the others get its ids.
    kwargs = dict(temperature=1.0, top_k=20, top_p=0.95)
    first = generate(model, PROMPTS, NEW, seed=7 + rank, **kwargs)
    again = generate(model, PROMPTS, NEW, seed=7 + rank, **kwargs)
    other = generate(model, PROMPTS, NEW, seed=8 + rank, **kwargs)
    recompute = generate(model, PROMPTS, NEW, seed=7 + rank, use_cache=False, **kwargs)
    eod = generate(model, PROMPTS, NEW, seed=7 + rank, eod_id=first[0][2], **kwargs)
    return first, again, other, recompute, eod


def test_sampling_is_seeded_and_identical_on_every_model_parallel_rank():
    results = run_distributed(_sampled, 2, model_parallel_size=2)
    first, again, other, recompute, eod = results[0]
    assert results[1] == results[0]
    assert first == again == recompute
    assert other != first
    stop = first[0][2]                      # stops right after first producing end-of-document
    assert eod[0] == first[0][:first[0].index(stop) + 1] and eod[1:] == [
        row[:row.index(stop) + 1] if stop in row else row for row in first[1:]]
    assert all(len(t) == NEW for t in first)


def _padded_vocab():
    import mpu
    from megatron.text_generation import generate
    real = 50
    model = build_model(real_vocab_size=real)
    world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    weight = model.word_embeddings.weight
    rows = torch.arange(weight.size(0)) + rank * (CONFIG["vocab_size"] // world)
    with torch.no_grad():  # the final hidden state is all ones: a padded id's logit is 32 * 10
        model.transformer.final_layernorm.weight.zero_()
        model.transformer.final_layernorm.bias.fill_(1.0)
        weight[rows >= real] = 10.0
        logits = model(torch.tensor(PROMPTS[:1]))
    assert int(logits[0, -1].argmax()) >= real  # unclamped, a padded id would win
    prompts = [[t % real for t in p] for p in PROMPTS]
    greedy = generate(model, prompts, NEW, greedy=True)
    sampled = generate(model, prompts, NEW, temperature=2.0, seed=3)
    return greedy + sampled


def test_padded_vocabulary_ids_are_never_generated():
    for tokens in run_distributed(_padded_vocab, 2, model_parallel_size=2):
        assert all(0 <= t < 50 for row in tokens for t in row) and all(len(row) == NEW for row in tokens)


MODEL = MOCK_VOCAB + TINY_SHAPE


def _pretrain(save_dir):
    import pretrain_gpt
    pretrain_gpt.main(MODEL + ["--batch-size", "2", "--train-iters", "2", "--log-interval", "100",
                               "--eval-iters", "0", "--lr-decay-iters", "100", "--warmup", "0.1",
                               "--save", save_dir])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("generation") / "save")
    run_distributed(_pretrain, 1, args=(save,))
    return save


def test_generate_samples_cli_at_model_parallel_2(tmp_path, checkpoint):
    save = checkpoint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 9 3\n11\n60 61 7 33 2\n")
    out = tmp_path / "samples.txt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "tools/generate_samples_gpt.py", *MODEL,
               "--model-parallel-size", "2", "--load", save, "--sample-input-file", str(prompts),
               "--sample-output-file", str(out), "--out-seq-length", "6", "--top_k", "5", "--batch-size", "2"]
    result = warm_python.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    blocks = out.read_text().strip().split("\n\n")
    assert blocks[0] == "Context: 5 9 3" and blocks[2] == "Context: 11" and blocks[4] == "Context: 60 61 7 33 2"
    for block in blocks[1::2]:
        ids = [int(t) for t in block.removeprefix("Megatron-LM: ").split()]
        assert len(ids) == 6 and all(0 <= t < 64 for t in ids)


def _generation_errors(argvs):
    """The one-line message tools/generate_samples_gpt.py prints for each bad command line."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import generate_samples_gpt
    from megatron.checkpoint.layout import CheckpointError
    messages = []
    for argv in argvs:
        try:
            generate_samples_gpt.main(argv)
            messages.append(None)
        except (CheckpointError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_generate_samples_bad_input_is_one_line(tmp_path, checkpoint):
    long_prompt = tmp_path / "prompts.txt"
    long_prompt.write_text("5 9 3\n" + " ".join(["7"] * 17) + "\n")      # 17 tokens, 16 positions
    out = tmp_path / "samples.txt"
    io = ["--load", checkpoint, "--sample-output-file", str(out), "--greedy", "--out-seq-length", "2"]
    wider = [flag if flag != "32" else "64" for flag in MODEL]             # --hidden-size 64
    messages = run_distributed(_generation_errors, 1, args=([
        MODEL + io + ["--sample-input-file", str(long_prompt)],
        MODEL + io + ["--sample-input-file", str(tmp_path / "missing.txt")],
        wider + io + ["--sample-input-file", str(long_prompt)]],))[0]
    assert messages[0] == (f"{long_prompt}:2: the prompt has 17 tokens, longer than the position table "
                           "(--max-position-embeddings 16): shorten it")
    assert messages[1] == f"--sample-input-file {tmp_path / 'missing.txt'} does not exist"
    assert messages[2].startswith(f"{checkpoint}") and \
        messages[2].endswith("was saved by another model shape: hidden_size 32 (checkpoint) != 64 (this run)")
    assert not out.exists()   # nothing was written
    # The command line: one line on stderr, exit status 1, no traceback.
    result = warm_python.run([sys.executable, "tools/generate_samples_gpt.py", *MODEL, *io, "--sample-input-file",
                              str(tmp_path / "missing.txt")], cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, MASTER_PORT=str(free_port())))   # port 6000 may be taken
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {messages[1]}"]


def _front_door_errors(checkpoint, empty, valid):
    """{case: (error class, message)} of the three inference front ends, each refused by load_inference_model."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import generate_samples_gpt
    from megatron.text_generation.lm_eval_model import load_from_megatron_args
    from tasks import main as tasks_main
    task = ["--task", "WIKITEXT103", "--valid-data", valid, "--overlapping-eval", "8"]
    cases = {"generate: no --load": lambda: generate_samples_gpt.main(MODEL),
             "generate: empty": lambda: generate_samples_gpt.main(MODEL + ["--load", empty]),
             "generate: chat without tokenizer": lambda: generate_samples_gpt.main(
                 MODEL + ["--load", checkpoint, "--chat-template", "deepspeed-chat"]),
             "tasks: no --load": lambda: tasks_main.main(MODEL + task),
             "tasks: empty": lambda: tasks_main.main(MODEL + task + ["--load", empty]),
             "tasks: no tokenizer": lambda: tasks_main.main(MODEL + task + ["--load", checkpoint]),
             "lm-eval: no --load": lambda: load_from_megatron_args(MODEL),
             "lm-eval: no tokenizer": lambda: load_from_megatron_args(MODEL + ["--load", checkpoint])}
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = None
        except ValueError as error:
            messages[name] = (type(error).__name__, str(error))
    return messages


def test_every_inference_front_end_refuses_a_bad_load_through_one_check(tmp_path, checkpoint):
    empty = tmp_path / "empty"
    empty.mkdir()
    valid = tmp_path / "wiki.txt"
    valid.write_text(" = Title = \n a b c \n")
    got = run_distributed(_front_door_errors, 1, args=(checkpoint, str(empty), str(valid)))[0]
    no_checkpoint = f"{empty} holds no checkpoint (no latest_checkpointed_iteration.txt)"
    tokenizer = "needs a tokenizer (--vocab-file/--merge-file), not --mock-data"
    load = "needs --load DIR (a checkpoint saved by pretrain_gpt.py)"
    assert got == {
        "generate: no --load": ("InferenceInputError", f"generation {load}"),
        "generate: empty": ("InferenceInputError", no_checkpoint),
        "generate: chat without tokenizer": ("InferenceInputError", f"generation with --chat-template {tokenizer}"),
        "tasks: no --load": ("TaskError", f"zero-shot evaluation {load}"),
        "tasks: empty": ("TaskError", no_checkpoint),
        "tasks: no tokenizer": ("TaskError", f"zero-shot evaluation {tokenizer}"),
        "lm-eval: no --load": ("InferenceInputError", f"the lm-eval model (megatron_args) {load}"),
        "lm-eval: no tokenizer": ("InferenceInputError", f"the lm-eval model (megatron_args) {tokenizer}")}


def test_generation_under_pipelining_is_refused_in_one_line(tmp_path, checkpoint):
    io = ["--load", checkpoint, "--sample-output-file", str(tmp_path / "out.txt"), "--greedy", "--out-seq-length", "2",
          "--sample-input-file", str(tmp_path / "prompts.txt"), "--pipeline-model-parallel-size", "2"]
    (tmp_path / "prompts.txt").write_text("5 9 3\n")
    for message in run_distributed(_generation_errors, 2, args=([MODEL + io],)):
        assert message == ["generation and evaluation need the whole model on one stage, not "
                           "--pipeline-model-parallel-size 2: run with --pipeline-model-parallel-size 1 (a pipelined "
                           "checkpoint loads there)"]


# ---- the sampler's exact supports and distribution (sample_logits is a pure function) ------------------------

PROBS = torch.tensor([[0.6, 0.3, 0.1]])
DRAWS = 4000


def _draw_counts(**kwargs):
    from megatron.text_generation.generation import sample_logits
    generator = torch.Generator().manual_seed(0)
    logits = PROBS.log().expand(DRAWS, 3)     # 4000 independent rows, one draw each
    return torch.bincount(sample_logits(logits, generator=generator, **kwargs), minlength=3)


@pytest.mark.parametrize("kwargs,support,expected", [
    (dict(top_p=0.8), {0, 1}, [2 / 3, 1 / 3, 0.0]),      # 0.6 < 0.8: the token that crosses p (0.3) is kept
    (dict(top_p=0.5), {0}, [1.0, 0.0, 0.0]),             # 0.6 alone crosses 0.5
    (dict(top_p=0.95), {0, 1, 2}, [0.6, 0.3, 0.1]),      # 0.9 < 0.95: all three
    (dict(top_k=2), {0, 1}, [2 / 3, 1 / 3, 0.0]),
    (dict(top_k=1), {0}, [1.0, 0.0, 0.0]),
    (dict(), {0, 1, 2}, [0.6, 0.3, 0.1]),
    (dict(temperature=2.0), {0, 1, 2}, None),            # p_i ~ sqrt(p_i): 0.4636, 0.3278, 0.2086
], ids=["top_p0.8", "top_p0.5", "top_p0.95", "top_k2", "top_k1", "plain", "temperature2"])
def test_sampling_draws_exactly_the_support_with_the_renormalised_probabilities(kwargs, support, expected):
    counts = _draw_counts(**kwargs)
    assert {i for i in range(3) if counts[i] > 0} == support
    if expected is None:
        root = PROBS[0].sqrt()
        expected = (root / root.sum()).tolist()
    frequencies = counts.double() / DRAWS
    for frequency, p in zip(frequencies.tolist(), expected):   # 4 standard errors of a binomial at n = 4000
        assert abs(frequency - p) <= 4 * (max(p * (1 - p), 1e-12) / DRAWS) ** 0.5 + 1e-12, (frequencies, expected)


def _stops_inside_a_prompt():
    """End-of-text is the model's greedy next token at a position still inside the long prompt (decoding
    starts after the short one): the long row must take its prompt token there and go on as if it were alone."""
    from megatron.text_generation import generate
    model = build_model()
    short, long_prompt = [5, 9], [5, 9, 3, 17, 40, 2, 8]
    with torch.no_grad():
        eod = int(model(torch.tensor([long_prompt]))[0, len(short) - 1].argmax())
    batched = generate(model, [short, long_prompt], NEW, greedy=True, eod_id=eod)
    alone = [generate(model, [p], NEW, greedy=True, eod_id=eod)[0] for p in (short, long_prompt)]
    return eod, batched, alone


def test_end_of_text_inside_a_prompt_does_not_stop_that_row():
    eod, batched, alone = run_distributed(_stops_inside_a_prompt, 1, model_parallel_size=1)[0]
    assert batched[0] == alone[0] == [eod]          # the short row stops right after producing end-of-text
    assert batched[1] == alone[1] and len(alone[1]) > 0


def _lora_generation_errors(save, config, argvs):
    """Pretrain a tiny LoRA model on the ZeRO path (as scripts/finetune_gpt.sh saves one), then generate."""
    import mpu
    import pretrain_gpt
    pretrain_gpt.main(MODEL + ["--lora-rank", "2", "--lora-alpha", "4", "--lora-targets", "qkv,fc2", "--batch-size",
                               "2", "--train-iters", "2", "--eval-iters", "0", "--save", save, "--deepspeed",
                               "--deepspeed_config", config])
    mpu.destroy_model_parallel()
    return _generation_errors(argvs)


def test_a_lora_checkpoint_needs_its_lora_flags(tmp_path):
    """tools/generate_samples_gpt.py (as tasks/main.py: the one load) --load of a LoRA checkpoint without its
    --lora-* flags, or with another alpha, stops in one line naming them instead of running the base model."""
    from tests.helpers import write_config
    save = str(tmp_path / "lora")
    (tmp_path / "prompts.txt").write_text("5 9 3\n")
    io = ["--load", save, "--sample-input-file", str(tmp_path / "prompts.txt"), "--sample-output-file",
          str(tmp_path / "out.txt"), "--greedy", "--out-seq-length", "2"]
    lora = ["--lora-rank", "2", "--lora-targets", "qkv,fc2"]
    messages = run_distributed(_lora_generation_errors, 1, args=(save, write_config(str(tmp_path)), [
        MODEL + io, MODEL + io + lora + ["--lora-alpha", "8"], MODEL + io + lora + ["--lora-alpha", "4"]]))[0]
    wanted = "--lora-rank 2 --lora-alpha 4 --lora-targets qkv,fc2"
    assert messages == [
        f"{save}/iter_0000002 holds LoRA adapters ({wanted}), this run has none (it would run the base model alone): "
        f"pass {wanted}",
        f"{save}/iter_0000002 holds LoRA adapters ({wanted}), this run has --lora-rank 2 --lora-alpha 8 "
        f"--lora-targets qkv,fc2: pass {wanted}",
        None]
