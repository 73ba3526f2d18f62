"""--sequence-parallel (Megatron-LM's sequence parallelism: mpu/mappings.py's sequence pairs, mpu/layers.py,
mpu/transformer.py, GPT2Model).

What is asserted, in one launch of 2 processes (every variant in sequence):
- the three sequence mappings' forward and backward against tensors computed by hand;
- with embedding and hidden dropout (0.2), 10 SGD steps of GPT-2 at mp 2 with sequence parallelism == mp 1 == mp 2
  without (losses, first gradients and every weight, gathered to full size, within 1e-6 relative, fp32): each rank
  keeps its slice of the whole sequence's mask, drawn from the default generator (mpu.replicated_mask_dropout);
- with attention dropout too, mp 2 with sequence parallelism == mp 2 without (attention dropout draws from the
  per-rank stream for the rank's heads, as in Megatron-LM, so neither equals mp 1 then);
- the LayerNorms' (and the row-parallel biases') gradients are identical on the two tensor-parallel ranks, and
  equal the mp 1 gradients (each rank sums its sequence slice's partial gradient over the group);
- full and selective recomputation with sequence parallelism and dropout are bitwise the plain sequence-parallel
  run (the masks are replayed), and each rank's embedding-dropout mask is its slice of the whole sequence's;
- ZeRO stages 0, 2 and 3 at mp 2 with sequence parallelism and dropout == the ZeRO-0 run without sequence
  parallelism (the LayerNorm sums happen inside autograd, before ZeRO's gradient hooks).
- the activation bytes one rank's layers keep for backward (measured as test_recompute.py does, fp32, dropout on)
  equal memory.activation_bytes_saved with the sequence-parallel layout at mp 2, for no recomputation, selective
  and full: the replicated part is divided by 2.
- pretrain_gpt.py at pp 2 x mp 2 (a second launch, 4 processes), on the Megatron path, on ZeRO-1 and on the Llama
  shape (rotary: the second stage's tables cover the whole sequence): with sequence parallelism (the stages pass
  their sequence slices) the losses of 10 steps equal the run without (1e-6 relative, dropout 0.1 everywhere);
  and the Llama shape's second stage called with position_ids left out (its input a [b, s/2, h] slice) builds the
  rotary tables of the whole sequence: losses equal those with 0..s-1 given.
- a tiny Llama shape (SwiGLU, RMSNorm, rotary, GQA 2 of 4 heads, no biases, untied head) at mp 2: with sequence
  parallelism (and with it and full recomputation) its 10 SGD losses and RMSNorm gradients equal the run without;
- the command line: --sequence-parallel at mp 1 is one line.
"""
import pytest
import torch
import torch.distributed as dist

import mpu
from megatron.spawn import run_distributed
from megatron.guards import memory
from tests.helpers import (gathered_model_parallel, max_relative_difference, parser_error, TINY,
                           train_each)
from tests.model.test_recompute import _saved_activation_bytes

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB, STEPS, LR = 2, 32, 4, 16, 2, 64, 10, 0.5
TOLERANCE = 1e-6
REPLICATED_SP = ("layernorm", "dense.bias", "dense_4h_to_h.bias")   # summed over the group under SP


# ---- the mappings against hand-computed tensors --------------------------------------------------------------

def _mappings_case():
    """At mp 2, s = 4: rank r holds x_r = (r + 1) * arange; what each mapping gives forward and backward."""
    rank = mpu.get_model_parallel_rank()
    out = {}
    full = torch.arange(8.0).view(1, 4, 2)                                  # [b=1, s=4, h=2]: the same on both
    x = full.clone().requires_grad_()
    y = mpu.scatter_to_sequence_parallel_region(x)                         # [1, 2, 2]: positions 2r, 2r+1
    (y * (rank + 1)).sum().backward()
    out["scatter"] = (y.detach(), x.grad)
    piece = ((rank + 1) * torch.arange(4.0)).view(1, 2, 2).requires_grad_()
    gathered = mpu.gather_from_sequence_parallel_region(piece)             # [1, 4, 2]
    (gathered * torch.arange(8.0).view(1, 4, 2) * (rank + 1)).sum().backward()
    out["gather"] = (gathered.detach(), piece.grad)
    piece2 = ((rank + 1) * torch.arange(4.0)).view(1, 2, 2).requires_grad_()
    gathered2 = mpu.gather_from_sequence_parallel_region(piece2, tensor_parallel_output_grad=False)
    (gathered2 * torch.arange(8.0).view(1, 4, 2)).sum().backward()
    out["gather, replicated consumer"] = piece2.grad
    partial = ((rank + 1) * torch.arange(8.0)).view(1, 4, 2).requires_grad_()
    reduced = mpu.reduce_scatter_to_sequence_parallel_region(partial)      # [1, 2, 2]
    (reduced * (rank + 1)).sum().backward()
    out["reduce-scatter"] = (reduced.detach(), partial.grad)
    return out


