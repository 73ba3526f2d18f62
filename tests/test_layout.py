"""The package boundaries the design promises: mpu imports only torch (and the standard library), and no tool
imports the tests."""
import ast
import os
import subprocess
import sys

from megatron.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported_modules(path):
    """Top-level names of every absolute import in the file at `path` (relative imports are left out)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _python_files(directory):
    for root, _, files in os.walk(os.path.join(REPO, directory)):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def test_mpu_imports_only_torch_and_the_standard_library():
    for path in _python_files("mpu"):
        foreign = _imported_modules(path) - {"torch"} - set(sys.stdlib_module_names)
        assert not foreign, f"{os.path.relpath(path, REPO)} imports {sorted(foreign)}"


def test_import_mpu_loads_no_megatron_module():
    """In a fresh interpreter, `import mpu` (and building a transformer layer) loads nothing from megatron."""
    code = "\n".join([
        "import sys, torch, torch.distributed as dist, mpu",
        "dist.init_process_group('gloo', rank=0, world_size=1)",
        "mpu.initialize_model_parallel(1)",
        "mpu.model_parallel_cuda_manual_seed(1)",
        "model = mpu.ParallelTransformer(2, 8, 2, 0.1, 0.1, checkpoint_activations=True)",
        "model(torch.randn(1, 4, 8, requires_grad=True)).sum().backward()",
        "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))"])
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_no_tool_imports_the_tests():
    for path in _python_files("tools"):
        assert "tests" not in _imported_modules(path), f"{os.path.relpath(path, REPO)} imports tests/"
