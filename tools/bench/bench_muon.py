"""Muon against AdamW on the `make pretrain` recipe (scripts/ds_pretrain_gpt.sh: GPT-2 L2 h128, seq 128, batch 32,
420 steps, cosine schedule, ZeRO-2 --deepspeed, the embedded default data): validation loss against tokens, and the
tokens each needs to reach AdamW's final validation loss.

    python tools/bench/bench_muon.py                         # AdamW at --lr 2e-3 and Muon (muon_lr 0.02) side by side
    python tools/bench/bench_muon.py --muon-lrs 0.01 0.02 0.05 --eval-interval 20

Both runs start together (one thread each, so neither gets a quieter machine), evaluate every --eval-interval steps
on the same validation batches (the validation iterator advances alike in both) and share every flag but the
optimizer. Muon's AdamW half (embeddings, head, norms, biases) runs at the recipe's --lr; its matrices peak at
--muon-lr under the same cosine schedule (lr_mult). "tokens to target" is the first evaluation at or below AdamW's
last validation loss.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
TOKENS_PER_STEP = 32 * 128      # the recipe's batch x sequence length


def _launch(name, extra_args, eval_interval, train_iters, workdir):
    env = dict(os.environ, PYTHON=sys.executable, TRAIN_ITERS=str(train_iters), EVAL_INTERVAL=str(eval_interval),
               SAVE_INTERVAL=str(10 ** 6), CHECKPOINT_PATH=os.path.join(workdir, name), LOG_JSONL="",
               EXTRA_ARGS=extra_args, OMP_NUM_THREADS="1")
    log = open(os.path.join(workdir, name + ".log"), "w")
    return subprocess.Popen(["bash", "scripts/ds_pretrain_gpt.sh"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT), log.name


def _curve(path):
    return {int(step): float(loss) for step, loss in LINE.findall(open(path).read())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.02])
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--train-iters", type=int, default=420)
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="bench_muon_")
    runs = {"adamw": ""} | {f"muon {lr:g}": f"--optimizer muon --muon-lr {lr}" for lr in args.muon_lrs}
    procs = {name: _launch(name.replace(" ", "_"), extra, args.eval_interval, args.train_iters, workdir)
             for name, extra in runs.items()}
    curves = {}
    for name, (proc, log) in procs.items():
        if proc.wait() != 0:
            sys.exit(f"bench_muon: the {name} run failed: see {log}")
        curves[name] = _curve(log)
    target = curves["adamw"][max(curves["adamw"])]
    steps = sorted(curves["adamw"])
    print(f"validation loss against tokens (tokens = steps x {TOKENS_PER_STEP}); logs in {workdir}")
    print("| step | tokens | " + " | ".join(curves) + " |")
    print("|---" * (2 + len(curves)) + "|")
    for step in steps:
        print(f"| {step} | {step * TOKENS_PER_STEP:,} | " +
              " | ".join(f"{curves[name].get(step, float('nan')):.4f}" for name in curves) + " |")
    print(f"\ntarget: AdamW's final validation loss {target:.4f} (step {max(curves['adamw'])})")
    for name, curve in curves.items():
        reached = [step for step in sorted(curve) if curve[step] <= target]
        if reached:
            ratio = reached[0] / max(curves["adamw"])
            print(f"{name}: reaches it at step {reached[0]} ({reached[0] * TOKENS_PER_STEP:,} tokens, "
                  f"{ratio:.2f}x AdamW's)")
        else:
            print(f"{name}: does not reach it (final {curve[max(curve)]:.4f})")


if __name__ == "__main__":
    main()
