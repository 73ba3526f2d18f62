"""Megatron's command line, built (build_parser: the flags' `_add_*_args` groups are megatron/flags/groups.py's; the
ZeRO engine's flags are added here, where the DeepSpeed-Megatron tutorial adds them), parsed and validated up front,
before any model is built (validate_args and its checks, here; under --deepspeed the JSON config is reconciled with
the flags by megatron/flags/deepspeed_json.py).

Every inconsistency is reported with `parser.error` (one line naming the flags and numbers, exit status 2; see
megatron/cli.py).
"""
import os

import mpu
from megatron import cli, zero
from megatron.flags.deepspeed_json import reconcile_with_deepspeed_config
from megatron.flags.compile_choice import resolve_torch_compile
from megatron.flags.groups import ARGUMENT_GROUPS
from megatron.model.moe_args import check_moe_args


def build_parser(extra_args_provider=None):
    """Every flag: Megatron's groups, the entry point's own (`extra_args_provider(parser)` returns the parser), then
    the ZeRO engine's --deepspeed, --deepspeed_config and --deepspeed_activation_checkpointing."""
    parser = cli.ArgumentParser(description="Megatron-style GPT-2 pretraining with integrated ZeRO",
                                allow_abbrev=False)
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    # Include DeepSpeed configuration arguments
    parser = zero.add_config_arguments(parser)
    return parser


def parse_args(extra_args_provider=None, args_list=None):
    parser = build_parser(extra_args_provider)
    args = parser.parse_args(args_list)
    if extra_args_provider is not None and args.context_parallel_size > 1:
        # the post-training, evaluation and generation entry points read whole sequences: said before the checks of
        # the sizes (a world size that C does not divide), which would send the user after the wrong flag
        parser.error(f"--context-parallel-size {args.context_parallel_size} is for pretrain_gpt.py: this entry "
                     "point reads whole sequences; use --context-parallel-size 1 (checkpoints load at any C)")
    validate_args(args, parser, pretraining=extra_args_provider is None)
    return args


def _check_fault_tolerance(args, parser):
    """--ft-* (after the JSON's fault_tolerance block set them): the replica groups average the ZeRO engine's
    reduced gradients, so R > 1 needs --deepspeed."""
    from megatron.trainer.fault_tolerance import FaultToleranceError, ReplicaSettings
    try:
        ReplicaSettings.from_args(args).check()
    except FaultToleranceError as error:
        parser.error(str(error))
    if args.ft_replica_groups > 1 and args.zero_config is None:      # no --deepspeed
        parser.error(f"--ft-replica-groups {args.ft_replica_groups} needs --deepspeed (the groups average the ZeRO "
                     "engine's reduced gradients): add --deepspeed --deepspeed_config PATH, or drop the flag")


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
    args.lora_targets = targets


# Sizes, lengths, intervals and the optimizer's numbers: a value out of range is a typo (a negative rate trains
# backwards, a beta of 1 never forgets), refused by name before anything is built.
POSITIVE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                  "make_vocab_size_divisible_by", "batch_size", "global_batch_size", "log_interval", "eval_interval",
                  "save_interval", "save_keep_last", "eval_tasks_interval", "eval_tasks_limit", "exit_interval", "vocab_size", "model_parallel_size",
                  "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "checkpoint_num_layers",
                  "recompute_num_layers", "loss_scale_window", "hysteresis", "distributed_timeout_minutes",
                  "layernorm_epsilon", "adam_eps", "lr_decay_iters", "lr", "muon_lr", "critic_lr")
NON_NEGATIVE_FLAGS = ("train_iters", "eval_iters", "min_lr", "warmup", "weight_decay",
                      "clip_grad", "init_method_std", "attention_dropout", "hidden_dropout", "num_workers",
                      "max_skipped_steps_at_min_scale", "exit_duration_in_mins", "stream_shuffle_buffer")
FRACTION_FLAGS = ("adam_beta1", "adam_beta2", "muon_momentum")      # [0, 1), as torch's AdamW takes its betas


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


