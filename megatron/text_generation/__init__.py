"""Text generation with the training model: KV-cache decoding, sampling, tensor-parallel agreement."""
from .generation import generate, sample_logits

__all__ = ["generate", "sample_logits"]
