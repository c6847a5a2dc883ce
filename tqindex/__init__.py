"""tqindex: vectors compressed to 1-4 bits per coordinate, for ANN search and LLM KV caches."""

from .codes import Codes
from .encoder import Encoder, encoder_from_dict, encoder_names, make_encoder
from .factory import index_factory
from .fp4 import FP4UE8M0
from .index import FlatIndex
from .io import load_index, read_header
from .ivf import IVFIndex
from .pca import TurboQuantPCA
from .rotation import Rotation
from .turboquant import TurboQuantMSE, TurboQuantProd

__version__ = "0.1.0"

__all__ = [
    "Codes",
    "Encoder",
    "FP4UE8M0",
    "FlatIndex",
    "IVFIndex",
    "Rotation",
    "TurboQuantMSE",
    "TurboQuantPCA",
    "TurboQuantProd",
    "encoder_from_dict",
    "encoder_names",
    "index_factory",
    "load_index",
    "make_encoder",
    "read_header",
]
