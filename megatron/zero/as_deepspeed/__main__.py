"""`deepspeed` for megatron.zero: DeepSpeed's launcher command line, running an unmodified DeepSpeed client with
`import deepspeed` resolving to megatron.zero (see __init__.py).

    python -m megatron.zero.as_deepspeed --num_gpus 2 main.py ARGS      # as `deepspeed --num_gpus 2 main.py ARGS`
    python -m megatron.zero.as_deepspeed main.py ARGS                   # one process, as `python main.py ARGS`
    torchrun --nproc_per_node 2 -m megatron.zero.as_deepspeed main.py ARGS
    deepspeed --module megatron.zero.as_deepspeed main.py ARGS         # DeepSpeed's own launcher
    python -m megatron.zero.as_deepspeed [--module | -m] my_package.train ARGS

DeepSpeed's launcher options (--num_gpus, --num_nodes, --node_rank, --master_addr, --master_port, --include,
--exclude) start one process per local device through torchrun, the codebase's one launcher. Every launched
process (torchrun's LOCAL_RANK, or the `--local_rank=N` DeepSpeed's launcher puts before the script) runs the script
with `--local_rank=N` first among its arguments, as DeepSpeed's launcher does (DeepSpeed-Chat's mains start
torch.distributed only when given it), unless --no_local_rank.
"""
import argparse
import os
import runpy
import socket
import subprocess
import sys

from megatron import cli
from megatron.spawn import free_port
from megatron.zero.as_deepspeed import install

LAUNCH_OPTIONS = ("num_gpus", "num_nodes", "node_rank", "master_addr", "master_port", "include", "exclude")
# DeepSpeed's runner options for its ssh/MPI launchers, logging and core binding: accepted, named, no effect
NO_EFFECT = ("launcher", "launcher_args", "no_ssh", "no_ssh_check", "force_multi", "save_pid",
             "enable_each_rank_log", "bind_cores_to_rank", "bind_core_list", "ssh_port", "venv_script",
             "log_level", "quiet", "hostfile")
LOCAL_HOSTS = ("localhost", "127.0.0.1", socket.gethostname())
DEFAULT_PORT = 29500               # DeepSpeed's (TORCH_DISTRIBUTED_DEFAULT_PORT), used across nodes


def build_parser():
    parser = cli.ArgumentParser(prog="python -m megatron.zero.as_deepspeed", allow_abbrev=False,
                                description="DeepSpeed's launcher for a DeepSpeed client on megatron.zero")
    add = parser.add_argument
    add("--num_gpus", "--num_accelerators", type=int, default=-1, help="processes on this node (default: its GPUs)")
    add("--num_nodes", type=int, default=-1, help="nodes; run the command on each with --node_rank")
    add("--node_rank", type=int, default=-1)
    add("--master_addr", default="", help="node 0's address (default 127.0.0.1 on one node)")
    add("--master_port", type=int, default=None, help="default: a free port on one node, 29500 across nodes")
    add("-i", "--include", default="", help="this node's device slots, e.g. localhost:0,2")
    add("-e", "--exclude", default="", help="device slots not to use, e.g. localhost:1")
    add("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--local_rank", "--local-rank", type=int, default=None, help="set by DeepSpeed's launcher")
    add("--no_python", action="store_true", help="DeepSpeed's; refused (the client runs in Python here)")
    add("--autotuning", default="", help="DeepSpeed's; refused (no autotuner here)")
    for name in ("--launcher", "--launcher_args", "--enable_each_rank_log", "--bind_core_list", "--venv_script",
                 "--log_level", "--ssh_port"):
        add(name, default=None, help=argparse.SUPPRESS)
    for name in ("--no_ssh", "--no_ssh_check", "--force_multi", "--save_pid", "--bind_cores_to_rank"):
        add(name, action="store_true", help=argparse.SUPPRESS)
    add("-q", "--quiet", action="store_true", help=argparse.SUPPRESS)
    add("-H", "--hostfile", default=None, help=argparse.SUPPRESS)
    add("user_script", metavar="script", help="the client script (or module with --module)")
    add("user_args", metavar="args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def main(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    _refuse_unsupported(args, parser)
    ignored = [name for name in NO_EFFECT if getattr(args, name) not in (None, False)]
    if ignored:
        print(f"[as_deepspeed] accepted with no effect here: {', '.join('--' + n for n in ignored)}", file=sys.stderr)
    launched = args.local_rank is not None or "LOCAL_RANK" in os.environ
    asked = [name for name in LAUNCH_OPTIONS if getattr(args, name) != parser.get_default(name)]
    if launched and asked:
        parser.error(f"--{asked[0]} starts processes: give it to the first command, not inside torchrun or "
                     "DeepSpeed's launcher")
    return _launch(args, parser) if asked else _run(args)


def _refuse_unsupported(args, parser):
    if args.no_python:
        parser.error("--no_python: the client runs in Python here (drop the flag)")
    if args.autotuning:
        parser.error("--autotuning: DeepSpeed's autotuner is not provided here (drop the flag)")
    if args.hostfile and os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile}: ssh/MPI multi-node launch is not done here; run the command on "
                     "each node with --num_nodes N --node_rank R --master_addr NODE0")
    if (args.include or args.exclude) and args.num_gpus > 0:
        parser.error("--num_gpus with --include/--exclude: give one of them (DeepSpeed's rule)")


