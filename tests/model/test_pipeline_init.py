"""A pipeline stage builds only its own layers (and the embeddings on the first stage, the final LayerNorm and the
LM-head word embedding on the last) and holds bitwise the weights of the same slice of the single-process model
built from the same seed, at P = 2 and P = 4 (L = 4: one layer a stage), at model-parallel size 1 and 2, with
LoRA adapters too; the default generator ends where the whole model's build leaves it. Stages are built in one
process per model-parallel rank, the pipeline rank faked (the stage a model builds is read from mpu at build)."""
import dataclasses
from unittest import mock

import pytest
import torch

from megatron.spawn import run_distributed

HIDDEN, LAYERS = 32, 4
CONFIG = dict(num_layers=LAYERS, vocab_size=64, hidden_size=HIDDEN, num_attention_heads=4, max_sequence_length=16)
SEED = 1234
LAYER_NUMEL = 12 * HIDDEN ** 2 + 13 * HIDDEN    # 2 LayerNorms 4h, q/k/v 3h^2 + 3h, dense + h->4h + 4h->h 9h^2 + 6h


def _build(config, stages=1, stage=0, chunks=None):
    """(model, elements of every parameter registered while building, the default generator's state after);
    `chunks`: model chunks per stage (interleaved)."""
    import mpu
    from megatron.model import GPT2Model
    built = [0]

    def count(module, name, param):
        built[0] += param.numel() if param is not None else 0
    mpu.model_parallel_cuda_manual_seed(SEED)
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(count)
    try:
        with mock.patch.object(mpu, "get_pipeline_model_parallel_world_size", lambda: stages), \
                mock.patch.object(mpu, "get_pipeline_model_parallel_rank", lambda: stage), \
                mock.patch.object(mpu, "get_virtual_pipeline_model_parallel_world_size", lambda: chunks):
            model = GPT2Model(config)
    finally:
        handle.remove()
    return model, built[0], torch.get_rng_state()


def _stages_against_whole(stage_counts, lora):
    """On this model-parallel rank: for every P and stage, what the stage holds and how it differs from the whole."""
    import mpu
    from megatron.model import GPT2ModelConfig
    config = GPT2ModelConfig(**CONFIG)
    if lora:
        config = dataclasses.replace(config, lora=mpu.LoRAConfig(rank=2, zero_init_b=False))
    whole, _, whole_rng = _build(config)
    reference = whole.state_dict()
    found = {}
    for stages in stage_counts:
        for stage in range(stages):
            model, built, rng = _build(config, stages, stage)
            state = model.state_dict()
            found[stages, stage] = {
                "keys": sorted(state),
                "layers": [number for number, _ in model.transformer.numbered_layers()],
                "numel": sum(p.numel() for p in model.parameters()),
                "built": built,
                "differ": [k for k, v in state.items() if not torch.equal(v, reference[k])],
                "rng_differs": not torch.equal(rng, whole_rng)}
    return {"whole_keys": sorted(reference), "found": found}


def _expected_keys(whole_keys, stages, stage):
    """The whole model's keys a stage holds: its layers', the embeddings on the first, final LayerNorm and word
    embedding on the last."""
    per_stage = LAYERS // stages
    layers = {f"transformer.layers.{i}." for i in range(stage * per_stage, (stage + 1) * per_stage)}
    first, last = stage == 0, stage == stages - 1

    def held(key):
        if key.startswith("transformer.layers."):
            return any(key.startswith(prefix) for prefix in layers)
        if key.startswith("word_embeddings."):
            return first or last
        if key.startswith("position_embeddings."):
            return first
        return last   # transformer.final_layernorm
    return sorted(k for k in whole_keys if held(k))


@pytest.mark.parametrize("world_size,lora", [(1, False), (2, False), (1, True)], ids=["mp1", "mp2", "mp1-lora"])
def test_each_stage_holds_only_its_slice_of_the_whole_model_bitwise(world_size, lora):
    results = run_distributed(_stages_against_whole, world_size, args=((2, 4), lora), model_parallel_size=world_size)
    for result in results:
        for (stages, stage), found in result["found"].items():
            where = f"P={stages} stage {stage}"
            per_stage = LAYERS // stages
            assert found["layers"] == list(range(stage * per_stage, (stage + 1) * per_stage)), where
            assert found["keys"] == _expected_keys(result["whole_keys"], stages, stage), where
            assert found["differ"] == [], f"{where}: not the whole model's {found['differ']}"
            assert not found["rng_differs"], f"{where}: the generator does not end where the whole model's does"
            assert found["built"] == found["numel"], f"{where}: built {found['built']} elements, holds {found['numel']}"
            if world_size == 1 and not lora:   # hand count: the layers, [V, h] and [max_seq, h] embeddings, 2h
                embeddings = 64 * HIDDEN * (stage in (0, stages - 1)) + 16 * HIDDEN * (stage == 0)
                assert found["numel"] == per_stage * LAYER_NUMEL + embeddings + 2 * HIDDEN * (stage == stages - 1)


def _interleaved_stages_against_whole():
    """P = 2, v = 2: each stage's layer numbers, state-dict layers, keys differing from the whole model's, whether
    the generator ends elsewhere, and built vs held elements."""
    from megatron.model import GPT2ModelConfig
    config = GPT2ModelConfig(**CONFIG)
    whole, _, whole_rng = _build(config)
    reference = whole.state_dict()
    found = []
    for stage in range(2):
        model, built, rng = _build(config, 2, stage, chunks=2)
        state = model.state_dict()
        found.append({"layers": [number for number, _ in model.transformer.numbered_layers()],
                      "keys": sorted({int(k.split(".")[2]) for k in state if k.startswith("transformer.layers.")}),
                      "differ": [k for k, v in state.items() if not torch.equal(v, reference[k])],
                      "rng_differs": not torch.equal(rng, whole_rng),
                      "built_minus_held": built - sum(p.numel() for p in model.parameters())})
    return found


def test_interleaved_stage_holds_its_chunks_layers_of_the_whole_model_bitwise():
    """P = 2, v = 2, L = 4: stage 0 holds layers 0 and 2, stage 1 layers 1 and 3 (chunk c of stage r: layer
    c P + r), each bitwise the whole model's (the draws of the layers between chunks skipped), the generator ending
    where the whole model's does."""
    found = run_distributed(_interleaved_stages_against_whole, 1, model_parallel_size=1)[0]
    for stage, layers in ((0, [0, 2]), (1, [1, 3])):
        assert found[stage] == {"layers": layers, "keys": layers, "differ": [], "rng_differs": False,
                                "built_minus_held": 0}, stage


def test_skip_init_draws_advances_the_generator_as_the_draws_would():
    from mpu.transformer import skip_init_draws
    shapes = [(3, 17), (40, 8), (5,)]       # a tail under 16 elements, a multiple of 16, a short one
    torch.manual_seed(7)
    for shape in shapes:
        torch.empty(shape).normal_(mean=0.0, std=0.02)
    expected = torch.randn(10)
    torch.manual_seed(7)
    skip_init_draws(shapes, torch.device("cpu"))
    assert torch.equal(torch.randn(10), expected)
