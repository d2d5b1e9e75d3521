"""Selection logs in HDF5: what a rollout selected, replayed by training.

An inference rollout appends every layer's selection (int32 [N, k], see
``hs.indexer_topk``) for each sample or step; a later training step reads
exactly those selections back. The file is plain HDF5:

    /                       attrs format = "hyscale-selection-log",
                                  format_version = 1, complete, created,
                                  hyscale_version (of the writer that made it)
    /samples/<sample>/<layer>
        the table's datasets         in the entry's encoding (encodings.py):
                                     count, first, gaps, lehmer for
                                     "sorted-gaps-lehmer-v1", table for
                                     "int32-v1"; chunked along its rows,
                                     shuffle + deflate + fletcher32 on
                                     every chunk
        q_pos, cu_seqlens            int64, only when given to append
        attrs  n_queries, k, n_keys, causal, fingerprint, encoding,
               hyscale_version, created, chunk_rows, appended

Each entry is stored in the smaller of the two encodings unless the writer
asks for one (see encodings.py for the rule and its cost). format_version
stays 1 with the second encoding: the layout is unchanged and the entry's
``encoding`` attribute, there since version 1, names how it is stored; a
reader that does not know an entry's encoding refuses that entry by name.

Safety contract:

* ``complete`` is false from the moment a writer opens the file until it
  closes it; a reader refuses an incomplete log unless asked
  (``allow_incomplete=True``).
* An entry gets ``appended = true`` only after its data and metadata are
  flushed to the file. A writer killed at any point leaves every earlier
  entry readable; an entry it was writing is reported, never returned.
  (Flushed means handed to the operating system: it survives the process,
  not a power cut.)
* Reading a whole table checks it against its logged fingerprint; every
  chunk read is checked by fletcher32. Problems raise ``SelectionLogError``
  (a ``ValueError``) naming the file, sample and layer.
"""
from __future__ import annotations

import datetime
import numbers
import os
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from .. import __version__
from .._backend import GPU, as_array
from .._checks import check_dtype, check_int, check_ndim
from ..ops.indexer.ranges import candidate_ranges, host_ints
from . import encodings
from .entry import EntryInfo, FingerprintMismatchError, IncompleteLogError, SelectionLogError
from .fingerprint import fingerprint

FORMAT = "hyscale-selection-log"
FORMAT_VERSION = 1
DEFAULT_CHUNK_ROWS = 1024
_SAMPLES = "samples"
_MODES = ("r", "w", "x", "a")
# Each entry attribute EntryInfo holds, and the Python type it is read as.
_ENTRY_ATTRS = {"n_queries": int, "k": int, "n_keys": int, "causal": bool, "fingerprint": str, "encoding": str,
                "hyscale_version": str, "created": str}
_KIND_NAMES = {int: "an integer >= 0", bool: "a bool", str: "a string"}
_MASKS = ("q_pos", "cu_seqlens")


