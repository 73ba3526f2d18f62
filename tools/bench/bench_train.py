"""Training-step throughput: our Megatron train_step (model-parallel 1) next to a plain PyTorch nanoGPT-style
loop and Hugging Face GPT2LMHeadModel on the same config, run alternately in one process so ratios are fair.

    python tools/bench/bench_train.py                      # tiny and small, fp32 (+ bf16 where native); markdown table
    python tools/bench/bench_train.py --configs small --dtypes fp32 --rounds 7 --steps 5

Every implementation runs `--steps` steps per round, alternating, for `--rounds` rounds (>= 5): tokens/s is the
median over rounds with its min-max, and "vs plain PyTorch" the median of the per-round ratios (each from the same
round, so slow phases of the shared machine cancel). "ours, torch-default AdamW" is ours with --no-fused-adam: its
ratio to "ours" is the step-time gain of the fused AdamW kernel (printed after the table); `--adam-step-only` times
AdamW.step() alone for torch's three kernels.
Every implementation runs on mpu's device with mpu's backend (the CPU and gloo here; a GPU and NCCL where CUDA is
present, timed after a device synchronize), so the comparison is always on one device.
Peak RSS is measured separately (one short subprocess per cell) because a process's peak only grows.
TFLOP/s = tokens/s x megatron.training.flops_per_token, the count the training log's TFLOP/s uses (Narayanan et
al. 2021: 3 passes of 24 L h^2 (1 + s/(6h)) per token plus 3 x 2 h V for the LM head).
"""
import argparse
import functools
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpu  # noqa: E402
from bench_common import init_single_process, median_and_spread  # noqa: E402

DEVICE = mpu.get_device()

CONFIGS = {
    "tiny": dict(layers=2, hidden=128, heads=4, seq=128, vocab=8192, batch=8),
    "small": dict(layers=4, hidden=256, heads=4, seq=256, vocab=8192, batch=4),
    "gpt2-124m": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50257, batch=8),
}


class _Block(nn.Module):
    """nanoGPT's block: pre-LN attention (one fused qkv Linear, SDPA) and a GELU MLP."""

    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.c_fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c["vocab"], c["hidden"]), nn.Embedding(c["seq"], c["hidden"])
        self.blocks = nn.ModuleList([_Block(c["hidden"], c["heads"]) for _ in range(c["layers"])])
        self.ln_f = nn.LayerNorm(c["hidden"])

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def _batch(c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), generator=g).to(DEVICE)


def _synchronize():
    """Wait for the device's queued work (CUDA runs asynchronously: a timer read without it measures launches)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def make_plain(c, dtype, compile_model=False):
    """nanoGPT-style loop; compile_model: the whole model under torch.compile (the reference of --torch-compile)."""
    torch.manual_seed(0)
    model = PlainGPT(c).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = dtype == "bf16"
    forward = torch.compile(model) if compile_model else model

    def step(text):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(text[:, :-1], text[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def make_hf(c, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=c["vocab"], n_positions=c["seq"], n_embd=c["hidden"], n_layer=c["layers"],
                        n_head=c["heads"], resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = dtype == "bf16"

    def step(text):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=text[:, :-1], labels=text[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def make_ours(c, dtype, extra_flags=()):
    """The real Megatron train_step with our GPT2Model, FP16_Optimizer (bf16) and local DDP, mp=1, dropout off."""
    import pretrain_gpt
    from megatron.arguments import parse_args
    from megatron.global_vars import set_global_variables
    from megatron.initialize import set_random_seed
    from megatron.training import setup_model_and_optimizer, train_step
    flags = ["--mock-data", "--num-layers", str(c["layers"]), "--hidden-size", str(c["hidden"]),
             "--num-attention-heads", str(c["heads"]), "--seq-length", str(c["seq"]), "--vocab-size", str(c["vocab"]),
             "--batch-size", str(c["batch"]), "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
             "--make-vocab-size-divisible-by", "1", "--clip-grad", "1.0"] + (["--bf16"] if dtype == "bf16" else []) \
        + list(extra_flags)
    args = parse_args(args_list=flags)
    args.rank, args.distributed_backend = 0, mpu.get_backend()
    set_global_variables(args)
    set_random_seed(0)
    model, optimizer, scheduler, _ = setup_model_and_optimizer(pretrain_gpt.model_provider)

    def step(text):
        train_step(pretrain_gpt.forward_step, iter([{"text": text}]), model, optimizer, scheduler)
    return step


UNFUSED = "ours, torch-default AdamW"
COMPILED = {"ours --torch-compile": functools.partial(make_ours, extra_flags=["--torch-compile"]),
            "plain PyTorch, torch.compile": functools.partial(make_plain, compile_model=True)}
IMPLS = {"ours": make_ours, UNFUSED: functools.partial(make_ours, extra_flags=["--no-fused-adam"]),
         "plain PyTorch": make_plain, "HF GPT2LMHeadModel": make_hf, **COMPILED}


# (implementation, baseline) pairs whose per-round ratio is printed after the table: the fused AdamW kernel's
# gain, and the fused compute path against our eager step and against torch.compile of the plain model.
GAINS = (("ours", UNFUSED), ("ours --torch-compile", "ours"),
         ("ours --torch-compile", "plain PyTorch, torch.compile"))


def flops_per_token(c):
    """The training log's count for config `c` (make_ours pads the vocabulary to a multiple of 1: V itself)."""
    from megatron.training import flops_per_token as training_flops_per_token
    return training_flops_per_token(c["layers"], c["hidden"], c["seq"], c["vocab"])


