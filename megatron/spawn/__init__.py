"""Run a function on N gloo processes on this machine and collect what each rank returns (the tests' and the
benchmarks' process launcher; training itself is always launched by torchrun).

    results = run_distributed(fn, world_size=2, args=(x,), model_parallel_size=2)

`fn` must be a module-level function (it is pickled into spawned processes). Each worker initializes
torch.distributed through mpu.init_distributed, which decides device and backend (gloo on the CPU; NCCL with one GPU
per rank where the tests' --device cuda leaves CUDA visible: a launch with more ranks than GPUs is skipped under
pytest, refused otherwise), installs the NCCL-rules check when MEGATRON_NCCL_RULES=1 (the tests set it) and, when
`model_parallel_size` is given, mpu's groups; calls `fn(*args)`; and sends back its return value serialized
with torch.save (tensors are cloned, so no shared memory outlives the worker). A worker's exception fails the
caller with that worker's traceback.
"""
import io
import multiprocessing
import os
import socket
import sys
import traceback

# torch is imported where it is used: the fork server imports this package before megatron/spawn/preload.py turns the
# garbage collector off for its imports


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, args, model_parallel_size, queue, init_process_group=True):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        import mpu
        from megatron.guards import nccl_rules
        nccl_rules.install_if_requested()        # the tests' NCCL-rules mode (MEGATRON_NCCL_RULES=1)
        if init_process_group:                   # mpu decides device and backend (nccl on CUDA: rank r on GPU r,
            mpu.init_distributed(rank=rank, world_size=world_size)   # _launch refuses more ranks than GPUs)
        if model_parallel_size is not None:
            mpu.initialize_model_parallel(model_parallel_size)
        result = fn(*args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
        if dist.is_initialized():
            dist.barrier()
            mpu.destroy_model_parallel()
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))


# Workers fork from one server process that imported these once (a fresh interpreter importing torch costs ~1 s
# per worker, and torch._dynamo, which torch.optim imports on a process's first optimizer, another ~1.7 s);
# nothing in them starts threads or touches torch.distributed at import.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "numpy", "mpu", "megatron.training", "megatron.zero",
            "pretrain_gpt"]
# More modules for the server to import once, comma-separated (tests/conftest.py names pytest and the reference
# libraries its tests' workers import: a worker unpickling a test's function imports that test's module, and with
# it pytest, DeepSpeed, transformers, lm-eval, each ~0.5-1.5 CPU-s per worker otherwise). A missing one is skipped.
PRELOAD_ENV = "MEGATRON_SPAWN_PRELOAD"


def preload_names():
    return _PRELOAD + [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron.spawn.preload"])     # imports preload_names() (read in the server)
    return ctx


def run_distributed(fn, world_size, args=(), model_parallel_size=None, timeout=300, init_process_group=True):
    """Returns [result of rank 0, result of rank 1, ...]. A launch whose rendezvous port was taken meanwhile by
    another process (free_port() cannot hold it) is retried once on a new port. `init_process_group=False`: the
    workers only get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK) and `fn` starts
    torch.distributed itself (a DeepSpeed-style client whose `initialize` does it)."""
    launch = (fn, world_size, args, model_parallel_size, timeout, init_process_group)
    try:
        return _launch(*launch)
    except RuntimeError as error:
        if "EADDRINUSE" not in str(error):
            raise
        return _launch(*launch)


def too_many_ranks(world_size):
    """Why `world_size` NCCL ranks cannot run here (more ranks than GPUs: two ranks on one GPU make NCCL fail or
    hang), or None; always None off CUDA (gloo)."""
    import torch
    gpus = torch.cuda.device_count()
    if os.environ.get("MEGATRON_TEST_DEVICE") != "cuda" or world_size <= gpus:
        return None
    return f"{world_size} NCCL ranks need {world_size} GPUs (one rank per GPU); this machine has {gpus}"


def _launch(fn, world_size, args, model_parallel_size, timeout, init_process_group):
    import torch
    refused = too_many_ranks(world_size)
    if refused:
        if "pytest" in sys.modules:     # a test: skipped, and named in pytest's summary (gpu_check.sh -rs)
            import pytest
            pytest.skip(refused)
        raise RuntimeError(refused)
    ctx = _context()
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, model_parallel_size, queue,
                                               init_process_group))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, ok, payload = _get(queue, procs, timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if errors else timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        rank, tb = next(iter(errors.items()))
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    return [results[rank] for rank in range(world_size)]


def _get(queue, procs, timeout):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"worker exited with code {dead[0].exitcode} before reporting")
        time.sleep(0.01)
    raise TimeoutError(f"distributed test did not finish within {timeout}s")
