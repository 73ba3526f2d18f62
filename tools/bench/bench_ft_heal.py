"""A killed worker: replica groups on torchft against today's torchrun restart + checkpoint load, on the same run.

    python tools/bench/bench_ft_heal.py [--kill-at 25] [--train-iters 300] [--save-interval 10] [--keep-logs DIR]

Both runs train the tiny GPT-2 on --mock-data with ZeRO-2 at the same global batch, each worker one CPU process:
- replica groups: torchft's lighthouse on loopback and 2 groups of 1 process, each under its own torchrun
  (--max-restarts 1); group 1's worker is SIGKILLed once its log reaches --kill-at. Measured: seconds from the
  kill to group 1's next logged iteration (restart, quorum, state from group 0, a step), and the steps group 0
  lost (iterations it did not commit; the goal is 0: a failed exchange is redone with a new quorum), the exchanges
  it redid and the steps it trained alone meanwhile.
- torchrun restart: one torchrun of 2 processes (data parallel 2, --save-interval, --load = --save), the same kill.
  Measured: seconds to the next logged iteration, and the steps lost (trained again after loading the newest
  checkpoint: --kill-at minus the last saved iteration, for every worker).
Prints one markdown table (docs/benchmarks.md).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
MODEL = ["--mock-data", "--vocab-size", "64", "--make-vocab-size-divisible-by", "8", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--batch-size", "2",
         "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3", "--warmup", "0", "--seed", "7"]


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip().startswith("{")]


def _torchrun(nproc, argv, log, directory):
    from megatron.spawn import free_port
    config = os.path.join(directory, "ds.json")
    with open(config, "w") as handle:
        json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 2}}, handle)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "pretrain_gpt.py", *MODEL,
               *argv, "--deepspeed", "--deepspeed_config", config, "--log-jsonl", log]
    with open(log + ".out", "w") as output:   # a file: a pipe read only at the end fills and blocks the worker
        return subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True)


def _output(log):
    with open(log + ".out") as handle:
        return handle.read()


def _kill_a_worker(agent, log, kill_at):
    """SIGKILL one worker of `agent` (a torchrun) once `log` reaches iteration kill_at; the kill's time."""
    while not any(r.get("iteration", 0) >= kill_at for r in _records(log)):
        if agent.poll() is not None:
            raise RuntimeError(f"the run ended before iteration {kill_at}:\n{_output(log)[-3000:]}")
        time.sleep(0.02)
    with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as handle:
        worker = int(handle.read().split()[-1])
    os.kill(worker, signal.SIGKILL)
    return time.monotonic()


def _next_iteration_after(log, count, agent):
    """Seconds-stamp of the first record beyond the first `count` ones (training again)."""
    while len(_records(log)) <= count:
        if agent.poll() is not None:
            raise RuntimeError(f"the run ended without training again:\n{_output(log)[-3000:]}")
        time.sleep(0.02)
    return time.monotonic()


def replica_groups(args, directory):
    from torchft._torchft import LighthouseServer
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=20,
                                  heartbeat_timeout_ms=1000)
    logs = [os.path.join(directory, f"group{g}.jsonl") for g in range(2)]
    ft = ["--train-iters", str(args.train_iters), "--ft-replica-groups", "2", "--ft-lighthouse", lighthouse.address()]
    agents = [_torchrun(1, ft + ["--ft-group-id", str(g)], logs[g], directory) for g in range(2)]
    try:
        killed = _kill_a_worker(agents[1], logs[1], args.kill_at)
        back = _next_iteration_after(logs[1], len(_records(logs[1])), agents[1])
        for agent in agents:
            agent.wait()
        outputs = [_output(log) for log in logs]
    finally:
        lighthouse.shutdown()
    for g, output in enumerate(outputs if args.keep_logs else []):
        with open(os.path.join(args.keep_logs, f"group{g}.txt"), "w") as handle:
            handle.write(output)
    alone = outputs[0].count("dropped group 1's samples")
    lost = outputs[0].count("groups, discarded;")     # the step lines (a stack dump may name `discarded` too)
    redone = outputs[0].count("the gradient exchange failed")
    return back - killed, lost, alone, redone


def torchrun_restart(args, directory):
    save, log = os.path.join(directory, "save"), os.path.join(directory, "restart.jsonl")
    argv = ["--train-iters", str(args.train_iters), "--global-batch-size", "4", "--save", save, "--load", save,
            "--save-interval", str(args.save_interval)]
    agent = _torchrun(2, argv, log, directory)
    killed = _kill_a_worker(agent, log, args.kill_at)
    done = max(r["iteration"] for r in _records(log))
    back = _next_iteration_after(log, len(_records(log)), agent)
    agent.wait()
    return back - killed, done - done // args.save_interval * args.save_interval


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kill-at", type=int, default=25)   # mid-interval: the restart redoes 5 steps
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--keep-logs", metavar="DIR", help="write the replica groups' output there")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        heal_s, lost, alone, exchanges = replica_groups(args, first)
        restart_s, redone = torchrun_restart(args, second)
    print("| recovery | kill -> training again (s) | steps lost by the other workers |")
    print("|---|---|---|")
    print(f"| torchft replica groups (2 x 1) | {heal_s:.1f} | {lost} (group 0 redid {exchanges} exchange(s) with a new "
          f"quorum, then trained {alone} steps alone) |")
    print(f"| torchrun restart + checkpoint load (dp 2, save every {args.save_interval}) | {restart_s:.1f} | "
          f"{redone} (redone after the reload) |")


if __name__ == "__main__":
    main()
