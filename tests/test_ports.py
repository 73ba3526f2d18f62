"""No fixed rendezvous port in the code tests run: a port another job holds (6000, 29500) fails the run with
EADDRINUSE (`make test` did, on port 6000). Tests, tools and the package take a free port (megatron.spawn.free_port,
or torchrun --standalone); only a default for users in scripts/, listed in ALLOWED with its reason, may name one.

The rule, pinned on examples below: in the repository's .py and .sh files and Makefile (outside .venv, data, runs
and this file, which holds the examples), a line names a fixed port when it gives a number literal to
- MASTER_PORT: `MASTER_PORT=6000`, `MASTER_PORT="29500"`, `"MASTER_PORT": "6000"`, `("MASTER_PORT", "6000")` (a
  setdefault or get default), `${MASTER_PORT:-6000}`;
- torchrun's master port: `--master_port 29500`, `--master-port=29500`, `"--master_port", "29500"`;
- a port keyword or variable: `port=6000`, `port = 29500` (port=0, "any free port", is fine);
- a rendezvous address: `tcp://127.0.0.1:29500`, `--rdzv-endpoint localhost:29400`.
Occupying a port on purpose (a test that holds 6000 to show a launch does not need it) gives no number to any of
these and is not a rendezvous.
"""
import os
import re

from tests.helpers import REPO

PATTERNS = (
    r"MASTER_PORT\s*=\s*[\"']?\d",                       # shell assignment, keyword argument
    r"[\"']MASTER_PORT[\"']\s*[:,]\s*[\"']?\d",          # dict literal, setdefault/get default
    r"MASTER_PORT:-\d",                                  # shell default
    r"--master[_-]port(?:\s*=\s*|\s+|[\"']\s*,\s*[\"'])\d",
    r"\bport\s*=\s*[1-9]\d{1,4}\b",
    r"tcp://[^\s\"'/]*:\d{2,5}",
    r"rdzv[_-]endpoint\W+[^\s\"']*:\d{2,5}",
)
FIXED_PORT = re.compile("|".join(f"(?:{pattern})" for pattern in PATTERNS))
SCANNED_DIRS = ("tests", "tools", "scripts", "megatron", "mpu", "tasks")
SKIPPED_DIRS = {".venv", "data", "runs", "__pycache__", ".git"}

# (path, line): why a user-facing default may name a port. Only scripts/ may have entries.
ALLOWED = {
    ("scripts/_common.sh", 'if [ "$NNODES" -gt 1 ]; then MASTER_PORT=${MASTER_PORT:-6000}; fi'):
        "the documented multi-node default (README, docs/operations.md): every node must agree on one port; it is "
        "overridable, and node 0 checks that it is free before launching",
}
# (path, line): known violations owned elsewhere; each entry must go when its line is fixed (this test then fails
# until it is removed, so the list cannot go stale).
KNOWN = {}      # fixed ports waiting for a fix: none (megatron/initialize.py's single-process 6000 became a store)


def _files():
    roots = [os.path.join(REPO, name) for name in SCANNED_DIRS]
    yield from (os.path.join(REPO, name) for name in sorted(os.listdir(REPO))
                if name.endswith((".py", ".sh")) or name == "Makefile")
    for root in roots:
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
            for name in sorted(names):
                path = os.path.join(directory, name)
                if name.endswith((".py", ".sh")) and path != os.path.abspath(__file__):
                    yield path


def fixed_ports():
    """{(path relative to the repository, stripped line)} of every line that names a fixed port."""
    found = set()
    for path in _files():
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if FIXED_PORT.search(line):
                    found.add((os.path.relpath(path, REPO), line.strip()))
    return found


def test_the_rule_on_examples():
    fixed = ['MASTER_PORT=6000 bash scripts/pretrain_gpt.sh', 'env = dict(os.environ, MASTER_PORT="29512")',
             'env = {"MASTER_PORT": "6000"}', 'os.environ.setdefault("MASTER_PORT", "6000")',
             'os.environ.get("MASTER_PORT", "29511")', 'MASTER_PORT=${MASTER_PORT:-6000}',
             'torchrun --master_port 29500 pretrain_gpt.py', 'torchrun --master-port=29500 x.py',
             '["--master_port", "29500"]', 'dist.TCPStore("127.0.0.1", port=6000)', 'port = 29500',
             'init_method="tcp://127.0.0.1:29500"', '--rdzv-endpoint localhost:29400']
    free = ['env = dict(os.environ, MASTER_PORT=str(free_port()))', '"--master_port", str(free_port()),',
            'os.environ.update(MASTER_PORT=str(port))', 'server.bind(("", 0))', 'with listening_on(6000):',
            'port=0', 'MASTER_PORT 6000 is already in use', '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"',
            'init_method=f"tcp://127.0.0.1:{free_port()}"', 'support = 12', 'report=6000']
    assert [line for line in fixed if not FIXED_PORT.search(line)] == []
    assert [line for line in free if FIXED_PORT.search(line)] == []


def test_no_fixed_port_outside_the_allowed_defaults():
    assert all(path.startswith("scripts/") for path, _ in ALLOWED)
    found = fixed_ports()
    assert found - set(ALLOWED) - set(KNOWN) == set(), "a fixed port: take megatron.spawn.free_port() instead"
    assert set(ALLOWED) | set(KNOWN) <= found, "an ALLOWED or KNOWN line is gone: remove its entry"
