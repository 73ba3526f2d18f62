"""What the tests share (one module): repository paths, the tiny Megatron model's flags and the run helper, the
tracker and ds_config writers, the ZeRO engine tests' tiny model and single-process reference, the data tests'
small corpus, and the launch-script runner."""
import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
ZERO_CONFIGS = os.path.join(REPO, "tests", "zero_configs")
if TOOLS not in sys.path:        # the tools are scripts, imported by name
    sys.path.insert(0, TOOLS)


# ---- the tiny Megatron model, trained through pretrain_gpt.main -------------------------------------------------
TINY_SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
MOCK_VOCAB = ["--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "8"]   # 64 ids, no padding at mp 2
TINY = MOCK_VOCAB + TINY_SHAPE + ["--train-iters", "10", "--log-interval", "100", "--eval-iters", "0", "--lr", "1e-3",
                                  "--warmup", "0", "--seed", "7"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def train(args_list):
    """pretrain_gpt.main on this process's arguments: what run_distributed runs on each rank (its history)."""
    import pretrain_gpt
    return pretrain_gpt.main(args_list)


def train_keeping_model(argv):
    """pretrain_gpt's training on argv, as `train`; (its history, the GPT2Model it built on this rank: the live
    parameters after the last step)."""
    import pretrain_gpt
    from megatron.training import pretrain
    built = []

    def provider():
        built.append(pretrain_gpt.model_provider())
        return built[-1]
    history = pretrain(pretrain_gpt.train_valid_test_datasets_provider, provider, pretrain_gpt.forward_step,
                       args_list=argv)
    return history, built[-1]


def train_each(argv_lists):
    """pretrain_gpt.main on each argument list in turn in this process (one launch for several runs: the process
    start, imports, and compiled graphs are shared); model-parallel groups are rebuilt for each. The histories."""
    import mpu
    histories = []
    for argv in argv_lists:
        histories.append(train(argv))
        mpu.destroy_model_parallel()
    return histories


def assert_bitwise(a, b, where=""):
    """Every tensor and number of two checkpoint objects equal (strings, e.g. paths, are not compared)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    elif isinstance(a, (int, float, bool)) and not isinstance(a, str):
        assert a == b or (a != a and b != b), where


def parser_error(parse, argv, capsys):
    """The one line `parse(argv)` prints on stderr, after checking it exits with argparse's code 2."""
    import pytest
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def set_tracker(save_dir, iteration):
    """Point Megatron's tracker file at `iteration` (written plainly, as a user or another tool would)."""
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(iteration))


def write_config(directory, **overrides):
    """A ZeRO-2 ds_config.json in `directory` (micro batch 2, clipping 1, small buckets), top-level keys overridden."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": 5000, "allgather_bucket_size": 5000}}
    config.update(overrides)
    path = os.path.join(directory, "ds_config.json")
    with open(path, "w") as handle:
        json.dump(config, handle)
    return path


# ---- the ZeRO engine tests: a tiny model, deterministic data, the single-process reference -----------------------
IN, HIDDEN, OUT = 16, 32, 8


def device():
    """Where the tests' tensors live: the CPU, or the rank's GPU under `pytest --device cuda` (mpu decides)."""
    import mpu
    return mpu.get_device()


class TinyNet(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear -> tanh -> Linear; ~1.9k parameters."""

    def __init__(self, seed=1234):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.to(device())

    def forward(self, x, y):
        h = self.norm(F.gelu(self.fc1(x)))
        return F.mse_loss(self.head(torch.tanh(self.fc2(h))).float(), y.float())


def batch(step, size, seed=99):
    """The global batch of `step`: x [size, IN], y = tanh(x @ teacher) [size, OUT]."""
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(size, IN, generator=torch.Generator().manual_seed(seed * 1000 + step))
    return x.to(device()), torch.tanh(x @ teacher).to(device())


def engine_train_step(engine, step, global_batch):
    """One optimizer step of `engine` on the global batch of `step`; returns the loss averaged over the global
    batch. Data-parallel rank r, micro-step k takes samples [(r * accumulation + k) * micro, ... + micro)."""
    import torch.distributed as dist
    ctx = engine.ctx
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    x, y = batch(step, global_batch)
    total = torch.zeros(1, dtype=torch.float64, device=device())
    for k in range(accumulation):
        lo = (ctx.data_parallel_rank * accumulation + k) * micro
        loss = engine(x[lo:lo + micro], y[lo:lo + micro])
        engine.backward(loss)
        engine.step()
        total += loss.item()
    if ctx.data_parallel_size > 1:
        dist.all_reduce(total, group=ctx.data_parallel_group)
    return float(total) / (ctx.data_parallel_size * accumulation)


def count_stage3_gathers():
    """(names of the ZeRO-3 buffers gathered from now on, in this process; a function undoing the count)."""
    from megatron.zero import stage3
    calls = []
    original = stage3._Buffer.start_gather

    def counting(buffer):
        calls.append(buffer.name)
        return original(buffer)
    stage3._Buffer.start_gather = counting
    return calls, lambda: setattr(stage3._Buffer, "start_gather", original)


def param_groups(model, weight_decay=0.01):
    """Megatron-style groups: weights decay, biases and norms do not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def reference_run(steps, global_batch, lr=1e-2, clip=0.0, make_model=TinyNet, grad_norms=None):
    """Plain single-process torch AdamW on the whole global batch: (losses, final state_dict). `grad_norms`, a
    list, receives clip_grad_norm_'s return value (the norm before clipping) at every step."""
    model = make_model()
    optimizer = torch.optim.AdamW(param_groups(model), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(step, global_batch)
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        if clip > 0 or grad_norms is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
            if grad_norms is not None:
                grad_norms.append(float(norm))
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class ParallelTinyNet(nn.Module):
    """ColumnParallel -> GELU -> RowParallel -> tanh -> LayerNorm -> Linear head (the last two are duplicated
    across model-parallel ranks)."""

    def __init__(self, seed=4321):
        import mpu
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = mpu.ColumnParallelLinear(IN, HIDDEN, gather_output=False)
        self.fc2 = mpu.RowParallelLinear(HIDDEN, HIDDEN, input_is_parallel=True)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)
        self.to(device())

    def forward(self, x, y):
        h = self.norm(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))
        return F.mse_loss(self.head(h), y)