def entry_name(value: Any, what: str) -> str:
    """A sample or layer key as its HDF5 group name (ints become decimal strings).

    TypeError unless ``value`` is a str or an int; ValueError naming ``what``
    for a name HDF5 cannot hold as given: empty, "." or "..", holding "/" or
    NUL (HDF5 would cut it there), or not encodable as UTF-8.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (str, numbers.Integral)):
        raise TypeError(f"{what} must be a str or an int, got {value!r}")
    name = str(int(value)) if isinstance(value, numbers.Integral) else value
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"{what} must be a non-empty name without '/' or NUL, got {value!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be UTF-8 encodable (HDF5 stores names as UTF-8), got {value!r}") from None
    return name


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _scalar(value: Any, kind: type) -> Any:
    """A stored attribute as a Python ``kind`` (int >= 0, bool or str), None if it is not one."""
    if kind is str:
        return _text(value)
    if kind is bool:
        return bool(value) if isinstance(value, (bool, np.bool_)) else None
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)) and value >= 0:
        return int(value)
    return None


def _appended(group: h5py.HLObject) -> bool:
    """Whether an entry was completely appended: its ``appended`` attribute is a true bool."""
    return _scalar(group.attrs.get("appended"), bool) is True


def _open_problem(exc: OSError) -> str:
    message = str(exc)
    if "truncated file" in message:
        return f"the file is truncated ({message})"
    if "signature not found" in message:
        return "not an HDF5 file, so not a hyscale selection log"
    if "lock" in message:
        return f"the file is locked by another process, perhaps a writer still running ({message})"
    return f"cannot be opened as HDF5 ({message})"


def _host_table(indices: Any) -> np.ndarray:
    backend, table = as_array(indices, "indices")
    if backend == GPU:
        table = table.get()
    check_ndim(table, 2, "indices", "[N, k]")
    check_dtype(table, (np.dtype(np.int32),), "indices")
    return np.ascontiguousarray(table)


def _check_range(table: np.ndarray, n_keys: int) -> None:
    """ValueError naming the first entry of ``indices`` outside [-1, n_keys)."""
    outside = (table < -1) | (table >= n_keys)
    if outside.any():
        r, c = divmod(int(np.flatnonzero(outside)[0]), table.shape[1])
        raise ValueError(f"indices[{r}, {c}] = {table[r, c]} is outside [-1, n_keys = {n_keys}) (-1 = no key)")


def _check_masks(table: np.ndarray, causal: Any, q_pos: Any, cu_seqlens: Any, n_keys: int) -> dict[str, Any]:
    """The masks as stored (int64 arrays or None); ValueError if the table (entries
    in [-1, n_keys), see _check_range) leaves them."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    n, k = table.shape
    if q_pos is None and (causal or cu_seqlens is not None) and n > n_keys:  # queries placed at the last keys
        raise ValueError(f"indices has {n} rows (queries) but n_keys = {n_keys}: without q_pos the queries are "
                         f"the last {n} keys, so pass q_pos or n_keys >= {n}")
    lo, hi = candidate_ranges(n, n_keys, causal, q_pos, cu_seqlens)  # validates q_pos, cu_seqlens
    outside = (table >= 0) & ((table < lo[:, None]) | (table >= hi[:, None]))
    if outside.any():
        r, c = divmod(int(np.flatnonzero(outside)[0]), k)
        raise ValueError(f"indices[{r}, {c}] = {table[r, c]} is neither -1 nor a key query {r} may select "
                         f"(keys {lo[r]} <= s < {hi[r]})")
    stored = {name: None if mask is None else host_ints(mask, name) for name, mask in
              (("q_pos", q_pos), ("cu_seqlens", cu_seqlens))}
    return {"causal": causal, **stored}


