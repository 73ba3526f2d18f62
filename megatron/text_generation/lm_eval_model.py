"""An lm-evaluation-harness model (lm_eval.api.model.LM) over a training checkpoint of either path, at any
model-parallel size, without converting it. lm-eval is optional (`pip install lm-eval==0.4.13`) and imported only
here.

    # the harness's CLI, with this model registered (model flags must match the checkpoint):
    python -m megatron.text_generation.lm_eval_model --model megatron_gpt2 --tasks lambada_openai --batch_size 8 \\
        --model_args "megatron_args=--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --max-position-embeddings 1024 --vocab-file V --merge-file M --load CKPT"

    # Python, on an already-loaded model (e.g. in a test or a notebook):
    lm = MegatronGPT2LM(model=load_inference_model(args), tokenizer=get_tokenizer(), batch_size=8)
    lm.loglikelihood([Instance("loglikelihood", {}, ("The cat", " sat"), 0)])

Semantics are the harness's (those of its Hugging Face model, lm_eval.models.huggingface.HFLM):
- loglikelihood(context, continuation): TemplateLM's tokenization (context and context + continuation encoded, the
  continuation's ids being the difference; an empty context conditions on <|endoftext|>); the last
  max_length + 1 ids are kept, the model reads all but the last, and the sum of the continuation's log-softmax
  (over the real vocabulary) and whether every continuation token is the argmax are returned.
- loglikelihood_rolling(text): the harness's disjoint rolling windows of max_length (lm_eval.utils), each scored
  as above, summed per text.
- generate_until(context, gen_kwargs): megatron.text_generation.generate (KV cache; greedy unless do_sample), the
  context left-truncated to max_length - max_gen_toks ids, the text cut at the first stop sequence (`until`, plus
  <|endoftext|>).
Data parallelism is the harness's own: the model reports the data-parallel rank and size (rank, world_size), so
lm_eval.evaluator.evaluate builds on each data-parallel rank the requests of its documents only (document i on rank
i mod dp: lm_eval.utils.create_iterator) and gathers the per-document results to data-parallel rank 0 through
all_gather / gather_object over the data-parallel group, where it computes the metrics; every rank of a
model-parallel group holds the same data-parallel rank, so it gets the same requests (tensor parallelism needs it).
`requests_scored` counts the (context, continuation) rows this rank has run through the model.
"""
import shlex

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as error:   # the optional dependency: say how to get it
    raise ImportError(f"megatron.text_generation.lm_eval_model needs lm-evaluation-harness ({error}): "
                      "pip install lm-eval==0.4.13 (or: pip install -r requirements-test.txt)") from None

import mpu

from .generation import _unwrap, generate, load_inference_model, whole_vocab_logits

MODEL_NAME = "megatron_gpt2"
PROG = "python -m megatron.text_generation.lm_eval_model"


def load_from_megatron_args(args_list):
    """(model, tokenizer) from Megatron's command-line flags (a list or one string): initializes torch.distributed
    and mpu like the tools do, then loads the checkpoint named by --load weights-only."""
    from megatron.global_vars import get_tokenizer
    from megatron.initialize import initialize_megatron
    if isinstance(args_list, str):
        args_list = shlex.split(args_list)

    def no_training_data(parser):   # the training parser insists on a data source
        parser.set_defaults(data_path=["(lm-eval: no training data)"])
        return parser
    args = initialize_megatron(extra_args_provider=no_training_data, args_list=list(args_list))
    model = load_inference_model(args, "the lm-eval model (megatron_args)", need_tokenizer=True)
    return model, get_tokenizer()


