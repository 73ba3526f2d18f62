"""Shared fixtures, and the `--device` option.

`pytest` (or `--device cpu`, the default) runs the suite on the CPU on every machine: CUDA is hidden from the tests
and their spawned workers, so a GPU machine computes what this CPU machine does. `pytest --device cuda` (what
tools/gpu_check.sh runs on the device-agnostic equivalence tests) leaves the GPUs visible: the code under test then
picks CUDA as it does in training (mpu.get_device(), mpu.get_backend()), and MEGATRON_TEST_DEVICE=cuda tells the
workers the run is a GPU run. MEGATRON_NCCL_RULES=1 (megatron/guards/nccl_rules.py) makes every collective of the
suite refuse what NCCL would: a host-offload tensor, a tensor off the rank's device, an unbound device.
"""
import gc
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEBTEXT = os.path.join(REPO, "data", "webtext")
DEVICE_ENV = "MEGATRON_TEST_DEVICE"
PRELOAD_ENV = "MEGATRON_SPAWN_PRELOAD"    # megatron.spawn.PRELOAD_ENV (not imported here: conftest loads before torch)


def pytest_addoption(parser):
    parser.addoption("--device", choices=["cpu", "cuda"], default="cpu",
                     help="cpu (default): hide CUDA from the tests; cuda: run them on this machine's GPUs")


def pytest_configure(config):
    device = config.getoption("--device")
    os.environ[DEVICE_ENV] = device
    # every collective of the suite (spawned workers, launched scripts) checks NCCL's rules, on gloo too
    os.environ.setdefault("MEGATRON_NCCL_RULES", "1")
    # One intra-op thread per process (spawned workers set it themselves): make test runs several pytest workers
    # and their launches on 2 cores, where more threads only oversubscribe (OpenMP's spinning threads burn the
    # cores another process needs). Read by torch at start-up, inherited by every process the tests launch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""     # read when CUDA first initializes, in this process and workers
        # run_distributed's fork server imports these once per pytest worker, not each of the ~800 workers it forks
        # (measured: pytest's import alone was ~5% of the suite's CPU; then, sampled over a whole run, DeepSpeed's
        # Muon module, which its ZeRO optimizer check imports in each engine's process (1.1 CPU-s: it builds
        # torch.compile wrappers), 2.1% of the suite, and transformers' GPT-2 model, 1.6 CPU-s, 1.0%; peft 0.4%).
        # Not on CUDA: DeepSpeed probes the device.
        preload = ["pytest", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers",
                   "transformers.models.gpt2.modeling_gpt2", "peft", "lm_eval.evaluator"]
        os.environ.setdefault(PRELOAD_ENV, ",".join(preload))
        # the scripts' `python` and torchrun's workers fork from the warm interpreter too (tests/warm_python.py)
        from tests import warm_python
        for key, value in warm_python.shim_environment().items():
            os.environ.setdefault(key, value)
        return
    import torch
    if not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                                "run on a GPU machine or drop --device cuda")


@pytest.fixture(scope="session")
def test_device(pytestconfig):
    """The torch.device the suite runs on (--device)."""
    import torch
    return torch.device(pytestconfig.getoption("--device"))


@pytest.fixture(scope="session")
def webtext_data():
    """The embedded default data (data/webtext/), built once if missing (~20-50 s); returns its directory. Under
    pytest-xdist every worker asks: the first builds it, the others wait on the lock and find it built."""
    os.makedirs(os.path.dirname(WEBTEXT), exist_ok=True)
    _build_once(os.path.join(os.path.dirname(WEBTEXT), ".webtext.lock"),
                os.path.join(WEBTEXT, "webtext_text_document.idx"),
                lambda: subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_default_data.py")],
                                       cwd=REPO, check=True, timeout=600))
    return WEBTEXT


def _build_once(lock_path, built_path, build):
    """Run `build` unless `built_path` exists, holding an exclusive lock on `lock_path`: under pytest-xdist the
    first worker builds, the others wait on the lock and find it built."""
    import fcntl
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(built_path):
            build()