def measure_throughput(config_name, dtype, rounds, steps, impls=tuple(IMPLS)):
    """{implementation: [tokens/s of round 0, round 1, ...]}; the order is reversed every other round so a drift
    in the machine's speed favours no implementation. The compiled ones compile in the warm-up steps."""
    c = CONFIGS[config_name]
    text = _batch(c, 0)
    steppers = {name: IMPLS[name](c, dtype) for name in impls}
    for step in steppers.values():  # warm-up
        step(text)
        step(text)
    samples = {name: [] for name in steppers}
    names = list(steppers)
    for index in range(rounds):  # alternate so machine noise hits every implementation alike
        for name in (names if index % 2 == 0 else names[::-1]):
            _synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                steppers[name](text)
            _synchronize()
            samples[name].append(steps * c["batch"] * c["seq"] / (time.perf_counter() - start))
    return samples


def summarize(samples, baseline="plain PyTorch"):
    """{implementation: (median tokens/s, min, max, median ratio to `baseline`, min ratio, max ratio)}; each
    ratio pairs the two implementations' figures of one round."""
    out = {}
    for name, speeds in samples.items():
        ratios = [mine / theirs for mine, theirs in zip(speeds, samples[baseline])]
        out[name] = median_and_spread(speeds) + median_and_spread(ratios)
    return out


