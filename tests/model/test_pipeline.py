"""Pipeline parallelism (1F1B) on gloo processes: pp2, pp2 x mp2 and pp2 x dp2 equal one process step for step on
the Megatron path and the ZeRO-1 path (fp32, dropout off, 4 micro-batches per step); the tied word embedding and
its LM-head copy stay identical; so does pp4 over 3 steps, where the embedding group (first and last stage) is not
the pipeline group, and the groups themselves are pinned at P = 4; checkpoints resume exactly at pp2 (dropout on)
and a pp2 checkpoint continues at pp1, on both paths (ZeRO-1: stage-named engine files; also pp1 -> pp2 and
zero_to_fp32); inconsistent flags stop before anything is built."""
import json
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.checkpoint.test_reshard import _with
from tests.helpers import NO_DROPOUT, set_tracker, TINY

PIPELINE = TINY + NO_DROPOUT + ["--global-batch-size", "8"]
EVALUATE = ["--eval-iters", "1", "--eval-interval", "5"]   # evaluation under pipelining, in the pp2 run only
MICRO_4 = ["--batch-size", "2"]          # 8 / (2 x dp1) = 4 micro-batches per step
TOLERANCE = 1e-6


def _train_recording_embeddings(args_list, with_final_state=False):
    """Train; also return, on the first and last stage, the tied weight as every forward saw it (so after every
    step), and the losses and validation losses; `with_final_state`: also this stage's parameters after training
    (by their global names) and the global ranks of its pipeline and embedding groups (None off the embedding
    group)."""
    import torch.distributed as dist
    import mpu
    import pretrain_gpt
    from megatron.training import pretrain
    from megatron.utils import unwrap_model
    seen, modules = [], []

    def forward_step(data_iterator, model):
        module = unwrap_model(model)
        modules[:] = [module]
        if module.word_embeddings is not None:
            seen.append(module.word_embeddings.weight.detach().clone())
        return pretrain_gpt.forward_step(data_iterator, model)
    history = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, forward_step,
                       args_list=args_list)
    result = {"losses": history["lm loss"], "valid": [v["lm loss"] for v in history["valid"]],
              "stage": mpu.get_pipeline_model_parallel_rank(), "embeddings": seen}
    if with_final_state:
        embedding = mpu.get_embedding_group()
        result.update(weights={n: p.detach().clone() for n, p in modules[0].named_parameters()},
                      pipeline_group=dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()),
                      embedding_group=None if embedding is None else dist.get_process_group_ranks(embedding))
    return result


def _run(world_size, extra):
    results = run_distributed(_train_recording_embeddings, world_size, args=(PIPELINE + extra,))
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"], "ranks disagree on the logged loss"
    return results


def _relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _check_tied_copies(results, stages=2, forwards=40):
    """Every first-stage rank's word embedding equals the last-stage rank at the same tensor/data position."""
    per_stage = len(results) // stages
    for position in range(per_stage):
        first, last = results[position], results[(stages - 1) * per_stage + position]
        assert first["stage"] == 0 and last["stage"] == stages - 1
        assert len(first["embeddings"]) == len(last["embeddings"]) >= forwards   # default: 10 steps x 4 micro-batches
        for a, b in zip(first["embeddings"], last["embeddings"]):
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def reference():
    return _run(1, MICRO_4 + EVALUATE)[0]


@pytest.fixture(scope="module")
def deepspeed_config(tmp_path_factory):
    def write(micro, accumulation):
        path = tmp_path_factory.mktemp("ds") / "ds_config.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                                    "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}))
        return str(path)
    return write


@pytest.fixture(scope="module")
def saved_pp2(tmp_path_factory):
    """The pp2 Megatron-path run, saving at iterations 5 and 10 (used by the equivalence and the pp1-load test)."""
    save = str(tmp_path_factory.mktemp("pp2"))
    results = _run(2, MICRO_4 + EVALUATE + ["--pipeline-model-parallel-size", "2", "--save", save,
                                            "--save-interval", "5"])
    return save, results


