"""Run a launch script in a subprocess and read the losses it logs."""
import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_env(env_overrides):
    """The environment without MASTER_PORT (a one-node launch picks a free port itself) plus the overrides."""
    env = {key: value for key, value in os.environ.items() if key != "MASTER_PORT"}
    return dict(env, **env_overrides)


def run_script(script, env_overrides, timeout=600):
    env = script_env(env_overrides)
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", script)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def logged_losses(stdout):
    return [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+)", stdout)]


def validation_losses(stdout):
    return [float(x) for x in re.findall(r"lm loss value: ([0-9.E+-]+)", stdout)]
