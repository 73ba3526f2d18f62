"""Checkpoints exchanged with real DeepSpeed 0.19.8 (issue 25, items 2 and 3), at data-parallel 2, stages 1-3.

DeepSpeed-written: our tools/zero_to_fp32.py gives exactly what DeepSpeed's own consolidation gives; our engine's
load_checkpoint + 5 steps equals DeepSpeed's own continuation (1e-5); the --load path (megatron.checkpoint.
load_checkpoint) reads a GPT2Model checkpoint with the client state Megatron-DeepSpeed writes (iteration, args with
the consumed samples, RNG states) at the same and at another model-parallel size; our engine at data-parallel 1
resumes a data-parallel-2 one.
Ours: DeepSpeed's get_fp32_state_dict_from_zero_checkpoint gives exactly what our zero_to_fp32.py gives, and
DeepSpeed's engine.load_checkpoint + 5 steps equals our own resume + 5 steps (1e-5).

The model has odd sizes (7 -> 13 -> 6, 1 x 13 layer norm: groups of 169 and 45 elements) so that both libraries'
padding is exercised: DeepSpeed pads a stage-1/2 group to a multiple of 2 x dp (here 172 and 48, not 170 and 46)
and every stage-3 parameter to a multiple of dp, we pad a group to a multiple of 32 x dp, so the two partitions
differ and a save re-cuts ours into DeepSpeed's."""
import argparse
import importlib.util
import os
import random

import numpy as np
import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import max_relative_difference
from tests.zero.test_deepspeed_oracle import _deepspeed, _full_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is a test requirement: pip install -r requirements-test.txt "
                                       "(DS_BUILD_OPS=0; make test does it)")

TOLERANCE = 1e-5
SAVED_AT, CONTINUED = 3, 5
STAGES = {1: {"stage": 1}, 2: {"stage": 2}, 3: {"stage": 3, "stage3_param_persistence_threshold": 0}}


class OddNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 6)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(self.norm(torch.tanh(self.fc1(x)))), y)


def _batch(step, size):
    generator = torch.Generator().manual_seed(500 + step)
    x = torch.randn(size, 7, generator=generator)
    return x, torch.sin(x[:, :6] * 2)


def _engine(library, stage, micro=None):
    model = OddNet()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-2)
    config = _full_config({"zero_optimization": STAGES[stage]})
    if micro is not None:
        config["train_micro_batch_size_per_gpu"] = micro
    return library.initialize(model=model, optimizer=optimizer, config=config)[0]


def _steps(engine, first, count):
    import torch.distributed as dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(first, first + count):
        x, y = _batch(step, 4)
        engine.backward(engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]))
        engine.step()


def _parameters(library, engine):
    parameters = list(engine.module.named_parameters())
    with library.zero.GatheredParameters([p for _, p in parameters]):
        return {name: p.detach().float().clone() for name, p in parameters}


def _megatron_deepspeed_client_state(**model_args):
    """What Megatron-DeepSpeed's save_checkpoint passes as client_state (its RNG states; counters and the model's
    shape in args)."""
    return {"iteration": SAVED_AT, "args": argparse.Namespace(consumed_train_samples=4 * SAVED_AT,
                                                              consumed_valid_samples=8, **model_args),
            "checkpoint_version": 3.0, "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": None}


def _round_trips(root, stages):
    """Per stage: DeepSpeed saves at step 3 and continues 5 steps; our engine loads that and does the same 5;
    and the other way round."""
    deepspeed = _deepspeed()
    from megatron import zero
    results = {}
    for stage in stages:
        ds_dir, our_dir = os.path.join(root, f"deepspeed{stage}"), os.path.join(root, f"ours{stage}")
        engine = _engine(deepspeed, stage)
        _steps(engine, 0, SAVED_AT)
        engine.save_checkpoint(ds_dir, client_state=_megatron_deepspeed_client_state())
        _steps(engine, SAVED_AT, CONTINUED)
        ds_continued = _parameters(deepspeed, engine)
        engine = _engine(zero, stage)
        _, client = engine.load_checkpoint(ds_dir)
        _steps(engine, SAVED_AT, CONTINUED)
        ours_from_ds = _parameters(zero, engine)

        engine = _engine(zero, stage)
        _steps(engine, 0, SAVED_AT)
        engine.save_checkpoint(our_dir, client_state={"iteration": SAVED_AT})
        _steps(engine, SAVED_AT, CONTINUED)
        ours_continued = _parameters(zero, engine)
        engine = _engine(deepspeed, stage)
        engine.load_checkpoint(our_dir)
        _steps(engine, SAVED_AT, CONTINUED)
        ds_from_ours = _parameters(deepspeed, engine)
        results[stage] = {"ds_continued": ds_continued, "ours_from_ds": ours_from_ds, "client": {
            k: client[k] for k in ("iteration", "consumed_train_samples", "consumed_valid_samples")},
            "ours_continued": ours_continued, "ds_from_ours": ds_from_ours, "ds_steps": engine.global_steps}
    return results


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("deepspeed_checkpoints"))
    return root, run_distributed(_round_trips, 2, args=(root, list(STAGES)), model_parallel_size=1,
                                 timeout=600)[0]