# ---- GPT-2 runs ------------------------------------------------------------------------------------------------



def _config(sequence_parallel, dropout=0.0, recompute=None, lora=None, attention_dropout=None):
    """attention_dropout: `dropout` unless given."""
    from megatron.model.gpt2_model import GPT2ModelConfig
    attention_dropout = dropout if attention_dropout is None else attention_dropout
    return GPT2ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                           max_sequence_length=SEQ, embedding_dropout=dropout, attention_dropout=attention_dropout,
                           hidden_dropout=dropout, sequence_parallel=sequence_parallel, recompute=recompute,
                           lora=lora)


# LoRA on all four linears with adapter dropout: its masks are drawn over the whole sequence from the default
# generator and cut to each rank's positions, so LoRA runs are equal with and without sequence parallelism.
LORA = mpu.LoRAConfig(rank=4, alpha=8, dropout=0.1, targets=("qkv", "dense", "fc1", "fc2"))


def _hidden_dropout_config(sequence_parallel):
    """Embedding and hidden dropout 0.2, no attention dropout: the masks are then the same at mp 1 and mp 2."""
    return _config(sequence_parallel, dropout=0.2, attention_dropout=0.0)


def _tokens(step):
    generator = torch.Generator().manual_seed(100 + step)          # the same batch on every rank
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].to(mpu.get_device()), tokens[:, 1:].to(mpu.get_device())


def _build(config):
    from megatron.model.gpt2_model import GPT2Model
    mpu.model_parallel_cuda_manual_seed(1234)                      # the same full-size weights at any mp
    return GPT2Model(config)


def _sgd_run(config):
    """STEPS SGD steps: losses, the first step's gradients (full size), the final weights (full size), and the
    first step's LayerNorm/bias gradients as this rank holds them."""
    model = _build(config)
    mpu.model_parallel_cuda_manual_seed(99)
    losses, first_grads, local = [], None, None
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss = model(*_tokens(step)[:1], labels=_tokens(step)[1]).mean()
        loss.backward()
        losses.append(float(loss))
        if step == 0:
            first_grads = gathered_model_parallel(_Trainable(model), grads=True)
            local = {n: p.grad.clone() for n, p in model.named_parameters() if any(k in n for k in REPLICATED_SP)
                     and p.grad is not None}
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
    return {"losses": losses, "grads": first_grads, "weights": gathered_model_parallel(model), "local": local}


class _Trainable(torch.nn.Module):
    """named_parameters() of `model`'s trainable parameters only (LoRA freezes the rest)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def named_parameters(self, *args, **kwargs):
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]


def _zero_run(config, stage):
    """STEPS steps of the ZeRO engine at mp 2 and dp 1: losses and final weights. Adam with eps = 1 (its update
    ~ lr * m for these gradients, ~1e-3): with the default eps its update is ~lr * sign(gradient), which turns
    the last-bit differences of near-zero gradient elements into differences of lr (measured 3e-4 relative)."""
    from megatron import zero
    model = _build(config)
    ds_config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.5, "eps": 1.0}},
                 "zero_optimization": {"stage": stage}}
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu,
                                 dist_init_required=False)
    mpu.model_parallel_cuda_manual_seed(99)
    losses = []
    for step in range(STEPS):
        tokens, labels = _tokens(step)
        loss = engine(tokens, labels=labels).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    with zero.GatheredParameters(list(model.parameters())):
        weights = gathered_model_parallel(model)
    return {"losses": losses, "weights": weights}


def _dropout_run(config):
    """Three steps with dropout: losses and first-step gradients (local), for the recomputation comparison."""
    model = _build(config)
    model.train()
    mpu.model_parallel_cuda_manual_seed(99)
    losses, grads = [], []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        tokens, labels = _tokens(step)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    return {"losses": losses, "grads": grads}


def _embedding_dropout_mask(sequence_parallel):
    """This rank's embedding-dropout output on ones: where its mask drops (its slice with sequence parallelism)."""
    model = _build(_config(sequence_parallel, dropout=0.5))
    mpu.model_parallel_cuda_manual_seed(99)
    words = []
    model.word_embeddings.register_forward_hook(lambda module, inputs, output: torch.ones_like(output))
    model.position_embeddings.register_forward_hook(lambda module, inputs, output: torch.zeros_like(output))
    model.transformer.layers[0].register_forward_pre_hook(lambda module, inputs: words.append(inputs[0].detach()))
    model(*_tokens(0)[:1], labels=_tokens(0)[1])
    return words[0]


