"""Megatron's command line, in `_add_*_args` groups, validated up front (before any model is built).

Every inconsistency is reported with `parser.error` (one line naming the flags and numbers, exit status 2; see
megatron/cli.py).
"""
import importlib.util
import os
import shutil

import mpu
from megatron import cli, zero
from megatron.model.moe_args import add_moe_args, check_moe_args


def parse_args(extra_args_provider=None, args_list=None):
    parser = build_parser(extra_args_provider)
    args = parser.parse_args(args_list)
    validate_args(args, parser)
    if extra_args_provider is not None and args.context_parallel_size > 1:
        # the post-training, evaluation and generation entry points read whole sequences
        parser.error(f"--context-parallel-size {args.context_parallel_size} is for pretrain_gpt.py: this entry "
                     "point reads whole sequences; use --context-parallel-size 1 (checkpoints load at any C)")
    return args


def build_parser(extra_args_provider=None):
    parser = cli.ArgumentParser(description="Megatron-style GPT-2 pretraining with integrated ZeRO",
                                allow_abbrev=False)
    for add_group in (_add_network_size_args, _add_regularization_args, _add_training_args,
                      _add_learning_rate_args, _add_checkpointing_args, _add_mixed_precision_args,
                      _add_distributed_args, _add_zero_args, _add_validation_args, _add_data_args,
                      _add_logging_args, _add_lora_args, add_moe_args):
        add_group(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    parser = zero.add_config_arguments(parser)
    return parser


def _add_network_size_args(parser):
    group = parser.add_argument_group("model shape")
    group.add_argument("--num-layers", type=int, default=2)
    group.add_argument("--hidden-size", type=int, default=128)
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    group.add_argument("--max-position-embeddings", type=int, default=None,
                       help="size of the position table (default: --seq-length)")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the vocabulary to a multiple of this times the model-parallel size")
    group.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    group.add_argument("--init-method-std", type=float, default=0.02)
    # Llama-family options (Megatron-DeepSpeed's names; docs/models.md)
    group.add_argument("--num-key-value-heads", type=int, default=None,
                       help="grouped-query attention: key/value heads (default: --num-attention-heads); a multiple "
                            "of the model-parallel size")
    group.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP inner width (default: 4 x hidden)")
    group.add_argument("--swiglu", action="store_true", help="SwiGLU MLP: down(silu(gate(x)) * up(x))")
    group.add_argument("--normalization", choices=("layernorm", "rmsnorm"), default="layernorm",
                       help="LayerNorm or RMSNorm (epsilon: --layernorm-epsilon)")
    group.add_argument("--disable-bias-linear", action="store_true",
                       help="no biases on the attention and MLP linears")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="rotary embeddings on q and k (HF Llama's rotate-half convention)")
    group.add_argument("--rotary-position-embeddings-theta", type=float, default=10000.0, help="rotary base")
    group.add_argument("--no-position-embedding", action="store_true", help="no learned position table")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="an output layer of its own instead of the word embedding as the LM head")
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group("regularization")
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--no-fused-adam", dest="fused_adam", action="store_false",
                       help="use torch's default AdamW kernel instead of its fused one (fused where torch runs it)")
    group.add_argument("--optimizer", choices=("adam", "muon"), default="adam",
                       help="adam: AdamW; muon: Muon for the hidden matrices, AdamW (at --lr) for embeddings, head, "
                            "norms and biases (megatron/zero/muon.py)")
    group.add_argument("--muon-lr", type=float, default=0.02,
                       help="Muon's peak learning rate (the schedule of --lr, scaled by --muon-lr / --lr)")
    group.add_argument("--muon-momentum", type=float, default=0.95)
    group.add_argument("--muon-ns-method", choices=("standard", "gram"), default="standard",
                       help="Newton-Schulz as published (standard) or on the Gram matrix (DeepSpeed's default)")
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--torch-compile", action="store_true",
                       help="the fused compute path: each layer's layer norm, bias + GeLU, bias + dropout + residual "
                            "and attention around SDPA, and the loss, compiled with torch.compile between the "
                            "tensor-parallel collectives (the same math; the first step compiles)")
    group.add_argument("--batch-size", "--micro-batch-size", dest="batch_size", type=int, default=4,
                       help="micro batch per data-parallel rank")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="samples per optimizer step (default: batch size x data-parallel size); a multiple "
                            "of that product, the quotient being the gradient-accumulation steps")
    group.add_argument("--train-iters", type=int, default=100)
    group.add_argument("--log-interval", type=int, default=10)
    group.add_argument("--exit-interval", type=int, default=None, help="stop (after saving) at this iteration")
    group.add_argument("--exit-duration-in-mins", type=float, default=None,
                       help="stop (after saving) when the run has lasted this long")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="on SIGTERM, save at the next step boundary (all ranks agree) and exit 0")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="recompute whole layers in backward: the older spelling of --recompute-granularity full "
                            "--recompute-method uniform --recompute-num-layers N (N: --checkpoint-num-layers)")
    group.add_argument("--checkpoint-num-layers", type=int, default=None,
                       help="with --checkpoint-activations: layers per checkpointed group (default 1)")
    group.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                       help="what backward recomputes instead of keeping (Megatron-LM's flags): full = whole layers "
                            "(with --recompute-method and --recompute-num-layers); selective = every layer's attention "
                            "core (QK^T, softmax, attention dropout, AV), whose s x s activations are then never kept")
    group.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                       help="with --recompute-granularity full: uniform = every layer of the pipeline stage, in "
                            "checkpointed groups of --recompute-num-layers; block = only the stage's first "
                            "--recompute-num-layers layers, one by one (the others keep their activations)")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="with --recompute-granularity full: 1 to the layers per pipeline stage (default 1)")
    group.add_argument("--DDP-impl", dest="DDP_impl", choices=["local", "torch"], default="local")
    group.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes")
    group.add_argument("--skip-nonfinite-steps", action="store_true",
                       help="fp32/bf16: when the loss or the global gradient norm is NaN/inf, skip that step "
                            "(parameters and optimizer state unchanged) instead of stopping the run")
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group("learning rate")
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    group.add_argument("--warmup", type=float, default=0.01, help="fraction of --lr-decay-iters spent warming up")
    group.add_argument("--override-lr-scheduler", action="store_true",
                       help="on load, take the lr schedule from the command line, not the checkpoint")
    group.add_argument("--use-checkpoint-lr-scheduler", action="store_true",
                       help="on load, take the lr schedule from the checkpoint, ignoring the command line")
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", type=str, default=None, help="directory to save checkpoints to")
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--save-keep-last", type=int, default=None, help="keep only the newest N checkpoints")
    group.add_argument("--no-save-optim", action="store_true")
    group.add_argument("--no-save-rng", action="store_true")
    group.add_argument("--async-save", action="store_true",
                       help="write checkpoints in a background thread after a copy to host memory (training "
                            "blocks for the copy only); each is published at the next save or the end of training")
    group.add_argument("--load", type=str, default=None, help="directory to load checkpoints from")
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--no-load-rng", action="store_true")
    group.add_argument("--finetune", action="store_true",
                       help="load weights only: iteration, optimizer, scheduler and consumed samples start fresh")
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group("mixed precision")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)")
    group.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    group.add_argument("--min-scale", type=float, default=1.0)
    group.add_argument("--loss-scale-window", type=int, default=1000)
    group.add_argument("--hysteresis", type=int, default=2)
    group.add_argument("--max-skipped-steps-at-min-scale", type=int, default=100,
                       help="fp16: stop the run when this many consecutive steps overflow at the minimum loss scale "
                            "(--min-scale or the JSON's min_loss_scale) and are skipped; 0: never stop")
    group.add_argument("--fp32-allreduce", action="store_true")
    return parser


