"""The Megatron-path launch scripts run as-is on CPU (embedded default data) and the loss falls; the launch port."""
import pathlib
import re
import socket
import subprocess

from tests.helpers import logged_losses, port_taken, REPO, run_script, script_env, SHORT_PRETRAIN as SHORT


def test_pretrain_gpt_sh(tmp_path, webtext_data):
    """MASTER_PORT unset on one node while Megatron's habitual port 6000 is taken: torchrun --standalone picks a free
    one."""
    with port_taken(6000):
        stdout = run_script("pretrain_gpt.sh", dict(SHORT, CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    losses = logged_losses(stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "20"


def test_pretrain_gpt_distributed_with_mp_sh(tmp_path, webtext_data):
    stdout = run_script("pretrain_gpt_distributed_with_mp.sh",
                        dict(SHORT, GPUS_PER_NODE="2", MP_SIZE="2", CHECKPOINT_PATH=str(tmp_path / "ckpt")))
    assert "model-parallel 2 x data-parallel 1" in stdout
    losses = logged_losses(stdout)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.2, losses


def test_a_taken_master_port_is_named_in_one_line(tmp_path):
    with socket.socket() as server:
        server.bind(("", 0))
        server.listen()
        port = server.getsockname()[1]
        for script, extra in (("pretrain_gpt.sh", {}), ("ds_zero2_pretrain_gpt_model_parallel.sh",
                                                         {"NNODES": "2", "NODE_RANK": "0", "GPUS_PER_NODE": "2"})):
            result = subprocess.run(["bash", f"scripts/{script}"], cwd=REPO, capture_output=True, text=True,
                                    timeout=120, env=script_env(dict(extra, MASTER_PORT=str(port),
                                                                     CHECKPOINT_PATH=str(tmp_path / "ckpt"))))
            assert result.returncode == 1, (script, result.stderr[-2000:])
            assert result.stderr.strip().splitlines() == [
                f"error: MASTER_PORT {port} is already in use on this machine (another job?): choose another "
                "MASTER_PORT, or on one node leave it unset to pick a free port"], script
    assert not (tmp_path / "ckpt").exists()


# the scripts' helpers (data, plots), run with "$PYTHON" directly: not entry points, no EXTRA_ARGS
SCRIPT_HELPERS = {"tools/prepare_default_data.py", "tools/prepare_sft_data.py", "tools/plot_run.py"}


def _launches(path):
    """Each command of `path` (continuation lines joined) that runs a Python entry point: `launch N X.py ...`,
    "$PYTHON" -m torch.distributed.run ... (a script's own torchrun), or "$PYTHON" X.py ... for an X not in
    SCRIPT_HELPERS."""
    commands = re.sub(r"\\\n", " ", path.read_text()).splitlines()
    return [command.strip() for command in commands if re.match(r"\s*launch\s", command)
            or re.search(r'"\$PYTHON"\s+-m\s+torch\.distributed\.run\s', command) or any(
        script not in SCRIPT_HELPERS for script in re.findall(r'"\$PYTHON"\s+(?:-u\s+)?(\S+\.py)\b', command))]


def test_every_script_appends_extra_args_to_every_launch():
    """EXTRA_ARGS is the last of each launch's flags (before any redirection or pipe), so the user's flags reach
    every entry point and override the script's own (argparse: the last wins)."""
    scripts = sorted(path for path in pathlib.Path(REPO, "scripts").glob("*.sh") if path.name != "_common.sh")
    assert len(scripts) >= 8
    for path in scripts:
        launches = _launches(path)
        assert launches, f"{path.name}: no launch found"
        for command in launches:
            flags = re.split(r"\s+(?:\d?>|\||&)", command)[0]     # before a redirection, a pipe or a `&`
            assert flags.endswith("${EXTRA_ARGS:-}"), f"{path.name}: EXTRA_ARGS is not the last flag of: {command}"


def test_extra_args_reach_generate_text_sh(tmp_path, webtext_data):
    """A flag in EXTRA_ARGS reaches tools/generate_samples_gpt.py: an unknown one is refused there (before the
    missing checkpoint is looked at)."""
    result = subprocess.run(["bash", "scripts/generate_text.sh"], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=script_env({"EXTRA_ARGS": "--no-such-flag-h66b",
                                                         "CHECKPOINT_PATH": str(tmp_path / "none")}))
    assert result.returncode == 1
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "generate_samples_gpt.py: error: unrecognized arguments: --no-such-flag-h66b"), errors
