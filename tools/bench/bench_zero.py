"""Benchmark: torch DDP vs our ZeRO stages 0-3 (and DeepSpeed's 0-2, when installed), fp32 and bf16.

    .venv/bin/python tools/bench/bench_zero.py                 # 2 gloo processes (data parallel 2), CPU, ~3 minutes on a quiet machine
    .venv/bin/python tools/bench/bench_zero.py --steps 10 --repeats 7 --variants ddp-fp32,zero2-fp32
    .venv/bin/python tools/bench/bench_zero.py --repeats 0     # communication table only
    .venv/bin/python tools/bench/bench_zero.py --world-size 1 --comm-world-sizes "" --repeats 7 \
        --variants zero2-fp32,zero3-fp32,zero3g-fp32              # stage 2 vs 3 at dp 1 (resident vs gathered)

Model: a GPT-2 (nanoGPT-style, tied head) with L=4, h=256, heads=4, s=256, V=8192; micro-batch 4 per rank.
Variants: ddp, ddpamp (fp32 parameters, bf16 autocast), zeroK (stage K), zeroKoff (optimizer offload), zeroKpg
(stages 1-2 with overlap_param_gather: the parameter all-gather completes during the next forward), zero3nr
(stage 3 with stage3_max_reuse_distance 0: every unit gathered again for the backward), zero3g (stage 3 gathering
per unit at data-parallel size 1 too, stage3_resident_at_dp1 off: zero3 keeps the parameters resident there), dsK
(DeepSpeed's stage K), each with -fp32 or -bf16.
Each variant runs in fresh processes, so peak RSS is its own. The variants run --repeats times, alternating
(and in reversed order every other repeat), and the table gives the median tokens/s with its min-max, the median
of the per-repeat ratios to its precision's DDP baseline (ddp-P, or ddpamp-P when ddp-P is not in the run; each
ratio from the same repeat, so slow phases of the shared machine cancel), per-rank model-state bytes
(parameters + gradients + fp32 masters + Adam moments, as held by real tensors) next to the ZeRO formula, and peak RSS per rank. Every variant steps the same AdamW kernel
(--adam, default fused, as megatron.training.get_optimizer does).

A second table gives the bytes each rank sends in one training step at data-parallel 2 and 4 (--comm-world-sizes),
counted by megatron.guards.comm_bytes (cost model there), next to the ideal: DDP / stage 0 one ring all-reduce,
2 (dp-1)/dp x gradient bytes; stages 1/2 reduce-scatter + all-gather, (dp-1)/dp x each, the same total; stage 3
reduce-scatter + a gather before forward, and one before backward only for zero3nr (by default the units stay
gathered into the backward); parameters under the persistence threshold stay whole: one refresh after the step
instead. This figure does not depend on the machine's speed.
DeepSpeed peers: `DS_BUILD_OPS=0 pip install deepspeed==0.19.8`, run with DS_ACCELERATOR=cpu.
"""
import argparse
import importlib.util
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import peak_rss_mb  # noqa: E402
# The tables and the formulas they compare with (tests/test_gpu_check.py reads them here, their home before).
from bench_zero_report import (PHASES, PHASES_DOC, VARIANT_KINDS, baseline_line, comm_table,  # noqa: E402,F401
                               deepspeed_ratio_lines, ddp_baseline, formula_bytes, gradient_element_size,
                               ideal_comm_bytes, overlap_ratio_lines, per_repeat_ratios, phase_table,
                               stage3_ratio_lines, stage_and_offload, throughput_table)

from megatron import zero  # noqa: E402
from megatron.training import param_groups_for_weight_decay  # noqa: E402  (Megatron's grouping)
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
        # the tied head uses wte's weight in this forward: ZeRO-3 gathers it here too (a no-op for the others)
        zero.register_external_parameter(self, self.wte.weight)

    def forward(self, tokens, targets):                            # tokens, targets: [b, s]
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)           # [b, s, V], head tied to wte
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))


def _no_clock(phase):
    pass


