"""GPT-2 on top of mpu's parallel transformer: embeddings, the stack, an LM head tied to the word embedding,
and the vocabulary-parallel loss.

    model = GPT2Model(GPT2ModelConfig(num_layers=12, vocab_size=50304, hidden_size=768, num_attention_heads=12,
                                      max_sequence_length=1024))
    model = GPT2Model(num_tokentypes=0, parallel_output=True)   # the seed's call: the config from the arguments

Parameter layout per model-parallel rank (p ranks, padded vocabulary V, hidden h):
    word_embeddings.weight        [V/p, h]   (also the LM head: logits_r = hidden @ W_r^T)
    position_embeddings.weight    [max_seq, h] replicated
    transformer.layers[i]...      see mpu/transformer.py

LoRA (config.lora): transformer.layers[i]...{query_key_value,dense,dense_h_to_4h,dense_4h_to_h}.lora_{A,B} are
the only trainable parameters (mpu/lora.py).

Pipeline parallelism (P stages, mpu.initialize_model_parallel(mp, P)): each stage holds L/P layers under their
global numbers; the first stage also the embeddings, the last the final LayerNorm, the loss and its own copy of
the word embedding as the LM head, initialized identically and kept identical by summing the two copies'
gradients over mpu.get_embedding_group() after backward (parameters marked `pipeline_tied`; the last stage's
copy is also marked `shared`, so the global gradient norm counts it once). A stage builds nothing else; the
weights it does not hold are drawn into a scratch buffer and dropped (mpu.random.skip_init_draws), so its
weights are bitwise the single-stage model's of the same seed. Names stay the single-stage model's:

    P = 2, L = 4:  stage 0: word_embeddings, position_embeddings, transformer.layers.{0,1}
                   stage 1: transformer.layers.{2,3}, transformer.final_layernorm, word_embeddings (LM head)

Interleaved pipeline (v model chunks per stage, mpu's virtual pipeline size; Megatron-LM's
--num-layers-per-virtual-pipeline-stage): one module per stage still, holding its v chunks' layers under their
global numbers (mpu.pipeline_layer_ranges); forward runs the chunk mpu.get_virtual_pipeline_model_parallel_rank()
names (the schedule sets it): the embeddings before chunk 0 of stage 0, the head after chunk v - 1 of stage P - 1.

    P = 2, v = 2, L = 4:  stage 0: embeddings, transformer.layers.{0,2}
                          stage 1: transformer.layers.{1,3}, final LayerNorm, LM-head copy

Llama-family options (docs/models.md; Megatron-DeepSpeed's flags): rotary embeddings instead of (or besides) the
learned position table, SwiGLU, RMSNorm, grouped-query attention, no biases, another MLP width, and an untied output
layer `output_layer.weight` [V/p, h] (vocabulary-parallel like the word embedding; on the last stage only; not in a
reward model, which scores with `score`).

Context parallelism (mpu.get_context_parallel_world_size() = C > 1, --context-parallel-size): input_ids, labels
and position_ids hold this rank's 2 chunks of the sequence, [b, s/C] (mpu/context_parallel.py's layout; left out,
position_ids are those chunks' global positions, so learned and rotary positions are the whole sequence's);
attention runs ring-style over the context-parallel group, everything else per token; the per-token losses are
this rank's [b, s/C] (megatron/data/context_parallel.py averages them over the whole sequence).

A stage before the last returns its hidden states [b, s, h]; a stage after the first reads its input from
set_input_tensor() (the pipeline schedule sets both).

Sequence parallelism (config.sequence_parallel, --sequence-parallel, Megatron-LM's): the embedding sum is cut into
this rank's sequence slice [b, s/p, h] (backward: all-gathered, so the embeddings' gradients are whole) and
dropped out there under the model-parallel RNG stream; the stack runs on slices (mpu/transformer.py) through the
final LayerNorm, and the slices are all-gathered before the LM head (backward: reduce-scatter) or the reward head
(backward: this rank's slice). Generation (an inference_cache) and a sequence length the model-parallel size does
not divide run without it: the same weights, whole sequences.
"""
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

