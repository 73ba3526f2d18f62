"""Benchmark: torch DDP vs our ZeRO stages 0-3 (and DeepSpeed's 0-2, when installed), fp32 and bf16.

    .venv/bin/python tools/bench/bench_zero.py                 # 2 gloo processes (data parallel 2), CPU, ~3 minutes on a quiet machine
    .venv/bin/python tools/bench/bench_zero.py --steps 10 --repeats 7 --variants ddp-fp32,zero2-fp32
    .venv/bin/python tools/bench/bench_zero.py --repeats 0     # communication table only

Model: a GPT-2 (nanoGPT-style, tied head) with L=4, h=256, heads=4, s=256, V=8192; micro-batch 4 per rank.
Variants: ddp, ddpamp (fp32 parameters, bf16 autocast), zeroK (stage K), zeroKoff (optimizer offload), zeroKpg
(stages 1-2 with overlap_param_gather: the parameter all-gather completes during the next forward), zero3nr
(stage 3 with stage3_max_reuse_distance 0: every unit gathered again for the backward), dsK
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
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import median_and_spread, peak_rss_mb  # noqa: E402

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


PHASES = ("forward", "backward", "step")
PHASES_DOC = """Phases: forward; backward with the gradient reduction it overlaps (DDP's all-reduce, ZeRO's
reduce-scatter buckets); step with what follows it (ZeRO's last buckets, the update, the parameter all-gather)."""


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


VARIANT_KINDS = ("ddp", "ddpamp", "zero0", "zero1", "zero2", "zero3", "zero3nr", "zero1pg", "zero2pg", "zero1off",
                 "zero2off", "zero3off", "ds0", "ds1", "ds2", "ds3")


def stage_and_offload(kind):
    """("zero3off" | "zero2pg" | "ds2" | ...) -> (ZeRO stage, the variant's own keys of zero_optimization): "off"
    offloads the optimizer (and, at stage 3, the parameters) to host memory; "nr" (stage 3) reuses nothing: every
    unit is gathered again for the backward (stage3_max_reuse_distance 0)."""
    stage = int(kind[4] if kind.startswith("zero") else kind[2])
    if kind.endswith("nr"):
        return stage, {"stage3_max_reuse_distance": 0}
    if not kind.endswith("off"):
        return stage, {}
    offload = {"offload_optimizer": {"device": "cpu"}}
    return stage, {**offload, **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}


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


def gradient_element_size(variant):
    """Bytes per communicated gradient (and gathered parameter) element: the low-precision dtype of the variant,
    fp32 for the fp32 variants and for autocast DDP (fp32 parameters)."""
    kind, precision = variant.split("-")
    return 2 if precision == "bf16" and kind != "ddpamp" else 4


def ideal_comm_bytes(variant, grad_bytes, dp, persistent_bytes=0):
    """Bytes per rank per step at the ideal volume: one ring all-reduce for DDP and stage 0; reduce-scatter plus
    all-gather, (dp-1)/dp each, for stages 1-2 (the same total); stage 3 gathers its partitioned parameters before
    forward, and refreshes the persistent (whole) ones once after the step; it gathers the partitioned ones again
    before backward only without reuse (zero3nr): by default (stage3_max_reuse_distance 1e9, more than the
    bench model's 5.3M elements) every unit stays gathered from the forward into the backward."""
    kind, share = variant.split("-")[0], (dp - 1) / dp
    stage = 0 if kind in ("ddp", "ddpamp") else stage_and_offload(kind)[0]
    if stage == 0:
        return 2 * share * grad_bytes
    if stage == 3:
        gathers = 2 if kind.endswith("nr") else 1
        return share * (grad_bytes + gathers * (grad_bytes - persistent_bytes) + persistent_bytes)
    return share * grad_bytes + share * grad_bytes


def formula_bytes(variant, params, dp):
    """The ZeRO paper's per-rank model-state bytes (K = 12 for Adam; fp32 masters alias fp32 parameters)."""
    kind, precision = variant.split("-")
    if kind == "ddpamp":
        return 16 * params                                         # fp32 params, grads, two fp32 moments
    if kind.endswith("off"):                # on the device: stage 2 keeps the 16-bit params, stage 3 nothing
        return (2 if precision == "bf16" else 4) * params if kind.startswith("zero2") else 0
    stage = 0 if kind == "ddp" else stage_and_offload(kind)[0]
    if precision == "bf16" and kind != "ddp":
        return {0: 16 * params, 1: 4 * params + 12 * params / dp, 2: 2 * params + 14 * params / dp,
                3: 16 * params / dp}[stage]
    if precision == "bf16":
        return 8 * params                                          # bf16 params, grads, two bf16 moments
    return {0: 16 * params, 1: 8 * params + 8 * params / dp, 2: 4 * params + 12 * params / dp,
            3: 16 * params / dp}[stage]


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


def ddp_baseline(runs, precision):
    """The DDP variant the "vs DDP" column divides by for `precision`: ddp-P, else ddpamp-P, else None."""
    return next((name for name in (f"ddp-{precision}", f"ddpamp-{precision}") if name in runs), None)


def per_repeat_ratios(mine, theirs):
    """Rank 0's tokens/s of `mine` over `theirs`, repeat by repeat (the same repeat shares the machine's phase)."""
    return [a[0]["tokens_per_s"] / b[0]["tokens_per_s"] for a, b in zip(mine, theirs)]


def throughput_table(runs, world_size):
    """Markdown rows: median tokens/s (min-max), median per-repeat ratio to the precision's DDP baseline
    (min-max), state and RSS."""
    lines = [f"| {'variant':<12} | {'tokens/s median':>15} | {'min-max':>11} | {'vs DDP median':>13} | "
             f"{'min-max':>11} | {'model-state MB/rank':>19} | {'formula MB':>10} | {'peak RSS MB/rank':>16} |",
             "|" + "|".join("-" * (width + 2) for width in (12, 15, 11, 13, 11, 19, 10, 16)) + "|"]
    for variant, repeats in runs.items():
        speeds = [results[0]["tokens_per_s"] for results in repeats]
        baseline = ddp_baseline(runs, variant.split("-")[1])
        ratios = per_repeat_ratios(repeats, runs[baseline]) if baseline else [math.nan]
        speed, speed_lo, speed_hi = median_and_spread(speeds)
        ratio, ratio_lo, ratio_hi = median_and_spread(ratios)
        state = max(r["state_bytes"] for results in repeats for r in results) / 2 ** 20
        formula = formula_bytes(variant, repeats[0][0]["params"], world_size) / 2 ** 20
        rss = statistics.median(max(r["peak_rss_mb"] for r in results) for results in repeats)
        lines.append(f"| {variant:<12} | {speed:>15.0f} | {f'{speed_lo:.0f}-{speed_hi:.0f}':>11} | {ratio:>13.2f} | "
                     f"{f'{ratio_lo:.2f}-{ratio_hi:.2f}':>11} | {state:>19.2f} | {formula:>10.2f} | {rss:>16.0f} |")
    return lines


def baseline_line(runs):
    """'# vs DDP: ...': which DDP variant each precision's "vs DDP" column divides by."""
    precisions = sorted({variant.split("-")[1] for variant in runs})
    return "# vs DDP: " + ", ".join(f"{precision} against {ddp_baseline(runs, precision)}" for precision in precisions)


def _ratio_lines(runs, peer_of):
    """'# A / B' lines (the median of per-repeat tokens/s ratios, min-max) for every variant A with a peer
    B = peer_of(kind, precision) in the run."""
    lines = []
    for variant, repeats in runs.items():
        kind, precision = variant.split("-")
        peer = peer_of(kind, precision)
        if peer in runs:
            ratio, lo, hi = median_and_spread(per_repeat_ratios(repeats, runs[peer]))
            lines.append(f"# {variant} / {peer}: per-repeat median {ratio:.2f}x ({lo:.2f}-{hi:.2f})")
    return lines


def deepspeed_ratio_lines(runs):
    """Our stage K (zeroK, zeroKpg) over DeepSpeed's (dsK), per-repeat medians."""
    return _ratio_lines(runs, lambda kind, precision: f"ds{kind[4]}-{precision}"
                        if kind.startswith("zero") and not kind.endswith(("off", "nr")) else None)


def stage3_ratio_lines(runs):
    """zero3 over zero2 (what partitioning the parameters costs) and over zero3nr (what the reuse gains)."""
    return (_ratio_lines(runs, lambda kind, precision: f"zero2-{precision}" if kind == "zero3" else None)
            + _ratio_lines(runs, lambda kind, precision: f"zero3nr-{precision}" if kind == "zero3" else None))


def overlap_ratio_lines(runs):
    """zeroKpg over zeroK: what overlapping the parameter all-gather with the forward gains."""
    return _ratio_lines(runs, lambda kind, precision: f"{kind[:-2]}-{precision}" if kind.endswith("pg") else None)


def phase_table(runs):
    """Markdown rows: rank 0's milliseconds per step in each phase (median over repeats), to say which phase
    costs a difference between two variants."""
    lines = ["| variant      | " + " | ".join(f"{phase} ms" for phase in PHASES) + " | total ms |",
             "|--------------|" + "|".join("-" * (len(phase) + 4) + ":" for phase in PHASES) + "|---------:|"]
    for variant, repeats in runs.items():
        medians = [statistics.median(results[0]["phase_ms"][phase] for results in repeats) for phase in PHASES]
        lines.append(f"| {variant:<12} | " + " | ".join(f"{ms:>{len(phase) + 3}.1f}" for ms, phase in
                                                        zip(medians, PHASES)) + f" | {sum(medians):>8.1f} |")
    return lines


def comm_table(measured):
    """Markdown rows from {dp: {variant: (bytes by op, gradient bytes, stage-3 persistent bytes, calls by op)}}
    (rank 0's). "by collective": MB and the number of calls in the step, per op."""
    lines = ["| dp | variant     | MB sent/rank/step | ideal MB | measured/ideal | by collective |",
             "|---:|-------------|------------------:|---------:|---------------:|---------------|"]
    for dp, by_variant in measured.items():
        for variant, (by_op, grad_bytes, persistent_bytes, calls) in by_variant.items():
            sent, ideal = sum(by_op.values()), ideal_comm_bytes(variant, grad_bytes, dp, persistent_bytes)
            split = ", ".join(f"{op} {value / 2 ** 20:.2f} ({calls[op]} call{'s' * (calls[op] != 1)})" for op, value in sorted(by_op.items())
                              if value)
            lines.append(f"| {dp:>2} | {variant:<11} | {sent / 2 ** 20:>17.2f} | {ideal / 2 ** 20:>8.2f} | "
                         f"{sent / ideal:>14.3f} | {split} |")
    return lines


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
