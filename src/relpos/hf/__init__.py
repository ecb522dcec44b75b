"""relpos inside Hugging Face transformers: :func:`accelerate` switches a model to relpos attention.

transformers is an optional dependency: ``pip install "relpos[hf]"``. Nothing here is imported by
``import relpos``. Each supported family is one adapter module that registers a
:class:`~relpos.hf._family.Family` in the table :data:`FAMILIES` (importing it here registers it).
"""

from . import t5  # noqa: F401, I001  (registers first: messages list T5 first)
from . import longt5, pix2struct, pop2piano, switch_transformers, udop  # noqa: F401, E402  (T5-bucket families)
from . import bloom, falcon, mpt  # noqa: F401, E402  (the ALiBi families)
from . import sam, swin  # noqa: F401, E402  (vision: SAM, SAM-HQ, ViTDet; Swin, Swin V2, Donut Swin)
from ._family import FAMILIES, Family, find_family
from .api import accelerate, is_accelerated, restore
from .swin import recompute_activations
from .t5 import SUPPORTED_MODEL_TYPES

__all__ = ["FAMILIES", "Family", "SUPPORTED_MODEL_TYPES", "accelerate", "find_family", "is_accelerated", "recompute_activations", "restore"]