import mpu
from mpu.random import skip_init_draws
from megatron.model.hf_interchange import REWARD_HEAD
from megatron.model.moe_args import moe_config_from_args
from megatron.zero import GatheredParameters, register_external_parameter


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
    """The older spelling of recompute=RecomputeConfig("full", "uniform", checkpoint_num_layers) (give one)."""
    checkpoint_num_layers: int = 1
    """Layers per checkpointed chunk with checkpoint_activations."""
    recompute: Optional[mpu.RecomputeConfig] = None
    """--recompute-*: what backward recomputes instead of keeping (mpu/recompute.py); None: checkpoint_activations
    decides."""
    init_method_std: float = 0.02
    """Std of the normal init; the projections into the residual stream use std / sqrt(2 num_layers)."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    real_vocab_size: Optional[int] = None
    """The tokenizer's vocabulary; word-embedding rows from it to vocab_size are padding (None: no padding), out of
    the loss's softmax (so the loss does not depend on the padding) and never generated."""
    fused_compute: bool = False
    """--torch-compile: the layers and the loss run mpu/fused.py's compiled pieces (the same math)."""
    lora: Optional[mpu.LoRAConfig] = None
    """--lora-*: LoRA adapters on the layers' linears, every other parameter frozen (mpu/lora.py); None: no LoRA."""
    num_key_value_heads: Optional[int] = None
    """--num-key-value-heads: grouped-query attention's key/value heads (None: one per query head)."""
    ffn_hidden_size: Optional[int] = None
    """--ffn-hidden-size: the MLP's inner width (None: 4 x hidden_size)."""
    swiglu: bool = False
    """--swiglu: the MLP is down(silu(gate(x)) * up(x)) (gate and up column-parallel, split alike)."""
    normalization: str = "layernorm"
    """--normalization: 'layernorm' or 'rmsnorm' (eps: layernorm_epsilon)."""
    add_bias_linear: bool = True
    """False with --disable-bias-linear: no biases on the attention and MLP linears."""
    learned_position_embeddings: bool = True
    """False with --no-position-embedding: no position table (use rotary embeddings)."""
    rotary: bool = False
    """--use-rotary-position-embeddings: rotate q and k per head (mpu/rotary.py, HF Llama's rotate-half)."""
    rotary_theta: float = 10000.0
    """--rotary-position-embeddings-theta: the rotary base."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: the LM head is its own vocabulary-parallel output_layer."""
    sequence_parallel: bool = False
    """--sequence-parallel: the LayerNorm, dropout and residual regions hold a slice of the sequence per
    model-parallel rank (see the module docstring); the same parameters and results as without."""
    moe: Optional[mpu.MoEConfig] = None
    """--num-experts and the --moe-* flags: mixture-of-experts MLPs (mpu/moe.py); None: dense MLPs."""
    reward_head: bool = False
    """A reward model (train_reward_model.py): a scalar head `score` (Linear(h, 1) without bias, HF
    GPT2ForSequenceClassification's) on the final LayerNorm's output instead of the LM head; forward returns one
    reward per token [b, s]. Trainable with LoRA too; a checkpoint without it (an LM's) leaves it at its init."""

    @classmethod
    def from_args(cls, args):
        """The config of Megatron's command line (after validation: args.padded_vocab_size is set)."""
        return cls(num_layers=args.num_layers, vocab_size=args.padded_vocab_size, hidden_size=args.hidden_size,
                   num_attention_heads=args.num_attention_heads, max_sequence_length=args.max_position_embeddings,
                   embedding_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                   hidden_dropout=args.hidden_dropout, recompute=recompute_config_from_args(args),
                   init_method_std=args.init_method_std,
                   layernorm_epsilon=args.layernorm_epsilon, real_vocab_size=args.real_vocab_size,
                   fused_compute=args.torch_compile, lora=lora_config_from_args(args),
                   num_key_value_heads=args.num_key_value_heads, ffn_hidden_size=args.ffn_hidden_size,
                   swiglu=args.swiglu, normalization=args.normalization, add_bias_linear=not args.disable_bias_linear,
                   learned_position_embeddings=not args.no_position_embedding,
                   rotary=args.use_rotary_position_embeddings, rotary_theta=args.rotary_position_embeddings_theta,
                   untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                   sequence_parallel=args.sequence_parallel, moe=moe_config_from_args(args))

    @property
    def architecture(self):
        """The transformer layers' options (mpu.Architecture)."""
        return mpu.Architecture(num_key_value_heads=self.num_key_value_heads, ffn_hidden_size=self.ffn_hidden_size,
                                swiglu=self.swiglu, normalization=self.normalization,
                                add_bias_linear=self.add_bias_linear, moe=self.moe)

    @property
    def num_experts(self):
        """Experts per MoE layer (None: dense), as checkpoints record it (layout.ARCHITECTURE_DEFAULTS)."""
        return self.moe.num_experts if self.moe is not None else None

    @property
    def moe_router_topk(self):
        return self.moe.topk if self.moe is not None else None

    @property
    def tied_head(self):
        """The LM head is the word embedding (GPT-2)."""
        return not self.untie_embeddings_and_output_weights