def test_pp2_megatron_equals_single_process(reference, saved_pp2):
    save, results = saved_pp2
    assert len(results[0]["losses"]) == 10
    assert _relative(results[0]["losses"], reference["losses"]) <= TOLERANCE
    assert _relative(results[0]["valid"], reference["valid"]) <= TOLERANCE
    assert results[0]["losses"][-1] < results[0]["losses"][0]
    _check_tied_copies(results)
    assert sorted(os.listdir(os.path.join(save, "iter_0000005"))) == ["manifest.json", "mp_rank_00_000",
                                                                       "mp_rank_00_001"]


@pytest.mark.parametrize("extra", [
    ["--model-parallel-size", "2"] + MICRO_4,
    ["--batch-size", "1"],                  # dp2: 8 / (1 x 2) = 4 micro-batches
], ids=["pp2xmp2", "pp2xdp2"])
def test_pp2_times_tensor_or_data_parallel_megatron(reference, extra):
    results = _run(4, extra + ["--pipeline-model-parallel-size", "2"])
    assert _relative(results[0]["losses"], reference["losses"]) <= TOLERANCE
    _check_tied_copies(results)


# ---- four stages: the embedding group (first + last stage) is not the pipeline group ---------------------------
PP4 = _with(PIPELINE, {"--num-layers": "4", "--train-iters": "3"}) + MICRO_4   # one layer per stage, 3 steps


def test_pp4_megatron_equals_single_process_and_ties_over_the_embedding_group():
    """pp4 (one layer per stage): the tied embedding's gradient is summed over {stage 0, stage 3} only. At pp2 that
    group is the whole pipeline, so only P > 2 tells them apart (a sum over the pipeline group mismatches the middle
    stages' collectives: the run fails). Losses within 1e-6 relative, and every final weight within 1e-6 absolute
    (fp32), of one process; the first and last stage's copies bitwise equal after every step."""
    args = PP4 + ["--distributed-timeout-minutes", "1"]   # a mismatched collective fails in a minute
    reference = run_distributed(_train_recording_embeddings, 1, args=(args, True))[0]
    results = run_distributed(_train_recording_embeddings, 4,
                              args=(args + ["--pipeline-model-parallel-size", "4"], True))
    assert [r["stage"] for r in results] == [0, 1, 2, 3]
    for rank, result in enumerate(results):
        assert result["pipeline_group"] == [0, 1, 2, 3]
        assert result["embedding_group"] == ([0, 3] if rank in (0, 3) else None), (rank, result["embedding_group"])
    assert len(reference["losses"]) == 3 and reference["losses"][-1] < reference["losses"][0]
    assert _relative(results[0]["losses"], reference["losses"]) <= TOLERANCE
    merged = {}
    for result in results:
        for name, tensor in result["weights"].items():
            if name in merged:   # the last stage's LM-head copy: bitwise the first stage's
                assert name == "word_embeddings.weight" and torch.equal(tensor, merged[name]), name
            merged[name] = tensor
    assert sorted(merged) == sorted(reference["weights"])
    assert {n.split(".")[2] for r in results[1:3] for n in r["weights"]} == {"1", "2"}   # a layer per stage
    for name, tensor in reference["weights"].items():
        assert (merged[name] - tensor).abs().max().item() <= 1e-6, (name, (merged[name] - tensor).abs().max())
    _check_tied_copies(results, stages=4, forwards=12)           # 3 steps x 4 micro-batches


def _groups_seen_by_every_rank(monkeypatch, world_size, mp, pp):
    """mpu.initialize_model_parallel run once per rank with torch.distributed faked (new_group returns its rank
    list): {rank: (pipeline group, embedding group or None, is_rank_in_embedding_group())}."""
    import types

    from mpu import initialize
    seen = {}
    for rank in range(world_size):
        fake = types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: world_size,
                                     get_rank=lambda rank=rank: rank, new_group=lambda ranks, timeout=None: list(ranks))
        monkeypatch.setattr(initialize, "dist", fake)
        initialize.initialize_model_parallel(mp, pp)
        try:
            seen[rank] = (initialize.get_pipeline_model_parallel_group(), initialize.get_embedding_group(),
                          initialize.is_rank_in_embedding_group())
        finally:
            initialize.destroy_model_parallel()
    return seen


