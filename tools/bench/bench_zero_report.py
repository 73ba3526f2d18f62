"""bench_zero.py's tables (throughput, phases, communication) and the figures they are compared with: the ZeRO
paper's per-rank model-state bytes and the ideal communication volume of each variant. Pure functions of the
measured numbers (tests/test_gpu_check.py checks them on made-up runs); bench_zero.py re-exports them.

    lines = throughput_table(runs, world_size)       # runs: {variant: [per-repeat [per-rank result dict]]}
    lines = comm_table({dp: {variant: (bytes by op, gradient bytes, persistent bytes, calls by op)}})
"""
import math
import statistics

from bench_common import median_and_spread

PHASES = ("forward", "backward", "step")
PHASES_DOC = """Phases: forward; backward with the gradient reduction it overlaps (DDP's all-reduce, ZeRO's
reduce-scatter buckets); step with what follows it (ZeRO's last buckets, the update, the parameter all-gather)."""
VARIANT_KINDS = ("ddp", "ddpamp", "zero0", "zero1", "zero2", "zero3", "zero3nr", "zero3g", "zero1pg", "zero2pg",
                 "zero1off", "zero2off", "zero3off", "ds0", "ds1", "ds2", "ds3")


def stage_and_offload(kind):
    """("zero3off" | "zero2pg" | "ds2" | ...) -> (ZeRO stage, the variant's own keys of zero_optimization): "off"
    offloads the optimizer (and, at stage 3, the parameters) to host memory; "nr" (stage 3) reuses nothing: every
    unit is gathered again for the backward (stage3_max_reuse_distance 0); "zero3g" gathers per unit at
    data-parallel size 1 too (stage3_resident_at_dp1 off: what zero3 did there before it kept the parameters
    resident; the same as zero3 at dp > 1)."""
    stage = int(kind[4] if kind.startswith("zero") else kind[2])
    if kind.endswith("nr"):
        return stage, {"stage3_max_reuse_distance": 0}
    if kind == "zero3g":
        return stage, {"stage3_resident_at_dp1": False}
    if not kind.endswith("off"):
        return stage, {}
    offload = {"offload_optimizer": {"device": "cpu"}}
    return stage, {**offload, **({"offload_param": {"device": "cpu"}} if stage == 3 else {})}


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
                        if kind.startswith("zero") and not kind.endswith(("off", "nr", "3g")) else None)


def stage3_ratio_lines(runs):
    """zero3 (and zero3g) over zero2 (what partitioning the parameters costs), zero3 over zero3nr (what the reuse
    gains) and over zero3g (at dp 1: what keeping the parameters resident gains)."""
    return (_ratio_lines(runs, lambda kind, precision: f"zero2-{precision}" if kind in ("zero3", "zero3g") else None)
            + _ratio_lines(runs, lambda kind, precision: f"zero3nr-{precision}" if kind == "zero3" else None)
            + _ratio_lines(runs, lambda kind, precision: f"zero3g-{precision}" if kind == "zero3" else None))


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