def _add_distributed_args(parser):
    group = parser.add_argument_group("distributed")
    group.add_argument("--model-parallel-size", "--tensor-model-parallel-size", dest="model_parallel_size",
                       type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", "--pipe-parallel-size", dest="pipeline_model_parallel_size",
                       type=int, default=1, help="pipeline stages (layers split evenly; 1F1B schedule)")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="interleaved 1F1B (Megatron-LM's): each stage holds L / (P x this) model chunks of this "
                            "many layers, chunk c of stage r layers [(c P + r) n, (c P + r + 1) n); the micro-batches "
                            "per step must be a multiple of P; bubble (P - 1) / (v M) instead of (P - 1) / M")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Megatron-LM's context parallelism: the sequence split over this many ranks (rank order "
                            "tp, cp, dp, pp), rank i holding chunks i and 2C-1-i of 2C, attention computed ring-style "
                            "(mpu/context_parallel.py); --seq-length must be a multiple of 2C")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Megatron-LM's sequence parallelism (needs --model-parallel-size > 1): LayerNorm, dropout "
                            "and residual activations split along the sequence across the tensor-parallel group, "
                            "all-gather/reduce-scatter around the parallel linears instead of all-reduce")
    group.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                       help="default: nccl on CUDA, gloo on CPU")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10,
                       help="timeout of torch.distributed's rendezvous and of each collective: a rank left waiting "
                            "this long raises (printing its last collective) instead of hanging")
    group.add_argument("--slow-step-report-factor", type=float, default=10.0,
                       help="a training step running this many times longer than the median step (and over 30 s) "
                            "prints this rank's last collective and every thread's stack, once; 0: off")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                       help="set by old launchers; torchrun's LOCAL_RANK is used otherwise")
    return parser