@pytest.mark.parametrize("world_size,mp,embedding_groups", [
    (4, 1, [[0, 3]]),
    (8, 2, [[0, 6], [1, 7]]),
    (16, 2, [[0, 12], [1, 13], [2, 14], [3, 15]]),     # mp2 x dp2 x pp4, mpu/initialize.py's example
], ids=["world4-mp1", "world8-mp2", "world16-mp2-dp2"])
def test_pp4_embedding_group_is_first_and_last_stage_only(monkeypatch, world_size, mp, embedding_groups):
    """At P = 4 each rank's embedding group is exactly {its pipeline's first-stage rank, last-stage rank}, not
    its pipeline group; the middle stages are in none."""
    seen = _groups_seen_by_every_rank(monkeypatch, world_size, mp, 4)
    stage_size = world_size // 4
    for rank, (pipeline, embedding, member) in seen.items():
        assert pipeline == [rank % stage_size + stage_size * s for s in range(4)], (rank, pipeline)
        expected = next((g for g in embedding_groups if rank in g), None)
        assert embedding == expected and member == (expected is not None), (rank, embedding, member)
        assert embedding != pipeline
    assert sorted(r for g in embedding_groups for r in g) == [r for r in range(world_size)
                                                              if r // stage_size in (0, 3)]


@pytest.mark.parametrize("world_size,extra,micro", [
    (2, ["--checkpoint-activations"], 2),   # recomputation inside a stage changes nothing
    (4, ["--model-parallel-size", "2", "--checkpoint-activations", "--deepspeed_activation_checkpointing"], 2),
    (4, [], 1),                             # dp2: micro 1 x 4 accumulation x dp 2 = 8
], ids=["pp2", "pp2xmp2", "pp2xdp2"])
def test_pipeline_zero1_equals_single_process(reference, deepspeed_config, world_size, extra, micro):
    config = deepspeed_config(micro, 4)
    results = _run(world_size, extra + ["--pipeline-model-parallel-size", "2", "--deepspeed",
                                        "--deepspeed_config", config])
    assert _relative(results[0]["losses"], reference["losses"]) <= TOLERANCE
    _check_tied_copies(results)


def _train(args_list):
    import pretrain_gpt
    return pretrain_gpt.main(args_list)


def test_pp2_checkpoint_continues_at_pp1(saved_pp2):
    save, results = saved_pp2
    set_tracker(save, 5)
    resumed = run_distributed(_train, 1, args=(PIPELINE + MICRO_4 + ["--load", save],))[0]
    assert resumed["iteration"] == list(range(6, 11))
    assert _relative(resumed["lm loss"], results[0]["losses"][5:]) <= TOLERANCE


def test_pp2_resume_is_exact_with_dropout(tmp_path):
    common = TINY + ["--global-batch-size", "4"] + MICRO_4 + [   # 2 micro-batches: the schedule, half the time
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4",
        "--pipeline-model-parallel-size", "2", "--save", str(tmp_path), "--save-interval", "2"]
    straight = run_distributed(_train, 2, args=(common,))[0]
    set_tracker(str(tmp_path), 2)
    resumed = run_distributed(_train, 2, args=(common + ["--load", str(tmp_path)],))[0]
    assert resumed["iteration"] == [3, 4]
    assert resumed["lm loss"] == straight["lm loss"][2:]   # bitwise: every RNG state and the optimizer came back


@pytest.mark.parametrize("flags,world_size,message", [
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     "--num-layers (3) is not divisible by --pipeline-model-parallel-size (2)"),
    (["--pipe-parallel-size", "2", "--model-parallel-size", "2"], 6,
     "world size (6) is not divisible by --pipeline-model-parallel-size (2) x --model-parallel-size (2) = 4"),
    (["--pipeline-model-parallel-size", "2", "--deepspeed"], 2,
     "ZeRO stage 2 cannot be combined with --pipeline-model-parallel-size 2: pipeline parallelism allows ZeRO "
     "stages 0 and 1 only"),
    # interleaving (--num-layers-per-virtual-pipeline-stage), Megatron-LM's words
    (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 1,
     "when interleaved schedule is used, pipeline-model-parallel size should be greater than 1"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"], 2,
     "number of layers is not divisible by number of layers per virtual pipeline stage: --num-layers (6) / "
     "--pipeline-model-parallel-size (2) = 3 layers per stage, --num-layers-per-virtual-pipeline-stage 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--batch-size", "2", "--global-batch-size", "12"], 4,
     "number of microbatches (6) is not divisible by pipeline-model-parallel-size (4) when using interleaved "
     "schedule"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--deepspeed"], 2,    # the JSON's gradient_accumulation_steps (3) is the micro-batch count
     "number of microbatches (3) is not divisible by pipeline-model-parallel-size (2)"),
    (["--num-layers-per-virtual-pipeline-stage", "0"], 1, "--num-layers-per-virtual-pipeline-stage"),
])
def test_bad_pipeline_flags_exit_2(tmp_path, monkeypatch, capsys, flags, world_size, message):
    from megatron.arguments import parse_args
    config = tmp_path / "ds.json"
    stage = 1 if "--num-layers-per-virtual-pipeline-stage" in flags else 2
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                  "zero_optimization": {"stage": stage}}))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    if "--deepspeed" in flags:
        flags = flags + ["--deepspeed_config", str(config)]
    with pytest.raises(SystemExit) as stopped:
        parse_args(args_list=["--mock-data"] + flags)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def _train_failing_on_last_stage(args_list):
    """The last stage raises in its third forward; every rank returns the error it ended with."""
    import mpu
    import pretrain_gpt
    from megatron.training import pretrain
    calls = [0]

    def forward_step(data_iterator, model):
        calls[0] += 1
        if mpu.is_pipeline_last_stage() and calls[0] == 3:
            raise ValueError("boom on the last stage")
        return pretrain_gpt.forward_step(data_iterator, model)
    try:
        pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, forward_step,
                 args_list=args_list)
    except Exception as error:  # noqa: BLE001 - the test wants whatever ended this rank
        return f"{type(error).__name__}: {error}"
    return "finished"


