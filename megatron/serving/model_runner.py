"""The model behind the server: generation and scoring on a loaded checkpoint, at any model-parallel size.

Megatron's design: model-parallel rank 0 serves HTTP and calls the runner from its batching thread; the other
ranks wait in follow(). Each call first broadcasts its job (a small picklable object) from rank 0 over the
model-parallel group, so every rank runs the same forward steps, and every collective inside generate and the
scoring forward has its partners; close() broadcasts None, which ends follow().

    rank 0:   runner.generate(GenerateJob(...), watcher)   ->  broadcast job  ->  generate(...)  ->  tokens
    rank r:   runner.follow()                              <-  receive job    ->  generate(...)  (same steps)

The one per-step decision (whether to stop: every stream disconnected, every row at a stop string) is made on
rank 0 by `watcher` and broadcast after each step, so every rank leaves generate at the same column.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mpu
from megatron.text_generation import generate
from megatron.text_generation.generation import _unwrap, whole_vocab_logits


@dataclass
class GenerateJob:
    """Rows (prompt ids) continued by up to max_new_tokens tokens with one sampling setting."""
    rows: list
    max_new_tokens: int
    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    watched: bool      # a watcher decides after every step whether to stop


@dataclass
class ScoreJob:
    """Sequences whose every token's log-probability (given the tokens before it) and `top` alternatives are
    wanted."""
    sequences: list
    top: int


class ModelRunner:
    """`model` (GPT2Model with gathered logits, eval mode) and its tokenizer, named `name`, trained `iteration`
    steps. Model-parallel rank 0 calls generate/score/close; the other ranks call follow()."""

    def __init__(self, model, tokenizer, name, iteration):
        self.model, self.tokenizer, self.name, self.iteration = model, tokenizer, name, iteration
        config = _unwrap(model).config
        self.max_positions = config.max_sequence_length
        self.vocab_size = config.real_vocab_size or config.vocab_size
        self.eod = tokenizer.eod
        self.parallel = mpu.get_model_parallel_world_size() > 1
        self.closed = False

    # ---- rank 0 ---------------------------------------------------------------------------------------------------
    def generate(self, job, watcher=None):
        """New ids per row (ending with the end-of-text id where it was produced; cut where `watcher`, given each
        step's new ids as a list, returned True)."""
        self._send(job)
        return self._generate(job, watcher)

    def score(self, job):
        """Per sequence: (log-probabilities [None, lp(t1 | t0), ...], top alternatives [None, {id: lp}, ...])."""
        self._send(job)
        return self._score(job)

    def close(self):
        """Release the followers (their follow() returns); once."""
        if not self.closed:
            self.closed = True
            self._send(None)

    # ---- the other model-parallel ranks --------------------------------------------------------------------------
    def follow(self):
        """Run every job rank 0 sends until close()."""
        while True:
            job = self._send(None, receive=True)
            if job is None:
                return
            if isinstance(job, GenerateJob):
                self._generate(job, None)
            else:
                self._score(job)

    # ---- every rank -----------------------------------------------------------------------------------------------
    def _send(self, job, receive=False):
        if not self.parallel:
            return job
        box = [None if receive else job]
        dist.broadcast_object_list(box, src=mpu.get_model_parallel_src_rank(), group=mpu.get_model_parallel_group(),
                                   device=mpu.get_device())
        return box[0]

    def _generate(self, job, watcher):
        hook = self._stop_hook(watcher) if job.watched else None
        return generate(self.model, job.rows, job.max_new_tokens, greedy=job.greedy, temperature=job.temperature,
                        top_k=job.top_k, top_p=job.top_p, eod_id=self.eod, seed=job.seed, on_step=hook)

    def _stop_hook(self, watcher):
        """generate's on_step: rank 0's watcher decides, the decision is broadcast (model parallel)."""
        def hook(new):
            stop = bool(watcher(new.tolist())) if watcher is not None else False
            if not self.parallel:
                return stop
            flag = torch.tensor([int(stop)], dtype=torch.long, device=new.device)
            dist.broadcast(flag, mpu.get_model_parallel_src_rank(), group=mpu.get_model_parallel_group())
            return bool(flag.item())
        return hook

    @torch.no_grad()
    def _score(self, job):
        """One forward over the right-padded sequences (causal: padding never changes an earlier position)."""
        width = max(len(s) for s in job.sequences)
        tokens = torch.full((len(job.sequences), width), self.eod, dtype=torch.long)
        for row, sequence in enumerate(job.sequences):
            tokens[row, :len(sequence)] = torch.tensor(sequence)
        device = _unwrap(self.model).word_embeddings.weight.device
        logits = whole_vocab_logits(_unwrap(self.model), self.model(tokens.to(device)))[..., :self.vocab_size]
        log_probs = F.log_softmax(logits.float(), dim=-1)                          # [b, s, V]
        out = []
        for row, sequence in enumerate(job.sequences):
            n = len(sequence)
            window = log_probs[row, :n - 1]                                        # predicts tokens 1..n-1
            target = torch.tensor(sequence[1:], device=window.device, dtype=torch.long)
            picked = window.gather(-1, target[:, None]).squeeze(-1).tolist()
            tops = [None]
            if job.top > 0:
                values, ids = window.topk(job.top, dim=-1)
                tops += [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                tops += [{} for _ in range(n - 1)]
            out.append(([None] + picked, tops))
        return out
