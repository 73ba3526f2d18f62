"""GPT-2 on top of mpu's parallel transformer: embeddings, the stack, an LM head tied to the word embedding,
and the vocabulary-parallel loss.

Parameter layout per model-parallel rank (p ranks, padded vocabulary V, hidden h):
    word_embeddings.weight        [V/p, h]   (also the LM head: logits_r = hidden @ W_r^T)
    position_embeddings.weight    [max_seq, h] replicated
    transformer.layers[i]...      see mpu/transformer.py
"""
import torch
from torch import nn

import mpu


class GPT2Model(nn.Module):
    def __init__(self, num_layers, vocab_size, hidden_size, num_attention_heads, embedding_dropout_prob,
                 attention_dropout_prob, output_dropout_prob, max_sequence_length, checkpoint_activations=False,
                 checkpoint_num_layers=1, parallel_output=True, init_method_std=0.02, layernorm_epsilon=1e-5):
        super().__init__()
        self.parallel_output = parallel_output
        init_method = mpu.init_method_normal(init_method_std)
        self.word_embeddings = mpu.VocabParallelEmbedding(vocab_size, hidden_size, init_method=init_method)
        self.position_embeddings = nn.Embedding(max_sequence_length, hidden_size, device=mpu.get_device())
        init_method(self.position_embeddings.weight)
        self.embedding_dropout = nn.Dropout(embedding_dropout_prob)
        self.transformer = mpu.ParallelTransformer(
            num_layers, hidden_size, num_attention_heads, attention_dropout_prob, output_dropout_prob,
            checkpoint_activations=checkpoint_activations, checkpoint_num_layers=checkpoint_num_layers,
            layernorm_epsilon=layernorm_epsilon, init_method_std=init_method_std)

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None):
        """input_ids, position_ids, labels: [b, s]; attention_mask: None (causal) or bool [b|1, 1, s, s].

        Returns per-token losses [b, s] when labels are given, else logits [b, s, V/p] (parallel_output) or
        [b, s, V] (gathered).
        """
        words = self.word_embeddings(input_ids)                               # [b, s, h]
        positions = self.position_embeddings(position_ids)                    # [b, s, h]
        hidden = self.embedding_dropout(words + positions)
        hidden = self.transformer(hidden, attention_mask)                     # [b, s, h]
        hidden_parallel = mpu.copy_to_model_parallel_region(hidden)
        logits_parallel = torch.nn.functional.linear(hidden_parallel, self.word_embeddings.weight)  # [b, s, V/p]
        if labels is not None:
            return mpu.vocab_parallel_cross_entropy(logits_parallel, labels)
        if self.parallel_output:
            return logits_parallel
        return mpu.gather_from_model_parallel_region(logits_parallel)


def gpt2_attention_mask_and_position_ids(batch_size, seq_length, device):
    """Plain causal GPT-2 inputs: no explicit mask (causal attention) and positions 0..s-1."""
    position_ids = torch.arange(seq_length, device=device).unsqueeze(0).expand(batch_size, seq_length)
    return None, position_ids
