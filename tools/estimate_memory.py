"""Model-state and activation memory per rank of a GPT-2 shape, without hardware (megatron/guards/memory.py).

    python tools/estimate_memory.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
        --vocab-size 50257 --model-parallel-size 2 --data-parallel-size 8 --zero-stage 2 --bf16 --micro-batch-size 4

    python tools/estimate_memory.py --plan        # the largest GPT that fits 80 GB per GPU, stages 0-3 x dp

Prints the parameters per model-parallel rank (our GPT2Model's shapes, vocabulary padded like the training script),
the model-state bytes by kind (the same numbers `pretrain_gpt.py` prints at start-up for the same settings) and an
activation estimate for the layers (Korthikanti et al. 2022 adapted to our layer, for --recompute-granularity
none/selective/full and --device; see memory.activation_bytes_per_layer), as the start-up estimate of a run without
pipelining.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mpu  # noqa: E402
from megatron import cli, zero  # noqa: E402
from megatron.guards import memory  # noqa: E402
from megatron.tokenizer.tokenizer import vocab_size_with_padding  # noqa: E402


def build_parser():
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    parser.add_argument("--vocab-size", type=int, help="the tokenizer's vocabulary (before padding)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--model-parallel-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="activations: the replicated part split along the sequence too (needs mp > 1)")
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="activations: each rank holds 2 of 2C chunks of the sequence and ring attention keeps "
                             "fp32 outputs; ZeRO partitions over data x context parallel ranks")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--optimizer", choices=["adam", "muon"], default="adam",
                        help="muon: the layers' weight matrices keep one fp32 momentum (Adam: two moments)")
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                        help="ZeRO stage (the --deepspeed path); omitted: the Megatron path (no partitioning)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    parser.add_argument("--reduce-bucket-size", type=int, default=None,
                        help="stages 2-3: zero_optimization.reduce_bucket_size, for the bucket bound (default: "
                             "DeepSpeed's, 5e8)")
    parser.add_argument("--contiguous-gradients", action=argparse.BooleanOptionalAction, default=True,
                        help="stages 2-3: zero_optimization.contiguous_gradients (on here by default; off in a JSON "
                             "config that leaves it out)")
    parser.add_argument("--overlap-comm", action="store_true", help="stages 2-3: zero_optimization.overlap_comm")
    parser.add_argument("--offload", "--offload-optimizer", dest="offload", action="store_true",
                        help="offload_optimizer: master weights, moments (and stage 2-3 gradients) in host memory")
    parser.add_argument("--offload-param", action="store_true", help="stage 3: parameter partitions in host memory")
    parser.add_argument("--param-persistence-threshold", type=int, default=100_000,
                        help="stage 3: stage3_param_persistence_threshold (parameters this small stay whole)")
    parser.add_argument("--plan", action="store_true",
                        help="print the planning table instead: the largest GPT-2/GPT-3 shape whose model state "
                             "fits --device-memory-gb per GPU, for stages 0-3 and offload at dp 1, 8, 64, 512")
    parser.add_argument("--device-memory-gb", type=float, default=80.0)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--checkpoint-activations", action="store_true",
                        help="= --recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                        help="as in training: full (with --recompute-method, --recompute-num-layers) or selective")
    parser.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    parser.add_argument("--recompute-num-layers", type=int, default=None, help="full: default 1")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="where the activations live: cuda (bool dropout masks, SDPA's fused attention keeps no "
                             "s x s scores) or cpu (masks in the activations' dtype; the scores are kept when "
                             "--attention-dropout > 0)")
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    llama = parser.add_argument_group("Llama options (docs/models.md)")
    llama.add_argument("--num-key-value-heads", type=int, default=None)
    llama.add_argument("--ffn-hidden-size", type=int, default=None)
    llama.add_argument("--swiglu", action="store_true")
    llama.add_argument("--normalization", choices=("layernorm", "rmsnorm"), default="layernorm")
    llama.add_argument("--disable-bias-linear", action="store_true")
    llama.add_argument("--no-position-embedding", action="store_true")
    llama.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    return parser


def recompute_config(args):
    """The mpu.RecomputeConfig of the flags (--checkpoint-activations: full, uniform, 1 layer); ValueError when
    they disagree (Megatron-LM's rules, mpu/recompute.py)."""
    given = [flag for flag in ("recompute_granularity", "recompute_method", "recompute_num_layers")
             if getattr(args, flag) is not None]
    if args.checkpoint_activations:
        if given:
            raise ValueError("--checkpoint-activations is --recompute-granularity full --recompute-method uniform "
                             "--recompute-num-layers 1: give one spelling")
        return mpu.RecomputeConfig.from_checkpoint_activations(True)
    num_layers = args.recompute_num_layers
    if args.recompute_granularity == "full" and num_layers is None:
        num_layers = 1
    return mpu.RecomputeConfig(args.recompute_granularity, args.recompute_method, num_layers)


def ds_config(stage, dtype, micro_batch_size=1, **zero_keys):
    """The DeepSpeed JSON (as a dict) of these settings: zero.load_config parses it as training parses
    --deepspeed_config, so the estimate reads the same zero.Config."""
    config = {"train_micro_batch_size_per_gpu": micro_batch_size, "zero_optimization": {"stage": stage, **zero_keys}}
    if dtype != "float32":
        config[{"float16": "fp16", "bfloat16": "bf16"}[dtype]] = {"enabled": True}
    return config


ZERO_FLAGS = ("reduce_bucket_size", "contiguous_gradients", "overlap_comm", "offload", "offload_param",
              "param_persistence_threshold")     # the destinations of the flags zero_keys reads


def zero_keys(args):
    """The zero_optimization keys the flags set."""
    keys = {"contiguous_gradients": args.contiguous_gradients, "overlap_comm": args.overlap_comm,
            "stage3_param_persistence_threshold": args.param_persistence_threshold}
    if args.reduce_bucket_size is not None:
        keys["reduce_bucket_size"] = args.reduce_bucket_size
    for flag, key in (("offload", "offload_optimizer"), ("offload_param", "offload_param")):
        if getattr(args, flag):
            keys[key] = {"device": "cpu"}
    return keys


def architecture_of(args):
    """The Llama options of the command line as GPT2ModelConfig fields (docs/models.md)."""
    return {"num_key_value_heads": args.num_key_value_heads, "ffn_hidden_size": args.ffn_hidden_size,
            "swiglu": args.swiglu, "normalization": args.normalization, "add_bias_linear": not args.disable_bias_linear,
            "learned_position_embeddings": not args.no_position_embedding,
            "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights}


def estimate(args):
    """(parameters per mp rank, per-group counts, model-state bytes, activation bytes)."""
    padded_vocab = vocab_size_with_padding(args.vocab_size, args.make_vocab_size_divisible_by,
                                            args.model_parallel_size)
    shape = (args.num_layers, args.hidden_size, padded_vocab, args.max_position_embeddings or args.seq_length,
             args.model_parallel_size, args.num_attention_heads, architecture_of(args))
    counts = memory.gpt2_param_groups(*shape)
    sizes = memory.gpt2_parameter_sizes(*shape)
    groups = list(counts)
    if args.optimizer == "muon":     # the decayed group's halves, as zero.split_param_groups: Muon's, then AdamW's
        options = architecture_of(args)
        vocab_rows = padded_vocab // args.model_parallel_size * args.hidden_size
        tables = vocab_rows * (2 if options["untie_embeddings_and_output_weights"] else 1) + \
            (shape[3] * args.hidden_size if options["learned_position_embeddings"] else 0)   # embeddings, head
        groups = [memory.StateGroup(counts[0] - tables, muon=True), tables, counts[1]]
    dtype = "float16" if args.fp16 else ("bfloat16" if args.bf16 else "float32")
    config = None if args.zero_stage is None else \
        zero.load_config(ds_config(args.zero_stage, dtype, args.micro_batch_size, **zero_keys(args)),
                         args.data_parallel_size)
    states = memory.run_model_state_bytes(groups, dtype, config, args.data_parallel_size, args.context_parallel_size,
                                          parameter_sizes=[n for n, _ in sizes])
    layout = memory.ActivationLayout.for_run(args.device, 4 if dtype == "float32" else 2, args.attention_dropout,
                                             args.hidden_dropout,
                                             sequence_parallel=args.sequence_parallel and args.model_parallel_size > 1,
                                             context_parallel_size=args.context_parallel_size)
    held_tokens = args.seq_length // args.context_parallel_size
    activations = memory.activation_bytes(args.num_layers, held_tokens, args.micro_batch_size, args.hidden_size,
                                          args.num_attention_heads, args.model_parallel_size,
                                          recompute_config(args), layout)
    return sum(counts), counts, states, activations, padded_vocab, dtype


# GPT-2 and GPT-3 (Brown et al. 2020, table 2.1) shapes: (name, layers, hidden, heads)
PLAN_SHAPES = [("125M", 12, 768, 12), ("350M", 24, 1024, 16), ("760M", 24, 1536, 16), ("1.3B", 24, 2048, 16),
               ("1.5B", 48, 1600, 25), ("2.7B", 32, 2560, 32), ("6.7B", 32, 4096, 32), ("13B", 40, 5120, 40),
               ("30B", 48, 7168, 56), ("66B", 64, 9216, 72), ("175B", 96, 12288, 96)]
PLAN_SETTINGS = [("stage 0", 0, False, False), ("stage 1", 1, False, False), ("stage 2", 2, False, False),
                 ("stage 3", 3, False, False), ("stage 2 + offload_optimizer", 2, True, False),
                 ("stage 3 + offload_optimizer", 3, True, False), ("stage 3 + offload both", 3, True, True)]
PLAN_DP = (1, 8, 64, 512)


def plan(device_bytes, dtype="bfloat16", vocab=50257, seq=2048, threshold=100_000):
    """{(setting, dp): largest shape name whose device model-state bytes fit (None: none fits)}."""
    table = {}
    for setting, stage, offload, offload_param in PLAN_SETTINGS:
        for dp in PLAN_DP:
            best = None
            for name, layers, hidden, _ in PLAN_SHAPES:
                padded = vocab_size_with_padding(vocab, 128, 1)
                sizes = memory.gpt2_parameter_sizes(layers, hidden, padded, seq)
                counts = memory.gpt2_param_groups(layers, hidden, padded, seq)
                offloads = {key: {"device": "cpu"} for key, on in (("offload_optimizer", offload),
                                                                   ("offload_param", offload_param)) if on}
                config = zero.load_config(ds_config(stage, dtype, stage3_param_persistence_threshold=threshold,
                                                    **offloads), dp)
                states = memory.model_state_bytes(counts, dtype, config, dp, parameter_sizes=[n for n, _ in sizes])
                if states["total"] <= device_bytes:
                    best = name
            table[setting, dp] = best
    return table


def print_plan(device_gb):
    table = plan(device_gb * 1e9)
    print(f"largest GPT shape whose model state (bf16 + Adam, no activations) fits {device_gb:g} GB per GPU "
          f"(tensor/pipeline parallel 1; offloaded state needs host memory instead)")
    print(f"{'setting':30s}" + "".join(f"{'dp ' + str(dp):>10s}" for dp in PLAN_DP))
    for setting, *_ in PLAN_SETTINGS:
        print(f"{setting:30s}" + "".join(f"{table[setting, dp] or '-':>10s}" for dp in PLAN_DP))
    return table


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.require_range(parser, args, positive=(
        "num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings", "vocab_size",
        "make_vocab_size_divisible_by", "model_parallel_size", "data_parallel_size", "reduce_bucket_size",
        "device_memory_gb", "micro_batch_size", "recompute_num_layers", "context_parallel_size"),
        non_negative=("param_persistence_threshold", "attention_dropout", "hidden_dropout"))
    if args.plan:
        return print_plan(args.device_memory_gb)
    missing = [f"--{k.replace('_', '-')}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                                    "vocab_size") if getattr(args, k) is None]
    if missing:
        sys.exit(f"error: {', '.join(missing)} required (or --plan)")
    zero_flags = [f"--{dest.replace('_', '-')}" for dest in ZERO_FLAGS
                  if getattr(args, dest) != parser.get_default(dest)]
    if args.zero_stage is None and zero_flags:
        sys.exit(f"error: {', '.join(zero_flags)} set the ZeRO engine's config: add --zero-stage N (without it the "
                 f"estimate is the Megatron optimizer's, which has none of them)")
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.model_parallel_size:
        sys.exit("error: --hidden-size must divide by --num-attention-heads, and the heads by --model-parallel-size")
    problem = mpu.sequence_length_problem(args.seq_length, args.context_parallel_size,
                                          names=("--seq-length", "--context-parallel-size"))
    if problem:
        sys.exit(f"error: {problem}")
    try:
        recompute = recompute_config(args)
    except ValueError as error:
        sys.exit(f"error: {error}")
    if recompute.full and recompute.num_layers > args.num_layers:
        sys.exit(f"error: --recompute-num-layers ({recompute.num_layers}) is more than --num-layers "
                 f"({args.num_layers})")
    try:
        total, counts, states, activations, padded_vocab, dtype = estimate(args)
    except zero.ConfigError as error:
        sys.exit(f"error: the ZeRO flags give an invalid config: {error}")
    cp = f", cp {args.context_parallel_size}" if args.context_parallel_size > 1 else ""
    setting = (f"mp {args.model_parallel_size}, dp {args.data_parallel_size}{cp}, "
               f"{'Megatron optimizer' if args.zero_stage is None else f'ZeRO stage {args.zero_stage}'}, {dtype}")
    print(f"parameters per model-parallel rank: {total} (weight decay {counts[0]}, no decay {counts[1]}; "
          f"padded vocabulary {padded_vocab})")
    print(f"model-state memory estimate per rank (bytes, {setting}): {memory.format_bytes(states)}")
    print(f"activations per rank (bytes, micro batch {args.micro_batch_size}, recompute "
          f"{recompute_config(args).describe()}, {args.device}): {activations} ({activations / 2 ** 20:.2f} MiB)")
    return states


if __name__ == "__main__":
    main()
