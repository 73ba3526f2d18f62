"""Text generation with the training model: KV-cache decoding, sampling, tensor-parallel agreement."""
from .generation import generate, load_inference_model, sample_logits

__all__ = ["generate", "load_inference_model", "sample_logits"]