def ds_config(stage, micro, accumulation=1, **zero):
    """A ds_config of the engine tests: no gradient clipping (DeepSpeed's default is 1.0), unless a test sets it."""
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 0.0, "steps_per_print": 10 ** 6, "zero_optimization": {"stage": stage, **zero}}
    return copy.deepcopy(config)


def max_relative_difference(a, b):
    """max over tensors of max|a - b| / max|b| (a and b: dicts or lists of tensors/floats)."""
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    worst = 0.0
    for x, y in pairs:
        x, y = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return worst


# ---- the data-pipeline tests: a small corpus and a BPE trained on it, built in a temp dir --------------------------

UNICODE_STRESS = (
    "Hello world! It's we're they've I'm you'll he'd. 東京は日本の首都です。 中文测试，标点。 한국어 텍스트 "
    "emoji 😀🚀👩‍👩‍👧‍👦 flags 🇯🇵 combining e\u0301 a\u0308 o\u0323\u0302 Zalgo Z\u0364\u0351a\u0336 "
    "odd spaces:\u00a0nbsp\u2009thin\u3000ideographic\ttab\r\nCRLF  double   triple\u200bzwsp "
    "literal <|endoftext|> inside text, and <|endoftext|><|endoftext|> twice. "
    "Numbers 1234567 3.14159 -42 1e-9 ١٢٣ Ⅻ; code: def f(x): return x**2  # comment\n\n\n"
    "RTL: שלום עולם مرحبا بالعالم; Cyrillic: Привет мир; Greek: Γειά σου Κόσμε; "
    "math ∑∫√∞≠≤ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ; lone surrogate-free edge: \U0010ffff end.  ")

HAND_DOCS = [
    "The quick brown fox jumps over the lazy dog. It barked.",
    "",
    "   ",
    "Dr. Smith went home. He was tired.\nThen he slept.",
    "A literal <|endoftext|> is ordinary text here.",
    UNICODE_STRESS,
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}, ensure_ascii=False) + "\n")
    return path


