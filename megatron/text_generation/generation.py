"""Batched autoregressive generation with the training GPT2Model, at any model-parallel size.

    new_tokens = generate(model, [[5, 7, 9], [3]], max_new_tokens=20, greedy=True, eod_id=tokenizer.eod)

Padding: prompts are LEFT-padded into one [b, P] batch (P: the longest prompt), so every row's next token is at
the same column and the KV cache is written at one offset for all rows. Each row keeps the position ids it has
alone and never attends to its padding (one mask built per call, sliced per step; see left_padded_layout), so
each row is decoded as if it were alone. With the KV cache (use_cache=True) the whole prompt batch is run once and
each later step feeds one token per row into a cache preallocated for the call; with use_cache=False
(--recompute) every step re-runs the whole sequence so far. Nothing is synchronized with the host per token:
whether every row has finished is asked every DONE_CHECK_INTERVAL steps.

Static decoding (static_cache=True, the default with the cache): after the prompt, every one-token step has the
same shapes and reads only fixed buffers (DecodeStep): the token, its position ids and its mask row are copied into
buffers made once per call, the step writes its keys/values at the slot a device tensor names
(InferenceCache.write_at) and attends over every slot of the cache, the slots not written yet (and a row's
padding) masked. On CUDA the step is then captured as a CUDA graph and replayed (cuda_graph; the host launches one
graph per token instead of every kernel: generation at batch 1 is host-bound without it); captured steps are kept
per model by (batch, cache length) for the next calls of that shape, and a model whose forward reads the host (MoE)
runs them eagerly (capture.py). The tokens are those of the growing-cache path (static_cache=False), which stays
for comparison.

Expert parallelism: every forward of an MoE model split over an expert group is an all-to-all over that group,
whose ranks (data-parallel ranks) pass their own prompts. They agree on the number of steps (the longest of the
group's) and on when every row of every rank is done, so each runs the same number of forward steps; a rank with
no prompt runs a placeholder and returns [] (lockstep_group).

Logits are gathered over the vocab-parallel group (when the model keeps them parallel) and cut to the real
vocabulary (config.real_vocab_size), so padded ids are never produced. Model-parallel rank 0 samples with a
torch.Generator seeded by `seed` and broadcasts the ids over the model-parallel group: every rank of a group gets
the same tokens. A row stops after producing `eod_id` (included in its output), after `max_new_tokens`, or at the
end of the position table.
"""
import torch
import torch.distributed as dist

import mpu
from megatron.cli import UserError

from .capture import CapturedSteps, capture_for

DONE_CHECK_INTERVAL = 16
"""Decoding steps between two checks whether every row has finished (each check waits for the device)."""


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def whole_vocab_logits(module, logits):
    """`module`'s logits [..., V/p] gathered over the vocab-parallel group into [..., V] when it keeps them parallel
    (a training model: parallel_output=True); else as they are."""
    if getattr(module, "parallel_output", False) and mpu.get_model_parallel_world_size() > 1:
        return mpu.gather_from_model_parallel_region(logits)
    return logits


def sample_logits(logits, greedy=False, temperature=1.0, top_k=0, top_p=0.0, generator=None):
    """One token id per row of logits [b, V] (fp32): argmax, or a sample after temperature, top-k and top-p."""
    if greedy:
        return logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature} (use greedy for argmax)")
    logits = logits / temperature
    if top_k and top_k > 0:
        top_k = min(top_k, logits.size(-1))
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative > top_p
        remove[:, 1:] = remove[:, :-1].clone()   # keep the token that crosses top_p
        remove[:, 0] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_sampling_options(max_new_tokens, greedy=False, temperature=1.0, top_k=0, top_p=0.0):
    """InferenceInputError (a ValueError; one line, named by the tools' flags) for options that cannot mean
    anything: before any work."""
    if max_new_tokens < 1:
        raise InferenceInputError(f"--out-seq-length (max_new_tokens) is {max_new_tokens}: give the number of new "
                                  "tokens, at least 1")
    if top_k < 0:
        raise InferenceInputError(f"--top_k is {top_k}: give 0 (off) or the number of most likely tokens to sample "
                                  "from")
    if not 0.0 <= top_p <= 1.0:
        raise InferenceInputError(f"--top_p is {top_p}: give a probability mass in (0, 1], e.g. 0.9 (0 turns it "
                                  "off)")
    if not greedy and not temperature > 0:
        raise InferenceInputError(f"--temperature is {temperature}: it must be positive (or pass --greedy for "
                                  "argmax)")


