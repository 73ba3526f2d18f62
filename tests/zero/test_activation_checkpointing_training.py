"""Activation checkpointing through Megatron's training loop: the same losses with zero.checkpointing as without,
and an exact resume with it on (pretrain_gpt.py, ZeRO stage 2, mp=2, fp32, dropout on)."""
import json

import pytest

from megatron.zero import checkpointing
from megatron.spawn import run_distributed

_PRETRAIN_ARGS = ["--mock-data", "--vocab-size", "256", "--num-layers", "2", "--hidden-size", "32",
                  "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
                  "--model-parallel-size", "2", "--train-iters", "10", "--lr-decay-iters", "10", "--lr", "1e-3",
                  "--attention-dropout", "0.2", "--hidden-dropout", "0.2", "--log-interval", "100",
                  "--eval-iters", "0", "--eval-interval", "1000"]
_CHECKPOINTING_ARGS = ["--checkpoint-activations", "--deepspeed_activation_checkpointing"]


def _pretrain_worker(argv):
    import pretrain_gpt
    history = pretrain_gpt.main(args_list=argv)
    config = checkpointing.get_config()
    return history["iteration"], history["lm loss"], config


@pytest.fixture(scope="module")
def zero_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("zero") / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                "activation_checkpointing": {"contiguous_memory_optimization": True,
                                                             "number_checkpoints": 2, "cpu_checkpointing": True}}))
    return ["--deepspeed", "--deepspeed_config", str(path)]


@pytest.fixture(scope="module")
def straight_runs(zero_config):
    """10 steps without and with zero.checkpointing (partitioned, contiguous, CPU)."""
    without = run_distributed(_pretrain_worker, 2, args=(_PRETRAIN_ARGS + zero_config,))[0]
    with_checkpointing = run_distributed(_pretrain_worker, 2, args=(_PRETRAIN_ARGS + zero_config +
                                                                    _CHECKPOINTING_ARGS,))[0]
    return without, with_checkpointing


def test_training_losses_equal_with_and_without_checkpointing(straight_runs):
    (iterations, losses, config), (ck_iterations, ck_losses, ck_config) = straight_runs
    assert config is None and ck_config.partition_activations and ck_config.contiguous_memory_optimization
    assert iterations == ck_iterations == list(range(1, 11))
    assert losses[0] != losses[-1]
    assert ck_losses == losses  # bitwise: python floats of the fp32 losses


def test_resume_with_checkpointing_is_exact(straight_runs, zero_config, tmp_path):
    save = ["--save", str(tmp_path), "--save-interval", "5"]
    first = run_distributed(_pretrain_worker, 2, args=(_PRETRAIN_ARGS + zero_config + _CHECKPOINTING_ARGS + save +
                                                       ["--exit-interval", "5"],))[0]
    second = run_distributed(_pretrain_worker, 2, args=(_PRETRAIN_ARGS + zero_config + _CHECKPOINTING_ARGS +
                                                        ["--load", str(tmp_path)],))[0]
    _, straight_losses, _ = straight_runs[1]
    assert first[0] == [1, 2, 3, 4, 5] and second[0] == [6, 7, 8, 9, 10]
    assert first[1] + second[1] == straight_losses