def build_small_corpus(directory, max_mb=0.3, vocab_size=1000):
    """Docstring corpus (stdlib only, ~max_mb MB) + the hand-written docs, and a BPE trained on it.

    Returns dict(corpus, vocab, merges, texts)."""
    import make_sample_corpus
    import train_tokenizer
    corpus = os.path.join(directory, "corpus.json")
    make_sample_corpus.write_corpus(corpus, max_mb=max_mb, stdlib_only=True, workers=1)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f] + HAND_DOCS
    write_jsonl(corpus, texts)
    vocab, merges, _ = train_tokenizer.train([corpus], directory, vocab_size=vocab_size)
    return {"corpus": corpus, "vocab": vocab, "merges": merges, "texts": texts}


# ---- launch scripts: run one in a subprocess, read the losses it logs -----------------------------------------------


# The launch scripts at a test size, pinned here (the CPU default's shape at half its sequence length) so that a
# change of the recipe in scripts/_common.sh cannot slow the scripts' tests (up to 4 processes on 2 cores); the
# micro batch is the CPU config's.
# The scripts' CPU model at a test size: micro batch 8 (the recipe's 32 is 4x the compute for what a 20-iteration
# run shows); on the --deepspeed path the micro batch is the JSON's, so a copy of scripts/ds_zero2_config.json that
# differs only there (test_zero_config pins that).
SCRIPT_TEST_DS_CONFIG = os.path.join(REPO, "tests", "zero_configs", "script_test_zero2.json")
SCRIPT_TEST_SHAPE = {"NUM_LAYERS": "2", "HIDDEN_SIZE": "128", "NUM_HEADS": "4", "SEQ_LENGTH": "64", "MICRO_BATCH": "8",
                     "DS_CONFIG": SCRIPT_TEST_DS_CONFIG}
# scripts/ds_pretrain_gpt.sh at a test size (conftest's ds_pretrained): 20 iterations. The script tests assert that the
# loss falls by more than 0.2 between the first and the fourth logged point; spread on the default data
# (845b8bad124aace2, --seed 1234, 1, 2, 3, 4): 1.466, 1.473, 1.387, 1.586, 1.451 (min 1.387): seven times the bound.
SHORT_PRETRAIN = dict(SCRIPT_TEST_SHAPE, TRAIN_ITERS="20", LOG_INTERVAL="5", EVAL_INTERVAL="10", EVAL_ITERS="2")


def spread_seeds(default):
    """The seeds a learned-effect test runs at: its own, then those of the SPREAD_SEEDS variable (comma-separated),
    which is how the spread its docstring states was measured: SPREAD_SEEDS=1,2,3,4 pytest -s -k NAME. Each run
    prints `spread: NAME seed=S VALUES`."""
    extra = [int(seed) for seed in os.environ.get("SPREAD_SEEDS", "").split(",") if seed.strip()]
    return [default] + [seed for seed in extra if seed != default]


def script_env(env_overrides):
    """The environment without MASTER_PORT (a one-node launch picks a free port itself) plus the overrides."""
    from tests import warm_python
    warm_python.start_for_scripts()
    env = {key: value for key, value in os.environ.items() if key != "MASTER_PORT"}
    return dict(env, **env_overrides)


@contextlib.contextmanager
def port_taken(port):
    """Another job's server on `port` (when nothing else already holds it, which is just as taken)."""
    with socket.socket() as server:
        with contextlib.suppress(OSError):
            server.bind(("", port))
            server.listen()
        yield


def run_script(script, env_overrides, timeout=600):
    env = script_env(env_overrides)
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", script)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def logged_losses(stdout):
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+)", stdout)]


def validation_losses(stdout):
    return [float(x) for x in re.findall(r"lm loss value: ([0-9.E+-]+)", stdout)]


def gathered_model_parallel(module, grads=False):
    """Every parameter of `module` (or its gradient), full size: all-gathered over the model-parallel group along
    param.partition_dim in partition_stride blocks (query_key_value: rank r holds [q_r, k_r, v_r])."""
    import torch.distributed as dist
    import mpu
    world = mpu.get_model_parallel_world_size()
    full = {}
    for name, param in module.named_parameters():
        tensor = (param.grad if grads else param).detach().contiguous()
        if world > 1 and getattr(param, "model_parallel", False):
            pieces = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(pieces, tensor, group=mpu.get_model_parallel_group())
            dim, stride = param.partition_dim, param.partition_stride
            blocks = [piece.chunk(stride, dim=dim) for piece in pieces]
            tensor = torch.cat([blocks[r][j] for j in range(stride) for r in range(world)], dim=dim)
        full[name] = tensor.clone()
    return full