def _broadcast_from_model_parallel_src(tensor):
    if mpu.get_model_parallel_world_size() > 1:
        dist.broadcast(tensor, mpu.get_model_parallel_src_rank(), group=mpu.get_model_parallel_group())
    return tensor


@torch.no_grad()
def generate(model, prompts_token_ids, max_new_tokens, greedy=False, temperature=1.0, top_k=0, top_p=0.0,
             eod_id=None, use_cache=True, seed=1234, static_cache=True, cuda_graph=None, on_step=None):
    """Continue each prompt (a list of token ids) by up to max_new_tokens tokens; returns a list of lists of the
    new token ids per prompt (ending with eod_id where it was produced). Every model-parallel rank must call it
    with the same prompts and arguments; under expert parallelism every rank of the expert group calls it too (its
    own prompts, maybe none). static_cache: the one-token steps at fixed shapes (DecodeStep); False:
    the cache read as a growing prefix. cuda_graph: capture the static step as a CUDA graph (True), run it eagerly
    (False), the default (None: on CUDA at model-parallel size 1, graph_capture_default), or a capture function
    (DecodeStep). on_step(new): called on every rank after each step with its new ids (a long tensor [b]); a
    true return ends the call there (every rank of the model-parallel group must return the same: the server's
    streaming and stop strings), each row keeping the tokens made so far."""
    check_sampling_options(max_new_tokens, greedy, temperature, top_k, top_p)
    module = _unwrap(model)
    config = module.config
    max_positions = config.max_sequence_length
    real_vocab = config.real_vocab_size or config.vocab_size
    prompts = [list(map(int, p)) for p in prompts_token_ids]
    group = lockstep_group(module)
    if not prompts and group is None:
        return []
    asked = len(prompts)
    prompts = prompts or [[0]]              # a rank with nothing to generate still joins its group's steps
    _check_prompts(prompts, max_positions, real_vocab)
    device = module.word_embeddings.weight.device
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    new_counts = [min(max_new_tokens, max_positions - n) for n in lengths]    # the position table caps a row
    steps = _agreed_max(max(new_counts), group, device)
    if steps == 0:
        return [[] for _ in range(asked)]
    width, total = max(lengths), max(lengths) + steps                         # prompt columns, all columns
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)       # left-padded
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):width] = torch.tensor(prompt, device=device)
    position_ids, mask = left_padded_layout(lengths, total, max_positions, device)
    last_column = torch.tensor([width + n - 1 for n in new_counts], device=device)   # a row's last new token
    done = last_column < width                                                # rows with no room at all
    generator = None
    if mpu.get_model_parallel_rank() == 0 and not greedy:
        generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        capture = capture_for(cuda_graph, device, module) if use_cache and static_cache else None
        kept = CapturedSteps.of(module).find(capture, batch, 1 if mask is None else batch, total, device)
        cache = kept.cache.restart() if kept else (module.new_inference_cache(total) if use_cache else None)
        step = None                                     # the static one-token step, after the prompt
        fed = 0                                         # columns already in the cache
        end = total                                     # columns produced, when on_step ends the call early
        for column in range(width, total):              # the column whose token this step produces
            if (column - width) % DONE_CHECK_INTERVAL == 0 and _agreed_max(int(not done.all()), group, device) == 0:
                break
            first = fed if cache is not None else 0
            if step is not None:
                logits = step(tokens[:, first:column], position_ids[:, first:column], step_mask[:, :, first], first)
            else:
                logits = model(tokens[:, first:column], position_ids=position_ids[:, first:column],
                               attention_mask=None if mask is None else mask[:, :, first:column, :column],
                               inference_cache=cache, last_logits_only=True)
                if cache is not None and static_cache and column + 1 < total:
                    step_mask = mask if mask is not None else causal_mask(total, device)   # [b|1, 1, total, total]
                    step = kept.rearm() if kept else CapturedSteps.of(module).keep(
                        DecodeStep(model, cache, batch, step_mask.size(0), total, device, capture))
            fed = column
            logits = logits[:, -1, :]                                         # [b, V/p] or [b, V]
            logits = whole_vocab_logits(module, logits)[:, :real_vocab].float()                           # padded ids never sampled
            if mpu.get_model_parallel_rank() == 0:
                new = sample_logits(logits, greedy, temperature, top_k, top_p, generator)
            else:
                new = torch.empty(batch, dtype=torch.long, device=device)
            new = _broadcast_from_model_parallel_src(new.to(torch.long).contiguous())
            tokens[:, column] = new
            if eod_id is not None:
                done = done | (new == eod_id)
            done = done | (column >= last_column)
            if on_step is not None and on_step(new):
                end = column + 1
                break
    finally:
        model.train(was_training)
    results = []
    for row, count in enumerate(new_counts):
        out = tokens[row, width:min(width + count, end)].tolist()
        if eod_id is not None and eod_id in out:
            out = out[:out.index(eod_id) + 1]
        results.append(out)
    return results[:asked]


