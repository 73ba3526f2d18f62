"""Downstream evaluation tasks (Megatron's tasks/): zero-shot WikiText-103 perplexity and LAMBADA accuracy."""