def test_exception_on_one_stage_ends_every_rank_within_the_timeout():
    import time
    start = time.monotonic()
    ended = run_distributed(_train_failing_on_last_stage, 2, timeout=120, args=(
        PIPELINE + MICRO_4 + ["--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "0.05"],))
    assert ended[1] == "ValueError: boom on the last stage"
    assert "timed out" in ended[0].lower() or "timeout" in ended[0].lower(), ended[0]
    assert time.monotonic() - start < 60


# ---- ZeRO-engine checkpoints under pipelining (--deepspeed, stage 1) ------------------------------------------
ZERO_PP2_FILES = ["manifest.json", "mp_rank_00_000_model_states.pt", "mp_rank_00_001_model_states.pt",
                  "zero_pp_rank_0_mp_rank_00_000_optim_states.pt", "zero_pp_rank_0_mp_rank_00_001_optim_states.pt"]


def test_pp2_zero1_resume_is_exact_with_dropout(tmp_path, deepspeed_config):
    """4 straight steps == 2 + save + fresh processes + the engine's own load + 2, bitwise, dropout on."""
    common = TINY + ["--global-batch-size", "4"] + MICRO_4 + [
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4",
        "--pipeline-model-parallel-size", "2", "--deepspeed", "--deepspeed_config", deepspeed_config(2, 2),
        "--save", str(tmp_path), "--save-interval", "2"]
    straight = run_distributed(_train, 2, args=(common,))
    assert sorted(os.listdir(os.path.join(str(tmp_path), "iter_0000002"))) == ZERO_PP2_FILES
    assert open(os.path.join(str(tmp_path), "latest")).read() == "iter_0000004"
    set_tracker(str(tmp_path), 2)
    resumed = run_distributed(_train, 2, args=(common + ["--load", str(tmp_path)],))
    for s, r in zip(straight, resumed):
        assert r["iteration"] == [3, 4]
        assert r["lm loss"] == s["lm loss"][2:]   # bitwise: every stage's RNG, weights and optimizer came back


@pytest.fixture(scope="module")
def saved_zero_pp2(tmp_path_factory, deepspeed_config):
    """A pp2 ZeRO-1 run (dropout off, 4 micro-batches) saving at iterations 5 and 10."""
    save = str(tmp_path_factory.mktemp("zero_pp2"))
    results = _run(2, MICRO_4 + ["--pipeline-model-parallel-size", "2", "--deepspeed", "--deepspeed_config",
                                 deepspeed_config(2, 4), "--save", save, "--save-interval", "5"])
    assert sorted(os.listdir(os.path.join(save, "iter_0000010"))) == ZERO_PP2_FILES
    return save, results


@pytest.mark.parametrize("zero", [True, False], ids=["zero1", "megatron"])
def test_pp2_zero_checkpoint_continues_at_pp1(saved_zero_pp2, deepspeed_config, tmp_path, zero):
    """The stages' weights and optimizer partitions merge into a pp1 model of either path: iterations 6-10
    within 1e-6 of the uninterrupted pp2 run; the pp1 ZeRO run's iteration-10 checkpoint and the pp2 one
    consolidate (tools/zero_to_fp32.py) to the same fp32 weights; the pp1 ZeRO checkpoint continues at pp2."""
    from tools.zero_to_fp32 import consolidate
    save, results = saved_zero_pp2
    set_tracker(save, 5)
    zero_args = ["--deepspeed", "--deepspeed_config", deepspeed_config(2, 4)]
    extra = zero_args + ["--save", str(tmp_path / "pp1"), "--save-interval", "2"] if zero else []
    resumed = run_distributed(_train, 1, args=(PIPELINE + MICRO_4 + ["--load", save] + extra,))[0]
    assert resumed["iteration"] == list(range(6, 11))
    assert _relative(resumed["lm loss"], results[0]["losses"][5:]) <= TOLERANCE
    if zero:
        pp2 = str(tmp_path / "pp2.pt")
        consolidate(save, pp2, tag="iter_0000010")
        consolidate(str(tmp_path / "pp1"), str(tmp_path / "pp1.pt"))
        pp2, pp1 = torch.load(pp2, weights_only=True), torch.load(str(tmp_path / "pp1.pt"), weights_only=True)
        assert sorted(pp2) == sorted(pp1) and any(n.startswith("transformer.layers.1.") for n in pp2)
        for name in pp1:
            torch.testing.assert_close(pp2[name], pp1[name], rtol=1e-5, atol=1e-6)
        # and back: the pp1 ZeRO checkpoint of iteration 8 continues at pp2 (split into stages by name)
        set_tracker(str(tmp_path / "pp1"), 8)
        split = run_distributed(_train, 2, args=(PIPELINE + MICRO_4 + zero_args + [
            "--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "pp1")],))[0]
        assert split["iteration"] == [9, 10]
        assert _relative(split["lm loss"], results[0]["losses"][8:]) <= TOLERANCE


def test_pp2_zero_checkpoint_missing_stage_is_named(saved_zero_pp2, tmp_path):
    import shutil

    from megatron.checkpoint.reshard import SavedCheckpoint
    from megatron.checkpoint.layout import CheckpointError
    save, _ = saved_zero_pp2
    shutil.copytree(os.path.join(save, "iter_0000010"), tmp_path / "iter_0000010")
    saved = SavedCheckpoint(str(tmp_path), "iter_0000010")
    assert saved.describe() == "mp1 x pp2 x dp1 (zero-1)" and saved.pipeline_model_parallel_size == 2
    assert saved.full_tensor("transformer.layers.1.mlp.dense_h_to_4h.weight", "exp_avg") is not None
    os.remove(tmp_path / "iter_0000010" / "zero_pp_rank_0_mp_rank_00_001_optim_states.pt")
    with pytest.raises(CheckpointError, match="optimizer-states files of pipeline stage 1"):
        SavedCheckpoint(str(tmp_path), "iter_0000010").full_tensor("transformer.layers.1.mlp.dense_h_to_4h.weight",
                                                                   "exp_avg")
    os.remove(tmp_path / "iter_0000010" / "mp_rank_00_001_model_states.pt")
    with pytest.raises(CheckpointError, match="pipeline stage 1 of model-parallel rank 0"):
        SavedCheckpoint(str(tmp_path), "iter_0000010")
