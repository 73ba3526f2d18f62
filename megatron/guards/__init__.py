"""The run's guard rails (DESIGN.md section 10): what checks, watches and accounts for a run without changing
its numbers.

    preflight.py        every rank agrees on arguments, config, world layout and sources before the model is built
    breadcrumbs.py      named collectives with timeouts: a hang names its collective and the ranks missing
    nccl_rules.py       the tests' NCCL-rules mode: collectives refuse what NCCL would (host tensors, unbound device)
    exit_controller.py  a signal or --exit-duration-in-mins ends the run after a checkpoint
    operations.py       non-finite losses and gradients named, the --log-jsonl records, the memory estimate line
    memory.py           model-state and activation memory from shapes alone
    comm_bytes.py       bytes each rank sends, counted per collective

This file imports nothing: the ZeRO engine and the checkpoint package use breadcrumbs, while memory.py and
operations.py build on megatron.zero, and no import circle comes of it.
"""