@pytest.mark.parametrize("stage", list(STAGES))
def test_our_engine_continues_a_deepspeed_checkpoint_as_deepspeed_does(round_trips, stage):
    result = round_trips[1][stage]
    assert result["ds_continued"].keys() == result["ours_from_ds"].keys()
    assert max_relative_difference(result["ours_from_ds"], result["ds_continued"]) <= TOLERANCE
    # Megatron-DeepSpeed's client state gives our counters (the consumed samples from its args)
    assert result["client"] == {"iteration": SAVED_AT, "consumed_train_samples": 4 * SAVED_AT,
                                "consumed_valid_samples": 8}


@pytest.mark.parametrize("stage", list(STAGES))
def test_deepspeed_continues_our_checkpoint_as_we_do(round_trips, stage):
    result = round_trips[1][stage]
    assert result["ds_steps"] == SAVED_AT + CONTINUED     # DeepSpeed took our step count
    assert max_relative_difference(result["ds_from_ours"], result["ours_continued"]) <= TOLERANCE


@pytest.mark.parametrize("stage", list(STAGES))
def test_our_engine_at_data_parallel_1_continues_a_data_parallel_2_deepspeed_checkpoint(round_trips, stage):
    """One process, the whole global batch of 4 as its micro-batch: DeepSpeed's two partitions (its stage-3
    per-parameter pieces too) re-partitioned into one."""
    from megatron import zero
    engine = _engine(zero, stage, micro=4)
    _, client = engine.load_checkpoint(os.path.join(round_trips[0], f"deepspeed{stage}"))
    assert engine.global_steps == SAVED_AT and client["iteration"] == SAVED_AT
    _steps(engine, SAVED_AT, CONTINUED)
    assert max_relative_difference(_parameters(zero, engine), round_trips[1][stage]["ds_continued"]) <= TOLERANCE


def _consolidated_both_ways(directory):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    import tools.zero_to_fp32 as ours
    theirs = get_fp32_state_dict_from_zero_checkpoint(directory)
    output = os.path.join(directory, "consolidated.pt")
    ours.consolidate(directory, output)
    return torch.load(output, weights_only=True), {name: t.contiguous() if hasattr(t, "contiguous") else t
                                                   for name, t in theirs.items()}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("writer", ["deepspeed", "ours"])
def test_zero_to_fp32_equals_deepspeeds_consolidation(round_trips, stage, writer):
    ours, theirs = _consolidated_both_ways(os.path.join(round_trips[0], f"{writer}{stage}"))
    assert ours.keys() == theirs.keys() == {"fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight",
                                            "fc2.bias"}
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


# ---- our GPT2Model, through the --load path (megatron.checkpoint.load_checkpoint) ------------------------------
GPT_CONFIG = {"gradient_clipping": 0.0,     # no clipping: see GPT_CONFIGS in test_deepspeed_oracle.py
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _gpt(library):
    from megatron.model.gpt2_model import GPT2Model, GPT2ModelConfig
    torch.manual_seed(1234)
    model = GPT2Model(GPT2ModelConfig(num_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=4,
                                      max_sequence_length=16))
    # the tied head reads wte outside its module (DeepSpeed needs to be told; ours gathers it either way)
    library.zero.register_external_parameter(model.lm_head, model.word_embeddings.weight)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "layernorm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "layernorm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-2)
    import mpu   # ours splits over mpu's data-parallel group (DeepSpeed runs at mp 1: the whole world)
    groups = {"mpu": mpu} if library.__name__ != "deepspeed" else {}
    return library.initialize(model=model, optimizer=optimizer, config=_full_config(GPT_CONFIG), **groups)[0]


