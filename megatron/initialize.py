"""Start-up: parse and validate the command line, join torch.distributed (env:// from torchrun, with the
--distributed-timeout-minutes collective timeout), build the model-parallel groups, check that every rank agrees on
its settings and code (megatron.guards.preflight), seed every generator. SIGUSR1 dumps every thread's stack."""
import os
import sys
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import mpu
from megatron.cli import UserError
from megatron.guards import breadcrumbs, nccl_rules, preflight
from megatron.arguments import parse_args
from megatron.global_vars import set_global_variables


def initialize_megatron(extra_args_provider=None, args_list=None):
    """Returns the validated args; afterwards get_args()/get_timers() work."""
    breadcrumbs.install_stack_dump()
    breadcrumbs.install_collective_breadcrumbs()   # the engine's and mpu's collectives leave breadcrumbs too
    nccl_rules.install_if_requested()              # the tests' NCCL-rules mode (MEGATRON_NCCL_RULES=1)
    args = parse_args(extra_args_provider, args_list)
    _initialize_distributed(args)
    preflight.check_agreement(args)   # one collective every rank reaches; raises PreflightError on every rank
    set_global_variables(args)
    set_random_seed(args.seed)
    if args.rank == 0:
        print(f"> world size {args.world_size}: model-parallel {args.model_parallel_size} x "
              + (f"context-parallel {args.context_parallel_size} x " if args.context_parallel_size > 1 else "")
              + f"data-parallel {args.data_parallel_size}, device {mpu.get_device()}, backend "
              f"{args.distributed_backend}", flush=True)
    return args


def layout_line(args):
    """The training entry points' start-up line (pretrain(), the RLHF driver) naming every parallel degree and the
    optimizer, e.g. `> layout: tensor-parallel 1, pipeline-parallel 1, context-parallel 1, data-parallel 2,
    expert-parallel 2 (expert-data-parallel 1); optimizer: Muon (muon-lr 0.02, momentum 0.95) for the hidden
    matrices, AdamW (lr 0.002, betas 0.9/0.95, eps 1e-08, weight decay 0.01) for the rest; ZeRO stage 2`."""
    ep = args.expert_model_parallel_size if args.num_experts else 1
    experts = f" (expert-data-parallel {args.data_parallel_size // ep})" if args.num_experts else ""
    adam = (f"AdamW (lr {args.lr:g}, betas {args.adam_beta1:g}/{args.adam_beta2:g}, eps {args.adam_eps:g}, "
            f"weight decay {args.weight_decay:g})")
    optimizer = (f"Muon (muon-lr {args.muon_lr:g}, momentum {args.muon_momentum:g}) for the hidden matrices, "
                 f"{adam} for the rest" if args.optimizer == "muon" else adam)
    engine = (f"ZeRO stage {args.zero_stage}" if args.zero_config is not None   # --deepspeed's parsed JSON
              else "Megatron's optimizer (no --deepspeed)")
    return (f"> layout: tensor-parallel {args.model_parallel_size}, pipeline-parallel "
            f"{args.pipeline_model_parallel_size}, context-parallel {args.context_parallel_size}, data-parallel "
            f"{args.data_parallel_size}, expert-parallel {ep}{experts}; optimizer: {optimizer}; {engine}")


def _initialize_distributed(args):
    if args.distributed_backend is None:
        args.distributed_backend = mpu.get_backend()
    if not dist.is_initialized():
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        if "MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE", "1") == "1":
            # one process started without torchrun: a store of its own, no port to collide with another job
            mpu.init_distributed(args.distributed_backend, store=dist.HashStore(), rank=0, world_size=1,
                                 timeout=timeout)
        else:
            store = restart_attempt_store(timeout)
            if store is None:
                mpu.init_distributed(args.distributed_backend, init_method="env://", timeout=timeout)
            else:
                mpu.init_distributed(args.distributed_backend, store=store, rank=int(os.environ["RANK"]),
                                     world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        mpu.set_device()     # a caller that started torch.distributed itself: still bind this rank's device
    args.rank = dist.get_rank()
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(args.model_parallel_size, args.pipeline_model_parallel_size,
                                      timeout=timedelta(minutes=args.distributed_timeout_minutes),
                                      virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                                      context_parallel_size=args.context_parallel_size)
        if getattr(args, "expert_model_parallel_size", 1) > 1:
            mpu.initialize_expert_parallel(args.expert_model_parallel_size,
                                           timeout=timedelta(minutes=args.distributed_timeout_minutes))


def restart_attempt_store(timeout):
    """Under torchrun's elastic agent (which keeps one store for the whole job, restarts included): that store
    with the keys of this restart attempt under their own prefix; None otherwise (plain env:// rendezvous).

    Why: env:// names the process group's keys the same in every attempt, so after a worker is killed and the
    group restarts, gloo's connectFullMesh can read the dead attempt's peer addresses from the store and fail
    with "Connection refused". A prefix per TORCHELASTIC_RESTART_COUNT gives every attempt fresh keys."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"megatron/restart_attempt_{attempt}", store)


def set_random_seed(seed):
    """python, numpy and torch from `seed` (same on every rank); the tracker's model-parallel stream per rank."""
    random.seed(seed)
    np.random.seed(seed)
    mpu.model_parallel_cuda_manual_seed(seed)


def run_main(main):
    """The entry point of every script and tool: run `main()`; an error a user can fix (megatron.cli.UserError:
    a bad checkpoint, config, file, flag combination, a diverged run) is printed as one line and exits with status
    1; then shutdown(). Anything else is a bug in our code and keeps its traceback."""
    try:
        main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        if dist.is_initialized():   # a live gloo group at interpreter exit can abort the process (SIGABRT,
            dist.destroy_process_group()   # "terminate called without an active exception"): status 1, not -6
        sys.exit(1)
    shutdown()


def shutdown():
    """All ranks leave together: across nodes, torchrun's store lives on node 0, so node 0 must not exit while
    other nodes still tear down their process groups (pretrain_gpt.py and the tools end with this)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