def _check_context_parallel(args, parser):
    """--context-parallel-size: one line for each combination not supported."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    problem = mpu.sequence_length_problem(args.seq_length, cp, names=("--seq-length", "--context-parallel-size"))
    if problem:
        parser.error(problem)
    if args.sequence_parallel and (args.seq_length // cp) % args.model_parallel_size:
        parser.error(f"--sequence-parallel with --context-parallel-size {cp}: the {args.seq_length // cp} tokens a "
                     f"rank holds are not divisible by --model-parallel-size ({args.model_parallel_size})")
    if args.attention_dropout:
        parser.error(f"--context-parallel-size {cp} computes attention ring-style without dropout: pass "
                     "--attention-dropout 0")
    if args.reset_attention_mask:
        parser.error("--context-parallel-size runs plain causal attention: drop --reset-attention-mask")
    if getattr(args, "num_experts", None):     # its router and capacity see one rank's tokens, its groups ignore C
        parser.error(f"--context-parallel-size {cp} cannot be combined with --num-experts yet: drop one of them")


def _check_eval_tasks(args, parser):
    """--eval-tasks and its companions: one line for a flag without it, a missing directory, no tokenizer."""
    if not args.eval_tasks:
        for dest in ("eval_tasks_path", "eval_tasks_interval", "eval_tasks_limit"):
            if getattr(args, dest) is not None:
                parser.error(f"{cli.flag(dest)} applies to --eval-tasks: give the task names (--eval-tasks T1,T2)")
        return
    if args.eval_tasks_path is not None and not os.path.isdir(args.eval_tasks_path):
        parser.error(f"--eval-tasks-path {args.eval_tasks_path}: no such directory (give the folder of task YAMLs)")
    if args.mock_data:
        parser.error("--eval-tasks reads text through the BPE tokenizer: drop --mock-data (give --vocab-file and "
                     "--merge-file)")
    if args.pipeline_model_parallel_size > 1:
        parser.error("--eval-tasks scores with the whole model on each rank: it needs "
                     "--pipeline-model-parallel-size 1")


def _check_backend(args, parser):
    """--distributed-backend must fit the device mpu picks: the model and batches live on CUDA when it is there,
    where gloo is slow or lacks collectives, and NCCL moves CUDA tensors only."""
    wanted = mpu.get_backend()
    if args.distributed_backend in (None, wanted):
        return
    where = "a CUDA machine (tensors on cuda)" if wanted == "nccl" else "a machine without CUDA (tensors on cpu)"
    parser.error(f"--distributed-backend {args.distributed_backend} on {where}: pass --distributed-backend {wanted} "
                 "or drop the flag (its default)")


def validate_args(args, parser, pretraining=True):
    """Check every cross-flag constraint before anything is built; fill derived defaults. pretraining: the entry
    point is pretrain_gpt.py (fixed-shape batches; post-training, evaluation and generation pass their own flags)."""
    cli.require_range(parser, args, positive=POSITIVE_FLAGS, non_negative=NON_NEGATIVE_FLAGS, fraction=FRACTION_FLAGS)
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
    args.zero_config = reconcile_with_deepspeed_config(args, parser) if args.deepspeed else None
    if args.optimizer == "muon" and args.zero_config is not None and \
            args.zero_config.zero_optimization.offload_optimizer.enabled:
        parser.error("--optimizer muon with zero_optimization.offload_optimizer is not supported: remove the "
                     "offload block from the --deepspeed_config JSON, or use --optimizer adam")
    _check_pipeline_combinations(args, parser)
    _check_fault_tolerance(args, parser)
    _check_lora_args(args, parser)
    check_moe_args(args, parser)
    _check_sequence_parallel(args, parser)
    _check_context_parallel(args, parser)
    _check_backend(args, parser)
    _check_eval_tasks(args, parser)
    _resolve_recompute_args(args, parser)
    resolve_torch_compile(args, parser, pretraining)
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
    args.lr_decay_iters_given = args.lr_decay_iters is not None   # else the schedule follows --train-iters
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
    resets = [flag for flag, given in (("--reset-attention-mask", args.reset_attention_mask),
                                       ("--reset-position-ids", args.reset_position_ids),
                                       ("--eod-mask-loss", args.eod_mask_loss)) if given]
    if args.mock_data and resets:
        parser.error(f"{' and '.join(resets)} need the tokenizer's end-of-document id, which --mock-data has not: "
                     "train on real data (--data-path PREFIX or --train-data webtext) or drop them")
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