class PhaseClock:
    """Seconds per phase: `clock(phase)` ends the phase that began at the previous call (or at start())."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.last = None

    def start(self):
        self.last = time.perf_counter()

    def __call__(self, phase):
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _build(variant, zero_options, adam, count_ddp_comm=False):
    """(parameter count, train_step(tokens, targets), state_bytes()) for one variant on this rank.
    `count_ddp_comm` routes torch DDP's all-reduce through Python so megatron.guards.comm_bytes sees it."""
    kind, precision = variant.split("-")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = GPT()
    params = sum(p.numel() for p in model.parameters())     # before stage 3 partitions them
    if kind == "ddp":
        model.to(dtype)   # ddp-bf16 keeps everything in bf16; ddpamp-bf16: fp32 params and Adam, bf16 autocast
    optimizer = torch.optim.AdamW(param_groups_for_weight_decay(model), lr=1e-4, weight_decay=0.1,
                                  **adam_options(adam))
    if kind in ("ddp", "ddpamp"):
        engine = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        if count_ddp_comm:
            from megatron.guards.comm_bytes import count_ddp_allreduce
            count_ddp_allreduce(engine)
        autocast = kind == "ddpamp" and precision == "bf16"
        device_type = next(model.parameters()).device.type

        def train_step(tokens, targets, clock=_no_clock):
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
                loss = engine(tokens, targets)
            clock("forward")
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            clock("backward")
            optimizer.step()
            clock("step")

        def state_bytes():
            return (_tensor_bytes(p for p in model.parameters()) + _tensor_bytes(p.grad for p in model.parameters())
                    + _tensor_bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0))
        return params, train_step, state_bytes
    stage, own_keys = stage_and_offload(kind)
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10 ** 9,
              "bf16": {"enabled": precision == "bf16"},
              "zero_optimization": {"stage": stage, **zero_options, **own_keys}}
    if kind.startswith("ds"):
        import deepspeed
        if stage == 3:   # the tied head reads wte's weight in GPT.forward: DeepSpeed must gather it there too
            deepspeed.zero.register_external_parameter(model, model.wte.weight)
        config["zero_allow_untested_optimizer"] = True
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    else:
        from megatron import zero
        config["zero_optimization"]["overlap_param_gather"] = kind.endswith("pg")
        engine, optimizer, _, _ = zero.initialize(model=model, optimizer=optimizer, config=config,
                                                  dist_init_required=False)

    def train_step(tokens, targets, clock=_no_clock):
        loss = engine(tokens, targets)
        clock("forward")
        engine.backward(loss)
        clock("backward")
        engine.step()
        clock("step")

    def state_bytes():     # on the device (what offload moves to the host is not counted)
        if hasattr(optimizer, "partitioned_state_bytes"):
            from megatron.guards.memory import measured_model_state_bytes
            return measured_model_state_bytes(optimizer)["total"]
        return float("nan")
    return params, train_step, state_bytes


def adam_options(adam):
    """torch AdamW keyword arguments for --adam: the kernel megatron.training.get_optimizer picks, or torch's
    default."""
    if adam == "default":
        return {}
    from megatron.zero import adam_kernel_options
    return adam_kernel_options(torch.device("cpu"))


def _data():
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator) for _ in range(4)]


def _worker(variant, steps, warmup, zero_options, adam):
    params, train_step, state_bytes = _build(variant, zero_options, adam)
    data = _data()
    clock = PhaseClock()
    for step in range(warmup + steps):
        if step == warmup:
            dist.barrier()
            start = time.perf_counter()
        batch = data[step % len(data)]
        clock.start()
        train_step(batch[:, :-1], batch[:, 1:], clock if step >= warmup else _no_clock)
    dist.barrier()
    elapsed = time.perf_counter() - start
    tokens = steps * MICRO * SEQ * dist.get_world_size()
    return {"tokens_per_s": tokens / elapsed, "state_bytes": state_bytes(),
            "peak_rss_mb": peak_rss_mb(), "params": params,
            "phase_ms": {phase: seconds / steps * 1e3 for phase, seconds in clock.seconds.items()}}


