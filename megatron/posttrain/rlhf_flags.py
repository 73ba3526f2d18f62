"""train_rlhf.py's command line: the RLHF flags (DeepSpeed-Chat's and TRL's names), their defaults and checks,
and the start (a checkpoint in --save resumes at a rollout boundary: the actor from --save, the critic from its
save, the reference from the --load the run started from).

    args_list = starting_point(args_list)      # bad flags: one line, exit status 2, before anything starts
    config = rlhf_config(args)                 # rlhf.RLHFConfig of the parsed flags
"""
import os

from . import rlhf, rlhf_loss
from .start import add_no_finetune_flag, check_data_flags, require_tokenizer, resume_or_start


def add_rlhf_args(parser):
    group = parser.add_argument_group("RLHF (PPO, GRPO)")
    group.add_argument("--algorithm", choices=rlhf.ALGORITHMS, default="ppo",
                       help="ppo: DeepSpeed-Chat's actor and critic; grpo: TRL's, no critic")
    group.add_argument("--critic-load", default=None, help="PPO: the critic's start (train_reward_model.py's --save)")
    group.add_argument("--critic-save", default=None, help="PPO: where the critic is saved (default: SAVE/critic)")
    group.add_argument("--critic-lr", type=float, default=None, help="PPO: the critic's peak lr (default: --lr)")
    group.add_argument("--reference-load", default=None,
                       help="the reference policy's checkpoint without LoRA (default: the starting weights; a "
                            "resumed run reads the --load it started from)")
    group.add_argument("--reward-model", default=None, help="score completions with this reward model "
                                                            "(train_reward_model.py's --save, any topology)")
    group.add_argument("--reward-fn", default=None,
                       help="score completions with module:function(prompts=, completions=, completion_ids=)")
    group.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps over each rollout")
    group.add_argument("--num-generations", type=int, default=None,
                       help="completions per prompt (GRPO's group, default 4; PPO: 1)")
    group.add_argument("--max-prompt-length", type=int, default=None,
                       help="a prompt's last tokens kept (default: --seq-length / 2)")
    group.add_argument("--max-completion-length", type=int, default=None,
                       help="new tokens per completion at most (default: --seq-length - --max-prompt-length)")
    group.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling at temperature 1")
    group.add_argument("--kl-ctl", type=float, default=rlhf_loss.KL_CTL, help="PPO: the per-token KL penalty")
    group.add_argument("--clip-reward-value", type=float, default=rlhf_loss.CLIP_REWARD_VALUE,
                       help="PPO: the score clamped to +-this")
    group.add_argument("--cliprange", type=float, default=rlhf_loss.CLIPRANGE, help="PPO: the ratio's clip")
    group.add_argument("--cliprange-value", type=float, default=rlhf_loss.CLIPRANGE_VALUE,
                       help="PPO: the value's clip around the old values")
    group.add_argument("--gamma", type=float, default=rlhf_loss.GAMMA, help="PPO: GAE's discount")
    group.add_argument("--lambda", dest="lam", type=float, default=rlhf_loss.LAM, help="PPO: GAE's lambda")
    group.add_argument("--whiten-advantages", action="store_true", help="PPO: whiten the advantages (TRL)")
    group.add_argument("--epsilon", type=float, default=rlhf_loss.EPSILON, help="GRPO: the ratio's lower clip")
    group.add_argument("--epsilon-high", type=float, default=None, help="GRPO: the upper clip (default: --epsilon)")
    group.add_argument("--beta", type=float, default=0.0, help="GRPO: the KL weight (0: no reference model)")
    group.add_argument("--loss-type", choices=rlhf_loss.LOSS_TYPES, default="dapo", help="GRPO: TRL's reduction")
    group.add_argument("--scale-rewards", choices=rlhf_loss.SCALE_REWARDS, default="group",
                       help="GRPO: the advantages' std: the group's, the batch's, none")
    group.add_argument("--enable-ema", action="store_true",
                       help="DeepSpeed-Chat's EMA actor: after each actor step ema = 0.992 ema + 0.008 actor, saved "
                            "with the actor in --ema-save")
    group.add_argument("--ema-save", default=None, help="where the EMA actor is saved (default: SAVE/ema)")
    group.add_argument("--unsupervised-data-path", nargs="*", default=None,
                       help="PPO-ptx: pretraining data (a tools/preprocess_data.py PREFIX or a weighted blend) whose "
                            "LM loss joins each actor step (DeepSpeed-Chat's unsupervised training)")
    group.add_argument("--unsup-coef", type=float, default=None,
                       help=f"PPO-ptx: the LM loss's weight (default {rlhf.PTX_COEF}, DeepSpeed-Chat's)")
    add_no_finetune_flag(parser, group, "RLHF")
    return parser


