"""The model-parallel MLP (`ParallelMLP`): a column-parallel linear in, GELU or SwiGLU, a row-parallel linear
out, one all-reduce (with sequence parallelism an all-gather before and a reduce-scatter after). A layer with
experts has mpu/moe.py's MoEMLP instead (ParallelTransformerLayer picks it from the Architecture)."""
import torch.nn.functional as F
from torch import nn

from .architecture import GPT2_ARCHITECTURE, hidden_dropout
from .layers import ColumnParallelLinear, RowParallelLinear


class ParallelMLP(nn.Module):
    """GELU (tanh) MLP h -> f -> h (f = ffn_hidden_size, 4h by default), or with `swiglu` down(silu(gate) * up):
    dense_h_to_4h is then the fused [gate; up] master [2f, h] at stride 2 (rank r: [gate_r; up_r])."""

    def __init__(self, hidden_size, output_dropout_prob, init_method, output_layer_init_method,
                 architecture=GPT2_ARCHITECTURE):
        super().__init__()
        ffn = architecture.ffn_size(hidden_size)
        self.swiglu = architecture.swiglu
        self.dense_h_to_4h = ColumnParallelLinear(hidden_size, 2 * ffn if self.swiglu else ffn, gather_output=False,
                                                  init_method=init_method, stride=2 if self.swiglu else 1,
                                                  bias=architecture.add_bias_linear)
        self.dense_4h_to_h = RowParallelLinear(ffn, hidden_size, input_is_parallel=True,
                                               init_method=output_layer_init_method,
                                               bias=architecture.add_bias_linear)
        self.dropout = nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states, layer_past=None, sequence_parallel=False):
        """layer_past: decoding (a LayerPast): only for its weight layouts. sequence_parallel: hidden_states and
        the output are this rank's sequence slice [b, s/p, h]."""
        weight_t = None if layer_past is None else layer_past.weight_t(self.dense_h_to_4h.weight)
        projected = self.dense_h_to_4h(hidden_states, weight_t=weight_t,
                                       sequence_parallel=sequence_parallel)                # [b, s, f/p or 2f/p]
        if self.swiglu:
            gate, up = projected.chunk(2, dim=-1)                                          # 2 x [b, s, f/p]
            intermediate = F.silu(gate) * up
        else:
            intermediate = F.gelu(projected, approximate="tanh")                           # [b, s, f/p]
        output = self.dense_4h_to_h(intermediate, sequence_parallel=sequence_parallel)   # [b, s, h] or [b, s/p, h]
        return hidden_dropout(self.dropout, output, sequence_parallel)