def _gpt_steps(engine, first, count, data_parallel_rank, data_parallel_size):
    """Mean token loss of each step; the global batch of 4 rows of consecutive ids (mod 64) split over dp."""
    micro = 4 // data_parallel_size
    losses = []
    for step in range(first, first + count):
        starts = torch.randint(0, 64, (4, 1), generator=torch.Generator().manual_seed(step))
        ids = ((starts + torch.arange(17)) % 64)[data_parallel_rank * micro:(data_parallel_rank + 1) * micro]
        loss = engine(ids[:, :-1], labels=ids[:, 1:]).float().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _deepspeed_gpt_run(directory):
    """DeepSpeed trains our GPT2Model at dp 2 (stage 3), saves at step 3 with Megatron-DeepSpeed's client state and
    continues; the global-batch losses of the continuation."""
    import torch.distributed as dist
    deepspeed = _deepspeed()
    engine = _gpt(deepspeed)
    rank = dist.get_rank()
    _gpt_steps(engine, 0, SAVED_AT, rank, 2)
    client_state = _megatron_deepspeed_client_state(num_layers=2, hidden_size=32, num_attention_heads=4,
                                                    padded_vocab_size=64, max_position_embeddings=16)
    engine.save_checkpoint(directory, client_state=client_state)
    torch.manual_seed(99)                 # a resume must restore the saved state, not keep this one
    losses = torch.tensor(_gpt_steps(engine, SAVED_AT, CONTINUED, rank, 2))
    dist.all_reduce(losses)
    return (losses / 2).tolist(), client_state["torch_rng_state"]


def _our_gpt_resume(directory):
    """Our engine (ZeRO-3) loads DeepSpeed's checkpoint through megatron.checkpoint.load_checkpoint (what --load
    runs) at this run's topology and continues: (train state, global-batch losses)."""
    import torch.distributed as dist
    import mpu
    from megatron import zero
    from megatron.checkpoint import load_checkpoint
    from megatron.train_state import CheckpointOptions
    engine = _gpt(zero)
    state = load_checkpoint(engine, engine.optimizer, None, CheckpointOptions(load=directory))
    rng_after_load = torch.get_rng_state()
    dp_rank, dp = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    losses = torch.tensor(_gpt_steps(engine, SAVED_AT, CONTINUED, dp_rank, dp))
    dist.all_reduce(losses, group=mpu.get_data_parallel_group())
    return state, (losses / dp).tolist(), rng_after_load


@pytest.fixture(scope="module")
def deepspeed_gpt(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("deepspeed_gpt"))
    return directory, run_distributed(_deepspeed_gpt_run, 2, args=(directory,), model_parallel_size=1,
                                      timeout=600)[0]


@pytest.mark.parametrize("model_parallel_size", [1, 2])
def test_load_path_resumes_a_megatron_deepspeed_gpt_checkpoint(deepspeed_gpt, model_parallel_size):
    """DeepSpeed's files only (no tracker, tag global_step3 in `latest`, no manifest): at the saving topology
    (mp 1 x dp 2) the engine's loader, at mp 2 x dp 1 the any-topology one; both continue with DeepSpeed's
    losses (1e-5) and take the counters from Megatron-DeepSpeed's client state."""
    directory, (ds_losses, saved_rng) = deepspeed_gpt
    state, losses, rng = run_distributed(_our_gpt_resume, 2, args=(directory,),
                                         model_parallel_size=model_parallel_size, timeout=600)[0]
    assert (state.iteration, state.consumed_train_samples, state.consumed_valid_samples) == (SAVED_AT, 12, 8)
    if model_parallel_size == 1:   # the RNG states are restored at the saving model-parallel size only
        assert torch.equal(rng, saved_rng)
    assert ds_losses[-1] < ds_losses[0]
    assert max_relative_difference(losses, ds_losses) <= TOLERANCE, (losses, ds_losses)