MEASURE_LAYERS, MEASURE_SEQ, MEASURE_BATCH, MEASURE_DROPOUT = 2, 64, 2, 0.2
MEASURE_MODES = {"none": mpu.RecomputeConfig(), "selective": mpu.RecomputeConfig("selective"),
                 "full uniform 1": mpu.RecomputeConfig("full", "uniform", 1)}


def _measured_activation_bytes():
    """Bytes the sequence-parallel stack keeps for backward for one forward of this rank's slice, per mode."""
    mpu.model_parallel_cuda_manual_seed(1234)
    stack = mpu.ParallelTransformer(MEASURE_LAYERS, HIDDEN, HEADS, MEASURE_DROPOUT, MEASURE_DROPOUT,
                                    final_layernorm=False, sequence_parallel=True)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(MEASURE_BATCH, MEASURE_SEQ // mpu.get_model_parallel_world_size(), HIDDEN, generator=generator)
    measured = {}
    for name, config in MEASURE_MODES.items():
        stack.recompute = config
        measured[name] = _saved_activation_bytes(stack, x.to(mpu.get_device()))
    return measured


def _eval_and_decode(sequence_parallel):
    """Evaluation logits (gathered over the vocabulary) of the whole sequence, and a decoding pass through the KV
    cache (which runs without sequence parallelism) one token at a time."""
    model = _build(_config(sequence_parallel))
    model.eval()
    model.parallel_output = False
    tokens = _tokens(0)[0]
    with torch.no_grad():
        logits = model(tokens)                                         # [b, s, V]
        odd = model(tokens[:, :SEQ - 1])                               # 15 positions: run without
        cache = model.new_inference_cache()
        steps = [model(tokens[:, i:i + 1], inference_cache=cache) for i in range(4)]
    return {"logits": logits, "decoded": torch.cat(steps, dim=1), "odd length": odd}


def _reward_gradients(sequence_parallel):
    """A reward model's rewards [b, s] and the gradients (full size) of their sum: its head gathers the slices with
    a backward that only cuts (the head is replicated)."""
    import dataclasses
    model = _build(dataclasses.replace(_config(sequence_parallel), reward_head=True))
    rewards = model(_tokens(0)[0])
    (rewards * torch.linspace(0.5, 1.5, SEQ)).sum().backward()     # not summing to 0 (the final LN bias)
    return {"rewards": rewards.detach(), "grads": gathered_model_parallel(model, grads=True)}


def _llama_config(sequence_parallel, recompute=None):
    """A tiny Llama shape: SwiGLU, RMSNorm, rotary (no position table), GQA (2 key/value heads for 4), no biases,
    an untied output layer."""
    import dataclasses
    return dataclasses.replace(_config(sequence_parallel, recompute=recompute), num_key_value_heads=2, swiglu=True,
                               ffn_hidden_size=48, normalization="rmsnorm", add_bias_linear=False,
                               learned_position_embeddings=False, rotary=True,
                               untie_embeddings_and_output_weights=True)


def _llama_run(config):
    """STEPS SGD steps of the Llama shape: losses, and the first step's norm gradients as this rank holds them."""
    model = _build(config)
    mpu.model_parallel_cuda_manual_seed(99)
    losses, norms = [], None
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        tokens, labels = _tokens(step)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        losses.append(float(loss))
        if step == 0:
            norms = {n: p.grad.clone() for n, p in model.named_parameters() if "layernorm" in n}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    return {"losses": losses, "norms": norms}


COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")


def _backward_collectives(config):
    """(name, element count) of each collective one backward of GPT-2 runs, in order (forward not counted)."""
    model = _build(config)
    loss = model(*_tokens(0)[:1], labels=_tokens(0)[1]).mean()
    calls, originals = [], {name: getattr(dist, name) for name in COUNTED}

    def counting(name):
        def collective(*args, **kwargs):
            calls.append((name, args[0].numel() if torch.is_tensor(args[0]) else sum(t.numel() for t in args[0])))
            return originals[name](*args, **kwargs)
        return collective
    try:
        for name in COUNTED:
            setattr(dist, name, counting(name))
        loss.backward()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return calls


def _worker(zero_stages):
    from megatron.zero import checkpointing  # noqa: F401  (imported: the engine registers with it)
    results = {"mappings": _mappings_case(), "mp2": _sgd_run(_hidden_dropout_config(False)),
               "backward collectives sp": _backward_collectives(_config(True)),
               "mp2 sp": _sgd_run(_hidden_dropout_config(True))}
    results["dropout mp2"] = _sgd_run(_config(False, dropout=0.2))
    results["dropout mp2 sp"] = _sgd_run(_config(True, dropout=0.2))
    results["lora mp2"] = _sgd_run(_config(False, lora=LORA))
    results["lora mp2 sp"] = _sgd_run(_config(True, lora=LORA))
    results["llama mp2"] = _llama_run(_llama_config(False))
    results["llama mp2 sp"] = _llama_run(_llama_config(True))
    results["llama mp2 sp, full recompute"] = _llama_run(_llama_config(True, mpu.RecomputeConfig("full", "uniform", 1)))
    results["dropout sp"] = _dropout_run(_config(True, dropout=0.2))
    for mode, config in (("full", mpu.RecomputeConfig("full", "uniform", 1)),
                         ("selective", mpu.RecomputeConfig("selective"))):
        results[f"dropout sp, {mode} recompute"] = _dropout_run(_config(True, dropout=0.2, recompute=config))
    results["dropout mask"] = _embedding_dropout_mask(True)
    results["dropout mask, whole sequence"] = _embedding_dropout_mask(False)
    results["saved bytes"] = _measured_activation_bytes()
    results["eval"] = _eval_and_decode(False)
    results["eval sp"] = _eval_and_decode(True)
    results["reward"] = _reward_gradients(False)
    results["reward sp"] = _reward_gradients(True)
    for stage in zero_stages:
        results[f"zero {stage} sp"] = _zero_run(_config(True, dropout=0.2), stage)
    results["zero reference"] = _zero_run(_config(False, dropout=0.2), 0) if zero_stages else None
    # mp 1 on the same processes (data parallel 2: each rank computes the same whole model)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1)
    results["mp1"] = _sgd_run(_hidden_dropout_config(False))
    return results


ZERO_STAGES = (0, 2, 3)


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 2, args=(ZERO_STAGES,), model_parallel_size=2)


