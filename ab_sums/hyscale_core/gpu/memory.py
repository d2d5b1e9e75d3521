"""Peak device memory of a block of code, counted in CuPy's memory pool.

``pool.total_bytes()`` after a call overstates what the call needed: the
pool keeps freed blocks, and a block split between a live array and free
space cannot be given back, so a large freed temporary of the caller shows
up as the call's memory. :func:`pool_peak` counts instead the bytes of
the allocations made inside the block, at their high-water mark.
"""
from __future__ import annotations

import functools

from .._backend import cupy_module


@functools.lru_cache(maxsize=None)
def _hook_class():
    cp = cupy_module()

    class PoolPeak(cp.cuda.MemoryHook):
        """Memory hook: ``peak`` is the most bytes held at once by allocations
        from CuPy's pools made while the hook was active (this thread)."""

        name = "hyscale_pool_peak"

        def __init__(self):
            self.held: dict[int, int] = {}  # pointer -> bytes, allocated under the hook
            self.current = 0
            self.peak = 0

        def malloc_postprocess(self, **info):
            if not info["mem_ptr"]:  # the allocation failed
                return
            self.held[info["mem_ptr"]] = info["mem_size"]
            self.current += info["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **info):
            self.current -= self.held.pop(info["mem_ptr"], 0)

    return PoolPeak


def pool_peak():
    """A context manager counting device memory: ``with pool_peak() as m: ...``
    then ``m.peak`` holds the high-water mark in bytes (allocations rounded as
    the pool rounds them; memory allocated before the block is not counted)."""
    return _hook_class()()