def _add_zero_args(parser):
    group = parser.add_argument_group("ZeRO (Megatron-DeepSpeed's flags; the --deepspeed_config JSON wins)")
    group.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                       help="must agree with zero_optimization.stage of the JSON (taken from it when not given); "
                            "3 builds the model inside zero.Init")
    group.add_argument("--remote-device", choices=["none", "cpu", "nvme"], default="none",
                       help="where zero.Init keeps the parameter partitions: must agree with "
                            "zero_optimization.offload_param.device")
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group("validation")
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=10)
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="PREFIX of PREFIX.{bin,idx}, or a weighted blend 'w1 PREFIX1 w2 PREFIX2 ...'")
    group.add_argument("--train-data", type=str, default=None, help="a named corpus, e.g. webtext")
    group.add_argument("--split", type=str, default="949,50,1", help="train,valid,test weights")
    group.add_argument("--data-cache-path", type=str, default=None)
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--merge-file", type=str, default=None)
    group.add_argument("--tokenizer-type", choices=["GPT2BPETokenizer"], default="GPT2BPETokenizer")
    group.add_argument("--mock-data", action="store_true",
                       help="synthetic learnable token sequences, a pure function of the sample index")
    group.add_argument("--vocab-size", type=int, default=1024, help="vocabulary of --mock-data")
    group.add_argument("--reset-position-ids", action="store_true")
    group.add_argument("--reset-attention-mask", action="store_true")
    group.add_argument("--eod-mask-loss", action="store_true")
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group("logging")
    group.add_argument("--tensorboard-dir", type=str, default=None)
    group.add_argument("--log-jsonl", type=str, default=None, metavar="FILE",
                       help="append one JSON object per log interval (rank 0): every field of the log line, the "
                            "phase timers and memory")
    group.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                       help="Megatron-LM's timer levels: 0 (default) the iteration time only, no device "
                            "synchronization; 1 also the forward/backward/allreduce/optimizer phases, each timed "
                            "between device synchronizations (honest phase times, slower steps on a GPU); 2 as 1")
    return parser


