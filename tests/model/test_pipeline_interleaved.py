"""Interleaved pipeline (--num-layers-per-virtual-pipeline-stage) on gloo processes, L = 8 layers, 8 micro-batches a
step (fp32, dropout off): pp4 x v2 (Megatron path) and pp2 x v2 (ZeRO-1) equal one process within 1e-6 (losses
every step, validation losses, every final weight), the tied embedding copies bitwise equal after every step;
each stage holds Megatron-LM's layers; the pp4 x v2 checkpoint loads at pp1 and at pp2 x v1 bitwise (weights as
saved, the next loss identical), and the pp2 x v2 ZeRO-1 one at pp2 x v1 (same P, other layers per stage:
resharded by name) and at pp2 x v2 (the engine's own loader); pp2 x v2 x mp2 with sequence parallelism and torch
DDP equals one process. The schedule itself, as data and on two processes: test_pipeline_schedule.py; bad flags:
test_pipeline.py."""
import json
import os

import pytest
import torch

from megatron.checkpoint.reshard import SavedCheckpoint
from megatron.spawn import run_distributed
from tests.checkpoint.test_reshard import _with
from tests.helpers import set_tracker
from tests.model.test_pipeline import PIPELINE, TOLERANCE, _check_tied_copies, _relative, _train_recording_embeddings

EIGHT_LAYERS = _with(PIPELINE, {"--num-layers": "8", "--train-iters": "3", "--global-batch-size": "16"}) + [
    "--batch-size", "2",                                # 16 / (2 x dp1) = 8 micro-batches: P = 4 has a steady state
    "--distributed-timeout-minutes", "1",               # a schedule bug that mismatches collectives fails in a minute
    "--eval-iters", "1", "--eval-interval", "2"]        # evaluation: the interleaved schedule's forwards only
INTERLEAVED = ["--num-layers-per-virtual-pipeline-stage"]


def _train_recording_loaded_weights(args_list):
    """Train; return the losses, the stage, and this stage's parameters as the first forward saw them (as
    loaded), by their global names."""
    import mpu
    import pretrain_gpt
    from megatron.training import pretrain
    from megatron.utils import unwrap_model
    first = {}

    def forward_step(data_iterator, model):
        if not first:
            first.update({n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()})
        return pretrain_gpt.forward_step(data_iterator, model)
    history = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, forward_step,
                       args_list=args_list)
    return {"losses": history["lm loss"], "stage": mpu.get_pipeline_model_parallel_rank(), "weights": first}


def _merged(results):
    """Every stage's weights by global name (the last stage's LM-head copy checked bitwise the first's)."""
    merged = {}
    for result in results:
        for name, tensor in result["weights"].items():
            assert name not in merged or torch.equal(merged[name], tensor), name
            merged[name] = tensor
    return merged


def _layers_of(result):
    return sorted({int(name.split(".")[2]) for name in result["weights"] if name.startswith("transformer.layers.")})


def _saved_weights(directory):
    """The Megatron-path checkpoint's stages merged by name."""
    merged = {}
    for rank_dir in sorted(os.listdir(directory)):
        if rank_dir.startswith("mp_rank_"):
            merged.update(torch.load(os.path.join(directory, rank_dir, "model_optim_rng.pt"),
                                     weights_only=True)["model"])
    return merged


def _assert_equals_reference(results, reference):
    assert _relative(results[0]["losses"], reference["losses"]) <= TOLERANCE
    assert len(reference["valid"]) == 1 and _relative(results[0]["valid"], reference["valid"]) <= TOLERANCE
    merged = _merged(results)
    assert sorted(merged) == sorted(reference["weights"])
    for name, tensor in reference["weights"].items():
        assert (merged[name] - tensor).abs().max().item() <= TOLERANCE * max(1.0, tensor.abs().max().item()), name


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_train_recording_embeddings, 1, args=(EIGHT_LAYERS, True))[0]


@pytest.fixture(scope="module")
def zero1_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
                                "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}))
    return ["--deepspeed", "--deepspeed_config", str(path)]


