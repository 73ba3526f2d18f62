from megatron.spawn import free_port, run_distributed  # noqa: F401  (temporary shim; removed at the end)
