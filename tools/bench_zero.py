"""Benchmark: torch DDP vs our ZeRO stages 0/1/2 (and DeepSpeed's, when installed), fp32 and bf16.

    .venv/bin/python tools/bench_zero.py                 # 2 gloo processes (data parallel 2), CPU
    .venv/bin/python tools/bench_zero.py --steps 10 --repeats 2 --variants ddp-fp32,zero2-fp32

Model: a GPT-2 (nanoGPT-style, tied head) with L=4, h=256, heads=4, s=256, V=8192; micro-batch 4 per rank.
Each variant runs in fresh processes, so peak RSS is its own. Prints tokens/s (whole job), the ratio to torch
DDP of the same precision, per-rank model-state bytes (parameters + gradients + fp32 masters + Adam moments, as
held by real tensors) next to the ZeRO formula, and peak RSS per rank. With --repeats N the variants run N times
in interleaved order and the best tokens/s is reported (the machine is shared; compare ratios, not absolutes).
DeepSpeed peers: `DS_BUILD_OPS=0 pip install deepspeed==0.19.8`, run with DS_ACCELERATOR=cpu.
"""
import argparse
import importlib.util
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import peak_rss_mb  # noqa: E402

from megatron.spawn import run_distributed  # noqa: E402  (gloo processes on this machine)

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 4, 256, 4, 256, 8192, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc, self.out = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):                                           # x: [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)             # each [b, s, h]
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in (q, k, v))   # [b, heads, s, h/heads]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, tokens, targets):                            # tokens, targets: [b, s]
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)           # [b, s, V], head tied to wte
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def param_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _worker(variant, steps, warmup, zero_options):
    kind, precision = variant.split("-")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = GPT()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4)
    if kind in ("ddp", "ddpamp"):
        # ddp-bf16 keeps everything in bf16; ddpamp-bf16 is the usual mixed precision: fp32 params and Adam state,
        # bf16 compute under torch.autocast.
        if kind == "ddp":
            model.to(dtype)
        optimizer = torch.optim.AdamW(param_groups(model), lr=1e-4)
        engine = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        autocast = kind == "ddpamp" and precision == "bf16"
        device_type = next(model.parameters()).device.type

        def train_step(tokens, targets):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                loss = engine(tokens, targets)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            optimizer.step()

        def state_bytes():
            return (_tensor_bytes(p for p in model.parameters()) + _tensor_bytes(p.grad for p in model.parameters())
                    + _tensor_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0))
    else:
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 9,
                  "bf16": {"enabled": precision == "bf16"},
                  "zero_optimization": {"stage": int(kind[-1]), **zero_options}}
        if kind.startswith("ds"):
            import deepspeed
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        else:
            from megatron import zero
            engine, optimizer, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config,
                                                      dist_init_required=False)

        def train_step(tokens, targets):
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()

        def state_bytes():
            if hasattr(optimizer, "partitioned_state_bytes"):
                return sum(optimizer.partitioned_state_bytes().values())
            return float("nan")
    generator = torch.Generator().manual_seed(dist.get_rank())
    data = [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator) for _ in range(4)]
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            start = time.perf_counter()
        batch = data[step % len(data)]
        train_step(batch[:, :-1], batch[:, 1:])
    dist.barrier()
    elapsed = time.perf_counter() - start
    tokens = steps * MICRO * SEQ * dist.get_world_size()
    return {"tokens_per_s": tokens / elapsed, "state_bytes": state_bytes(),
            "peak_rss_mb": peak_rss_mb(),
            "params": sum(p.numel() for p in model.parameters())}


def formula_bytes(variant, params, dp):
    """The ZeRO paper's per-rank model-state bytes (K = 12 for Adam; fp32 masters alias fp32 parameters)."""
    kind, precision = variant.split("-")
    if kind == "ddpamp":
        return 16 * params                                         # fp32 params, grads, two fp32 moments
    stage = 0 if kind == "ddp" else int(kind[-1])
    if precision == "bf16" and kind != "ddp":
        return {0: 16 * params, 1: 4 * params + 12 * params / dp, 2: 2 * params + 14 * params / dp}[stage]
    if precision == "bf16":
        return 8 * params                                          # bf16 params, grads, two bf16 moments
    return {0: 16 * params, 1: 8 * params + 8 * params / dp, 2: 4 * params + 12 * params / dp}[stage]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--variants", default=None, help="comma-separated, e.g. ddp-fp32,zero2-bf16")
    parser.add_argument("--reduce-bucket-size", type=int, default=2_000_000, help="elements")
    parser.add_argument("--allgather-bucket-size", type=int, default=50_000_000, help="elements")
    parser.add_argument("--no-overlap-comm", action="store_true")
    parser.add_argument("--no-contiguous-gradients", action="store_true")
    args = parser.parse_args()
    from bench_common import default_precisions, precision_header
    print(precision_header())
    precisions = default_precisions()
    variants = [f"{kind}-{precision}" for precision in precisions for kind in ("ddp", "zero0", "zero1", "zero2")]
    if "bf16" in precisions:
        variants.insert(variants.index("ddp-bf16") + 1, "ddpamp-bf16")
    if importlib.util.find_spec("deepspeed") is not None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        variants += [f"ds{stage}-{precision}" for precision in precisions for stage in (0, 1, 2)]
    if args.variants:
        variants = args.variants.split(",")
    zero_options = {"overlap_comm": not args.no_overlap_comm, "contiguous_gradients": not args.no_contiguous_gradients,
                    "reduce_bucket_size": args.reduce_bucket_size, "allgather_bucket_size": args.allgather_bucket_size}
    best = {}
    for _ in range(args.repeats):
        for variant in variants:
            results = run_distributed(_worker, args.world_size, args=(variant, args.steps, args.warmup, zero_options),
                                      timeout=1800)
            previous = best.get(variant)
            if previous is None or results[0]["tokens_per_s"] > previous[0]["tokens_per_s"]:
                best[variant] = results
    print(f"GPT-2 L={LAYERS} h={HIDDEN} s={SEQ} V={VOCAB} micro={MICRO}, data parallel {args.world_size} (gloo), "
          f"{best[variants[0]][0]['params'] / 1e6:.2f}M parameters, {args.steps} timed steps")
    print(f"| {'variant':<11} | {'tokens/s':>9} | {'vs DDP':>6} | {'model-state MB/rank':>19} | "
          f"{'formula MB':>10} | {'peak RSS MB/rank':>16} |")
    print(f"|{'-' * 13}|{'-' * 11}|{'-' * 8}|{'-' * 21}|{'-' * 12}|{'-' * 18}|")
    for variant in variants:
        results = best[variant]
        ddp = best.get("ddp-" + variant.split("-")[1])
        ratio = results[0]["tokens_per_s"] / ddp[0]["tokens_per_s"] if ddp else math.nan
        state = max(r["state_bytes"] for r in results) / 2 ** 20
        formula = formula_bytes(variant, results[0]["params"], args.world_size) / 2 ** 20
        rss = max(r["peak_rss_mb"] for r in results)
        print(f"| {variant:<11} | {results[0]['tokens_per_s']:>9.0f} | {ratio:>6.2f} | {state:>19.2f} | "
              f"{formula:>10.2f} | {rss:>16.0f} |")


if __name__ == "__main__":
    main()
