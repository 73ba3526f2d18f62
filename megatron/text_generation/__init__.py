"""Text generation with the training model: KV-cache decoding, sampling, tensor-parallel agreement."""
from .generation import InferenceInputError, generate, left_padded_layout, load_inference_model, sample_logits
from .hybrid import generate_from_training_model, inference_view

__all__ = ["InferenceInputError", "generate", "generate_from_training_model", "inference_view", "left_padded_layout",
           "load_inference_model", "sample_logits"]