def recompute_config_from_args(args):
    """The mpu.RecomputeConfig of --recompute-granularity/--recompute-method/--recompute-num-layers, which
    validation fills from --checkpoint-activations/--checkpoint-num-layers too (megatron/arguments.py)."""
    return mpu.RecomputeConfig(args.recompute_granularity, args.recompute_method, args.recompute_num_layers)


def lora_config_from_args(args):
    """The mpu.LoRAConfig of --lora-rank/--lora-alpha/--lora-dropout/--lora-targets (validated), or None at rank 0."""
    if not args.lora_rank:
        return None
    return mpu.LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                          targets=tuple(args.lora_targets))


def activation_checkpointing_pair():
    """(checkpoint function, RNG tracker): zero.checkpointing's when it has been configured, else mpu's.
    Asked once, when the model is built."""
    from megatron.zero import checkpointing
    if checkpointing.is_configured():
        return checkpointing.checkpoint, checkpointing.get_cuda_rng_tracker()
    return mpu.checkpoint, mpu.get_cuda_rng_tracker()


class TiedLMHead(nn.Module):
    """logits_r = hidden @ W_r^T with the word embedding W (no parameters of its own: a module so that ZeRO-3 can
    gather W around this use)."""

    def forward(self, hidden, word_embedding_weight, matmul=None, sequence_parallel=False):
        """matmul: x -> x @ word_embedding_weight^T in a decoding layout (on CPU: InferenceCache.head_matmul).
        sequence_parallel: hidden is this rank's sequence slice [b, s/p, h], all-gathered here."""
        hidden_parallel = mpu.gather_from_sequence_parallel_region(hidden) if sequence_parallel else \
            mpu.copy_to_model_parallel_region(hidden)
        if matmul is not None:
            return matmul(hidden_parallel)
        return torch.nn.functional.linear(hidden_parallel, word_embedding_weight)


def fresh_parameters(param_names, saved_names):
    """The parameters among `param_names` that loading a checkpoint holding `saved_names` leaves at their
    initialization: LoRA adapters into a base model (mpu.fresh_adapters), the reward head from an LM checkpoint."""
    fresh = set(mpu.fresh_adapters(param_names, saved_names))
    if REWARD_HEAD in param_names and REWARD_HEAD not in saved_names:
        fresh.add(REWARD_HEAD)
    return fresh