class SelectionLog:
    """An HDF5 selection log, opened like a file (``with SelectionLog(...)``).

    Parameters
    ----------
    path : str or os.PathLike
    mode : "r" read; "w" create (replacing a file there); "x" create,
        failing if a file exists; "a" append to a log (created if missing).
    allow_incomplete : read (or, in "a", continue) a log whose writer did
        not close it, e.g. after a crash: every completely appended entry
        is readable, an entry cut off mid-append is skipped and listed by
        :meth:`incomplete_entries`.
    compression_level : deflate level 0-9 for new entries (default 4).
    chunk_rows : table rows per HDF5 chunk for new entries (default 1024);
        reading rows [a, b) touches only the chunks holding them.
    encoding : how new entries are stored: "auto" (default) the smaller of
        "sorted-gaps-lehmer-v1" and "int32-v1" for each entry (the rule and
        its cost: encodings.py), or one of those two for every entry.
        Reading takes every entry in whichever encoding it was written.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "r", *, allow_incomplete: bool = False,
                 compression_level: int = 4, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                 encoding: str = encodings.AUTO) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if encoding != encodings.AUTO and encoding not in encodings.ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(map(repr, [encodings.AUTO, *encodings.ENCODINGS]))}"
                             f", got {encoding!r}")
        self.path = Path(os.fspath(path))
        self.mode = mode
        self.compression_level = check_int(compression_level, "compression_level", 0, 9)
        self.chunk_rows = check_int(chunk_rows, "chunk_rows", 1)
        self.encoding = encoding
        new = mode in ("w", "x") or (mode == "a" and not self.path.exists())
        self._file = self._open(mode)
        try:
            if new:
                self._file.attrs.update(format=FORMAT, format_version=FORMAT_VERSION, created=_now(),
                                        hyscale_version=__version__, complete=False)
                self._file.create_group(_SAMPLES, track_order=True)
            self.complete = new or self._check_root(allow_incomplete)
            if mode != "r":
                self._file.attrs["complete"] = False
                self._file.flush()
        except BaseException:
            self._file.close()
            raise

    def _open(self, mode: str) -> h5py.File:
        try:  # libver "earliest": no superblock flags that block reopening after a crash
            return h5py.File(self.path, mode, libver="earliest", track_order=True)
        except (FileNotFoundError, FileExistsError):
            raise
        except OSError as exc:
            raise SelectionLogError(f"{self.path}: {_open_problem(exc)}") from exc

    def _check_root(self, allow_incomplete: bool) -> bool:
        """Whether the log is complete; SelectionLogError if it is not a log."""
        attrs = self._file.attrs
        found = _text(attrs.get("format"))
        if found != FORMAT:
            what = "no 'format' attribute" if found is None else f"format {found!r}"
            raise SelectionLogError(f"{self.path} is not a hyscale selection log (its root has {what}, "
                                    f"expected format {FORMAT!r})")
        version = attrs.get("format_version")
        if not isinstance(version, (numbers.Integral, np.integer)) or not isinstance(self._file.get(_SAMPLES),
                                                                                     h5py.Group):
            raise SelectionLogError(f"{self.path} is not a hyscale selection log: it says format {FORMAT!r} but "
                                    f"has format_version {version!r} and {'a' if _SAMPLES in self._file else 'no'} "
                                    f"/{_SAMPLES} group")
        if version > FORMAT_VERSION:
            raise SelectionLogError(f"{self.path} has format_version {version}; hyscale-core {__version__} "
                                    f"reads format_version <= {FORMAT_VERSION}: upgrade hyscale-core")
        complete = bool(attrs.get("complete", False))
        if not complete and not allow_incomplete:
            raise IncompleteLogError(
                f"{self.path} is incomplete: its writer has not closed it (still writing, or it stopped "
                f"without closing); open with allow_incomplete=True to read its {len(self)} completely "
                f"appended selections")
        return complete

    @property
    def metadata(self) -> dict[str, Any]:
        """The root attributes: format, format_version, created, hyscale_version, complete."""
        return {name: _text(value) or (value.item() if isinstance(value, np.generic) else value)
                for name, value in self._file.attrs.items()}

    # -- closing ---------------------------------------------------------

    def close(self, complete: bool = True) -> None:
        """Close the file; a writer marks the log complete unless ``complete=False``."""
        if not self._file.id.valid:
            return
        if self.mode != "r" and complete:
            self._file.attrs["complete"] = True
            self.complete = True
        self._file.close()

    def __enter__(self) -> SelectionLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)  # a writer that raised leaves the log incomplete

    # -- writing ---------------------------------------------------------

    def append(self, sample: str | int, layer: str | int, indices: Any, *, causal: bool = True,
               q_pos: Any = None, cu_seqlens: Any = None, n_keys: int | None = None) -> EntryInfo:
        """Log one selection, durable when this returns.

        ``indices`` int32 [N, k] (NumPy, CuPy or DLPack) as ``hs.indexer_topk``
        returned it for ``causal``, ``q_pos``, ``cu_seqlens`` over ``n_keys``
        keys (default N: self-attention). Every entry must be -1 or a key its
        query may select under those masks. Each (sample, layer) is written
        once; one left half-written by a crashed writer is replaced. The
        returned EntryInfo names the encoding the table was stored in.
        """
        if self.mode == "r":
            raise ValueError(f"{self.path} is open for reading (mode 'r'); open it with mode 'a' to append")
        sample, layer = entry_name(sample, "sample"), entry_name(layer, "layer")
        table = _host_table(indices)
        n_keys = table.shape[0] if n_keys is None else check_int(n_keys, "n_keys", 1)
        _check_range(table, n_keys)
        masks = _check_masks(table, causal, q_pos, cu_seqlens, n_keys)
        rows = encodings.chunk_rows(*table.shape, self.chunk_rows)
        encoding = (encodings.choose(table, rows, self.compression_level) if self.encoding == encodings.AUTO
                    else encodings.ENCODINGS[self.encoding])
        group = self._fresh_group(sample, layer)
        encodings.write(group, encoding, table, rows, self.compression_level)
        for name in _MASKS:
            if masks[name] is not None:
                encodings.write_array(group, name, masks[name], 0, masks[name].shape[0], self.compression_level)
        group.attrs.update(n_queries=table.shape[0], k=table.shape[1], n_keys=n_keys, causal=masks["causal"],
                           fingerprint=fingerprint(table), encoding=encoding.name, hyscale_version=__version__,
                           created=_now(), chunk_rows=rows)
        self._file.flush()
        group.attrs["appended"] = True  # only now, after the data is in the file
        self._file.flush()
        return self.info(sample, layer)

    def _fresh_group(self, sample: str, layer: str) -> h5py.Group:
        samples = self._file[_SAMPLES]
        sample_group = self._child(samples, sample, h5py.Group)
        if sample_group is None:
            sample_group = samples.create_group(sample, track_order=True)
        old = self._child(sample_group, layer, h5py.Group)
        if old is not None:
            if _appended(old):
                raise ValueError(f"sample {sample!r} layer {layer!r} is already in {self.path}; "
                                 f"each (sample, layer) is logged once")
            del sample_group[layer]  # cut off mid-append by a writer that crashed
        return sample_group.create_group(layer)

    # -- looking up ------------------------------------------------------

    def _child(self, parent: h5py.Group, name: str, kind: type) -> Any:
        """``parent[name]`` if it is a ``kind`` (h5py.Group or h5py.Dataset), None if there
        is none; SelectionLogError naming the file and the HDF5 path if it is something else."""
        item = parent.get(name)
        if item is None or isinstance(item, kind):
            return item
        raise SelectionLogError(f"{self.path}: {item.name} is an HDF5 {type(item).__name__}, "
                                f"expected a {kind.__name__}")

    def _attr(self, group: h5py.Group, name: str, kind: type, where: str) -> Any:
        """Attribute ``name`` (present) of the entry ``group`` as a Python ``kind`` (int >= 0,
        bool or str); SelectionLogError naming ``where``, the attribute and its value otherwise."""
        value = _scalar(group.attrs[name], kind)
        if value is None:
            raise SelectionLogError(f"{where}: attribute {name!r} is {group.attrs[name]!r}, "
                                    f"expected {_KIND_NAMES[kind]}")
        return value

    # -- listing ---------------------------------------------------------

    def _layer_groups(self, sample_group: h5py.Group) -> Iterator[tuple[str, h5py.Group]]:
        """(layer, group) of every entry of one sample; SelectionLogError if one is not a group."""
        for layer in sample_group:
            yield layer, self._child(sample_group, layer, h5py.Group)

    def _groups(self) -> Iterator[tuple[str, str, h5py.Group]]:
        samples = self._file[_SAMPLES]
        for sample in samples:
            for layer, group in self._layer_groups(self._child(samples, sample, h5py.Group)):
                yield sample, layer, group

    def keys(self) -> list[tuple[str, str]]:
        """Every completely appended (sample, layer): samples in the order they were first
        appended to, each sample's layers in append order."""
        return [(s, l) for s, l, g in self._groups() if _appended(g)]

    def incomplete_entries(self) -> list[tuple[str, str]]:
        """(sample, layer) entries a writer was cut off appending; never readable."""
        return [(s, l) for s, l, g in self._groups() if not _appended(g)]

    def samples(self) -> list[str]:
        """Samples with at least one appended layer, in append order."""
        return list(dict.fromkeys(s for s, _ in self.keys()))

    def layers(self, sample: str | int) -> list[str]:
        """Layers logged for ``sample``, in append order; KeyError if it has none."""
        sample = entry_name(sample, "sample")
        group = self._child(self._file[_SAMPLES], sample, h5py.Group)
        layers = [l for l, g in self._layer_groups(group) if _appended(g)] if group is not None else []
        if not layers:
            raise KeyError(f"sample {sample!r} is not in {self.path}")
        return layers

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, key: tuple[str | int, str | int]) -> bool:
        try:
            self._entry(*key)
        except (KeyError, IncompleteLogError):
            return False
        return True

    def __iter__(self) -> Iterator[EntryInfo]:
        """EntryInfo of every appended entry, in the order of :meth:`keys`."""
        return (self.info(s, l) for s, l in self.keys())

    # -- reading ---------------------------------------------------------

    def _where(self, sample: str, layer: str) -> str:
        return f"{self.path}: sample {sample!r} layer {layer!r}"

    def _entry(self, sample: str | int, layer: str | int) -> tuple[str, str, h5py.Group]:
        sample, layer = entry_name(sample, "sample"), entry_name(layer, "layer")
        sample_group = self._child(self._file[_SAMPLES], sample, h5py.Group)
        group = None if sample_group is None else self._child(sample_group, layer, h5py.Group)
        if group is None:
            raise KeyError(f"sample {sample!r} layer {layer!r} is not in {self.path}")
        if not _appended(group):
            raise IncompleteLogError(f"{self._where(sample, layer)} was not completely appended "
                                     f"(its writer stopped mid-append)")
        return sample, layer, group

    def info(self, sample: str | int, layer: str | int) -> EntryInfo:
        """Metadata of one entry; KeyError if it is not in the log, SelectionLogError
        naming the entry if its metadata is missing or malformed."""
        sample, layer, group = self._entry(sample, layer)
        where = self._where(sample, layer)
        missing = [a for a in _ENTRY_ATTRS if a not in group.attrs]
        if missing:
            raise SelectionLogError(f"{where} lacks metadata: {', '.join(missing)}")
        attrs = {name: self._attr(group, name, kind, where) for name, kind in _ENTRY_ATTRS.items()}
        masks = {name: self._mask(sample, layer, group, name) for name in _MASKS}
        stored = sum(item.id.get_storage_size() for name, item in group.items()
                     if name not in _MASKS and isinstance(item, h5py.Dataset))  # the table's datasets
        return EntryInfo(sample=sample, layer=layer, **attrs, **masks, stored_bytes=int(stored))

    def _mask(self, sample: str, layer: str, group: h5py.Group, name: str) -> np.ndarray | None:
        """The stored mask ``name`` as int64 [n], None if the entry has none; SelectionLogError
        unless it holds 1-D integers."""
        if name not in group:
            return None
        values = self._read(sample, layer, group, name, 0, slice(None))
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise SelectionLogError(f"{self._where(sample, layer)}: dataset {name!r} has shape {values.shape} and "
                                    f"dtype {values.dtype}, expected 1-D integers")
        return values.astype(np.int64)

    def _read(self, sample: str, layer: str, group: h5py.Group, name: str, axis: int, rows: slice) -> np.ndarray:
        """Rows ``rows`` (along ``axis``) of one dataset; SelectionLogError if it is missing,
        has no such axis or is corrupted."""
        dataset = self._child(group, name, h5py.Dataset)
        if dataset is None:
            raise SelectionLogError(f"{self._where(sample, layer)} has no dataset {name!r}")
        if dataset.ndim <= axis:
            raise SelectionLogError(f"{self._where(sample, layer)}: dataset {name!r} has shape {dataset.shape}, "
                                    f"expected rows along axis {axis}")
        try:
            if dataset.size == 0:  # stored unchunked: read it whole (nothing), slice here
                return dataset[()][(slice(None),) * axis + (rows,)]
            return dataset[(slice(None),) * axis + (rows,)]
        except OSError as exc:
            raise SelectionLogError(f"{self._where(sample, layer)}: dataset {name!r} is corrupted, its checksum "
                                    f"or decompression failed ({exc})") from exc

    def read(self, sample: str | int, layer: str | int, rows: slice | None = None, *,
             verify: bool = True) -> np.ndarray:
        """The logged selection, int32 [N, k], or rows ``rows`` (a slice) of it.

        A whole table is checked against its logged fingerprint
        (``verify=False`` skips that); a row range is checked by the chunks'
        fletcher32 checksums and by its indices lying in [-1, n_keys).
        Raises KeyError if the entry is absent, FingerprintMismatchError /
        SelectionLogError if it does not read back.
        """
        info = self.info(sample, layer)
        sample, layer, group = self._entry(sample, layer)
        try:
            encoding = encodings.lookup(info.encoding)
        except ValueError as exc:
            raise SelectionLogError(f"{self._where(sample, layer)}: {exc}") from exc
        rows = slice(None) if rows is None else rows
        if not isinstance(rows, slice) or rows.indices(info.n_queries)[2] != 1:
            raise ValueError(f"rows must be a slice with step 1, got {rows!r}")
        start, stop, _ = rows.indices(info.n_queries)
        rows = slice(start, max(start, stop))
        arrays = [self._read(sample, layer, group, name, axis, rows) for name, axis in encoding.fields]
        try:
            table = encoding.decode(arrays)
        except ValueError as exc:
            raise SelectionLogError(f"{self._where(sample, layer)}: {exc}") from exc
        if table.shape[1] != info.k or (rows.stop - rows.start) != table.shape[0]:
            raise SelectionLogError(f"{self._where(sample, layer)}: stored arrays hold a [{table.shape[0]}, "
                                    f"{table.shape[1]}] table, metadata says rows {rows} of "
                                    f"[{info.n_queries}, {info.k}]")
        if table.size and (table.min() < -1 or table.max() >= info.n_keys):
            raise SelectionLogError(f"{self._where(sample, layer)}: stored table holds indices in [{table.min()}, "
                                    f"{table.max()}], outside [-1, n_keys = {info.n_keys})")
        if verify and table.shape[0] == info.n_queries:
            found = fingerprint(table)
            if found != info.fingerprint:
                raise FingerprintMismatchError(f"{self._where(sample, layer)}: selection read back has fingerprint "
                                               f"{found}, logged with {info.fingerprint}")
        return table