def test_scatter_keeps_my_slice_and_gathers_the_gradient(ranks):
    full = torch.arange(8.0).view(1, 4, 2)
    for rank, result in enumerate(ranks):
        out, grad = result["mappings"]["scatter"]
        assert torch.equal(out, full[:, 2 * rank:2 * rank + 2])
        # backward all-gathers: rank r's gradient slice is (r + 1) on its positions, the other rank's elsewhere
        assert torch.equal(grad, torch.tensor([1.0, 1, 2, 2]).view(1, 4, 1).expand(1, 4, 2))


def test_backward_sums_each_layers_replicated_gradients_in_one_all_reduce(ranks):
    """Per layer, both LayerNorms' weights and biases and the two row-parallel biases (6h elements) are summed in
    one all-reduce, not six; the final LayerNorm's two are summed alone (outside the layers). The sequence
    gathers and reduce-scatters are the single-tensor collectives (no list collectives)."""
    calls = ranks[0]["backward collectives sp"]
    all_reduces = sorted(numel for name, numel in calls if name == "all_reduce")
    assert all_reduces.count(6 * HIDDEN) == LAYERS and all_reduces.count(HIDDEN) == 2, all_reduces
    assert len([numel for numel in all_reduces if numel <= 6 * HIDDEN]) == LAYERS + 2, all_reduces
    assert not {name for name, _ in calls} & {"all_gather", "reduce_scatter"}, calls
    assert {name for name, _ in calls} >= {"all_gather_into_tensor", "reduce_scatter_tensor"}, calls
    assert calls == ranks[1]["backward collectives sp"]


