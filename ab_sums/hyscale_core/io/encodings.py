"""How a logged selection is stored, and the choice of the smaller encoding.

A selection table (int32 [N, k], ``-1`` = no key) is stored in one of two
lossless encodings, named by the entry's ``encoding`` attribute:

    name                    datasets (row axis)                        see
    "sorted-gaps-lehmer-v1" count (0), first (0), gaps (1), lehmer (1) codec.py
    "int32-v1"              table (0): the int32 table itself          here

Every dataset is chunked ``rows`` table rows at a time along its row axis
(the same rows for both encodings), with HDF5 shuffle + deflate +
fletcher32 on each chunk, so a row range reads only the chunks holding it.

Which is smaller depends on the selections. Sorted gaps + Lehmer codes the
set and the rank order near their information content when the rank order
has no relation to the index order (the usual case for a real indexer; it
wins on random selections at long context and on windowed ones). Plain int32
lets deflate find runs of positions that recur across rows, which the
Lehmer digits hide: an indexer that ties (scores that depend on the token
only) selects merges of the same runs in every row, and int32 stores those
in a quarter of the Lehmer size.

The rule (``encoding="auto"``, the default): encode the same rows both ways
with the log's filters into an in-memory HDF5 file and keep the encoding
whose chunks are smaller (int32 on a tie: it writes and reads faster). The
rows are the whole table when it spans at most ``SAMPLE_CHUNKS`` chunks (the
choice is then exact), else ``SAMPLE_CHUNKS`` whole chunks spread evenly
over the table (chunk ``floor((i + 1/2) * chunks / SAMPLE_CHUNKS)``). Cost:
both encodings of those rows, about ``SAMPLE_CHUNKS / chunks`` of writing
the table once each way (an eighth at N = 32768 with 1024-row chunks).
"""
from __future__ import annotations

import io
from typing import Protocol

import h5py
import numpy as np

from . import codec

AUTO = "auto"
SAMPLE_CHUNKS = 4
MAX_CHUNK_BYTES = 64 << 20  # far below HDF5's 4 GiB chunk limit


class Encoding(Protocol):
    """A stored form of a selection table: its datasets and the two directions."""

    name: str
    fields: tuple[tuple[str, int], ...]  # (dataset name, axis running over the table's rows)

    def encode(self, table: np.ndarray) -> dict[str, np.ndarray]:
        """The datasets of an int32 table [N, k] (entries >= -1), by name."""

    def decode(self, arrays: list[np.ndarray]) -> np.ndarray:
        """The int32 table [n, k] of the datasets' rows ``a:b``, in the order of ``fields``;
        ValueError if they are inconsistent."""


class LehmerEncoding:
    """Sorted gaps + Lehmer rank order, digit-major (codec.py)."""

    name = codec.ENCODING
    fields = codec.FIELDS

    def encode(self, table: np.ndarray) -> dict[str, np.ndarray]:
        return codec.encode(table).arrays()

    def decode(self, arrays: list[np.ndarray]) -> np.ndarray:
        return codec.decode(*arrays)


class Int32Encoding:
    """The table itself, int32 [N, k] row-major."""

    name = "int32-v1"
    fields = (("table", 0),)

    def encode(self, table: np.ndarray) -> dict[str, np.ndarray]:
        return {"table": table}

    def decode(self, arrays: list[np.ndarray]) -> np.ndarray:
        (table,) = arrays
        if table.ndim != 2 or table.dtype != np.int32:
            raise ValueError(f"corrupt encoding: table has shape {table.shape} and dtype {table.dtype}, "
                             f"expected an int32 [N, k] table")
        return table


LEHMER = LehmerEncoding()
INT32 = Int32Encoding()
ENCODINGS: dict[str, Encoding] = {e.name: e for e in (LEHMER, INT32)}


def lookup(name: str) -> Encoding:
    """The encoding stored under ``name``; ValueError naming the known ones otherwise."""
    if name not in ENCODINGS:
        raise ValueError(f"unknown encoding {name!r}; this reader knows {', '.join(map(repr, ENCODINGS))}")
    return ENCODINGS[name]


def chunk_rows(n: int, k: int, wanted: int) -> int:
    """Table rows per chunk: ``wanted``, fewer if a chunk of int32 rows would pass MAX_CHUNK_BYTES."""
    return max(1, min(wanted, n, MAX_CHUNK_BYTES // max(4 * k, 1)))


def write_array(group: h5py.Group, name: str, data: np.ndarray, axis: int, rows: int, level: int) -> None:
    """One dataset, chunked ``rows`` table rows at a time along ``axis``, shuffle +
    deflate ``level`` + fletcher32."""
    if data.size == 0:  # HDF5 has no chunks of size 0; nothing to compress
        group.create_dataset(name, data=data)
        return
    chunks = list(data.shape)
    chunks[axis] = min(rows, data.shape[axis])
    group.create_dataset(name, data=data, chunks=tuple(chunks), shuffle=True, compression="gzip",
                         compression_opts=level, fletcher32=True)


def write(group: h5py.Group, encoding: Encoding, table: np.ndarray, rows: int, level: int) -> int:
    """Store ``table`` (int32 [N, k]) in ``group`` as ``encoding``; returns the bytes its chunks take."""
    arrays = encoding.encode(table)
    for name, axis in encoding.fields:
        write_array(group, name, arrays[name], axis, rows, level)
    return sum(group[name].id.get_storage_size() for name, _ in encoding.fields)


def sample(table: np.ndarray, rows: int) -> np.ndarray:
    """The rows the choice is made on: the whole table if it spans at most SAMPLE_CHUNKS
    chunks of ``rows`` rows, else SAMPLE_CHUNKS whole chunks spread evenly over it."""
    chunks = -(-table.shape[0] // rows)
    if chunks <= SAMPLE_CHUNKS:
        return table
    picks = ((np.arange(SAMPLE_CHUNKS) + 0.5) * chunks / SAMPLE_CHUNKS).astype(int)
    return np.concatenate([table[c * rows:(c + 1) * rows] for c in picks])


def stored_sizes(table: np.ndarray, rows: int, level: int) -> dict[str, int]:
    """Bytes each encoding's chunks take for ``table`` (int32 [n, k]), written
    with the log's filters into an in-memory HDF5 file."""
    sizes = {}
    with h5py.File(io.BytesIO(), "w") as f:
        for name, encoding in ENCODINGS.items():
            sizes[name] = write(f.create_group(name), encoding, table, rows, level)
    return sizes


def choose(table: np.ndarray, rows: int, level: int) -> Encoding:
    """The encoding whose chunks are smaller on :func:`sample` of ``table`` (int32 [N, k],
    entries >= -1) with ``rows``-row chunks and deflate ``level``; int32 on a tie."""
    sizes = stored_sizes(sample(table, rows), rows, level)
    return INT32 if sizes[INT32.name] <= sizes[LEHMER.name] else LEHMER