@register_model(MODEL_NAME, "megatron-gpt2")
class MegatronGPT2LM(TemplateLM):
    """The harness's view of our GPT2Model (built with parallel_output=False) and megatron.tokenizer's GPT-2 BPE.
    Give either `model` and `tokenizer`, or `megatron_args` (the flags of tools/generate_samples_gpt.py: model
    shape, tokenizer files, --load, --model-parallel-size). `max_length` defaults to the position table.
    `device` and `max_batch_size` (passed by the harness's CLI) are ignored: mpu places the model."""

    def __init__(self, model=None, tokenizer=None, megatron_args=None, batch_size=8, max_length=None,
                 max_gen_toks=256, device=None, max_batch_size=None):
        super().__init__()
        if model is None:
            if megatron_args is None:
                raise ValueError(f"{MODEL_NAME} needs megatron_args (model flags and --load DIR) or a model")
            model, tokenizer = load_from_megatron_args(megatron_args)
        if tokenizer is None:
            raise ValueError(f"{MODEL_NAME} needs the tokenizer the model was trained with")
        try:
            self._batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r} ('auto' is not "
                             "supported)") from None
        if self._batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = _unwrap(model).config
        self.vocab_size = config.real_vocab_size or config.vocab_size
        self._max_length = int(max_length or config.max_sequence_length)
        if self._max_length > config.max_sequence_length:
            raise ValueError(f"max_length {self._max_length} is longer than the position table "
                             f"(max_sequence_length {config.max_sequence_length})")
        self.max_gen_toks = int(max_gen_toks)
        self._device = _unwrap(model).word_embeddings.weight.device
        self._group = mpu.get_data_parallel_group() if mpu.model_parallel_is_initialized() else None
        if self._group is not None:
            self._rank, self._world_size = dist.get_rank(self._group), dist.get_world_size(self._group)
        self.requests_scored = 0

    # ---- the harness's data-parallel protocol (lm_eval.api.model.LM), over the data-parallel group -------------
    def all_gather(self, tensor):
        """Every data-parallel rank's `tensor`, concatenated in rank order (0-d tensors stacked)."""
        if self._group is None:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self._group)
        return torch.stack(pieces) if tensor.dim() == 0 else torch.cat(pieces)

    def gather_object(self, obj, dst=0):
        """[data-parallel rank 0's obj, rank 1's, ...] on data-parallel rank `dst`, None on the others."""
        if self._group is None:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(self._group, dst), group=self._group)
        return gathered

    def barrier(self):
        if self._group is not None:
            dist.barrier(group=self._group)

    # ---- what TemplateLM needs ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self):
        return self.tokenizer.eod

    @property
    def max_length(self):
        return self._max_length

    @property
    def tokenizer_name(self):
        return "megatron-gpt2-bpe"

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.tokenizer.tokenize(string)

    def tok_decode(self, ids):
        return self.tokenizer.detokenize(list(ids))

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """[(sum of the continuation's log-probabilities, all greedy)] for [(strings, context ids, continuation
        ids)], in the order given. Rows are batched longest first and right-padded (causal: padding never
        changes an earlier position)."""
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation (ids)")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length "
                                 f"{self.max_length}")
            rows.append(((context + continuation)[-(self.max_length + 1):][:-1], continuation))
        self.requests_scored += len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results = [None] * len(rows)
        for start in range(0, len(order), self._batch_size):
            chunk = order[start:start + self._batch_size]
            for index, result in zip(chunk, self._score_batch([rows[i] for i in chunk])):
                results[index] = result
        return results

    def _score_batch(self, rows):
        width = max(len(inputs) for inputs, _ in rows)
        tokens = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
        for row, (inputs, _) in enumerate(rows):
            tokens[row, :len(inputs)] = torch.tensor(inputs)
        logits = whole_vocab_logits(_unwrap(self.model), self.model(tokens.to(self._device)))   # [b, s, V (padded)]
        logits = logits[..., :self.vocab_size]                                                 # [b, s, V]
        log_probs = F.log_softmax(logits.float(), dim=-1)
        out = []
        for row, (inputs, continuation) in enumerate(rows):
            end = len(inputs)                                  # the continuation's logits: its last positions
            window = log_probs[row, end - len(continuation):end]                   # [len(continuation), V]
            target = torch.tensor(continuation, device=window.device)
            picked = window.gather(-1, target[:, None]).squeeze(-1)
            out.append((float(picked.double().sum()), bool((window.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(lm_eval_utils.make_disjoint_window,
                                             lm_eval_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_prob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += log_prob
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        eos = self.tok_decode([self.eot_token_id])
        out = []
        for request in requests:   # one at a time: each request has its own stop sequences and length
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen_toks} must be below max_length {self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - max_gen_toks):] or [self.eot_token_id]
            sample = bool(kwargs.get("do_sample", False))
            new = generate(self.model, [ids], max_gen_toks, greedy=not sample,
                           temperature=float(kwargs.get("temperature", 1.0)) if sample else 1.0,
                           top_k=int(kwargs.get("top_k", 0) or 0), top_p=float(kwargs.get("top_p", 0.0) or 0.0),
                           eod_id=self.eot_token_id, seed=int(kwargs.get("seed", 1234)))[0]
            text = postprocess_generated_text(self.tok_decode(new), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


def main():
    """The harness's command line (lm_eval.__main__.cli_evaluate's steps) with this model registered; a bad flag is
    one `PROG: error: ... (see --help)` line as for every entry point, our bad input (checkpoint) one line too."""
    import sys
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging
    from megatron import cli
    from megatron.checkpoint.layout import CheckpointError
    try:
        setup_logging()
        harness = HarnessCLI()
        cli.one_line_errors(harness._parser, PROG)
        harness.execute(harness.parse_args())
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
