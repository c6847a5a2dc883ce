"""tqindex: vectors compressed to 1-4 bits per coordinate, for ANN search and LLM KV caches.

Quick start::

    import numpy as np
    import tqindex as tq

    x = np.random.default_rng(0).standard_normal((10_000, 64)).astype(np.float32)
    index = tq.index_factory(64, "tq4", metric="cosine")   # FlatIndex over 4-bit codes
    index.add(x)                                            # ids 0, 1, ... (or ids=...)
    D, I = index.search(x[:5], k=10)    # numpy in -> numpy out: D float32 [5, 10], I int64 [5, 10]
    index.save("vectors.tqi")
    index = tq.load_index("vectors.tqi")

    ivf = tq.index_factory(64, "IVF64,tq4", nprobe=8)       # inverted lists: train, then add
    ivf.train(x)
    ivf.add(x)

    enc = tq.make_encoder("tq4", 64)    # an encoder on its own: always returns torch
    codes = enc.encode(x)               # Codes: packed torch tensors, enc.code_size bytes per vector
    x_hat = enc.decode(codes)           # torch.Tensor float32 [10000, 64]

Return types: an index follows its input (numpy queries -> numpy ``(D, I)``, torch -> torch on the
queries' device), as faiss does; an encoder returns torch whatever its input (``encode`` -> ``Codes`` of
torch tensors, ``decode`` / ``score`` -> float32 torch tensors; ``.numpy()`` converts on CPU).

More: index descriptions ``[IVF<nlist>,]<encoder>[,RFlat]`` in :func:`index_factory`, encoder names in
:func:`encoder_names`; the command line ``tqindex build|search|info|bench`` (:mod:`tqindex.cli`); a
LangChain vector store, :class:`tqindex.langchain.TQVectorStore` (``pip install 'tqindex[langchain]'``);
the KV cache for transformers, :mod:`tqindex.kv`. Ground truth and prepared datasets are cached in
``$TQINDEX_CACHE`` (default ``~/.cache/tqindex``).
"""

from .codes import Codes
from .encoder import Encoder, encoder_from_dict, encoder_names, make_encoder
from .factory import index_factory
from .fp4 import FP4UE8M0
from .index import FlatIndex
from .io import load_index, read_header
from .ivf import IVFIndex
from .pca import TurboQuantPCA
from .rotation import Rotation
from .trellis import TrellisMSE
from .turboquant import TurboQuantMSE, TurboQuantProd

__version__ = "0.1.0"

__all__ = [
    "Codes",
    "Encoder",
    "FP4UE8M0",
    "FlatIndex",
    "IVFIndex",
    "Rotation",
    "TrellisMSE",
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
