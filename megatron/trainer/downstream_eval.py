"""Downstream evaluation while training: lm-evaluation-harness tasks (--eval-tasks) scored by the model being trained,
every --eval-tasks-interval iterations and at the end of training.

    downstream = DownstreamEval.from_args(args, tokenizer)   # before the model is built: bad tasks are one line
    downstream.maybe_run(model, iteration, history)          # after each step (a no-op without --eval-tasks)
    downstream.at_end(model, iteration, history)             # once more unless this iteration was evaluated

The harness builds the requests and splits the documents over the data-parallel ranks (megatron/text_generation/
lm_eval_tasks.py, lm_eval_model.py); each rank scores its share with the module it trains, whole and in eval mode
(inference_view: ZeRO-3 gathers every parameter once, the gathered forward generation uses), and the per-document
results go to data-parallel rank 0, where the harness computes its metrics. Every RNG state and every training
flag is put back after, so a run with evaluation is bitwise the run without it. Rank 0 prints one line per task,

    downstream eval at iteration 200 | local_mc | acc: 0.2871 ± 0.0143 | acc_norm: 0.2990 ± 0.0145

and appends a {"type": "downstream", ...} record per task to --log-jsonl; the metrics go to TensorBoard as
`downstream/TASK/METRIC`; history["downstream"] gets {"iteration", "metrics", "scores"} (scores: the per-document
record, rank 0 only).
"""
import time

import torch.distributed as dist

from megatron.guards import operations
from megatron.utils import print_rank_0


class DownstreamEval:
    """The loaded tasks and when to run them. `tasks` None: evaluation is off and every method returns at once."""

    def __init__(self, tasks=None, tokenizer=None, interval=None, limit=None, batch_size=8, log_jsonl=None,
                 writer=None):
        self.tasks, self.tokenizer, self.interval, self.limit = tasks, tokenizer, interval, limit
        self.batch_size, self.log_jsonl, self.writer = batch_size, log_jsonl, writer
        self.last_iteration = None

    @classmethod
    def from_args(cls, args, tokenizer, writer=None):
        """Loads --eval-tasks (from --eval-tasks-path first) on every rank: lm_eval_tasks.TaskError if one cannot
        run. The scoring batch is the training micro-batch."""
        if not args.eval_tasks:
            return cls()
        from megatron.text_generation.lm_eval_tasks import load_tasks
        print_rank_0(f"> loading lm-eval tasks {', '.join(args.eval_tasks)}"
                     + (f" (from {args.eval_tasks_path} first)" if args.eval_tasks_path else ""))
        return cls(load_tasks(args.eval_tasks, args.eval_tasks_path), tokenizer, args.eval_tasks_interval,
                   args.eval_tasks_limit, args.batch_size, args.log_jsonl if args.rank == 0 else None, writer)

    def maybe_run(self, model, iteration, history):
        if self.tasks is not None and self.interval and iteration % self.interval == 0:
            history.setdefault("downstream", []).append(self.run(model, iteration))

    def at_end(self, model, iteration, history):
        if self.tasks is not None and self.last_iteration != iteration:
            history.setdefault("downstream", []).append(self.run(model, iteration))

    def run(self, model, iteration):
        """Every rank calls it (ZeRO-3's gather is collective). {"iteration", "metrics": {task: {metric: value}}
        on every rank, "scores": the per-document record on rank 0 (None elsewhere)}."""
        from megatron.text_generation import inference_view
        from megatron.text_generation.lm_eval_model import MegatronGPT2LM
        from megatron.text_generation.lm_eval_tasks import document_scores, run_tasks, task_metrics
        start = time.time()
        with inference_view(model) as module:
            lm = MegatronGPT2LM(model=module, tokenizer=self.tokenizer, batch_size=self.batch_size)
            results = run_tasks(lm, self.tasks, self.limit)
        metrics = _from_rank_0(task_metrics(results) if dist.get_rank() == 0 else None)
        seconds = time.time() - start
        self.last_iteration = iteration
        self._report(iteration, metrics, seconds, lm.requests_scored)
        scores = document_scores(results) if dist.get_rank() == 0 else None
        return {"iteration": iteration, "metrics": metrics, "scores": scores}

    def _report(self, iteration, metrics, seconds, requests_scored):
        for task, values in metrics.items():
            shown = [f"{name}: {value:.4f}" + (f" ± {values[name + '_stderr']:.4f}"
                                                if name + "_stderr" in values else "")
                     for name, value in values.items() if not name.endswith("_stderr")]
            print_rank_0(f" downstream eval at iteration {iteration} | {task} | " + " | ".join(shown))
            if self.log_jsonl:
                operations.write_jsonl_record(self.log_jsonl, {
                    "type": "downstream", "iteration": iteration, "task": task, "metrics": values,
                    "seconds": seconds, "requests_scored_rank0": requests_scored})
            if self.writer is not None:
                for name, value in values.items():
                    self.writer.add_scalar(f"downstream/{task}/{name}", value, iteration)


def _from_rank_0(obj):
    """Global rank 0's `obj` on every rank (the TensorBoard writer lives on the last rank)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
