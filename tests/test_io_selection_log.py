"""SelectionLog: round trips with metadata, reopening, row ranges, bad files, size."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

import hyscale_core as hs
from helpers import causal_selection, dataset_in_place_of
from hyscale_core.io import (FingerprintMismatchError, IncompleteLogError, SelectionLog, SelectionLogError,
                             fingerprint)
from hyscale_core.io.encodings import ENCODINGS, LEHMER

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def table():
    return causal_selection(np.random.default_rng(0), 300, 64)


def write(path, entries, **kwargs):
    with SelectionLog(path, "w", **kwargs) as log:
        for sample, layer, t, masks in entries:
            log.append(sample, layer, t, **masks)


def test_round_trip_with_metadata(tmp_path, table):
    cu = np.array([0, 7, 300])
    packed = causal_selection(np.random.default_rng(1), 300, 64, cu)
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        info = log.append("s0", "layer0", table)
        log.append("s0", 1, packed, cu_seqlens=cu)
    assert info.shape == (300, 64) and info.n_keys == 300 and info.causal and info.fingerprint == fingerprint(table)
    assert info.encoding in ENCODINGS and info.hyscale_version == hs.__version__
    assert info.raw_bytes == 4 * 300 * 64 and 0 < info.stored_bytes < info.raw_bytes
    with SelectionLog(tmp_path / "a.h5") as log:
        assert log.complete and log.metadata["format_version"] == 1
        assert log.keys() == [("s0", "layer0"), ("s0", "1")] and log.samples() == ["s0"]
        np.testing.assert_array_equal(log.read("s0", "layer0"), table)
        np.testing.assert_array_equal(log.read("s0", 1), packed)
        second = log.info("s0", "1")
        np.testing.assert_array_equal(second.cu_seqlens, cu)
        assert second.q_pos is None and log.info("s0", "layer0").cu_seqlens is None
        assert [e.layer for e in log] == ["layer0", "1"] and len(log) == 2 and ("s0", 1) in log


def test_masks_q_pos_and_non_causal_are_kept(tmp_path):
    table = np.array([[4, 0, -1], [9, 8, 1]], dtype=np.int32)
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        log.append(3, "x", table, causal=True, q_pos=[5, 9], n_keys=10)
        log.append(3, "y", table, causal=False, n_keys=10)
    with SelectionLog(tmp_path / "a.h5") as log:
        x, y = log.info(3, "x"), log.info(3, "y")
        assert x.mask_kwargs()["causal"] and not y.causal and x.n_keys == y.n_keys == 10
        np.testing.assert_array_equal(x.q_pos, [5, 9])
        np.testing.assert_array_equal(log.read(3, "y"), table)


def test_reopen_to_append_keeps_order_and_everything_written(tmp_path, table):
    path = tmp_path / "a.h5"
    write(path, [(0, 0, table, {}), (0, 1, table[:, :7], {})])
    with SelectionLog(path, "a") as log:
        log.append(1, 0, table[:50])
        assert log.layers(0) == ["0", "1"]
    with SelectionLog(path, "a") as log:  # and once more, a third writer session
        log.append(0, 2, table[::-1].copy() * 0)
    with SelectionLog(path) as log:
        assert log.keys() == [("0", "0"), ("0", "1"), ("0", "2"), ("1", "0")]  # by sample, then append
        assert log.samples() == ["0", "1"] and log.layers(0) == ["0", "1", "2"]
        np.testing.assert_array_equal(log.read(0, 1), table[:, :7])
        np.testing.assert_array_equal(log.read(1, 0), table[:50])


def test_row_ranges(tmp_path, table):
    write(tmp_path / "a.h5", [(0, 0, table, {})], chunk_rows=64)
    with SelectionLog(tmp_path / "a.h5") as log:
        for rows in (slice(0, 1), slice(60, 70), slice(250, None), slice(-5, None), slice(10, 5)):
            np.testing.assert_array_equal(log.read(0, 0, rows), table[rows])
        with pytest.raises(ValueError, match="step 1"):
            log.read(0, 0, slice(0, 10, 2))


def test_datasets_are_chunked_along_rows_and_checksummed(tmp_path, table):
    write(tmp_path / "a.h5", [(0, 0, table, {})], chunk_rows=128, encoding=LEHMER.name)  # int32: test_io_encodings
    with h5py.File(tmp_path / "a.h5") as f:
        group = f["samples/0/0"]
        for name, chunks in (("count", (128,)), ("first", (128,)), ("gaps", (63, 128)), ("lehmer", (64, 128))):
            ds = group[name]
            assert ds.chunks == chunks and ds.fletcher32 and ds.shuffle and ds.compression == "gzip", name
        assert f.attrs["format"] == "hyscale-selection-log" and bool(f.attrs["complete"])


def corrupt_chunk(path, dataset, chunk):
    with h5py.File(path) as f:
        info = f[dataset].id.get_chunk_info(chunk)
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset + info.size // 2)
        byte = raw.read(1)
        raw.seek(info.byte_offset + info.size // 2)
        raw.write(bytes([byte[0] ^ 0xFF]))


def test_corrupted_chunk_is_named_and_other_row_ranges_still_read(tmp_path, table):
    path = tmp_path / "a.h5"
    write(path, [("s", "L", table, {})], chunk_rows=64, encoding=LEHMER.name)
    corrupt_chunk(path, "samples/s/L/lehmer", 2)  # rows 128..191
    with SelectionLog(path) as log:
        np.testing.assert_array_equal(log.read("s", "L", slice(0, 128)), table[:128])  # untouched chunks
        np.testing.assert_array_equal(log.read("s", "L", slice(192, 300)), table[192:])
        for rows in (None, slice(130, 140)):
            with pytest.raises(SelectionLogError, match=rf"{path}: sample 's' layer 'L': dataset 'lehmer' is corrupted"):
                log.read("s", "L", rows)


def test_fingerprint_mismatch_names_the_entry(tmp_path, table):
    path = tmp_path / "a.h5"
    write(path, [("s", "L", table, {}), ("s", "M", table, {})], encoding=LEHMER.name)
    with h5py.File(path, "r+") as f:  # valid checksums, different data: only the fingerprint can tell
        first = f["samples/s/L/first"]
        first[5] = first[5] + 1
        f["samples/s/M"].attrs["fingerprint"] = "0" * 32
    with SelectionLog(path) as log:
        for layer in ("L", "M"):
            with pytest.raises(FingerprintMismatchError, match=f"sample 's' layer '{layer}'"):
                log.read("s", layer)
        assert log.read("s", "L", verify=False)[5].max() == table[5].max() + 1


def test_plain_h5py_file_is_not_a_log(tmp_path):
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["samples/0/0"] = np.zeros((3, 3), np.int32)
    with pytest.raises(ValueError, match=rf"{path} is not a hyscale selection log \(its root has no 'format'"):
        SelectionLog(path)
    with pytest.raises(ValueError, match="not a hyscale selection log"):
        SelectionLog(path, "a")
    with h5py.File(path, "r+") as f:
        f.attrs["format"] = "hyscale-selection-log"
    with pytest.raises(ValueError, match="not a hyscale selection log: it says format"):
        SelectionLog(path)


def test_foreign_truncated_and_newer_files(tmp_path, table):
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not hdf5\n" * 100)
    with pytest.raises(SelectionLogError, match=rf"{foreign}: not an HDF5 file"):
        SelectionLog(foreign)
    path = tmp_path / "a.h5"
    write(path, [(0, 0, table, {})])
    size = path.stat().st_size
    truncated = tmp_path / "cut.h5"
    truncated.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(SelectionLogError, match=rf"{truncated}: the file is truncated"):
        SelectionLog(truncated)
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 2
    with pytest.raises(SelectionLogError, match="format_version 2"):
        SelectionLog(path)
    with pytest.raises(FileNotFoundError):
        SelectionLog(tmp_path / "missing.h5")


def test_writer_that_raised_leaves_an_incomplete_log(tmp_path, table):
    path = tmp_path / "a.h5"
    with pytest.raises(RuntimeError):
        with SelectionLog(path, "w") as log:
            log.append(0, 0, table)
            raise RuntimeError("rollout failed")
    with pytest.raises(IncompleteLogError, match=rf"{path} is incomplete.*allow_incomplete=True.*1 completely"):
        SelectionLog(path)
    with pytest.raises(IncompleteLogError):
        SelectionLog(path, "a")
    with SelectionLog(path, allow_incomplete=True) as log:
        assert not log.complete
        np.testing.assert_array_equal(log.read(0, 0), table)
    with SelectionLog(path, "a", allow_incomplete=True) as log:  # finishing the job marks it complete
        log.append(0, 1, table)
    assert SelectionLog(path).complete


def test_bad_appends_are_named(tmp_path, table):
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        log.append(0, 0, table)
        with pytest.raises(ValueError, match="sample '0' layer '0' is already in"):
            log.append("0", "0", table)
        bad = table.copy()
        bad[10, 3] = 11
        with pytest.raises(ValueError, match=r"indices\[10, 3\] = 11 is neither -1 nor a key query 10 may select"):
            log.append(0, 1, bad)
        with pytest.raises(ValueError, match=r"indices\[0, 1\] = -5"):
            log.append(0, 1, np.array([[0, -5]], dtype=np.int32))
        with pytest.raises(TypeError, match="indices has dtype int64"):
            log.append(0, 1, table.astype(np.int64))
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            log.append(0, 1, table, cu_seqlens=[1, 300])
        with pytest.raises(TypeError, match="causal must be a bool"):
            log.append(0, 1, table, causal=1)
        for name in ("a/b", "", "."):
            with pytest.raises(ValueError, match="layer must be a non-empty name without '/'"):
                log.append(0, name, table)
        with pytest.raises(TypeError, match="sample must be a str or an int"):
            log.append(True, 1, table)
        assert log.keys() == [("0", "0")]  # nothing half-written by the refused appends
    with SelectionLog(tmp_path / "a.h5") as log:
        with pytest.raises(ValueError, match="open for reading"):
            log.append(0, 1, table)
        with pytest.raises(KeyError, match="sample '0' layer '9' is not in"):
            log.read(0, 9)
        with pytest.raises(KeyError, match="sample '4' is not in"):
            log.layers(4)
    with pytest.raises(ValueError, match="mode must be one of"):
        SelectionLog(tmp_path / "a.h5", "rw")
    with pytest.raises(FileExistsError):
        SelectionLog(tmp_path / "a.h5", "x")


def test_empty_tables(tmp_path):
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        log.append(0, "no rows", np.zeros((0, 16), np.int32), n_keys=4, q_pos=np.zeros(0, int))
        log.append(0, "k=0", np.zeros((5, 0), np.int32))
        log.append(0, "all -1", np.full((5, 3), -1, np.int32), cu_seqlens=[0, 0, 5])
    with SelectionLog(tmp_path / "a.h5") as log:
        assert log.read(0, "no rows").shape == (0, 16) and log.read(0, "k=0").shape == (5, 0)
        assert log.read(0, "k=0", slice(1, 3)).shape == (2, 0)
        assert (log.read(0, "all -1") == -1).all()


def test_format_version_1_file_still_reads():
    spec = importlib.util.spec_from_file_location("make_v1", DATA / "make_selection_log_v1.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    with SelectionLog(DATA / "selection_log_v1.h5") as log:
        assert log.metadata["format_version"] == 1 and log.metadata["hyscale_version"] == "0.1.0"
        assert log.keys() == [("rollout-0", "0"), ("rollout-0", "1"), ("7", "layers.2.indexer")]
        expected = {("rollout-0", "0"): make.windows(50, 8),
                    ("rollout-0", "1"): make.windows(50, 8, make.CU_SEQLENS),
                    ("7", "layers.2.indexer"): make.scattered()}
        prints = ["1ee53146fa1088429c9d07e9565d1846", "abaaa080871e8b8b52e839f30cbbc6d9",
                  "0042f558bc5e57b30872d532d6f739f4"]
        for (key, table), known in zip(expected.items(), prints):
            np.testing.assert_array_equal(log.read(*key), table)
            assert log.info(*key).fingerprint == known == fingerprint(table)
        last = log.info(7, "layers.2.indexer")
        assert not last.causal and last.n_keys == 30
        np.testing.assert_array_equal(last.q_pos, make.Q_POS)
        np.testing.assert_array_equal(log.info("rollout-0", "1").cu_seqlens, make.CU_SEQLENS)


def test_entries_record_the_writer_version_and_mix_across_versions(tmp_path, table, monkeypatch):
    from hyscale_core.io import selection_log

    path = tmp_path / "a.h5"
    monkeypatch.setattr(selection_log, "__version__", "0.0.9")
    write(path, [(0, 0, table, {})])
    monkeypatch.undo()
    with SelectionLog(path, "a") as log:
        log.append(0, 1, table)
    with SelectionLog(path) as log:
        assert log.metadata["hyscale_version"] == "0.0.9"
        assert [e.hyscale_version for e in log] == ["0.0.9", hs.__version__]
        np.testing.assert_array_equal(log.read(0, 0), log.read(0, 1))



def _table_is_a_group(f):
    del f["samples/s/L/table"]
    f.create_group("samples/s/L/table")


def _table_is_a_scalar(f):
    del f["samples/s/L/table"]
    f["samples/s/L/table"] = 3


def _set_attr(name, value):
    return lambda f: f["samples/s/L"].attrs.__setitem__(name, value)


MALFORMED = {
    "n_queries string": (_set_attr("n_queries", "three"),
                         r"sample 's' layer 'L': attribute 'n_queries' is 'three', expected an integer >= 0"),
    "n_keys array": (_set_attr("n_keys", np.array([3, 3])), r"attribute 'n_keys' is array\(\[3, 3\]\), expected an"),
    "k negative": (_set_attr("k", -1), r"attribute 'k' is np.int64\(-1\), expected an integer >= 0"),
    "causal int": (_set_attr("causal", 1), r"attribute 'causal' is np.int64\(1\), expected a bool"),
    "fingerprint int": (_set_attr("fingerprint", 7), r"attribute 'fingerprint' is np.int64\(7\), expected a string"),
    "sample is a dataset": (dataset_in_place_of("samples/s"), r": /samples/s is an HDF5 Dataset, expected a Group"),
    "layer is a dataset": (dataset_in_place_of("samples/s/L"), r": /samples/s/L is an HDF5 Dataset, expected a Group"),
    "table is a group": (_table_is_a_group, r": /samples/s/L/table is an HDF5 Group, expected a Dataset"),
    "table is a scalar": (_table_is_a_scalar, r"dataset 'table' has shape \(\), expected rows along axis 0"),
    "q_pos float": (lambda f: f.create_dataset("samples/s/L/q_pos", data=np.array([0.5, 1.0, 2.0])),
                    r"dataset 'q_pos' has shape \(3,\) and dtype float64, expected 1-D integers"),
}


def malformed_log(path, mutate):
    write(path, [("s", "L", np.array([[0, -1], [1, 0], [2, 1]], np.int32), {})], encoding="int32-v1")
    with h5py.File(path, "r+") as f:
        mutate(f)
    return path


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_entries_raise_selection_log_error_naming_them(tmp_path, case):
    mutate, message = MALFORMED[case]
    path = malformed_log(tmp_path / "a.h5", mutate)
    with SelectionLog(path) as log:
        with pytest.raises(SelectionLogError, match=rf"^{path}.*{message}"):
            log.read("s", "L")


def test_malformed_layout_is_named_when_listing_and_appending(tmp_path):
    for group in ("samples/s", "samples/s/L"):
        mutate, where = dataset_in_place_of(group), f"/{group} is"
        path = malformed_log(tmp_path / "a.h5", mutate)
        with SelectionLog(path, "a") as log:
            for call in (log.keys, log.incomplete_entries, lambda: log.layers("s"),
                         lambda: log.append("s", "L", np.zeros((1, 1), np.int32))):
                with pytest.raises(SelectionLogError, match=rf"^{path}: {where} an HDF5 Dataset, expected a Group"):
                    call()


def test_names_hdf5_cannot_hold_are_refused(tmp_path, table):
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        log.append("s", "a", table)
        for name in ("a\0b", "\0", "a\udcff"):
            with pytest.raises(ValueError, match=rf"^layer must be .*, got {re.escape(repr(name))}"):
                log.append("s", name, table)
            with pytest.raises(ValueError, match=rf"^sample must be .*, got {re.escape(repr(name))}"):
                log.read(name, "a")
        assert log.keys() == [("s", "a")]


def test_tables_outside_n_keys_name_indices_and_n_keys(tmp_path):
    t = np.array([[0, -1], [1, 0], [2, 1]], np.int32)
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        with pytest.raises(ValueError, match=r"^indices\[2, 0\] = 2 is outside \[-1, n_keys = 2\)"):
            log.append("s", "L", t, n_keys=2)
        with pytest.raises(ValueError, match=r"^indices has 3 rows \(queries\) but n_keys = 2: .* pass q_pos"):
            log.append("s", "L", np.minimum(t, 1), n_keys=2)
        log.append("s", "L", np.minimum(t, 1), n_keys=2, q_pos=[0, 1, 1])  # placed: fine