def _session_dir(tmp_path_factory):
    """A directory every pytest-xdist worker of this run shares (the run's own base temp without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def sft_dir(tmp_path_factory, webtext_data):
    """The default chat data (tools/prepare_sft_data.py into a directory of its own), built once per test run and
    read-only for its users (the fine-tuning script's test, the reward model's default-data test)."""
    from tests.helpers import TOOLS
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import prepare_sft_data
    out = _session_dir(tmp_path_factory) / "sft"
    _build_once(_session_dir(tmp_path_factory) / "sft.lock", out / "chatterbot.json",
                lambda: prepare_sft_data.prepare(str(out), vocab_dir=webtext_data))
    return out


@pytest.fixture(scope="session")
def ds_pretrained(tmp_path_factory, webtext_data):
    """`make pretrain`'s training step (scripts/ds_pretrain_gpt.sh, ZeRO-2) run once per test run at SHORT_PRETRAIN:
    (checkpoint directory, the script's stdout). Read-only for its users (the script's own test and the fine-tuning
    test start from it); under pytest-xdist the first worker runs it, the other waits on the lock."""
    from tests.helpers import run_script, SHORT_PRETRAIN
    root = _session_dir(tmp_path_factory)
    checkpoint, stdout_file = root / "ds_pretrained", root / "ds_pretrained.stdout"
    _build_once(root / "ds_pretrained.lock", stdout_file, lambda: stdout_file.write_text(
        run_script("ds_pretrain_gpt.sh", dict(SHORT_PRETRAIN, CHECKPOINT_PATH=str(checkpoint)))))
    return checkpoint, stdout_file.read_text()


# The files that take longest (measured in a full run, their tests together), started first (in this order, by the
# scheduler below): with `--dist loadfile` a worker that picks one of them up at the end of the run keeps the run
# going alone for minutes. test_bad_input.py is among the first: it builds the default data the later files read
# when pytest runs without `make test`, which builds the data before the suite.
LONGEST_FIRST = ["tests/model/test_fused_compute.py", "tests/training/test_restarts.py",
                 "tests/training/test_bad_input.py", "tests/posttrain/test_reward.py",
                 "tests/zero/test_deepspeed_path.py", "tests/training/test_hang_diagnostics.py",
                 "tests/zero/test_deepspeed_checkpoints.py", "tests/zero/test_zero3.py",
                 "tests/training/test_scripts.py", "tests/posttrain/test_finetune_default.py",
                 "tests/inference/test_generation.py",
                 "tests/zero/test_zero_engine.py", "tests/model/test_vocab_padding.py", "tests/posttrain/test_sft.py",
                 "tests/checkpoint/test_hf_interchange.py", "tests/data/test_preprocess.py", "tests/test_gpu_check.py",
                 "tests/zero/test_ds_chat_client.py", "tests/zero/test_memory_estimate.py"]


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile handing the files out in collection order (LONGEST_FIRST first): pytest-xdist 3 orders them
    by their number of tests, which started the longest files last and ran them alone at the end."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CollectionOrderScheduling(LoadFileScheduling):
        def schedule(self):
            if self.collection is not None or not self._check_nodes_have_same_collection():
                return super().schedule()
            self.collection = list(next(iter(self.registered_collections.values())))
            for nodeid in self.collection:
                self.workqueue.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for node in self.nodes[len(self.workqueue):]:      # more workers than files: the extra ones stop
                self.assigned_work.pop(node)
                node.shutdown()
            for node in self.nodes:
                self._assign_work_unit(node)
            for node in self.nodes:                           # a second file each, as xdist does
                self._reschedule(node)

    return CollectionOrderScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """The test modules import torch, transformers and DeepSpeed here: with the garbage collector off (a full
    collection each time the heap grows by a quarter costs ~20% of such an import), and their objects frozen after,
    so the collections during the tests scan what the tests made, not the libraries again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def pytest_collection_modifyitems(config, items):
    """Order the collected tests so the LONGEST_FIRST files come first (the rest keep their order): pytest-xdist
    hands files out in collection order."""
    position = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(os.path.relpath(str(item.fspath), REPO), len(position)))
