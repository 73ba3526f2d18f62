"""`make install` keeps the torch of the Python it builds from (a GPU user's CUDA build) and installs the CPU pin only
where that Python has none. Run offline against an empty wheel directory: the installs fail at once, which is
enough to see which of them make attempted."""
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

BASE_PYTHON = os.path.join(sys.base_prefix, "bin", "python3")     # the interpreter the venvs are built from


def make_install(tmp_path, with_torch):
    """`make install` with a fresh VENV, from this Python (given a fake torch 2.11.0+cu130 on its path, or not)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PIP_", "PYTHONPATH", "MAKE"))}
    empty = tmp_path / "wheels"
    empty.mkdir()
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty), PIP_CONFIG_FILE=os.devnull)
    if with_torch:
        fake = tmp_path / "site" / "torch"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text('__version__ = "2.11.0+cu130"\n')
        env["PYTHONPATH"] = str(tmp_path / "site")
    venv = tmp_path / "venv"
    result = subprocess.run(["make", "-C", REPO, "install", f"VENV={venv}", f"PYTHON={BASE_PYTHON}"], env=env,
                            capture_output=True, text=True, timeout=300)
    return venv, result.stdout + result.stderr


@pytest.mark.parametrize("with_torch", [True, False])
def test_install_keeps_the_pythons_torch_and_pins_the_cpu_one_otherwise(tmp_path, with_torch):
    if not with_torch and subprocess.run([BASE_PYTHON, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{BASE_PYTHON} has a torch of its own: make keeps it")
    venv, output = make_install(tmp_path, with_torch)
    config = (venv / "pyvenv.cfg").read_text()
    tried_cpu_torch = "torch==2.13.0" in output      # pip's "no matching distribution" names what it was asked
    if with_torch:
        assert f"keeping {BASE_PYTHON}'s torch 2.11.0+cu130 (the venv sees its site-packages)" in output
        assert "include-system-site-packages = true" in config and not tried_cpu_torch, output
        assert "pip install -q --no-compile -r requirements.lock" in output     # the rest: from the lock
    else:
        assert "include-system-site-packages = false" in config and tried_cpu_torch, output