def test_checkpoint_util_resizes_a_deepspeed_checkpoint(deepspeed_gpt, tmp_path):
    """tools/checkpoint_util.py: DeepSpeed's mp-1 stage-3 checkpoint to a Megatron-path mp-2 one whose weights
    are DeepSpeed's own consolidation, split (q, k, v rows by stride 3, columns of the row-parallel weights)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    import tools.checkpoint_util as checkpoint_util
    from megatron.checkpoint.reshard import SavedCheckpoint
    source, written = checkpoint_util.resize(deepspeed_gpt[0], str(tmp_path / "mp2"), 2, target_path="megatron",
                                             make_vocab_size_divisible_by=32)
    assert source == "mp1 x dp2 (zero-3)"
    full = get_fp32_state_dict_from_zero_checkpoint(deepspeed_gpt[0])
    resized = SavedCheckpoint(str(tmp_path / "mp2"))
    assert resized.model_parallel_size == 2 and resized.train_state().iteration == SAVED_AT
    qkv = resized.files[1][ckpt_keys().MODEL]["transformer.layers.1.attention.query_key_value.weight"]  # [3 x 16, 32]
    whole = full["transformer.layers.1.attention.query_key_value.weight"].contiguous()          # [3 x 32, 32]
    assert torch.equal(qkv, torch.cat([whole[16:32], whole[48:64], whole[80:96]]))  # rank 1: q1, k1, v1
    dense = resized.files[1][ckpt_keys().MODEL]["transformer.layers.0.attention.dense.weight"]
    assert torch.equal(dense, full["transformer.layers.0.attention.dense.weight"].contiguous()[:, 16:])
    for name, tensor in full.items():
        assert torch.equal(resized.full_tensor(name), tensor.contiguous()), name


def ckpt_keys():
    from megatron.checkpoint import layout
    return layout


def _deepspeed_part(path):
    from megatron.checkpoint.deepspeed_classes import NUMPY_GLOBALS, SAFE_GLOBALS
    with torch.serialization.safe_globals(SAFE_GLOBALS + NUMPY_GLOBALS):
        return torch.load(path, weights_only=True)


@pytest.mark.parametrize("stage", list(STAGES))
def test_our_files_hold_what_deepspeed_writes(round_trips, stage):
    """After the same 3 steps, our files' DeepSpeed keys have DeepSpeed's own layout: the same per-rank flat fp32
    partitions (lean at stages 1-2, per-parameter pieces at stage 3) and moments within 1e-5, the same paddings,
    partition counts, stage, flags, parameter shapes and world sizes."""
    from megatron.checkpoint import deepspeed_format as dsf
    root = round_trips[0]
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    ours_model = _deepspeed_part(os.path.join(root, f"ours{stage}", "global_step3", model_file))
    theirs_model = _deepspeed_part(os.path.join(root, f"deepspeed{stage}", "global_step3", model_file))
    shapes = theirs_model[dsf.PARAM_SHAPES]
    for rank in (0, 1):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        ours = _deepspeed_part(os.path.join(root, f"ours{stage}", "global_step3", name))[dsf.OPTIMIZER_STATE_DICT]
        theirs = _deepspeed_part(os.path.join(root, f"deepspeed{stage}", "global_step3", name))[dsf.OPTIMIZER_STATE_DICT]
        flats = dsf.FP32_FLAT_GROUPS if stage == 3 else dsf.SINGLE_PARTITION
        inner = dsf.INNER_OPTIMIZER_STATE if stage == 3 else dsf.BASE_OPTIMIZER_STATE
        for key in ("zero_stage", "partition_count", "dynamic_loss_scale", "overflow", "clip_grad", "group_paddings",
                    "param_alignment_paddings"):
            assert (key in ours) == (key in theirs) and ours.get(key) == theirs.get(key), (key, rank)
        assert [t.shape for t in ours[flats]] == [t.shape for t in theirs[flats]], rank
        held = _held_elements(stage, shapes, rank)
        if stage == 3:
            paddings = [_stage3_real_and_padding(flat, shapes[index], rank, 2)[1]
                        for index, flat in enumerate(ours[flats])]
            assert rank == 0 or sum(p.numel() for p in paddings) > 0, "rank 1 holds the stage-3 padding"
            assert all(torch.count_nonzero(p) == 0 for p in paddings), rank
        assert max_relative_difference(held(ours[flats]), held(theirs[flats])) <= TOLERANCE
        for group, state in theirs[inner]["state"].items():
            assert ours[inner]["state"][group].keys() == state.keys()
            for key, value in state.items():
                assert ours[inner]["state"][group][key].shape == value.shape, (group, key)
                difference = max_relative_difference(held([ours[inner]["state"][group][key]], group),
                                                     held([value], group))
                assert difference <= TOLERANCE, (group, key)
    ours, theirs = ours_model, theirs_model
    for key in (dsf.PARAM_SHAPES, dsf.BUFFER_NAMES, dsf.DP_WORLD_SIZE, dsf.MP_WORLD_SIZE, "global_steps",
                "skipped_steps", dsf.GLOBAL_SAMPLES, dsf.SHARED_PARAMS, dsf.DS_VERSION_KEY):
        assert ours[key] == theirs[key], key
    assert {n: t.shape for n, t in ours["module"].items()} == {n: t.shape for n, t in theirs["module"].items()}


def _deepspeed_gpt_with_vocabulary(directory, vocab_size):
    """DeepSpeed (stage 2, dp 2) trains our GPT2Model with the default tokenizer's vocabulary for 2 steps and
    saves with Megatron-DeepSpeed's client state."""
    import torch.distributed as dist
    from megatron.model.gpt2_model import GPT2Model, GPT2ModelConfig
    deepspeed = _deepspeed()
    torch.manual_seed(3)
    model = GPT2Model(GPT2ModelConfig(num_layers=2, vocab_size=vocab_size, hidden_size=32, num_attention_heads=4,
                                      max_sequence_length=16))
    config = _full_config({"gradient_clipping": 0.0, "zero_optimization": {"stage": 2}})
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config=config)[0]
    rank = dist.get_rank()
    for step in range(2):
        ids = torch.randint(0, vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))[2 * rank:][:2]
        engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]).float().mean())
        engine.step()
    engine.save_checkpoint(directory, client_state=_megatron_deepspeed_client_state(
        num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=vocab_size,
        max_position_embeddings=16))


