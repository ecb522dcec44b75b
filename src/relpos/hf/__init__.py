"""relpos inside Hugging Face transformers: :func:`accelerate` switches a model to relpos attention.

transformers is an optional dependency: ``pip install "relpos[hf]"``. Nothing here is imported by
``import relpos``. Each supported family is one adapter module that registers a
:class:`~relpos.hf._family.Family` in the table :data:`FAMILIES` (importing it here registers it).
"""

from . import t5 # noqa: F401, I001  (registers first: messages list T5 first)
from . import longt5 # noqa: F401, E402  (T5-bucket families)
from . import pix2struct # noqa: F401, E402  (T5-bucket families)
from . import pop2piano # noqa: F401, E402  (T5-bucket families)
from . import switch_transformers # noqa: F401, E402  (T5-bucket families)
from . import udop # noqa: F401, E402  (T5-bucket families)
from . import bloom # noqa: F401, E402  (the ALiBi families)
from . import falcon # noqa: F401, E402  (the ALiBi families)
from . import mpt # noqa: F401, E402  (the ALiBi families)
from . import sam # noqa: F401, E402  (vision: SAM, SAM-HQ, ViTDet; Swin, Swin V2, Donut Swin)
from . import swin # noqa: F401, E402  (vision: SAM, SAM-HQ, ViTDet; Swin, Swin V2, Donut Swin)
from ._family import FAMILIES, Family, find_family
from .api import accelerate, is_accelerated, restore
from .swin import recompute_activations
from .t5 import SUPPORTED_MODEL_TYPES

__all__ = ["FAMILIES", "Family", "SUPPORTED_MODEL_TYPES", "accelerate", "find_family", "is_accelerated", "recompute_activations", "restore"]