def test_pp4_v2_megatron_equals_single_process_and_loads_at_pp1_and_pp2(reference, tmp_path):
    """pp4 x v2: stage r holds layers r and r + 4 (chunk c of stage r: layer c P + r); its iteration-2 checkpoint
    continues at pp1 and at pp2 x v1 from bitwise the saved weights, with iteration 3's loss identical."""
    save = str(tmp_path / "pp4v2")
    results = run_distributed(_train_recording_embeddings, 4, args=(EIGHT_LAYERS + [
        "--pipeline-model-parallel-size", "4"] + INTERLEAVED + ["1", "--save", save, "--save-interval", "2"], True))
    assert [r["stage"] for r in results] == [0, 1, 2, 3]
    assert [_layers_of(r) for r in results] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    _assert_equals_reference(results, reference)
    _check_tied_copies(results, stages=4, forwards=3 * 8 * 2)   # 3 steps x 8 micro-batches x 2 chunks on stage 0
    assert SavedCheckpoint(save, "iter_0000002").describe() == "mp1 x pp4 x v2 (megatron)"
    saved = _saved_weights(os.path.join(save, "iter_0000002"))
    set_tracker(save, 2)
    for world_size, extra in ((1, []), (2, ["--pipeline-model-parallel-size", "2"])):
        loaded = run_distributed(_train_recording_loaded_weights, world_size, args=(EIGHT_LAYERS + extra + [
            "--load", save],))
        assert [_layers_of(r) for r in loaded] == ([list(range(8))] if world_size == 1 else [[0, 1, 2, 3],
                                                                                               [4, 5, 6, 7]])
        weights = _merged(loaded)
        assert sorted(weights) == sorted(saved)
        for name, tensor in saved.items():
            assert torch.equal(weights[name], tensor), name
        assert loaded[0]["losses"] == results[0]["losses"][2:], world_size


def test_pp2_v2_zero1_equals_single_process_and_loads_at_pp2_v1(reference, zero1_config, tmp_path):
    """ZeRO-1 x pp2 x v2 (stage 0: layers 0-1 and 4-5): equal to one process; its checkpoint loads at pp2 without
    interleaving, where stage 0 holds layers 0-3 (the same P: resharded by name, not the stage files as they are)."""
    save = str(tmp_path / "pp2v2")
    pipeline = ["--pipeline-model-parallel-size", "2"]
    results = run_distributed(_train_recording_embeddings, 2, args=(EIGHT_LAYERS + pipeline + INTERLEAVED + [
        "2", "--save", save, "--save-interval", "2"] + zero1_config, True))
    assert [_layers_of(r) for r in results] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    _assert_equals_reference(results, reference)
    _check_tied_copies(results, forwards=3 * 8 * 2)
    set_tracker(save, 2)
    for chunks, layers in ((None, [[0, 1, 2, 3], [4, 5, 6, 7]]), ("2", [[0, 1, 4, 5], [2, 3, 6, 7]])):
        extra = [] if chunks is None else INTERLEAVED + [chunks]    # v2 again: the engine's own loader
        loaded = run_distributed(_train_recording_loaded_weights, 2, args=(EIGHT_LAYERS + pipeline + zero1_config + [
            "--load", save] + extra,))
        assert [_layers_of(r) for r in loaded] == layers
        assert loaded[0]["losses"] == results[0]["losses"][2:]


def test_pp2_v2_times_mp2_sequence_parallel_torch_ddp_equals_single_process(reference):
    """Interleaving with tensor parallelism (sequence-parallel slices between chunks) and torch DDP (run under
    no_sync, reduced after the step's last backward): the losses within 1e-6 of one process."""
    results = run_distributed(_train_recording_embeddings, 4, args=(EIGHT_LAYERS + [
        "--pipeline-model-parallel-size", "2"] + INTERLEAVED + ["2"] + [
        "--model-parallel-size", "2", "--sequence-parallel", "--DDP-impl", "torch"],))
    assert _relative(results[0]["losses"], reference["losses"]) <= TOLERANCE
    assert _relative(results[0]["valid"], reference["valid"]) <= TOLERANCE
    _check_tied_copies(results, forwards=3 * 8 * 2)


def test_pp2_v2_full_recompute_groups_each_chunks_own_layers(reference):
    """Full recomputation in uniform groups of 2 layers: each model chunk (2 layers here) is its own group, never
    layers of the stage's other chunk; recomputation changes no number (dropout off), so the losses, the validation
    loss and every weight equal one process without it."""
    results = run_distributed(_train_recording_embeddings, 2, args=(EIGHT_LAYERS + [
        "--pipeline-model-parallel-size", "2"] + INTERLEAVED + ["2", "--recompute-granularity", "full",
                                                                "--recompute-method", "uniform",
                                                                "--recompute-num-layers", "2"], True))
    assert [_layers_of(r) for r in results] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    _assert_equals_reference(results, reference)