def test_convert_to_hf_exports_a_deepspeed_checkpoint(tmp_path, webtext_data):
    """tools/convert_to_hf.py on DeepSpeed's checkpoint: Hugging Face's logits equal our GPT2Model's with
    DeepSpeed's own consolidated weights (1e-5)."""
    import json
    from transformers import GPT2LMHeadModel
    import tools.convert_to_hf as convert_to_hf
    vocab_size = len(json.load(open(os.path.join(webtext_data, "vocab.json"))))
    directory = str(tmp_path / "deepspeed")
    run_distributed(_deepspeed_gpt_with_vocabulary, 2, args=(directory, vocab_size), model_parallel_size=1,
                    timeout=600)
    convert_to_hf.convert(directory, str(tmp_path / "hf"), os.path.join(webtext_data, "vocab.json"),
                          os.path.join(webtext_data, "merges.txt"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(9))
    expected = run_distributed(_logits_of_consolidated, 1, args=(directory, vocab_size, tokens),
                               model_parallel_size=1)[0]
    with torch.no_grad():
        actual = hf(tokens).logits.float()
    assert max_relative_difference([actual], [expected]) <= TOLERANCE


def _logits_of_consolidated(directory, vocab_size, tokens):
    """Our GPT2Model with DeepSpeed's own consolidation of the checkpoint: its logits of `tokens`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from megatron.model.gpt2_model import GPT2Model, GPT2ModelConfig
    model = GPT2Model(GPT2ModelConfig(num_layers=2, vocab_size=vocab_size, hidden_size=32, num_attention_heads=4,
                                      max_sequence_length=16)).eval()
    model.load_state_dict({name: tensor.contiguous() for name, tensor in
                           get_fp32_state_dict_from_zero_checkpoint(directory).items()})
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)).float()


# ---- bf16 (stage 2): the fp32 masters and the bf16 weights cross both ways exactly --------------------------------
BF16_CONFIG = {"bf16": {"enabled": True}, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}


def _bf16_engine(library):
    model = OddNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return library.initialize(model=model, optimizer=optimizer, config=_full_config(BF16_CONFIG))[0]


def _bf16_exchange(root):
    """Each library trains 2 bf16 steps and saves; the other loads that and saves again at once: (the saver's
    and the re-saver's directories, and the module weights the loader holds) per writer."""
    import torch.distributed as dist
    deepspeed = _deepspeed()
    from megatron import zero
    rank = dist.get_rank()
    results = {}
    for writer, reader in ((deepspeed, zero), (zero, deepspeed)):
        name = writer.__name__.split(".")[-1]
        saved, resaved = os.path.join(root, f"bf16_{name}"), os.path.join(root, f"bf16_{name}_reread")
        engine = _bf16_engine(writer)
        for step in range(2):
            x, y = _batch(step, 4)
            engine.backward(engine(x[2 * rank:2 * rank + 2].bfloat16(), y[2 * rank:2 * rank + 2].bfloat16()))
            engine.step()
        weights = _parameters(writer, engine)
        engine.save_checkpoint(saved, tag="t")
        other = _bf16_engine(reader)
        other.load_checkpoint(saved, tag="t")
        loaded = _parameters(reader, other)
        other.save_checkpoint(resaved, tag="t")
        results[name] = (saved, resaved, weights, loaded)
    return results


@pytest.fixture(scope="module")
def bf16_exchange(tmp_path_factory):
    return run_distributed(_bf16_exchange, 2, args=(str(tmp_path_factory.mktemp("bf16")),), model_parallel_size=1,
                           timeout=600)[0]


@pytest.mark.parametrize("writer", ["deepspeed", "zero"])
def test_bf16_checkpoints_cross_exactly(bf16_exchange, writer):
    """The loader's bf16 weights equal the saver's bitwise, and its fp32 masters too (its own re-save consolidates
    to exactly what the saver's file does; DeepSpeed's consolidation of the saver's file too). DeepSpeed names a
    bf16 run's optimizer files bf16_zero_pp_rank_..., and so do we."""
    import tools.zero_to_fp32 as ours
    saved, resaved, weights, loaded = bf16_exchange[writer]
    assert weights.keys() == loaded.keys() and all(torch.equal(weights[n], loaded[n]) for n in weights)
    masters = []
    for directory in (saved, resaved):
        output = os.path.join(directory, "fp32.pt")
        ours.consolidate(directory, output, tag="t")
        masters.append(torch.load(output, weights_only=True))
    assert masters[0].keys() == masters[1].keys()
    assert all(torch.equal(masters[0][n], masters[1][n]) for n in masters[0])
    assert any(not torch.equal(masters[0][n], weights[n]) for n in weights)     # the masters are not the bf16 weights
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    theirs = get_fp32_state_dict_from_zero_checkpoint(saved, tag="t")          # DeepSpeed's consolidation agrees
    assert all(torch.equal(theirs[n].contiguous(), masters[0][n]) for n in masters[0])


def _held_elements(stage, param_shapes, rank, world=2):
    """Returns a function that keeps, of a rank's flat groups, the elements of real parameters. At stage 3 DeepSpeed
    leaves its per-parameter padding (on the last rank) uninitialised, so it is not compared; ours is asserted zero.
    Stages 1-2 compare the whole partition (both zero-fill the group padding there)."""
    def held(flat_groups, only_group=None):
        if stage != 3 or flat_groups[0].dim() == 0:    # stages 1-2; the optimizer's step count
            return flat_groups
        kept = []
        for index, flat in enumerate(flat_groups):
            real, padding = _stage3_real_and_padding(flat, param_shapes[index if only_group is None else only_group],
                                                     rank, world)
            kept.append(real)
        return kept
    return held


def _stage3_real_and_padding(flat, shapes, rank, world):
    """DeepSpeed's stage-3 flat group on one rank: each parameter's ceil(numel / world) slice in order, the part past
    the parameter's end padding (as DeepSpeed's zero_to_fp32 reads it; written out here rather than taken from
    deepspeed_format.stage3_pieces, the layout under test)."""
    real, padding, offset = [], [], 0
    for shape in shapes.values():
        per_rank = -(-shape.numel() // world)
        count = max(0, min(per_rank, shape.numel() - rank * per_rank))
        real.append(flat[offset:offset + count])
        padding.append(flat[offset + count:offset + per_rank])
        offset += per_rank
    assert offset == flat.numel(), (offset, flat.numel())
    return torch.cat(real), torch.cat(padding)