def test_gather_concatenates_and_reduce_scatters_the_gradient(ranks):
    pieces = [(r + 1) * torch.arange(4.0).view(1, 2, 2) for r in range(2)]
    weights = torch.arange(8.0).view(1, 4, 2)
    for rank, result in enumerate(ranks):
        out, grad = result["mappings"]["gather"]
        assert torch.equal(out, torch.cat(pieces, dim=1))
        # each rank's gradient of the gathered tensor is weights * (r + 1); summed: 3 * weights, my positions
        assert torch.equal(grad, 3 * weights[:, 2 * rank:2 * rank + 2])
        # into a replicated consumer the gradient is whole on each rank: only cut
        assert torch.equal(result["mappings"]["gather, replicated consumer"], weights[:, 2 * rank:2 * rank + 2])


def test_reduce_scatter_sums_my_slice_and_gathers_the_gradient(ranks):
    total = 3 * torch.arange(8.0).view(1, 4, 2)                         # rank 0's 1x plus rank 1's 2x
    for rank, result in enumerate(ranks):
        out, grad = result["mappings"]["reduce-scatter"]
        assert torch.equal(out, total[:, 2 * rank:2 * rank + 2])
        assert torch.equal(grad, torch.tensor([1.0, 1, 2, 2]).view(1, 4, 1).expand(1, 4, 2))


@pytest.mark.parametrize("run", ["mp2", "mp2 sp"])
def test_mp2_with_and_without_sequence_parallel_equal_mp1(ranks, run):
    for rank, result in enumerate(ranks):
        reference = result["mp1"]
        assert max_relative_difference(result[run]["losses"], reference["losses"]) < TOLERANCE, (rank, run)
        assert max_relative_difference(result[run]["grads"], reference["grads"]) < TOLERANCE, (rank, run)
        assert max_relative_difference(result[run]["weights"], reference["weights"]) < TOLERANCE, (rank, run)
    assert len(set(ranks[0]["mp1"]["losses"])) == STEPS                 # the steps change the loss


def test_sequence_parallel_equals_plain_mp2(ranks):
    for result in ranks:
        assert max_relative_difference(result["mp2 sp"]["weights"], result["mp2"]["weights"]) < TOLERANCE


def test_with_attention_dropout_sequence_parallel_equals_plain_mp2(ranks):
    for rank, result in enumerate(ranks):
        got, reference = result["dropout mp2 sp"], result["dropout mp2"]
        for key in ("losses", "grads", "weights"):
            assert max_relative_difference(got[key], reference[key]) < TOLERANCE, (rank, key)
        # attention dropout really acts: the run differs from the one without it
        assert max_relative_difference(reference["losses"], result["mp2"]["losses"]) > 100 * TOLERANCE, rank


def test_lora_with_sequence_parallel_equals_lora_without(ranks):
    for rank, result in enumerate(ranks):
        got, reference = result["lora mp2 sp"], result["lora mp2"]
        assert any("lora_A" in name for name in reference["grads"]) and all(
            "lora" in name for name in reference["grads"])
        assert max_relative_difference(got["losses"], reference["losses"]) < TOLERANCE, rank
        assert max_relative_difference(got["grads"], reference["grads"]) < TOLERANCE, rank
        assert max_relative_difference(got["weights"], reference["weights"]) < TOLERANCE, rank
        # the adapters moved: B starts at zero
        assert float(got["weights"]["transformer.layers.0.mlp.dense_4h_to_h.lora_B"].abs().max()) > 0


@pytest.mark.parametrize("run", ["llama mp2 sp", "llama mp2 sp, full recompute"])
def test_llama_shape_with_sequence_parallel_equals_it_without(ranks, run):
    """SwiGLU, RMSNorm (its weight's gradient summed over the group), rotary tables of the whole sequence, GQA on
    the gathered sequence, no biases, the untied head on the gathered hidden states; full recomputation's chunks
    carry the rotary tables and the sequence-parallel flag."""
    for rank, result in enumerate(ranks):
        got, reference = result[run], result["llama mp2"]
        assert max_relative_difference(got["losses"], reference["losses"]) < TOLERANCE, (rank, run)
        assert len(got["norms"]) == 2 * LAYERS + 1                     # RMSNorm: weights only
        assert max_relative_difference(list(got["norms"].values()), list(reference["norms"].values())) < \
            TOLERANCE, (rank, run)
    assert len(set(ranks[0]["llama mp2"]["losses"])) == STEPS