def _add_lora_args(parser):
    group = parser.add_argument_group("LoRA (low-rank adapters on the layers' linears; every other weight frozen)")
    group.add_argument("--lora-rank", type=int, default=0, help="r, the adapters' rank (0: no LoRA)")
    group.add_argument("--lora-alpha", type=float, default=8.0, help="the adapters' output is scaled by alpha / r "
                       "(PEFT's lora_alpha)")
    group.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input, in [0, 1)")
    group.add_argument("--lora-targets", type=str, default=",".join(mpu.LORA_TARGETS),
                       help=f"comma-separated linears of every layer to adapt, from {','.join(mpu.LORA_TARGETS)}")
    return parser


def _check_lora_args(args, parser):
    """--lora-*: refused by name (also at --lora-rank 0, so a typo does not wait for the day LoRA is turned on);
    args.lora_targets becomes a tuple."""
    targets = tuple(name.strip() for name in args.lora_targets.split(","))
    if args.lora_rank < 0:
        parser.error(f"--lora-rank ({args.lora_rank}) must be >= 0 (0: no LoRA)")
    if not args.lora_alpha > 0:
        parser.error(f"--lora-alpha ({args.lora_alpha}) must be > 0")
    if not 0.0 <= args.lora_dropout < 1.0:
        parser.error(f"--lora-dropout ({args.lora_dropout}) must be in [0, 1)")
    unknown = [name for name in targets if name not in mpu.LORA_TARGETS]
    if unknown or len(set(targets)) != len(targets):
        parser.error(f"--lora-targets {args.lora_targets!r}: name each of {','.join(mpu.LORA_TARGETS)} at most once, "
                     "comma-separated")
    if args.lora_rank and args.torch_compile:
        parser.error("--lora-rank runs the eager layers: drop --torch-compile")
    args.lora_targets = targets


def _check_torch_compile_toolchain(args, parser):
    """--torch-compile needs inductor's compiler: Triton on CUDA, a C++ compiler (CXX, default g++) on the CPU."""
    if not args.torch_compile:
        return
    import torch
    if torch.cuda.is_available():
        if importlib.util.find_spec("triton") is None:
            parser.error("--torch-compile on CUDA needs triton (pip install the triton your torch build names), "
                         "or drop --torch-compile")
        return
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        parser.error(f"--torch-compile on the CPU needs a C++ compiler for inductor: {compiler!r} (the CXX "
                     "variable, default g++) is not on PATH; install g++ (apt install g++), set CXX, or drop "
                     "--torch-compile")


# Sizes, lengths and intervals: zero or a negative value is a typo, refused by name before anything is built.
POSITIVE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                  "make_vocab_size_divisible_by", "batch_size", "global_batch_size", "log_interval", "eval_interval",
                  "save_interval", "save_keep_last", "exit_interval", "vocab_size", "model_parallel_size",
                  "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "checkpoint_num_layers",
                  "recompute_num_layers", "loss_scale_window", "hysteresis", "distributed_timeout_minutes", "layernorm_epsilon", "adam_eps", "lr_decay_iters")
NON_NEGATIVE_FLAGS = ("train_iters", "eval_iters", "lr", "min_lr", "warmup", "weight_decay",
                      "clip_grad", "init_method_std", "attention_dropout", "hidden_dropout", "num_workers",
                      "max_skipped_steps_at_min_scale", "exit_duration_in_mins")


def _check_sequence_parallel(args, parser):
    """--sequence-parallel: one line for each combination not supported (yet)."""
    if not args.sequence_parallel:
        return
    if args.model_parallel_size == 1:
        parser.error("--sequence-parallel splits the sequence across the tensor-parallel group: it needs "
                     "--model-parallel-size > 1")
    if args.seq_length % args.model_parallel_size:
        parser.error(f"--sequence-parallel: --seq-length ({args.seq_length}) is not divisible by "
                     f"--model-parallel-size ({args.model_parallel_size})")
    if args.torch_compile:
        parser.error("--sequence-parallel runs the eager layers: drop --torch-compile or --sequence-parallel")


