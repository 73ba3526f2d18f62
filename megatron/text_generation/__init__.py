"""Text generation with the training model: KV-cache decoding, sampling, tensor-parallel agreement."""
from .generation import InferenceInputError, generate, load_inference_model, sample_logits

__all__ = ["InferenceInputError", "generate", "load_inference_model", "sample_logits"]
