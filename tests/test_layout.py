"""The package boundaries the design promises: mpu imports only torch (and the standard library), no tool imports
the tests, no import circle in megatron/, megatron.zero entered only by its front door, a short megatron/ root."""
import ast
import os
import subprocess
import sys

from megatron.spawn import free_port

from tests.helpers import REPO


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


# ---- megatron/: no import circle, zero's front door, a short root -----------------------------------------------

def _module_name(path):
    """megatron/checkpoint/layout.py -> megatron.checkpoint.layout; a package's __init__.py -> the package."""
    parts = os.path.relpath(path, REPO)[:-len(".py")].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path, modules, name=None):
    """The modules of `modules` that the file at `path` (module `name`) imports anywhere in it (function bodies
    too: a lazy import hides a circle, it does not remove it). Importing a.b.c runs a and a.b first: those count."""
    name = name or _module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), filename=path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        parts = target.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return found - {name} - ancestors    # a module's own packages are initialised before it runs


def _import_graph(directory):
    paths = list(_python_files(directory))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports_of(p, modules) for p in paths}


def _find_cycle(graph):
    """One import circle of `graph` as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None
    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_circle_in_megatron():
    cycle = _find_cycle(_import_graph("megatron"))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_circle(tmp_path):
    """The check above can fail: a lazy import inside a function closes a circle through a package __init__
    (importing megatron.checkpoint.layout runs megatron/checkpoint/__init__.py, which imports saving)."""
    graph = _import_graph("megatron")
    assert "megatron.checkpoint" in graph["megatron.zero.engine"]
    assert "megatron.checkpoint.saving" in graph["megatron.checkpoint"]
    lazy = tmp_path / "saving.py"
    lazy.write_text("import os\n\n\ndef f():\n    from megatron.zero import ZeroEngine\n")
    planted = dict(graph)
    planted["megatron.checkpoint.saving"] = _imports_of(str(lazy), set(graph), name="megatron.checkpoint.saving")
    assert planted["megatron.checkpoint.saving"] == {"megatron.zero"}
    cycle = _find_cycle(planted)
    assert cycle is not None and {"megatron.checkpoint.saving", "megatron.zero.engine"} <= set(cycle), cycle


def _zero_internal_imports(path):
    """`megatron.zero.X` modules the file imports (rather than what megatron.zero itself exports)."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), filename=path)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "megatron.zero" else [])
        for name in names:
            if name.startswith("megatron.zero."):
                found.add(name)
    return found


def test_outside_zero_only_its_exports_are_imported():
    """megatron.zero is a library with a front door (its __init__'s __all__): code outside it (megatron/, tools/,
    tasks/, the entry points; the tests may reach inside to test the pieces) imports only what it exports."""
    import megatron.zero as zero
    exported_modules = {f"megatron.zero.{name}" for name in zero.__all__}       # e.g. zero.checkpointing
    offenders = {}
    for directory in ("megatron", "tools", "tasks", "."):
        paths = _python_files(directory) if directory != "." else \
            (os.path.join(REPO, n) for n in sorted(os.listdir(REPO)) if n.endswith(".py"))
        for path in paths:
            if os.sep + os.path.join("megatron", "zero") + os.sep in path:
                continue
            internal = {name for name in _zero_internal_imports(path) if name not in exported_modules}
            if internal:
                offenders[os.path.relpath(path, REPO)] = sorted(internal)
    assert not offenders, offenders


def test_zero_front_door_check_catches_a_submodule_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from megatron.zero.partition import ALIGNMENT\nfrom megatron.zero import checkpointing\n"
                       "def f():\n    import megatron.zero.builder\n")
    assert _zero_internal_imports(str(planted)) == {"megatron.zero.partition", "megatron.zero.builder",
                                                    "megatron.zero.checkpointing"}


def test_megatron_root_holds_at_most_ten_modules():
    """The tutorial's modules and a few more stay at the root; the rest are grouped by concern (checkpoint/,
    pipeline/, guards/, zero/, model/, data/, ...)."""
    root = sorted(n for n in os.listdir(os.path.join(REPO, "megatron")) if n.endswith(".py") and n != "__init__.py")
    assert len(root) <= 10, root
    for name in ("arguments.py", "training.py", "utils.py", "initialize.py", "global_vars.py", "learning_rates.py"):
        assert name in root, name


def test_checkpoint_code_lives_in_the_checkpoint_package():
    """utils.py is short and holds no save/load code (that is megatron.checkpoint's): the tutorial's two names there
    are one call each into megatron.checkpoint's function of the same name."""
    utils = open(os.path.join(REPO, "megatron", "utils.py")).read()
    assert len(utils.splitlines()) <= 150
    for name in ("def save_checkpoint", "def get_rng_state", "torch.load(", "torch.save(", "model.save_checkpoint(",
                 "model.load_checkpoint("):
        assert name not in utils, name
    functions = {node.name: node for node in ast.parse(utils).body if isinstance(node, ast.FunctionDef)}
    for name in ("save_ds_checkpoint", "load_checkpoint"):
        body = functions[name].body[1:]                         # after the docstring
        assert len(body) == 1, name
        calls = [node.func for node in ast.walk(body[0]) if isinstance(node, ast.Call)]
        assert any(isinstance(f, ast.Attribute) and f.attr == name and getattr(f.value, "id", None) == "checkpoint"
                   for f in calls), name

