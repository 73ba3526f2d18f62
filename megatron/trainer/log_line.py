"""The training log line every --log-interval and at the last iteration (log_due; megatron/training.py's train, through
IntervalLog, and the RLHF loop, megatron/posttrain/rlhf_driver.py, call training_log): printed on rank 0, written to
TensorBoard, returned as the --log-jsonl record's core; its tokens/s and TFLOP/s per rank come from flops_per_token
(Narayanan et al. 2021), which the benchmarks use too."""
import time

import mpu
from megatron.global_vars import get_args
from megatron.guards import operations
from megatron.model.gpt2_model import recompute_config_from_args
from megatron.model.moe_args import moe_config_from_args, moe_log_text
from megatron.utils import print_rank_0


def flops_per_token(num_layers, hidden_size, seq_length, padded_vocab_size, checkpoint_activations=False,
                    recompute=None, num_stages=1, num_attention_heads=None, num_key_value_heads=None,
                    ffn_hidden_size=None, swiglu=False, moe=None):
    """Training FLOPs per token (Narayanan et al. 2021): a forward of the layers costs 24 L h^2 (1 + s/(6h)) (qkv
    6h^2, projection 2h^2, MLP 16h^2, attention scores and values 4sh per layer); forward + backward = 3 such
    passes; the LM head 2hV per pass, 3 passes (it is not recomputed). Recomputation (`recompute`, an
    mpu.RecomputeConfig; checkpoint_activations=True is full uniform) adds one more forward of what it recomputes:
    full uniform every layer (4 passes), full block num_layers of each stage's L / num_stages layers, selective the
    attention core (4sh per layer). The Llama options (docs/models.md): K key/value heads make qkv 2h (h + 2 K h /
    heads); an MLP f wide costs 4hf, 6hf with SwiGLU (gate, up, down). MoE (`moe`, an mpu.MoEConfig): an MoE layer
    costs its router (2hE) and the MLPs of the k experts each token is routed to (the active parameters; capacity
    drops are not subtracted)."""
    L, h, s = num_layers, hidden_size, seq_length
    if recompute is None:
        recompute = mpu.RecomputeConfig.from_checkpoint_activations(checkpoint_activations)
    kv_width = h if not num_key_value_heads else h // num_attention_heads * num_key_value_heads
    f = ffn_hidden_size or 4 * h
    layer_forward = 2 * h * (h + 2 * kv_width) + 2 * h * h + (3 if swiglu else 2) * 2 * h * f + 4 * s * h
    if moe is not None:   # the MoE layers' extra k - 1 expert MLPs and router, spread over the L layers
        moe_layers = sum(moe.is_moe_layer(number) for number in range(L))
        layer_forward += moe_layers * ((moe.topk - 1) * (3 if swiglu else 2) * 2 * h * f + 2 * h * moe.num_experts) / L
    recomputed = 0.0
    if recompute.full:
        per_stage = L // num_stages
        recomputed = L * layer_forward * (1 if recompute.method == "uniform" else
                                          min(recompute.num_layers, per_stage) / per_stage)
    elif recompute.selective:
        recomputed = L * 4 * s * h
    return 3 * L * layer_forward + recomputed + 3 * 2 * h * padded_vocab_size


def _flops_per_iteration(args):
    return args.global_batch_size * args.seq_length * flops_per_token(
        args.num_layers, args.hidden_size, args.seq_length, args.padded_vocab_size,
        recompute=recompute_config_from_args(args),   # block recomputation: the first layers of each model chunk
        num_stages=args.pipeline_model_parallel_size * (args.virtual_pipeline_model_parallel_size or 1),
        num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
        ffn_hidden_size=args.ffn_hidden_size, swiglu=args.swiglu, moe=moe_config_from_args(args))


