"""Sharded indexes over ``torch.distributed``: one FlatIndex or IVFIndex per rank, used as one index.

Launch one process per shard (``torchrun --nproc-per-node=N script.py``), then on every rank::

    import tqindex as tq
    from tqindex.distributed import ShardedIndex, init_distributed, shard_range

    device = init_distributed()                    # NCCL on GPUs (cuda:LOCAL_RANK), else gloo
    index = ShardedIndex(tq.index_factory(768, "tq4"))
    start, stop = shard_range(len(x), index.rank, index.world_size)
    index.add(x[start:stop])                       # global ids in rank order (or ids=..., or src=0)
    D, I = index.search(q, k=10)                   # the global top-k on every rank
    index.save("shards/")                          # one file per rank + manifest.json

Every method is collective (all ranks call it, in the same order). Needs nothing beyond torch.
"""

from .comm import DistributedIndexError, broadcast_encoder, init_distributed, local_device
from .files import read_manifest
from .merge import merge_topk
from .sharded import SearchStats, ShardedIndex, shard_range

__all__ = [
    "DistributedIndexError",
    "SearchStats",
    "ShardedIndex",
    "broadcast_encoder",
    "init_distributed",
    "local_device",
    "merge_topk",
    "read_manifest",
    "shard_range",
]
