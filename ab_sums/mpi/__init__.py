"""Sequence shards over MPI (installed as ``hyscale_core.mpi``).

- ``layout``: pure partition helpers (no MPI): who holds which positions,
  contiguous or load-balanced (zigzag), aligned to the indexer's blocks.
- ``transport``: how rows travel (host-staged mpi4py, CUDA-aware MPI, NCCL).
- ``shard``: a rank's view (communicator, layout, transport); ``make_shard``.
- ``exchange`` / ``costmodel``: all-gather or fetch of the rows selections
  use, gradients summed at their owners in rank order; bytes per rank.
- ``ops``: ``sharded_indexer_topk``, ``sharded_sparse_attention`` (+ backward).
- ``engine``: the DSA block and the tiny model sharded, deterministic
  gradient all-reduce, a training step.

See mpi/README.md for the layouts and the communication cost model.
"""
from .layout import QUERY_ALIGN, Layout, balanced_layout, contiguous_layout, zigzag_layout
from .ops import sharded_indexer_topk, sharded_sparse_attention, sharded_sparse_attention_backward
from .shard import Shard, abort_on_error, launched_world, make_shard, use_local_gpu

__all__ = [
    "QUERY_ALIGN", "Layout", "balanced_layout", "contiguous_layout", "zigzag_layout", "Shard", "abort_on_error",
    "launched_world", "make_shard", "use_local_gpu", "sharded_indexer_topk", "sharded_sparse_attention",
    "sharded_sparse_attention_backward",
]
