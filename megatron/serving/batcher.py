"""Requests -> batches: one thread owns the model and runs what the HTTP handlers submit.

    work = Work(request, runner, asyncio.get_running_loop())
    batcher.submit(work)
    event = await work.events.get()   # ("delta", choice, text) while streaming, then ("done",) or ("error", exc)

Batching: the greedy requests waiting when the model becomes free are run as one left-padded batch (the KV-cache
path of megatron.text_generation.generate) of up to max_batch_size rows (a request's prompts x n); each row's
tokens are those it gets alone (generate's padding and masks). The batch runs to the longest max_tokens asked,
each row keeping its own. A sampled request runs alone (its own seeded generator: the same request gives the same
tokens every time, whatever else is waiting), in chunks of max_batch_size rows with the seed + chunk index.

A batch stops early when every row has finished (end-of-text, a stop string, its max_tokens) or belongs to a
client that went away (Work.cancel: a closed stream), which frees the model for the next batch.
"""
import asyncio
import collections
import threading
from dataclasses import dataclass

from .model_runner import GenerateJob, ScoreJob
from .rows import Row


class Work:
    """One request in flight: its rows (prompt-major: prompt i's choice j is row i * n + j), the event queue of
    the handler awaiting it, and per row the scores (log-probabilities) when asked."""

    def __init__(self, request, runner, loop):
        self.request, self.loop = request, loop
        self.rows = [Row(prompt, request.max_tokens, runner.eod, runner.tokenizer.detokenize, request.stop,
                         request.stop_after)
                     for prompt in request.prompts for _ in range(request.n)]
        self.scores = None
        self.events = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, *event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self):
        """The client went away: stop spending the model on it."""
        self.cancelled.set()

    @property
    def include_usage(self):
        return self.request.include_usage

    @property
    def watched(self):
        """Whether each step must be looked at (streaming, stop strings) rather than the result at the end."""
        return self.request.stream or bool(self.request.stop or self.request.stop_after)


@dataclass
class Stats:
    """What /health reports."""
    batches: int = 0
    largest_batch: int = 0
    running_rows: int = 0


class Batcher:
    def __init__(self, runner, max_batch_size):
        self.runner, self.max_batch_size = runner, max_batch_size
        self.pending = collections.deque()
        self.ready = threading.Condition()
        self.stats = Stats()
        self.closing = False
        self.thread = threading.Thread(target=self._serve, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, work):
        with self.ready:
            self.pending.append(work)
            self.ready.notify()

    @property
    def waiting(self):
        return len(self.pending)

    def close(self):
        """Finish the batch in progress, release the followers (model parallel), end the thread."""
        with self.ready:
            self.closing = True
            self.ready.notify()
        self.thread.join()
        self.runner.close()

    # ---- the batching thread --------------------------------------------------------------------------------------
    def _serve(self):
        while True:
            with self.ready:
                while not self.pending and not self.closing:
                    self.ready.wait()
                if self.closing:
                    return
                works = self._take()
            if works:
                self._run(works)

    def _take(self):
        """The next batch: the first live request, and behind it every greedy one that still fits."""
        while self.pending and self.pending[0].cancelled.is_set():
            self.pending.popleft()
        if not self.pending:
            return []
        works = [self.pending.popleft()]
        if works[0].request.sampled:
            return works
        rows = len(works[0].rows)
        while (self.pending and not self.pending[0].request.sampled
               and rows + len(self.pending[0].rows) <= self.max_batch_size):
            works.append(self.pending.popleft())
            rows += len(works[-1].rows)
        return [w for w in works if not w.cancelled.is_set()]

    def _run(self, works):
        try:
            pairs = [(work, row) for work in works for row in work.rows]
            for index, start in enumerate(range(0, len(pairs), self.max_batch_size)):
                self._generate(pairs[start:start + self.max_batch_size], works[0].request, index)
            self._score([w for w in works if w.request.logprobs is not None or w.request.echo])
            for work in works:
                work.emit("done")
        except Exception as error:   # noqa: BLE001 - handed to the request's handler, the server stays up
            for work in works:
                work.emit("error", error)
        finally:
            self.stats.running_rows = 0

    def _generate(self, pairs, request, chunk):
        live = [(work, row) for work, row in pairs if not row.finish_reason]
        if not live:
            return
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(live))
        self.stats.running_rows = len(live)
        watched = any(work.watched for work, _ in live)
        job = GenerateJob(rows=[row.prompt for _, row in live], max_new_tokens=max(r.max_tokens for _, r in live),
                          greedy=request.greedy, temperature=request.temperature, top_k=request.top_k,
                          top_p=request.top_p, seed=request.seed + chunk, watched=watched)
        steps = [0]

        def watcher(new):
            steps[0] += 1
            for (work, row), token in zip(live, new):
                self._add(work, row, token)
            return all(row.finish_reason or work.cancelled.is_set() for work, row in live)
        results = self.runner.generate(job, watcher if watched else None)
        for (work, row), new in zip(live, results):
            for token in new[steps[0]:]:
                self._add(work, row, token)
            row.finish_reason = row.finish_reason or "length"

    @staticmethod
    def _add(work, row, token):
        delta = row.add(token)
        if delta and work.request.stream:
            work.emit("delta", work.rows.index(row), delta)

    def _score(self, works):
        pairs = [(work, row) for work in works for row in work.rows]
        if not pairs:
            return
        top = max(work.request.logprobs or 0 for work in works)
        scores = []
        for start in range(0, len(pairs), self.max_batch_size):
            chunk = pairs[start:start + self.max_batch_size]
            scores += self.runner.score(ScoreJob([row.prompt + row.tokens for _, row in chunk], top))
        for work in works:
            work.scores = [scores.pop(0) for _ in work.rows]
