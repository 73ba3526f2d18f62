"""run_distributed's fork server (megatron/spawn/): its modules imported with the garbage collector off, frozen,
and the collector on again in every worker it forks."""
import gc
import importlib
import subprocess
import sys

from megatron import spawn
from megatron.spawn import run_distributed
from tests.helpers import REPO


def _collector_state():
    return gc.isenabled(), gc.get_freeze_count(), "mpu" in sys.modules


def test_workers_inherit_the_preloaded_modules_frozen_with_the_collector_on():
    for enabled, frozen, preloaded in run_distributed(_collector_state, 2, init_process_group=False):
        assert enabled and preloaded
        assert frozen > 100_000, frozen          # torch's objects alone are several hundred thousand


def test_the_preload_imports_with_the_collector_off_and_skips_a_missing_module(tmp_path, monkeypatch):
    (tmp_path / "gc_state_at_import.py").write_text("import gc\nenabled = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(spawn, "_PRELOAD", ["colorsys"])
    monkeypatch.setenv(spawn.PRELOAD_ENV, "no_such_module_anywhere,gc_state_at_import")
    for name in ("megatron.spawn.preload", "gc_state_at_import", "colorsys"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    frozen = gc.get_freeze_count()
    importlib.import_module("megatron.spawn.preload")
    assert "colorsys" in sys.modules and sys.modules["gc_state_at_import"].enabled is False
    assert gc.isenabled() and gc.get_freeze_count() > frozen


def test_the_package_imports_no_torch():
    """The fork server imports megatron.spawn before its preload turns the collector off: torch must wait."""
    check = "import sys, megatron.spawn; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True,
                          cwd=REPO).stdout == "False\n"
