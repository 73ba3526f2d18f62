"""Megatron's command line: the `_add_*_args` groups (every flag, its default and its help), in ARGUMENT_GROUPS.
megatron/arguments.py's build_parser adds them in that order, then the entry point's own group
(`extra_args_provider`) and the ZeRO engine's flags; it parses with it and validates the result."""
import argparse

import mpu
from megatron import cli
from megatron.model.moe_args import add_moe_args


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
    group.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                       help="the fused compute path: each layer's layer norm, bias + GeLU, bias + dropout + residual "
                            "and attention around SDPA, and the loss, compiled with torch.compile between the "
                            "tensor-parallel collectives (the same math; the first step compiles). Default: on with "
                            "CUDA where the layers can be compiled, eager on the CPU (megatron/flags/compile_choice.py)")
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


def _add_fault_tolerance_args(parser):
    group = parser.add_argument_group("fault-tolerant replica groups on torchft (docs/operations.md; the JSON's "
                                      "fault_tolerance block wins)")
    group.add_argument("--ft-replica-groups", type=int, default=1,
                       help="R replica groups, each this job's layout under its own torchrun; gradients averaged "
                            "across the groups in torchft's quorum each step (needs --deepspeed); 1: off")
    group.add_argument("--ft-group-id", type=int, default=0, help="this job's group, 0 .. R-1")
    group.add_argument("--ft-lighthouse", type=str, default="",
                       help="http://HOST:PORT of torchft_lighthouse (default: $TORCHFT_LIGHTHOUSE)")
    group.add_argument("--ft-min-replicas", type=int, default=1,
                       help="a step commits only with at least this many groups in the quorum")
    group.add_argument("--ft-timeout", type=float, default=60.0,
                       help="seconds torchft waits for the gradient exchange, should_commit, a quorum and a heal")
    group.add_argument("--ft-replay-dropped", action="store_true",
                       help="queue the samples of a group that was out of a step (by global sample index) and train "
                            "on them at the next steps, so every sample is trained on once")
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group("validation")
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=10)
    group.add_argument("--eval-tasks", type=lambda text: [name for name in text.split(",") if name], default=None,
                       help="lm-eval tasks T1,T2 scored by the model being trained (lm-eval installed; "
                            "docs/training.md)")
    group.add_argument("--eval-tasks-path", type=str, default=None,
                       help="a directory of lm-eval task YAMLs (e.g. local JSON-lines tasks), searched first")
    group.add_argument("--eval-tasks-interval", type=int, default=None,
                       help="run --eval-tasks every N iterations (and always at the end of training)")
    group.add_argument("--eval-tasks-limit", type=int, default=None,
                       help="the first K documents of each task (default: all)")
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="PREFIX of PREFIX.{bin,idx}, or a weighted blend 'w1 PREFIX1 w2 PREFIX2 ...'; or raw "
                            "shards streamed while training: a directory, glob or .jsonl/.jsonl.gz/.json/.parquet file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="raw shards: the text field")
    group.add_argument("--append-eod", action="store_true",
                       help="raw shards: the eod id after each document (tools/preprocess_data.py --append-eod)")
    group.add_argument("--stream-shuffle-buffer", type=int, default=0, metavar="N",
                       help="raw shards: a seeded shuffle buffer of N samples (0 = stream order)")
    group.add_argument("--stream-shard-order", choices=["shuffled", "sorted"], default="shuffled",
                       help="raw shards: a seeded shard order per epoch, or sorted")
    group.add_argument("--skip-bad-records", action="store_true",
                       help="raw shards: skip (and count) unreadable records instead of stopping at the first")
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
                       help="append one JSON object per log line (rank 0): every field of the log line, the "
                            "phase timers and memory (the file's folder is created if missing)")
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


ARGUMENT_GROUPS = (_add_network_size_args, _add_regularization_args, _add_training_args, _add_learning_rate_args,
                   _add_checkpointing_args, _add_mixed_precision_args, _add_distributed_args, _add_zero_args,
                   _add_fault_tolerance_args, _add_validation_args, _add_data_args, _add_logging_args, _add_lora_args,
                   add_moe_args)
