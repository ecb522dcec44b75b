"""relpos inside Hugging Face transformers: :func:`accelerate` switches a T5-family model to relpos attention.

transformers is an optional dependency: ``pip install "relpos[hf]"``. Nothing here is imported by
``import relpos``.
"""

from .t5 import SUPPORTED_MODEL_TYPES, accelerate, is_accelerated, restore

__all__ = ["SUPPORTED_MODEL_TYPES", "accelerate", "is_accelerated", "restore"]