def _keep_fresh_adapters(module, state_dict, prefix, *args):
    """load_state_dict of a checkpoint without LoRA adapters (a base model's) keeps the model's fresh adapters,
    and of one without a reward head (an LM's) the fresh head; an LM's untied output layer, which a reward model
    does not build, is left out."""
    if getattr(module, "score", None) is not None:
        state_dict.pop(prefix + "output_layer.weight", None)
    names = [name for name, _ in module.named_parameters()]
    saved = [key[len(prefix):] for key in state_dict if key.startswith(prefix)]
    params = dict(module.named_parameters())
    for name in fresh_parameters(names, saved):
        state_dict[prefix + name] = params[name].detach()


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
        stages, stage = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
        if config.num_layers % stages:
            raise ValueError(f"num_layers ({config.num_layers}) is not divisible by the pipeline size ({stages})")
        self.num_chunks = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
        self.pre_process, self.post_process = stage == 0, stage == stages - 1
        self.input_tensor = None
        # A stage builds only what it holds; what it does not hold it still draws, into a scratch buffer, in the
        # whole model's order (word, position, layers), so that its weights are the whole model's.
        init_method = mpu.init_method_normal(config.init_method_std)
        self.word_embeddings = None
        if self.pre_process or (self.post_process and config.tied_head):
            self.word_embeddings = mpu.VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                              init_method=init_method)
        else:
            skip_init_draws([(config.vocab_size, config.hidden_size)], mpu.get_device())
        self.position_embeddings = None
        if config.learned_position_embeddings and self.pre_process:
            self.position_embeddings = nn.Embedding(config.max_sequence_length, config.hidden_size,
                                                    device=mpu.get_device())
            with GatheredParameters(self.position_embeddings.weight, modifier_rank=0):   # whole under zero.Init
                init_method(self.position_embeddings.weight)
        elif config.learned_position_embeddings:   # nn.Embedding's own normal_ init, then init_method's
            skip_init_draws([(config.max_sequence_length, config.hidden_size)] * 2, mpu.get_device())
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        if self.word_embeddings is not None and stages > 1 and config.tied_head:
            self.word_embeddings.weight.pipeline_tied = True
            self.word_embeddings.weight.shared = not self.pre_process   # the LM-head copy: not counted twice
        checkpoint_function, rng_tracker = activation_checkpointing_pair()
        self.transformer = mpu.ParallelTransformer(
            config.num_layers, config.hidden_size, config.num_attention_heads, config.attention_dropout,
            config.hidden_dropout, checkpoint_activations=config.checkpoint_activations,
            checkpoint_num_layers=config.checkpoint_num_layers, recompute=config.recompute,
            layernorm_epsilon=config.layernorm_epsilon,
            init_method_std=config.init_method_std, checkpoint_function=checkpoint_function,
            rng_tracker=rng_tracker,
            layer_ranges=mpu.pipeline_layer_ranges(config.num_layers, stages, stage, self.num_chunks),
            final_layernorm=self.post_process, fused=config.fused_compute, architecture=config.architecture,
            sequence_parallel=config.sequence_parallel)
        self.output_layer = None
        if not config.tied_head:   # drawn after the layers, before LoRA and the reward head
            if self.post_process and not config.reward_head:
                self.output_layer = mpu.VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                               init_method=init_method)   # [V/p, h], rows split
            else:   # another stage's, or a reward model's (it scores with `score`, never with an LM head)
                skip_init_draws([(config.vocab_size, config.hidden_size)], mpu.get_device())

        self.lm_head = TiedLMHead() if self.post_process and not config.reward_head else None
        if self.lm_head is not None:   # ZeRO-3 gathers the head's weight (the word embedding's, tied) around it too
            register_external_parameter(self.lm_head, (self.word_embeddings if config.tied_head
                                                       else self.output_layer).weight)
        if config.lora is not None:
            if config.fused_compute:
                raise ValueError("LoRA runs the eager layers: drop --torch-compile (fused_compute) or --lora-rank")
            mpu.add_lora(self.transformer, config.lora)   # drawn after every base weight: those are unchanged
            mpu.mark_only_lora_as_trainable(self)
            self.register_load_state_dict_pre_hook(_keep_fresh_adapters)   # a base checkpoint loads into it
        self.score = None
        if config.reward_head and self.post_process:   # drawn last: every other weight is the LM's of this seed
            self.score = nn.Linear(config.hidden_size, 1, bias=False, device=mpu.get_device())  # replicated
            with GatheredParameters(self.score.weight, modifier_rank=0):
                init_method(self.score.weight)
            self.score.weight.requires_grad_(True)   # trained with LoRA too
            if config.lora is None:
                self.register_load_state_dict_pre_hook(_keep_fresh_adapters)   # an LM checkpoint loads into it

    def fresh_parameters(self, saved_names):
        """Our parameter names that a checkpoint holding `saved_names` leaves at their initialization."""
        return fresh_parameters([name for name, _ in self.named_parameters()], saved_names)

    def set_input_tensor(self, input_tensor):
        """The hidden states [b, s, h] the previous pipeline stage sent (the next forward's input)."""
        self.input_tensor = input_tensor

    def new_inference_cache(self, capacity=None):
        """An empty KV cache of `capacity` positions (default: the position table) to pass as
        forward(..., inference_cache=cache) step after step; its buffers are allocated once, at the first step."""
        return self.transformer.new_inference_cache(capacity or self.config.max_sequence_length)

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, inference_cache=None,
                last_logits_only=False):
        """input_ids, position_ids, labels: [b, s]; attention_mask: None (causal) or bool [b|1, 1, s, t]
        (t = cached + s positions).

        position_ids=None: cached length + 0..s-1 (0..s-1 without a cache); a decoding loop passes slices of
        ids it built once (generation: per-row positions of left-padded prompts). inference_cache (from
        new_inference_cache()): incremental decoding; this call's keys/values are written into it.
        Returns per-token losses [b, s] when labels are given, else logits [b, s, V/p] (parallel_output) or
        [b, s, V] (gathered); with last_logits_only those of the last position, [b, 1, V/p] or [b, 1, V] (what
        generation needs: a prompt of s tokens costs one LM-head row, not s).
        """
        if not (self.pre_process and self.post_process) and (labels is None or inference_cache is not None):
            raise RuntimeError("logits and generation need the whole model on one stage: run with "
                               "--pipeline-model-parallel-size 1 (a pipelined checkpoint loads there)")
        if inference_cache is not None and mpu.get_context_parallel_world_size() > 1:
            raise RuntimeError("generation runs whole sequences: use --context-parallel-size 1 (a checkpoint "
                               "trained with context parallelism loads there)")
        chunk = mpu.get_virtual_pipeline_model_parallel_rank() or 0         # interleaved: the chunk to run
        pre_process = self.pre_process and chunk == 0                      # this chunk embeds the tokens
        post_process = self.post_process and chunk == self.num_chunks - 1  # this chunk ends in the head
        # sequence parallelism for this call: not while decoding, nor for a length the model-parallel size does not
        # divide (an evaluation window's tail: the same weights on whole sequences); a later stage gets slices
        sequence_parallel = self.config.sequence_parallel and inference_cache is None and (
            not pre_process or input_ids.size(1) % mpu.get_model_parallel_world_size() == 0)
        if position_ids is None and (pre_process or self.config.rotary):
            # the whole sequence's positions (attention, and so rotary, runs on whole sequences); a later stage's
            # input is [b, s/p, h] with sequence parallelism
            if input_ids is not None:
                batch, length = input_ids.shape
            else:
                batch, length = self.input_tensor.shape[:2]
                if sequence_parallel:
                    length *= mpu.get_model_parallel_world_size()
            device = input_ids.device if input_ids is not None else self.input_tensor.device
            start = inference_cache.sequence_length if inference_cache is not None else 0
            if mpu.get_context_parallel_world_size() > 1:   # this rank's chunks i and 2C-1-i of the sequence
                position_ids = mpu.context_parallel_positions(length, batch, device)
            else:
                position_ids = torch.arange(start, start + length, device=device)
                position_ids = position_ids.unsqueeze(0).expand(batch, length)
        if pre_process:
            hidden = self.word_embeddings(input_ids)                          # [b, s, h]
            if self.position_embeddings is not None:
                hidden = hidden + self.position_embeddings(position_ids)      # [b, s, h]
            if sequence_parallel:
                hidden = mpu.scatter_to_sequence_parallel_region(hidden)     # [b, s/p, h]
                hidden = mpu.replicated_mask_dropout(hidden, self.embedding_dropout.p,      # its slice of the
                                                     self.embedding_dropout.training, sequence_slice=True)  # mask
            else:
                hidden = self.embedding_dropout(hidden)
        else:
            hidden = self.input_tensor                                        # [b, s, h] from the previous stage
        rotary = None
        if self.config.rotary:   # [b, 1, s, d] each, of the whole sequence, shared by every layer
            rotary = mpu.rotary_tables(position_ids, self.config.hidden_size // self.config.num_attention_heads,
                                       self.config.rotary_theta, hidden.dtype)
        hidden = self.transformer(hidden, attention_mask, inference_cache=inference_cache, rotary=rotary,
                                  sequence_parallel=sequence_parallel, chunk=chunk)  # [b, s, h] or [b, s/p, h]
        if not post_process:
            return hidden
        if self.score is not None:
            if labels is not None or inference_cache is not None:
                raise RuntimeError("a reward model (reward_head) returns rewards: no labels, no generation")
            if sequence_parallel:
                hidden = mpu.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            return self.score(hidden).squeeze(-1)                            # [b, s]
        if last_logits_only:
            if sequence_parallel:
                # the head's copy sums the gradient over the group: the gather's backward only cuts it
                hidden = mpu.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
                sequence_parallel = False
            hidden = hidden[:, -1:]                                           # [b, 1, h]
        head_weight = self.word_embeddings.weight if self.config.tied_head else self.output_layer.weight
        matmul = None if inference_cache is None else inference_cache.head_matmul(
            head_weight, hidden.size(0) * hidden.size(1))
        logits_parallel = self.lm_head(hidden, head_weight, matmul,
                                       sequence_parallel=sequence_parallel)   # [b, s, V/p]
        if labels is not None:
            return mpu.vocab_parallel_cross_entropy(logits_parallel, labels, fused=self.config.fused_compute,
                                                    real_vocab_size=self.config.real_vocab_size,
                                                    vocab_size=self.config.vocab_size)
        if self.parallel_output:
            return logits_parallel
        return mpu.gather_from_model_parallel_region(logits_parallel)

