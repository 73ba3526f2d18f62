"""GPT-2 on top of mpu's parallel transformer: embeddings, the stack, an LM head tied to the word embedding,
and the vocabulary-parallel loss.

    model = GPT2Model(GPT2ModelConfig(num_layers=12, vocab_size=50304, hidden_size=768, num_attention_heads=12,
                                      max_sequence_length=1024))
    model = GPT2Model(num_tokentypes=0, parallel_output=True)   # the seed's call: the config from the arguments

Parameter layout per model-parallel rank (p ranks, padded vocabulary V, hidden h):
    word_embeddings.weight        [V/p, h]   (also the LM head: logits_r = hidden @ W_r^T)
    position_embeddings.weight    [max_seq, h] replicated
    transformer.layers[i]...      see mpu/transformer.py
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

import mpu


@dataclass(frozen=True)
class GPT2ModelConfig:
    num_layers: int
    """Transformer layers."""
    vocab_size: int
    """Rows of the word embedding: the padded vocabulary (a multiple of make-vocab-size-divisible-by x mp)."""
    hidden_size: int
    """Width of the residual stream (h); the MLP is 4h wide."""
    num_attention_heads: int
    """Attention heads; divisible by the model-parallel size."""
    max_sequence_length: int
    """Rows of the position embedding (--max-position-embeddings)."""
    embedding_dropout: float = 0.0
    """Dropout on word + position embeddings (Megatron uses --hidden-dropout)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and MLP outputs before each residual add."""
    checkpoint_activations: bool = False
    """Recompute each chunk of checkpoint_num_layers layers in backward instead of keeping its activations."""
    checkpoint_num_layers: int = 1
    """Layers per checkpointed chunk."""
    init_method_std: float = 0.02
    """Std of the normal init; the projections into the residual stream use std / sqrt(2 num_layers)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    real_vocab_size: Optional[int] = None
    """The tokenizer's vocabulary; word-embedding rows from it to vocab_size are padding (None: no padding)."""

    @classmethod
    def from_args(cls, args):
        """The config of Megatron's command line (after validation: args.padded_vocab_size is set)."""
        return cls(num_layers=args.num_layers, vocab_size=args.padded_vocab_size, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads, max_sequence_length=args.max_position_embeddings,
                   embedding_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                   hidden_dropout=args.hidden_dropout, checkpoint_activations=args.checkpoint_activations,
                   checkpoint_num_layers=args.checkpoint_num_layers, init_method_std=args.init_method_std,
                   layernorm_epsilon=args.layernorm_epsilon, real_vocab_size=args.real_vocab_size)


def activation_checkpointing_pair():
    """(checkpoint function, RNG tracker): zero.checkpointing's when it has been configured, else mpu's.
    Asked once, when the model is built."""
    from megatron.zero import checkpointing
    if checkpointing.is_configured():
        return checkpointing.checkpoint, checkpointing.get_cuda_rng_tracker()
    return mpu.checkpoint, mpu.get_cuda_rng_tracker()


class GPT2Model(nn.Module):
    def __init__(self, config=None, num_tokentypes=0, parallel_output=True):
        super().__init__()
        if num_tokentypes != 0:
            raise ValueError(f"GPT-2 has no token types: num_tokentypes must be 0, got {num_tokentypes}")
        if config is None:  # the seed's GPT2Model(num_tokentypes=0, parallel_output=True)
            from megatron.global_vars import get_args
            config = GPT2ModelConfig.from_args(get_args())
        self.config = config
        self.parallel_output = parallel_output
        init_method = mpu.init_method_normal(config.init_method_std)
        self.word_embeddings = mpu.VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                          init_method=init_method)
        self.position_embeddings = nn.Embedding(config.max_sequence_length, config.hidden_size,
                                                device=mpu.get_device())
        init_method(self.position_embeddings.weight)
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        checkpoint_function, rng_tracker = activation_checkpointing_pair()
        self.transformer = mpu.ParallelTransformer(
            config.num_layers, config.hidden_size, config.num_attention_heads, config.attention_dropout,
            config.hidden_dropout, checkpoint_activations=config.checkpoint_activations,
            checkpoint_num_layers=config.checkpoint_num_layers, layernorm_epsilon=config.layernorm_epsilon,
            init_method_std=config.init_method_std, checkpoint_function=checkpoint_function,
            rng_tracker=rng_tracker)

    def new_inference_cache(self):
        """An empty KV cache to pass as forward(..., inference_cache=cache) step after step."""
        return self.transformer.new_inference_cache()

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, inference_cache=None):
        """input_ids, position_ids, labels: [b, s]; attention_mask: None (causal) or bool [b|1, 1, s, t]
        (t = cached + s positions).

        position_ids=None: cached length + 0..s-1 (0..s-1 without a cache). inference_cache (from
        new_inference_cache()): incremental decoding; this call's keys/values are appended to it.
        Returns per-token losses [b, s] when labels are given, else logits [b, s, V/p] (parallel_output) or
        [b, s, V] (gathered).
        """
        if position_ids is None:
            start = inference_cache.sequence_length if inference_cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.size(1), device=input_ids.device).unsqueeze(0)
            position_ids = position_ids.expand_as(input_ids)
        words = self.word_embeddings(input_ids)                               # [b, s, h]
        positions = self.position_embeddings(position_ids)                    # [b, s, h]
        hidden = self.embedding_dropout(words + positions)
        hidden = self.transformer(hidden, attention_mask, inference_cache=inference_cache)  # [b, s, h]
        hidden_parallel = mpu.copy_to_model_parallel_region(hidden)
        logits_parallel = torch.nn.functional.linear(hidden_parallel, self.word_embeddings.weight)  # [b, s, V/p]
        if labels is not None:
            return mpu.vocab_parallel_cross_entropy(logits_parallel, labels)
        if self.parallel_output:
            return logits_parallel
        return mpu.gather_from_model_parallel_region(logits_parallel)