def test_evaluation_and_decoding_of_a_sequence_parallel_model(ranks):
    """Evaluation runs sequence-parallel (gathered before the head), decoding with the KV cache and a length the
    model-parallel size does not divide without it: all give the plain model's logits, and the cached decoding the
    full forward's first positions."""
    for rank, result in enumerate(ranks):
        plain, got = result["eval"], result["eval sp"]
        assert got["logits"].shape == (BATCH, SEQ, VOCAB)
        assert max_relative_difference([got["logits"]], [plain["logits"]]) < TOLERANCE, rank
        assert max_relative_difference([got["decoded"]], [plain["decoded"]]) < TOLERANCE, rank
        assert max_relative_difference([got["odd length"]], [plain["odd length"]]) < TOLERANCE, rank
        assert max_relative_difference([got["decoded"]], [got["logits"][:, :4]]) < 1e-5, rank


def test_reward_model_with_sequence_parallel_equals_it_without(ranks):
    for rank, result in enumerate(ranks):
        got, reference = result["reward sp"], result["reward"]
        assert got["rewards"].shape == (BATCH, SEQ)
        assert max_relative_difference([got["rewards"]], [reference["rewards"]]) < TOLERANCE, rank
        assert max_relative_difference(got["grads"], reference["grads"]) < TOLERANCE, rank


def test_layernorm_and_bias_gradients_identical_across_the_group(ranks):
    local = [result["mp2 sp"]["local"] for result in ranks]
    names = sorted(local[0])
    assert len(names) == 4 * LAYERS + 2 + 2 * LAYERS                  # 2 LayerNorms x (w, b) per layer, final LN,
    for name in names:                                                # the two row-parallel biases per layer
        assert torch.equal(local[0][name], local[1][name]), name
        full = ranks[0]["mp1"]["grads"][name]
        assert max_relative_difference([local[0][name]], [full]) < TOLERANCE, name


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dropout_recompute_is_bitwise_the_plain_sequence_parallel_run(ranks, mode):
    for rank, result in enumerate(ranks):
        plain, recomputed = result["dropout sp"], result[f"dropout sp, {mode} recompute"]
        assert all(torch.equal(a, b) for a, b in zip(plain["losses"], recomputed["losses"])), rank
        for g, ref in zip(recomputed["grads"], plain["grads"]):
            assert all(torch.equal(g[key], ref[key]) for key in ref), rank