def _check_context_parallel(args, parser):
    """--context-parallel-size: one line for each combination not supported."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        parser.error(f"--seq-length ({args.seq_length}) is not divisible by 2 x --context-parallel-size ({2 * cp}): "
                     f"each context-parallel rank holds 2 of 2C chunks; use a multiple of {2 * cp}")
    if args.sequence_parallel and (args.seq_length // cp) % args.model_parallel_size:
        parser.error(f"--sequence-parallel with --context-parallel-size {cp}: the {args.seq_length // cp} tokens a "
                     f"rank holds are not divisible by --model-parallel-size ({args.model_parallel_size})")
    if args.attention_dropout:
        parser.error(f"--context-parallel-size {cp} computes attention ring-style without dropout: pass "
                     "--attention-dropout 0")
    if args.reset_attention_mask:
        parser.error("--context-parallel-size runs plain causal attention: drop --reset-attention-mask")
    if args.torch_compile:
        parser.error("--context-parallel-size runs the eager layers: drop --torch-compile")
    if getattr(args, "num_experts", None):     # its router and capacity see one rank's tokens, its groups ignore C
        parser.error(f"--context-parallel-size {cp} cannot be combined with --num-experts yet: drop one of them")


def _check_backend(args, parser):
    """--distributed-backend must fit the device mpu picks: the model and batches live on CUDA when it is there,
    where gloo is slow or lacks collectives, and NCCL moves CUDA tensors only."""
    wanted = mpu.get_backend()
    if args.distributed_backend in (None, wanted):
        return
    where = "a CUDA machine (tensors on cuda)" if wanted == "nccl" else "a machine without CUDA (tensors on cpu)"
    parser.error(f"--distributed-backend {args.distributed_backend} on {where}: pass --distributed-backend {wanted} "
                 "or drop the flag (its default)")


def validate_args(args, parser):
    """Check every cross-flag constraint before anything is built; fill derived defaults."""
    cli.require_range(parser, args, positive=POSITIVE_FLAGS, non_negative=NON_NEGATIVE_FLAGS)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mp, pp, cp = args.model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if mp < 1 or world_size % mp != 0:
        parser.error(f"world size ({world_size}) is not divisible by --model-parallel-size ({mp})")
    if cp < 1 or world_size % (cp * mp) != 0:
        parser.error(f"world size ({world_size}) is not divisible by --context-parallel-size ({cp}) x "
                     f"--model-parallel-size ({mp}) = {cp * mp}")
    if pp < 1 or world_size % (pp * cp * mp) != 0:
        parser.error(f"world size ({world_size}) is not divisible by --pipeline-model-parallel-size ({pp}) x "
                     + (f"--context-parallel-size ({cp}) x " if cp > 1 else "")
                     + f"--model-parallel-size ({mp}) = {pp * cp * mp}")
    if args.num_layers % pp != 0:
        parser.error(f"--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size ({pp})")
    args.world_size = world_size
    args.data_parallel_size = world_size // (pp * cp * mp)
    if args.hidden_size % args.num_attention_heads != 0:
        parser.error(f"--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads "
                     f"({args.num_attention_heads})")
    if args.num_attention_heads % mp != 0:
        parser.error(f"--num-attention-heads ({args.num_attention_heads}) is not divisible by "
                     f"--model-parallel-size ({mp})")
    kv_heads = args.num_key_value_heads
    if kv_heads is not None and (kv_heads < 1 or args.num_attention_heads % kv_heads
                                 or (kv_heads % mp and mp % kv_heads)):
        parser.error(f"--num-key-value-heads ({kv_heads}) must divide --num-attention-heads "
                     f"({args.num_attention_heads}) and be a multiple or a divisor of --model-parallel-size ({mp})")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % mp:
        parser.error(f"--ffn-hidden-size ({args.ffn_hidden_size}) is not divisible by --model-parallel-size ({mp})")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        parser.error(f"--seq-length ({args.seq_length}) is longer than --max-position-embeddings "
                     f"({args.max_position_embeddings})")
    args.zero_config = _reconcile_with_deepspeed_config(args, parser) if args.deepspeed else None
    if args.optimizer == "muon" and args.zero_config is not None and \
            args.zero_config.zero_optimization.offload_optimizer.enabled:
        parser.error("--optimizer muon with zero_optimization.offload_optimizer is not supported: remove the "
                     "offload block from the --deepspeed_config JSON, or use --optimizer adam")
    _check_pipeline_combinations(args, parser)
    _check_torch_compile_toolchain(args, parser)
    _check_lora_args(args, parser)
    check_moe_args(args, parser)
    _check_sequence_parallel(args, parser)
    _check_context_parallel(args, parser)
    _check_backend(args, parser)
    _resolve_recompute_args(args, parser)
    if args.deepspeed_activation_checkpointing and not (args.deepspeed and args.recompute_granularity == "full"):
        parser.error("--deepspeed_activation_checkpointing sets how full recomputation keeps each checkpointed "
                     "group's input (megatron.zero.checkpointing, the JSON activation_checkpointing block): it needs "
                     "--deepspeed and --recompute-granularity full (or --checkpoint-activations)")
    if args.zero_config is None and args.zero_stage not in (None, 0):
        parser.error(f"--zero-stage {args.zero_stage} needs --deepspeed and a --deepspeed_config JSON with "
                     f"zero_optimization.stage {args.zero_stage}")
    args.zero_stage = args.zero_config.zero_optimization.stage if args.zero_config is not None else 0
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 are exclusive: choose one")
    per_step = args.batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step != 0:
        parser.error(f"--global-batch-size ({args.global_batch_size}) is not a multiple of --batch-size "
                     f"({args.batch_size}) x data-parallel size ({args.data_parallel_size}) = {per_step}")
    # One owner: under --deepspeed the engine's gradient_accumulation_steps (its JSON's batch triangle), otherwise
    # the Megatron flags; the two agree by construction (the JSON's batch sizes replaced the flags above).
    args.num_micro_batches = (args.zero_config.gradient_accumulation_steps if args.zero_config is not None
                              else args.global_batch_size // per_step)
    _resolve_virtual_pipeline(args, parser)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.override_lr_scheduler and args.use_checkpoint_lr_scheduler:
        parser.error("--override-lr-scheduler and --use-checkpoint-lr-scheduler are exclusive: choose one")
    if args.save_interval is not None and args.save is None:
        parser.error("--save-interval needs --save DIR")
    if args.async_save and args.save is None:
        parser.error("--async-save needs --save DIR")
    if args.save_keep_last is not None and args.save_keep_last < 1:
        parser.error(f"--save-keep-last ({args.save_keep_last}) must be at least 1")
    if not args.mock_data and not args.data_path and not args.train_data:
        parser.error("no training data: pass --data-path PREFIX, --train-data webtext, or --mock-data")
    if args.local_rank is None:
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    else:  # an old launcher passed --local_rank: mpu.get_device() reads LOCAL_RANK
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    args.params_dtype = "float16" if args.fp16 else ("bfloat16" if args.bf16 else "float32")
    return args


def _resolve_recompute_args(args, parser):
    """--recompute-* with Megatron-LM's rules and --checkpoint-activations as their older spelling: each refused
    combination is one line (validate_args checks --deepspeed_activation_checkpointing against the result). Leaves args.recompute_granularity/method/num_layers resolved (None: no
    recomputation; full: method and number of layers set; selective: neither)."""
    given = [flag for flag, value in (("--recompute-granularity", args.recompute_granularity),
                                      ("--recompute-method", args.recompute_method),
                                      ("--recompute-num-layers", args.recompute_num_layers)) if value is not None]
    if args.checkpoint_activations and given:
        parser.error(f"--checkpoint-activations is the older spelling of --recompute-granularity full "
                     f"--recompute-method uniform --recompute-num-layers N: drop it or {' '.join(given)}")
    if args.checkpoint_num_layers is not None and not args.checkpoint_activations:
        parser.error(f"--checkpoint-num-layers ({args.checkpoint_num_layers}) needs --checkpoint-activations "
                     f"(or use --recompute-granularity full --recompute-method uniform --recompute-num-layers N)")
    if args.checkpoint_activations:
        args.recompute_granularity, args.recompute_method = "full", "uniform"
        args.recompute_num_layers = args.checkpoint_num_layers or 1   # may exceed the stage: one group
    elif args.recompute_granularity is None and given:
        parser.error(f"{' and '.join(given)} need --recompute-granularity full")
    elif args.recompute_granularity == "selective" and given[1:]:
        parser.error(f"{' and '.join(given[1:])} are for --recompute-granularity full: selective recomputes the "
                     f"attention core of every layer (Megatron-LM's rule)")
    elif args.recompute_granularity == "full":
        if args.recompute_method is None:
            parser.error("--recompute-granularity full needs --recompute-method uniform (every layer, in groups of "
                         "--recompute-num-layers) or block (the first --recompute-num-layers layers of each stage)")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.recompute_num_layers = 1 if args.recompute_num_layers is None else args.recompute_num_layers
        if args.recompute_num_layers > per_stage:
            parser.error(f"--recompute-num-layers ({args.recompute_num_layers}) is more than the layers per "
                         f"pipeline stage ({args.num_layers} / {args.pipeline_model_parallel_size} = {per_stage})")
    if args.recompute_granularity == "selective" and args.torch_compile:
        parser.error("--recompute-granularity selective recomputes the eager attention core: drop --torch-compile")


def _resolve_virtual_pipeline(args, parser):
    """--num-layers-per-virtual-pipeline-stage n with Megatron-LM's rules and words; sets
    args.virtual_pipeline_model_parallel_size = L / P / n (None without the flag, or when it is 1: plain 1F1B)."""
    args.virtual_pipeline_model_parallel_size = None
    per_chunk = args.num_layers_per_virtual_pipeline_stage
    if per_chunk is None:
        return
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        parser.error("when interleaved schedule is used, pipeline-model-parallel size should be greater than 1")
    if (args.num_layers // pp) % per_chunk:
        parser.error(f"number of layers is not divisible by number of layers per virtual pipeline stage: "
                     f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) = "
                     f"{args.num_layers // pp} layers per stage, --num-layers-per-virtual-pipeline-stage {per_chunk}")
    chunks = args.num_layers // pp // per_chunk
    if chunks == 1:
        return
    from megatron.pipeline.schedules import interleaving_error
    error = interleaving_error(args.num_micro_batches, pp)
    if error:
        parser.error(f"{error} (micro-batches per step: --global-batch-size / (--batch-size x data-parallel size), "
                     f"or gradient_accumulation_steps under --deepspeed)")
    args.virtual_pipeline_model_parallel_size = chunks


def _check_pipeline_combinations(args, parser):
    """What pipeline parallelism (P > 1) cannot be combined with, refused before anything is built."""
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        return
    stage = args.zero_config.zero_optimization.stage if args.zero_config is not None else None
    if stage is not None and stage >= 2:
        parser.error(f"ZeRO stage {stage} cannot be combined with --pipeline-model-parallel-size {pp}: pipeline "
                     "parallelism allows ZeRO stages 0 and 1 only (DeepSpeed's rule: gradient partitioning does not "
                     "fit gradients accumulated across micro-batches); set zero_optimization.stage to 0 or 1")


def _reconcile_with_deepspeed_config(args, parser):
    """Parse the JSON config (the one time it is parsed: the `zero.Config` returned goes to zero.initialize and
    zero.checkpointing.configure). Under --deepspeed the JSON is the source of truth for the values it shares
    with the command line (micro batch, global batch / accumulation, clipping, fp16/bf16, lr): the command line
    takes the JSON's values (DeepSpeed's defaults for keys the JSON leaves out), and a flag set to something other
    than its default that disagrees with the JSON is an error naming both values."""
    path = args.deepspeed_config
    if not path:
        parser.error("--deepspeed needs --deepspeed_config PATH (a DeepSpeed-style JSON config)")
    try:
        config = zero.load_config(path, args.data_parallel_size)
    except zero.ConfigError as error:
        parser.error(f"--deepspeed_config: {error}")
    shared = [("batch_size", "--batch-size", config.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu"),
              ("global_batch_size", "--global-batch-size", config.train_batch_size, "train_batch_size"),
              ("clip_grad", "--clip-grad", config.gradient_clipping, "gradient_clipping"),
              ("fp16", "--fp16", config.fp16.enabled, "fp16.enabled"),
              ("bf16", "--bf16", config.bf16.enabled, "bf16.enabled")]
    shared += [("zero_stage", "--zero-stage", config.zero_optimization.stage, "zero_optimization.stage"),
               ("remote_device", "--remote-device", config.zero_optimization.offload_param.device,
                "zero_optimization.offload_param.device")]
    if config.optimizer is not None:
        shared += _optimizer_flags(config.optimizer)
    for dest, flag, json_value, key in shared:
        value = getattr(args, dest)
        if value != parser.get_default(dest) and value != json_value:
            parser.error(f"{flag} ({value}) disagrees with {key} ({json_value}) in {path}; under --deepspeed the "
                         f"JSON config wins: drop {flag} or make the two agree")
        setattr(args, dest, json_value)
    if config.fp16.enabled:  # Megatron's scaler flags mirror the engine's so logs and checks agree
        args.loss_scale = config.fp16.loss_scale or None
        args.initial_loss_scale = 2.0 ** config.fp16.initial_scale_power
        args.loss_scale_window, args.hysteresis = config.fp16.loss_scale_window, config.fp16.hysteresis
        args.min_scale = config.fp16.min_loss_scale
    # "auto" values are resolved in one place, zero.initialize (from the model's hidden size), which prints them
    ignored = [name for name, block in (("optimizer", config.optimizer), ("scheduler", config.scheduler)) if block]
    if ignored and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: {path}: the JSON {' and '.join(ignored)} block(s) are replaced by Megatron's optimizer "
              f"(--optimizer and its flags, set from the JSON's type, lr, muon_lr, adam_lr, momentum, ns_method) and "
              f"--lr-decay-style schedule", flush=True)
    return config


def _optimizer_flags(optimizer):
    """(dest, flag, JSON value, JSON key) of the Megatron flags a JSON "optimizer" block sets: its type, and the lr
    (adam_lr over lr for Muon: --lr is the AdamW half's), muon_lr, momentum, ns_method."""
    params, muon = optimizer.params, optimizer.type == "Muon"
    flags = [("optimizer", "--optimizer", "muon" if muon else "adam", "optimizer.type")]
    lr_key = "adam_lr" if muon and "adam_lr" in params else "lr"
    if lr_key in params:
        flags.append(("lr", "--lr", params[lr_key], f"optimizer.params.{lr_key}"))
    muon_lr = "muon_lr" if "muon_lr" in params else "lr"     # DeepSpeed: the shared lr when muon_lr is absent
    for key, dest in ((muon_lr, "muon_lr"), ("momentum", "muon_momentum"), ("ns_method", "muon_ns_method")):
        if muon and key in params:
            flags.append((dest, "--" + dest.replace("_", "-"), params[key], f"optimizer.params.{key}"))
    return flags