def _comm_worker(variants, zero_options, adam):
    """{variant: (bytes sent by op in the second step, gradient bytes, bytes of stage-3 persistent parameters,
    calls by op in that step)} on this rank; the first step warms up."""
    from megatron import zero
    from megatron.guards.comm_bytes import CommCounter
    numels = [p.numel() for p in GPT().parameters()]       # full sizes (stage 3 partitions the model's own)
    threshold = zero.load_config({"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {
        "stage": 3, **zero_options}}, dist.get_world_size()).zero_optimization.stage3_param_persistence_threshold
    out = {}
    for variant in variants:
        _, train_step, _ = _build(variant, zero_options, adam, count_ddp_comm=True)
        batch = _data()[0]
        train_step(batch[:, :-1], batch[:, 1:])
        with CommCounter() as counter:
            train_step(batch[:, :-1], batch[:, 1:])
        size = gradient_element_size(variant)
        persistent = sum(n for n in numels if n <= threshold) * size if variant.startswith("zero3") else 0
        out[variant] = (dict(counter.bytes_by_op), sum(numels) * size, persistent, dict(counter.calls_by_op))
        del train_step
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of every variant (0: none)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--comm-world-sizes", default="2,4",
                        help="data-parallel sizes of the bytes-per-step table (empty: skip it)")
    parser.add_argument("--variants", default=None, help="comma-separated, e.g. ddp-fp32,zero2-bf16")
    parser.add_argument("--adam", choices=["fused", "default"], default="fused",
                        help="AdamW kernel of every variant: fused where torch has it, or torch's default")
    parser.add_argument("--reduce-bucket-size", type=int, default=2_000_000, help="elements")
    parser.add_argument("--allgather-bucket-size", type=int, default=500_000,
                        help="elements per partition chunk of the parameter all-gather (several buckets, so the "
                             "zeroKpg variants' first layers start before the last buckets arrive)")
    parser.add_argument("--no-overlap-comm", action="store_true")
    parser.add_argument("--no-contiguous-gradients", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < 0 or args.steps < 1:
        parser.error(f"--repeats {args.repeats} / --steps {args.steps}: need repeats >= 0 and steps >= 1")
    for variant in (args.variants.split(",") if args.variants else []):
        kind, _, precision = variant.partition("-")
        if kind not in VARIANT_KINDS or precision not in ("fp32", "bf16"):
            parser.error(f"--variants: {variant!r} is not KIND-PRECISION with KIND one of {', '.join(VARIANT_KINDS)} "
                         "and PRECISION fp32 or bf16")
    return args


def default_variants(precisions, deepspeed_installed):
    variants = [f"{kind}-{precision}" for precision in precisions
                for kind in ("ddp", "zero0", "zero1", "zero1pg", "zero2", "zero2pg", "zero3", "zero3nr", "zero2off",
                             "zero3off")]
    if "bf16" in precisions:
        variants.insert(variants.index("ddp-bf16") + 1, "ddpamp-bf16")
    if deepspeed_installed:
        variants += [f"ds{stage}-{precision}" for precision in precisions for stage in (0, 1, 2, 3)]
    return variants


def run_repeats(variants, args, zero_options):
    """{variant: [per-rank results of repeat 0, of repeat 1, ...]}: every repeat runs every variant, the order
    reversed every other repeat so a drift in the machine's speed does not favour one end of the list."""
    runs = {variant: [] for variant in variants}
    for repeat in range(args.repeats):
        for variant in (variants if repeat % 2 == 0 else variants[::-1]):
            runs[variant].append(run_distributed(_worker, args.world_size,
                                                 args=(variant, args.steps, args.warmup, zero_options, args.adam),
                                                 timeout=1800))
    return runs


def main():
    args = parse_args()
    from bench_common import default_precisions, precision_header
    print(precision_header())
    deepspeed_installed = importlib.util.find_spec("deepspeed") is not None
    if deepspeed_installed:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    variants = args.variants.split(",") if args.variants else default_variants(default_precisions(),
                                                                                 deepspeed_installed)
    zero_options = {"overlap_comm": not args.no_overlap_comm, "contiguous_gradients": not args.no_contiguous_gradients,
                    "reduce_bucket_size": args.reduce_bucket_size, "allgather_bucket_size": args.allgather_bucket_size,
                    # stage 3: what "auto" resolves to for this hidden size (0.9 h^2, 10 h), as in the ZeRO-3 configs
                    "stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
                    "stage3_param_persistence_threshold": 10 * HIDDEN}
    print(f"# GPT-2 L={LAYERS} h={HIDDEN} s={SEQ} V={VOCAB} micro={MICRO}, AdamW kernel: {args.adam} "
          f"{adam_options(args.adam) or '(torch default)'}")
    if args.repeats:
        runs = run_repeats(variants, args, zero_options)
        print(f"# data parallel {args.world_size} (gloo), {runs[variants[0]][0][0]['params'] / 1e6:.2f}M parameters, "
              f"{args.steps} timed steps per run, median of {args.repeats} alternating repeats")
        print("\n".join(throughput_table(runs, args.world_size) + [baseline_line(runs)]
                        + deepspeed_ratio_lines(runs) + overlap_ratio_lines(runs) + stage3_ratio_lines(runs)),
              flush=True)
        print("# ms per step by phase (rank 0, median over repeats). " + " ".join(PHASES_DOC.split()))
        print("\n".join(phase_table(runs)), flush=True)
    comm_sizes = [int(size) for size in args.comm_world_sizes.split(",") if size]
    if comm_sizes:
        measured = {dp: run_distributed(_comm_worker, dp, args=(variants, zero_options, args.adam),
                                        timeout=1800)[0] for dp in comm_sizes}
        print("# bytes each rank sends in one training step (megatron.guards.comm_bytes cost model), ideal: DDP/stage 0 "
              "2(dp-1)/dp G, stages 1-2 (dp-1)/dp G reduce-scatter + (dp-1)/dp G all-gather, stage 3 reduce-scatter "
              "+ 1 gather of the partitioned parameters (2 for zero3nr: again before backward) + 1 refresh of the "
              "persistent ones")
        print("\n".join(comm_table(measured)))


if __name__ == "__main__":
    main()
