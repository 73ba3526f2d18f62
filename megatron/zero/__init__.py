"""The integrated ZeRO engine (DeepSpeed-compatible API). Filled in by the ZeRO issue."""