def lockstep_group(module):
    """The expert-model-parallel group of `module`'s MoE layers when they are split over more than one rank, else
    None. Every forward's dispatch is an all-to-all over that group, so its ranks (data-parallel ranks with their
    own prompts, lengths and ends) must run the same number of forward steps: generate agrees with them on the
    number of steps and on when every row of every rank is done."""
    for layer in module.modules():
        if isinstance(layer, mpu.MoEMLP) and layer.ep > 1:
            return layer.group
    return None


def _agreed_max(value, group, device):
    """max(value) over `group` (value itself when group is None)."""
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def causal_mask(total, device):
    """[1, 1, total, total] bool, True = masked out: query column i sees keys 0..i (equal-length prompts)."""
    columns = torch.arange(total, device=device)
    return (columns[None, :] > columns[:, None])[None, None]


class DecodeStep:
    """generate's one-token step at fixed shapes, reading only buffers made once per call: the token ids [b, 1],
    their position ids [b, 1], the mask row [b|1, 1, 1, total] over every cache slot, and the slot to write (a
    long tensor [1], InferenceCache.write_at). A call copies the step's values into them and runs the model, or,
    with `capture`, replays what capture(forward) made of the first call (CUDA: cuda_graph_capture). Its result,
    the logits [b, 1, V/p or V], is then the capture's static output: read it before the next call.

        step = DecodeStep(model, cache, b, mask_rows, total, device, capture=None)   # after the prompt is cached
        logits = step(tokens[:, c:c + 1], position_ids[:, c:c + 1], mask[:, :, c], c)   # column c's token
    """

    def __init__(self, model, cache, batch, mask_rows, total, device, capture=None):
        self.model, self.cache, self.capture, self.replay = model, cache, capture, None
        self.key = (capture, batch, mask_rows, total)        # what CapturedSteps keeps it under
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(mask_rows, 1, 1, total, dtype=torch.bool, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        cache.write_at(self.position)

    def rearm(self):
        """Static decoding on this step's slot again, after a prompt was written into its (restarted) cache."""
        self.cache.write_at(self.position)
        return self

    def forward(self):
        """The model on the static buffers (what a capture records)."""
        return self.model(self.tokens, position_ids=self.position_ids, attention_mask=self.mask,
                          inference_cache=self.cache, last_logits_only=True)

    def __call__(self, tokens, position_ids, mask_row, column):
        """Logits after feeding `tokens` [b, 1] at cache slot `column` (position_ids [b, 1], mask_row [b|1, 1,
        total]: the keys the token may see, True = masked out)."""
        self.tokens.copy_(tokens)
        self.position_ids.copy_(position_ids)
        self.mask.copy_(mask_row[:, :, None])
        self.position.fill_(column)
        self.cache.set_length(column + 1)
        if self.capture is None:
            return self.forward()
        if self.replay is None:
            self.replay = self.capture(self.forward)
        return self.replay()


def _check_prompts(prompts, max_positions, real_vocab):
    """InferenceInputError (a ValueError; one line) for an empty prompt, one longer than the position table, an
    id outside the vocabulary."""
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise InferenceInputError(f"prompt {index} is empty: give at least one token (e.g. end-of-document)")
        if len(prompt) > max_positions:
            raise InferenceInputError(f"prompt {index} has {len(prompt)} tokens, longer than the position table "
                                      f"(max_sequence_length {max_positions}): shorten it")
        bad = [t for t in prompt if not 0 <= t < real_vocab]
        if bad:
            raise InferenceInputError(f"prompt {index} has token ids outside the vocabulary [0, {real_vocab}): "
                                      f"{bad[:5]}")


def left_padded_layout(lengths, total, max_positions, device):
    """(position_ids [b, total], mask [b, 1, total, total] or None) of prompts of `lengths` left-padded to the
    longest, over `total` columns. Row r has pad_r = max(lengths) - lengths[r] padding columns:

        lengths [3, 1], total 5:   position_ids [[0, 1, 2, 3, 4],     mask[1, 0] (row 1, True = masked out):
                                                 [0, 0, 0, 1, 2]]     query col 2: keys 0, 1 masked, 2 seen
                                                                       query col 0: key 0 seen (itself)

    A row's positions are those it has alone; its queries never see its padding keys, and a padding query sees
    only itself (never no key at all, so its junk stays finite: some SDPA kernels give NaN for an all-masked row,
    which would reach real rows through the next layer's values). Positions past the table (a row already at its
    end) are clamped; those tokens are never returned. Equal lengths need no mask (SDPA's causal paths)."""
    pad = max(lengths) - torch.tensor(lengths, device=device)                 # [b]
    columns = torch.arange(total, device=device)
    position_ids = (columns[None, :] - pad[:, None]).clamp(0, max_positions - 1)   # [b, total]
    if not bool(pad.any()):
        return position_ids, None
    causal = columns[:, None] >= columns[None, :]                             # [total, total]
    real_key = columns[None, :] >= pad[:, None]                               # [b, total]
    allowed = (causal[None] & real_key[:, None, :]) | torch.eye(total, dtype=torch.bool, device=device)
    return position_ids, ~allowed[:, None]                                    # [b, 1, total, total]


class InferenceInputError(UserError, ValueError):
    """What load_inference_model refuses (no --load, no checkpoint there, no tokenizer, a pipelined run): one line
    naming the problem and the fix. The tools print it as `error: ...` with exit status 1."""


def load_inference_model(args, who="generation", need_tokenizer=False):
    """GPT2Model from Megatron's arguments with gathered logits, its weights (only) loaded from args.load at this
    run's model-parallel size (either path, any saving topology), in eval mode: what generation and the zero-shot
    tasks run on. No optimizer, lr-scheduler, counters or RNG are needed or restored.

    The checks of every inference front end, before anything is built (InferenceInputError; `who` names the
    caller in the message, e.g. "zero-shot evaluation"): --load given and holding a checkpoint (load_checkpoint
    would go on with random weights), a tokenizer when `need_tokenizer` (not --mock-data), one pipeline stage."""
    import dataclasses
    from megatron.checkpoint import get_checkpoint_iteration, load_checkpoint
    from megatron.global_vars import get_tokenizer
    from megatron.model import GPT2Model, GPT2ModelConfig
    from megatron.train_state import CheckpointOptions
    if not args.load:
        raise InferenceInputError(f"{who} needs --load DIR (a checkpoint saved by pretrain_gpt.py)")
    if get_checkpoint_iteration(args.load)[0] is None:
        raise InferenceInputError(f"{args.load} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    if need_tokenizer and get_tokenizer() is None:
        raise InferenceInputError(f"{who} needs a tokenizer (--vocab-file/--merge-file), not --mock-data")
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        raise InferenceInputError(f"generation and evaluation need the whole model on one stage, not "
                                  f"--pipeline-model-parallel-size {mpu.get_pipeline_model_parallel_world_size()}: "
                                  "run with --pipeline-model-parallel-size 1 (a pipelined checkpoint loads there)")
    model = GPT2Model(GPT2ModelConfig.from_args(args), parallel_output=False)
    model.to(device=mpu.get_device(), dtype=getattr(torch, args.params_dtype))
    options = dataclasses.replace(CheckpointOptions.from_args(args), finetune=True, no_load_optim=True,
                                  no_load_rng=True)
    load_checkpoint(model, None, None, options)
    return model.eval()
