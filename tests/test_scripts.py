"""The Megatron-path launch scripts run as-is on CPU (embedded default data) and the loss falls."""
from tests.scripts_util import logged_losses, run_script

SHORT = {"TRAIN_ITERS": "30", "LOG_INTERVAL": "5", "EVAL_INTERVAL": "15", "EVAL_ITERS": "2", "SEQ_LENGTH": "64"}


def test_pretrain_gpt_sh(tmp_path, webtext_data):
    stdout = run_script("pretrain_gpt.sh", dict(SHORT, CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    losses = logged_losses(stdout)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "30"


def test_pretrain_gpt_distributed_with_mp_sh(tmp_path, webtext_data):
    stdout = run_script("pretrain_gpt_distributed_with_mp.sh",
                        dict(SHORT, GPUS_PER_NODE="2", MP_SIZE="2", CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    assert "model-parallel 2 x data-parallel 1" in stdout
    losses = logged_losses(stdout)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