def test_each_ranks_dropout_mask_is_its_slice_of_the_whole_sequences(ranks):
    masks = [result["dropout mask"] for result in ranks]
    whole = ranks[0]["dropout mask, whole sequence"]
    assert masks[0].shape == (BATCH, SEQ // 2, HIDDEN) and whole.shape == (BATCH, SEQ, HIDDEN)
    for rank, mask in enumerate(masks):
        assert torch.equal(mask, whole[:, rank * SEQ // 2:(rank + 1) * SEQ // 2]), rank
        assert torch.equal(ranks[rank]["dropout mask, whole sequence"], whole)
    assert not torch.equal(masks[0] == 0, masks[1] == 0)
    assert 0.3 < float((whole == 0).float().mean()) < 0.7


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_zero_with_sequence_parallel_equals_the_plain_run(ranks, stage):
    for rank, result in enumerate(ranks):
        got, reference = result[f"zero {stage} sp"], result["zero reference"]
        assert max_relative_difference(got["losses"], reference["losses"]) < TOLERANCE, (rank, stage)
        assert max_relative_difference(got["weights"], reference["weights"]) < TOLERANCE, (rank, stage)


def test_saved_activation_bytes_match_the_sequence_parallel_formula(ranks):
    layout = memory.ActivationLayout.for_run("cpu", 4, MEASURE_DROPOUT, MEASURE_DROPOUT, sequence_parallel=True)
    plain = memory.ActivationLayout.for_run("cpu", 4, MEASURE_DROPOUT, MEASURE_DROPOUT)
    shape = (MEASURE_LAYERS, MEASURE_SEQ, MEASURE_BATCH, HIDDEN, HEADS, 2)
    for rank, result in enumerate(ranks):
        for mode, measured in result["saved bytes"].items():
            formula = memory.activation_bytes_saved(*shape, MEASURE_MODES[mode], layout)
            assert measured == formula, (rank, mode, measured, formula)
            assert formula < memory.activation_bytes_saved(*shape, MEASURE_MODES[mode], plain), mode
    sbh = MEASURE_SEQ * MEASURE_BATCH * HIDDEN * 4
    assert ranks[0]["saved bytes"]["full uniform 1"] == MEASURE_LAYERS * sbh // 2      # each input a slice


PIPELINE = TINY + ["--model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--batch-size", "2", "--global-batch-size", "4"]


# the Llama shape on the Megatron path: the second stage builds rotary tables for the whole sequence from its
# [b, s/p, h] input (a later stage has no input_ids to count positions from)
PIPELINED_LLAMA = ["--swiglu", "--ffn-hidden-size", "48", "--num-key-value-heads", "2",
                   "--use-rotary-position-embeddings", "--no-position-embedding", "--normalization", "rmsnorm",
                   "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


@pytest.fixture(scope="module")
def pipelined_losses(tmp_path_factory):
    """pp 2 x mp 2 on the Megatron path, on ZeRO-1 and on the Llama shape, each without and with
    --sequence-parallel."""
    config = tmp_path_factory.mktemp("zero1") / "ds_config.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, '
                      '"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}')
    zero1 = ["--deepspeed", "--deepspeed_config", str(config)]
    argv = [PIPELINE + path + sp for path in ([], zero1, PIPELINED_LLAMA) for sp in ([], ["--sequence-parallel"])]
    histories = run_distributed(train_each, 4, args=(argv,))
    losses = [history["lm loss"] for history in histories[-1]]        # the last stage's
    return {"megatron": losses[:2], "zero1": losses[2:4], "llama": losses[4:]}


@pytest.mark.parametrize("path", ["megatron", "zero1", "llama"])
def test_pipelined_sequence_parallel_equals_the_plain_pipeline(pipelined_losses, path):
    plain, sequence_parallel = pipelined_losses[path]
    assert len(plain) == 10 and len(set(plain)) == 10
    assert max_relative_difference(sequence_parallel, plain) < TOLERANCE


def _later_stage_positions():
    """pp 2 x mp 2, the Llama shape with sequence parallelism, on the second stage only: its per-token losses on
    a [b, s/2, h] slice of fixed hidden states with position_ids left out (the model counts them from its input)
    and with the whole sequence's positions 0..s-1 given. None on the first stage."""
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2, 2)
    if mpu.is_pipeline_first_stage():
        return None
    model = _build(_llama_config(True)).eval()
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))     # [b, s, h]
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    rank = mpu.get_model_parallel_rank()
    losses = {}
    with torch.no_grad():
        for name, positions in (("counted", None), ("given", torch.arange(SEQ).expand(BATCH, SEQ))):
            model.set_input_tensor(hidden.chunk(2, dim=1)[rank].clone())                      # [b, s/2, h]
            losses[name] = model(None, positions, labels=labels)
    return losses


def test_a_later_stage_counts_the_whole_sequences_positions_under_sequence_parallelism():
    """Its input is a sequence slice, but its rotary tables are the whole sequence's: the losses with the positions
    left out equal those with 0..s-1 given (pretrain_gpt.py always gives them, so its runs above cannot tell)."""
    results = run_distributed(_later_stage_positions, 4, model_parallel_size=2)
    assert results[:2] == [None, None]
    for result in results[2:]:
        assert result["given"].shape == (BATCH, SEQ) and torch.equal(result["counted"], result["given"])


# ---- the command line ----------------------------------------------------------------------------------------

def test_sequence_parallel_needs_model_parallel(capsys):
    from megatron.arguments import parse_args
    line = parser_error(lambda argv: parse_args(args_list=argv), ["--mock-data", "--sequence-parallel"], capsys)
    assert ("--sequence-parallel splits the sequence across the tensor-parallel group: it needs "
                         "--model-parallel-size > 1") in line
