"""The mixture-of-experts flags (Megatron-LM's names), what they cannot be combined with (docs/models.md), and the
MoE fields of the training log.

    --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 --moe-aux-loss-coeff 1e-2

megatron/flags/groups.py adds the group and megatron/arguments.py calls check_moe_args; GPT2ModelConfig.from_args
reads them through moe_config_from_args; the expert groups are built in megatron/initialize.py.
"""
import torch

import mpu


def add_moe_args(parser):
    group = parser.add_argument_group("mixture of experts (Megatron-LM's flags; docs/models.md)")
    group.add_argument("--num-experts", type=int, default=None,
                       help="experts per MoE layer (default: none, dense MLPs)")
    group.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    group.add_argument("--moe-router-score-function", choices=mpu.moe.ROUTERS, default="softmax",
                       help="softmax (Mixtral: softmax over the top-k logits) or sigmoid (top-k scores, renormalized)")
    group.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                       help="weight of the Switch/GShard load-balancing loss E sum_e f_e P_e")
    group.add_argument("--moe-z-loss-coeff", type=float, default=0.0,
                       help="weight of the router z-loss mean(logsumexp(logits)^2)")
    group.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                       help="each expert takes at most ceil(tokens x topk x this / experts) of a rank's tokens, the "
                            "rest dropped (default: dropless)")
    group.add_argument("--moe-layer-freq", type=int, default=1,
                       help="layer i is an MoE layer when i %% this == 0 (default: every layer)")
    group.add_argument("--expert-model-parallel-size", type=int, default=1,
                       help="experts split across this many ranks of the data-parallel group (all-to-all dispatch); "
                            "must divide the data-parallel size and --num-experts")
    return parser


def check_moe_args(args, parser):
    """Refuse, before anything is built, what the MoE layer does not support (one line naming the fix)."""
    ep = args.expert_model_parallel_size
    if not args.num_experts:
        if ep != 1:
            parser.error(f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    try:
        mpu.MoEConfig(num_experts=args.num_experts, topk=args.moe_router_topk, router=args.moe_router_score_function,
                      capacity_factor=args.moe_expert_capacity_factor, layer_freq=args.moe_layer_freq)
    except ValueError as error:
        parser.error(str(error))
    if ep < 1 or args.data_parallel_size % ep or args.num_experts % ep:
        parser.error(f"--expert-model-parallel-size ({ep}) must divide the data-parallel size "
                     f"({args.data_parallel_size}) and --num-experts ({args.num_experts})")
    refused = [(args.sequence_parallel, "--sequence-parallel (the MoE layer runs on whole sequences)"),
               (bool(args.lora_rank), "--lora-rank (LoRA targets the dense MLP's linears)")]
    for given, what in refused:
        if given:
            parser.error(f"--num-experts cannot be combined with {what}: drop one of them")
    if ep > 1 and args.zero_config is None:          # the --deepspeed path's parsed JSON
        parser.error(f"--expert-model-parallel-size {ep} needs --deepspeed (the ZeRO engine averages expert gradients "
                     "over the expert-data-parallel group; the local DDP path does not)")


def moe_config_from_args(args):
    """The mpu.MoEConfig of --num-experts and the --moe-* flags, or None without --num-experts."""
    if not getattr(args, "num_experts", None):
        return None
    return mpu.MoEConfig(num_experts=args.num_experts, topk=args.moe_router_topk,
                         router=args.moe_router_score_function, aux_loss_coeff=args.moe_aux_loss_coeff,
                         z_loss_coeff=args.moe_z_loss_coeff, capacity_factor=args.moe_expert_capacity_factor,
                         layer_freq=args.moe_layer_freq)


def moe_log_fields(module):
    """The training log's MoE fields of `module`'s last forward on this rank: the aux losses (load balancing + z)
    summed over its MoE layers, and the fewest and most tokens any of its experts was routed (per layer, before
    capacity drops: an expert at 0 is starving, one far above tokens x topk / experts is overloaded); {} without
    MoE layers. One host sync (log intervals only)."""
    statistics = mpu.moe_statistics(module)
    if not statistics:
        return {}
    aux = sum(aux for aux, _ in statistics)
    counts = torch.stack([counts for _, counts in statistics])                  # [MoE layers, E]
    values = torch.stack([aux.float(), counts.min().float(), counts.max().float()]).tolist()
    return {"moe aux loss": values[0], "tokens per expert min": int(values[1]), "tokens per expert max": int(values[2])}


def moe_log_text(fields):
    """' | moe aux loss: ... | tokens per expert min/max: a/b' ('' without MoE)."""
    if not fields:
        return ""
    return (f" | moe aux loss: {fields['moe aux loss']:.6E} | tokens per expert min/max: "
            f"{fields['tokens per expert min']}/{fields['tokens per expert max']}")


class StarvingExpertWatch:
    """Warns once (rank 0's log line) when an expert was routed no tokens at `intervals` log intervals in a row: the
    router is collapsing onto fewer experts, which the default --moe-aux-loss-coeff 0 does nothing against. Re-arms
    after an interval where every expert got tokens."""

    def __init__(self, aux_loss_coeff, intervals=3):
        self.aux_loss_coeff = aux_loss_coeff
        self.intervals = intervals
        self.starving_in_a_row = 0

    def observe(self, fields, iteration):
        """`fields`: moe_log_fields' dict of one log interval. Returns the warning line once, else None."""
        if not fields:
            return None
        self.starving_in_a_row = self.starving_in_a_row + 1 if fields["tokens per expert min"] == 0 else 0
        if self.starving_in_a_row != self.intervals:
            return None
        advice = ("set it (Megatron-LM's usual 1e-2) to balance the experts' load" if self.aux_loss_coeff == 0 else
                  "raise it to balance the experts' load")
        return (f"WARNING: an expert was routed no tokens at each of the last {self.intervals} log intervals "
                f"(iteration {iteration}): --moe-aux-loss-coeff is {self.aux_loss_coeff:g}; {advice}")