ADAM_KERNELS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def measure_adam_step(config_name, rounds, steps=3, deepspeed_cpu_adam=False):
    """{kernel: [ms per AdamW.step() of round 0, ...]} on fp32 parameters of the config's model (random
    gradients), the kernels alternating (reversed every other round). deepspeed_cpu_adam: DeepSpeed's
    DeepSpeedCPUAdam (AdamW mode, torch's default weight decay) too, its C++ op JIT-built on first use (minutes)."""
    torch.manual_seed(0)
    params = list(PlainGPT(CONFIGS[config_name]).to(DEVICE).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizers = {name: torch.optim.AdamW(params, lr=1e-4, **options) for name, options in ADAM_KERNELS.items()}
    if deepspeed_cpu_adam:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizers["DeepSpeedCPUAdam"] = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    for optimizer in optimizers.values():
        optimizer.step()      # allocates the moments
    samples, names = {name: [] for name in optimizers}, list(optimizers)
    for index in range(rounds):
        for name in (names if index % 2 == 0 else names[::-1]):
            _synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                optimizers[name].step()
            _synchronize()
            samples[name].append((time.perf_counter() - start) / steps * 1e3)
    return samples


def peak_rss_mb(config_name, dtype, impl):
    """Peak RSS of a fresh process that builds `impl` and runs 3 steps."""
    code = (f"import sys; sys.argv=['x']; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import bench_train as b; b.init_single_process(); c=b.CONFIGS[{config_name!r}]; "
            f"s=b.IMPLS[{impl!r}](c, {dtype!r}); t=b._batch(c, 0); [s(t) for _ in range(3)]; "
            f"import bench_common; print(bench_common.peak_rss_mb())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return float("nan")
    return float(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["tiny", "small"], choices=sorted(CONFIGS))
    parser.add_argument("--dtypes", nargs="+", default=None, choices=["fp32", "bf16"],
                        help="default: fp32, plus bf16 where it is native (see the header line)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 5 for a median)")
    parser.add_argument("--steps", type=int, default=3, help="steps per implementation per round")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS), metavar="IMPL",
                        help=f"implementations to compare (default: all): {', '.join(map(repr, IMPLS))}")
    parser.add_argument("--no-rss", action="store_true", help="skip the per-cell peak RSS subprocesses")
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    parser.add_argument("--adam-step-only", action="store_true",
                        help="time AdamW.step() alone (for-loop, foreach, fused kernels) on each config's parameters")
    parser.add_argument("--deepspeed-cpu-adam", action="store_true",
                        help="with --adam-step-only on the CPU: DeepSpeed's DeepSpeedCPUAdam too (JIT-built, minutes)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds {args.rounds} --steps {args.steps}: both must be >= 1")
    if "plain PyTorch" not in args.impls:
        parser.error("--impls must include 'plain PyTorch' (the table's baseline)")
    from bench_common import default_precisions, precision_header
    print(precision_header())
    args.dtypes = args.dtypes or default_precisions()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.adam_step_only:
        print(f"# {torch.get_num_threads()} thread(s); ratios: per-round medians (min-max)")
        print("| config | parameters | AdamW kernel | ms per step | ns per parameter | vs for-loop |\n"
              "|---|---:|---|---:|---:|---:|")
        for config_name in args.configs:
            samples = measure_adam_step(config_name, args.rounds, deepspeed_cpu_adam=args.deepspeed_cpu_adam)
            count = sum(p.numel() for p in PlainGPT(CONFIGS[config_name]).parameters())
            for name, ms in samples.items():
                ratio = median_and_spread([a / b for a, b in zip(samples["for-loop"], ms)])
                median = median_and_spread(ms)[0]
                print(f"| {config_name} | {count / 1e6:.2f}M | {name} | {median:.2f} | {median * 1e6 / count:.2f} | "
                      f"{ratio[0]:.2f}x ({ratio[1]:.2f}-{ratio[2]:.2f}) |")
        return
    init_single_process()
    rows, gains = [], []
    print(f"# median of {args.rounds} alternating rounds of {args.steps} steps (min-max in brackets)")
    print("| config | dtype | implementation | tokens/s | vs plain PyTorch | TFLOP/s | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for config_name in args.configs:
        for dtype in args.dtypes:
            samples = measure_throughput(config_name, dtype, args.rounds, args.steps, args.impls)
            summary = summarize(samples)
            for mine, theirs in GAINS:
                if mine in samples and theirs in samples:
                    gains.append((config_name, dtype, mine, theirs, summarize(samples, baseline=theirs)[mine][3:]))
            for impl, (tokens_per_s, lo, hi, ratio, ratio_lo, ratio_hi) in summary.items():
                c = CONFIGS[config_name]
                tflops = flops_per_token(c) * tokens_per_s / 1e12
                rss = float("nan") if args.no_rss else peak_rss_mb(config_name, dtype, impl)
                rows.append(dict(config=config_name, dtype=dtype, impl=impl, tokens_per_s=tokens_per_s,
                                 tokens_per_s_min=lo, tokens_per_s_max=hi, ratio=ratio, ratio_min=ratio_lo,
                                 ratio_max=ratio_hi, tflops=tflops, rss_mb=rss))
                print(f"| {config_name} | {dtype} | {impl} | {tokens_per_s:,.0f} ({lo:,.0f}-{hi:,.0f}) | "
                      f"{ratio:.2f}x ({ratio_lo:.2f}-{ratio_hi:.2f}) | {tflops:.3f} | {rss:,.0f} |", flush=True)
    for config_name, dtype, mine, theirs, (gain, lo, hi) in gains:
        print(f"# {config_name} {dtype}: {mine} / {theirs}, per-round median {gain:.2f}x ({lo:.2f}-{hi:.2f})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