def rlhf_config(args):
    return rlhf.RLHFConfig(
        algorithm=args.algorithm, ppo_epochs=args.ppo_epochs, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, greedy=args.greedy, kl_ctl=args.kl_ctl,
        clip_reward_value=args.clip_reward_value, cliprange=args.cliprange, cliprange_value=args.cliprange_value,
        gamma=args.gamma, lam=args.lam, whiten_advantages=args.whiten_advantages, epsilon=args.epsilon,
        epsilon_high=args.epsilon_high, beta=args.beta, loss_type=args.loss_type, scale_rewards=args.scale_rewards,
        unsup_coef=_unsup_coef(args))


def _unsup_coef(args):
    """PTX's weight (None: no PTX)."""
    if not args.unsupervised_data_path:
        return None
    return rlhf.PTX_COEF if args.unsup_coef is None else args.unsup_coef


def _flags_error(args):
    """What is wrong with the RLHF flags (None when nothing)."""
    if args.pipeline_model_parallel_size > 1:
        return ("train_rlhf.py generates with the whole model on one stage: drop --pipeline-model-parallel-size "
                "(a pipelined checkpoint loads at 1)")
    if (args.reward_model is None) == (args.reward_fn is None):
        return "give one scorer: --reward-model DIR or --reward-fn module:function"
    if args.algorithm == "ppo" and args.critic_load is None:
        return "--algorithm ppo trains a critic: pass --critic-load DIR (train_reward_model.py's --save)"
    if args.algorithm == "grpo" and args.num_generations < 2:
        return f"--num-generations ({args.num_generations}) must be >= 2 for GRPO (a group of one has no advantage)"
    if args.algorithm == "ppo" and args.num_generations != 1:
        return f"--num-generations ({args.num_generations}) is GRPO's; PPO samples each prompt once"
    if args.ppo_epochs < 1 or args.train_iters % args.ppo_epochs or (args.save_interval or 0) % args.ppo_epochs:
        return (f"--train-iters ({args.train_iters}) and --save-interval ({args.save_interval}) must be multiples "
                f"of --ppo-epochs ({args.ppo_epochs}) >= 1 (a rollout's steps end together)")
    if args.unsupervised_data_path is not None and not args.unsupervised_data_path:
        return "--unsupervised-data-path takes a PREFIX (tools/preprocess_data.py's) or a weighted blend"
    if args.unsup_coef is not None and not args.unsupervised_data_path:
        return "--unsup-coef weighs the PTX loss of --unsupervised-data-path: pass that too"
    if args.unsupervised_data_path and args.algorithm != "ppo":
        return "--unsupervised-data-path (PTX) is DeepSpeed-Chat's PPO-ptx: use it with --algorithm ppo"
    if args.ema_save is not None and not args.enable_ema:
        return "--ema-save is where --enable-ema saves the EMA actor: add --enable-ema"
    if args.enable_ema and args.save is None and args.ema_save is None:
        return "--enable-ema saves the EMA actor with the run: pass --save (or --ema-save)"
    if args.max_prompt_length < 1 or args.max_completion_length < 1 or \
            args.max_prompt_length + args.max_completion_length > args.max_position_embeddings:
        return (f"--max-prompt-length ({args.max_prompt_length}) + --max-completion-length "
                f"({args.max_completion_length}) must fit --max-position-embeddings ({args.max_position_embeddings})")
    return None


def starting_point(args_list):
    """The command line to train with (a checkpoint in --save resumes); bad flags exit with one line (status 2)."""
    from megatron.arguments import build_parser
    parser = build_parser(add_rlhf_args)
    args = parser.parse_args(args_list)
    check_data_flags(parser, args, reads="train_rlhf.py reads prompts from --data-path PREFIX (the --output-prefix "
                     "of tools/preprocess_sft_data.py)", source="the --output-prefix of tools/preprocess_sft_data.py")
    fill_defaults(args)
    error = _flags_error(args)
    if error:
        parser.error(error)
    require_tokenizer(parser, args, "RLHF")
    resumed = resume_or_start(parser, args, args_list, "RLHF", "RLHF", "finetune_gpt.py's --save (an SFT model)")
    if resumed != list(args_list):   # the actor from --save; the critic from its save, the reference from --load
        if args.reference_load is None and args.load is not None:
            resumed += ["--reference-load", args.load]
        if args.algorithm == "ppo":
            resumed += ["--critic-load", critic_save_dir(args)]
    return resumed


def fill_defaults(args):
    args.num_generations = args.num_generations or (4 if args.algorithm == "grpo" else 1)
    args.max_prompt_length = args.max_prompt_length or args.seq_length // 2
    args.max_completion_length = args.max_completion_length or args.seq_length - args.max_prompt_length


def critic_save_dir(args):
    return args.critic_save or (os.path.join(args.save, "critic") if args.save else None)


def ema_save_dir(args):
    return args.ema_save or (os.path.join(args.save, "ema") if args.save else None)