def _run(args):
    """This process runs the client, with --local_rank=N first among its arguments when it is a launched one."""
    local_rank = args.local_rank if args.local_rank is not None else os.environ.get("LOCAL_RANK")
    if args.local_rank is not None:           # DeepSpeed's launcher sets LOCAL_RANK too; mpu reads it
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    script_args = list(args.user_args)
    if local_rank is not None and not args.no_local_rank:
        script_args.insert(0, f"--local_rank={local_rank}")
    install()
    sys.argv = [args.user_script, *script_args]
    if args.module:
        runpy.run_module(args.user_script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.user_script)))    # as `python script.py` does
        runpy.run_path(args.user_script, run_name="__main__")
    return 0


def _launch(args, parser):
    """torchrun with one process per slot of this node, each running this alias on the script."""
    slots = _local_slots(args, parser)
    nodes = max(args.num_nodes, 1)
    if nodes > 1 and (args.node_rank < 0 or not args.master_addr):
        parser.error(f"--num_nodes {nodes}: run the command on each node with --node_rank R and --master_addr NODE0 "
                     "(ssh launch is not done here)")
    port = args.master_port or (DEFAULT_PORT if nodes > 1 else free_port())
    env = dict(os.environ)
    if (args.include or args.exclude) and _cuda_count():
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={len(slots)}", f"--nnodes={nodes}",
               f"--node_rank={max(args.node_rank, 0)}", f"--master_addr={args.master_addr or '127.0.0.1'}",
               f"--master_port={port}", "-m", "megatron.zero.as_deepspeed",
               *(["--module"] if args.module else []), *(["--no_local_rank"] if args.no_local_rank else []),
               args.user_script, *args.user_args]
    return subprocess.call(command, env=env)


def _local_slots(args, parser):
    """This node's device ids: --num_gpus N, else --include / --exclude (DeepSpeed's NAME[:SLOT,...] specs, this
    host only), else every GPU (one process on a machine without CUDA)."""
    if args.num_gpus > 0:
        return list(range(args.num_gpus))
    every = list(range(_cuda_count() or 1))
    if args.include:
        return _slots_of(args.include, every, "--include", parser)
    if args.exclude:
        excluded = _slots_of(args.exclude, every, "--exclude", parser)
        every = [slot for slot in every if slot not in excluded]
        if not every:
            parser.error(f"--exclude {args.exclude} leaves no device")
    return every


def _slots_of(spec, every, flag, parser):
    slots = []
    for node in spec.split("@"):
        host, _, listed = node.partition(":")
        if host not in LOCAL_HOSTS:
            parser.error(f"{flag} {spec}: host {host!r} is not this node; ssh launch is not done here (run the "
                         "command on each node with --num_nodes, --node_rank, --master_addr)")
        try:
            slots += [int(slot) for slot in listed.split(",")] if listed else every
        except ValueError:
            parser.error(f"{flag} {spec}: slots are device numbers, e.g. localhost:0,2")
    return sorted(set(slots))


def _cuda_count():
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