def training_log(loss_dict, train_state, lr, loss_scale, grad_norm, elapsed_ms, writer, moe=None):
    """Print the log line (rank 0); returns the same fields as a dict (the --log-jsonl record's core). `moe`: the
    MoE fields (megatron.model.moe_args.moe_log_fields; rank 0's last micro-batch), appended when there are any."""
    args = get_args()
    iteration = train_state.iteration
    tokens_per_second = args.global_batch_size * args.seq_length / (elapsed_ms / 1000.0)
    tflops = _flops_per_iteration(args) / (elapsed_ms / 1000.0) / args.world_size / 1e12
    line = (f" iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: {train_state.consumed_train_samples:10d}"
            f" | learning rate: {lr:.3E}")
    for key, value in loss_dict.items():
        line += f" | {key}: {value:.6E}"
    line += (f" | loss scale: {loss_scale:.1f} | grad norm: {grad_norm if grad_norm is not None else float('nan'):.3f}"
             f" | skipped iterations: {train_state.skipped_iterations:3d} | elapsed time per iteration (ms): {elapsed_ms:.1f}"
             f" | tokens/s: {tokens_per_second:.0f} | TFLOP/s per rank: {tflops:.3f}") + moe_log_text(moe)
    print_rank_0(line)
    if writer is not None:
        writer.add_scalar("learning_rate", lr, iteration)
        writer.add_scalar("loss_scale", loss_scale, iteration)
        for key, value in loss_dict.items():
            writer.add_scalar(key, value, iteration)
        if grad_norm is not None:
            writer.add_scalar("grad_norm", float(grad_norm), iteration)
        writer.add_scalar("skipped_iterations", train_state.skipped_iterations, iteration)
        writer.add_scalar("ms_per_iteration", elapsed_ms, iteration)
        writer.add_scalar("tokens_per_second", tokens_per_second, iteration)
        writer.add_scalar("tflops_per_rank", tflops, iteration)
    return {"type": "train", "iteration": iteration, "train_iters": args.train_iters,
            "consumed_samples": train_state.consumed_train_samples, "learning_rate": lr,
            "losses": dict(loss_dict), "loss_scale": float(loss_scale),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped_iterations": train_state.skipped_iterations, "ms_per_iteration": elapsed_ms,
            "tokens_per_second": tokens_per_second, "tflops_per_rank": tflops, **({"moe": moe} if moe else {})}


def log_due(iteration, args):
    """Whether `iteration` ends a log interval: every --log-interval iterations, and the run's last (--train-iters)
    whatever the interval, so a run shorter than an interval, or not a multiple of it, logs (and plots) its end."""
    return iteration % args.log_interval == 0 or iteration == args.train_iters


class IntervalLog:
    """The iterations since the last log line (training.py's train): their summed losses, how many, since when.
    log() prints the line of their means (a resumed run's first interval, the last one, may be shorter than
    --log-interval), writes TensorBoard's scalars and (rank 0) the --log-jsonl record, and starts the next."""

    def __init__(self, args, timers, writer):
        self.args, self.timers, self.writer = args, timers, writer
        self.losses, self.iterations, self.start = {}, 0, time.time()

    def add(self, loss_dict):
        for key, value in loss_dict.items():
            self.losses[key] = self.losses.get(key, 0.0) + value
        self.iterations += 1

    def log(self, train_state, lr, loss_scale, grad_norm, moe=None):
        args, count = self.args, self.iterations
        elapsed_ms = (time.time() - self.start) * 1000.0 / count
        averages = {key: value / count for key, value in self.losses.items()}
        record = training_log(averages, train_state, lr, loss_scale, grad_norm, elapsed_ms, self.writer, moe)
        phases = operations.phase_ms(self.timers, count)
        if self.writer is not None:
            for name, value in phases.items():
                if value is not None:
                    self.writer.add_scalar(f"{name}_ms", value, train_state.iteration)
        self.timers.log([name for name in operations.PHASES if phases[name] is not None], normalizer=count)
        if args.log_jsonl and args.rank == 0:
            operations.write_jsonl_record(args.log_jsonl, {**record, "timers_ms": phases,
                                                           "memory": operations.memory_now()})
        self.losses, self.iterations, self.start = {}, 0, time.time()
