"""SelectionLog's two encodings (sorted-gaps-lehmer-v1, int32-v1) and the choice between them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import h5py
import numpy as np
import pytest

import hyscale_core as hs
from helpers import causal_selection
from hyscale_core.io import SelectionLog, SelectionLogError, encodings, fingerprint
from test_io_selection_log import corrupt_chunk

DATA = Path(__file__).resolve().parent / "data"
NAMES = list(encodings.ENCODINGS)
CU = np.array([0, 40, 41, 300])


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    causal = np.arange(scores.shape[0])[:, None] < np.arange(scores.shape[1])[None, :]
    values, indices = hs.topk(np.where(causal, -np.inf, scores).astype(np.float32), k)
    return np.where(values == -np.inf, -1, indices).astype(np.int32)


def tied(rng, n, k, vocab=48):
    """What an indexer that scores the token alone selects: equal tokens tie, so each row
    is a merge of ascending runs of positions, the same runs row after row."""
    score = rng.standard_normal(vocab)[rng.integers(0, vocab, n)]
    return _topk(np.broadcast_to(score, (n, n)), k)


def windowed(rng, n, k):
    """A window of k/2 keys, k/4 anchors and 4 sinks, ranked with noise: random rank order."""
    distance = np.arange(n)[:, None] - np.arange(n)[None, :]
    scores = rng.standard_normal((n, n))
    scores += np.where((distance >= 0) & (distance < k // 2), 3.0 + 2.0 * (1 - distance / (k // 2)), 0)
    scores[:, rng.choice(n, k // 4, replace=False)] += 3.0
    scores[:, :4] += 6.0
    return _topk(scores, k)


def make(kind, n=300, k=64, seed=0):
    """(table int32 [n, k], append's mask arguments) of one kind of selection."""
    rng = np.random.default_rng(seed)
    if kind == "packed":  # rows shorter than k, -1 padded, a 1-token sequence among them
        return causal_selection(rng, n, k, CU), {"cu_seqlens": CU}
    return {"random": causal_selection, "tied": tied, "windowed": windowed}[kind](rng, n, k), {}


def append(path, table, masks, mode="w", **kwargs):
    with SelectionLog(path, mode, **kwargs) as log:
        return log.append(0, 0, table, **masks)


@pytest.mark.parametrize("kind", ["random", "tied", "windowed", "packed"])
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_and_row_ranges(tmp_path, name, kind):
    table, masks = make(kind)
    assert append(tmp_path / "a.h5", table, masks, encoding=name, chunk_rows=64).encoding == name
    with SelectionLog(tmp_path / "a.h5") as log:
        np.testing.assert_array_equal(log.read(0, 0), table)
        for rows in (slice(0, 1), slice(60, 70), slice(63, 129), slice(250, None), slice(10, 5)):
            np.testing.assert_array_equal(log.read(0, 0, rows), table[rows])
    with h5py.File(tmp_path / "a.h5") as f:
        group = f["samples/0/0"]
        assert sorted(n for n in group if n != "cu_seqlens") == sorted(n for n, _ in encodings.ENCODINGS[name].fields)
        for field, axis in encodings.ENCODINGS[name].fields:
            ds = group[field]
            assert ds.chunks[axis] == 64 and ds.fletcher32 and ds.shuffle and ds.compression == "gzip", field


@pytest.mark.parametrize("name", NAMES)
def test_edge_shapes_round_trip(tmp_path, name):
    with SelectionLog(tmp_path / "a.h5", "w", encoding=name) as log:
        log.append(0, "no rows", np.zeros((0, 16), np.int32), n_keys=4, q_pos=np.zeros(0, int))
        log.append(0, "k=0", np.zeros((5, 0), np.int32))
        log.append(0, "all -1", np.full((5, 3), -1, np.int32))
        log.append(0, "k=1", np.arange(7, dtype=np.int32)[:, None])
    with SelectionLog(tmp_path / "a.h5") as log:
        assert log.read(0, "no rows").shape == (0, 16) and log.read(0, "k=0", slice(1, 3)).shape == (2, 0)
        assert (log.read(0, "all -1") == -1).all()
        np.testing.assert_array_equal(log.read(0, "k=1", slice(2, 5)), [[2], [3], [4]])
        assert {e.encoding for e in log} == {name}


@pytest.mark.parametrize("chunk_rows,slack", [(1024, 1.0), (64, 1.01)])
def test_auto_stores_each_kind_in_the_smaller_encoding(tmp_path, chunk_rows, slack):
    # 1 chunk: decided on the whole table, exactly; 16 chunks: on 4 of them, so where the two
    # sizes are within the sample's noise (random here: 0.3% apart) either may be picked
    chosen = {}
    for kind in ("random", "tied", "windowed"):
        table, masks = make(kind, n=1024, k=64, seed=1)
        sizes = {name: append(tmp_path / f"{name}.h5", table, masks, encoding=name, chunk_rows=chunk_rows)
                 .stored_bytes for name in NAMES}
        auto = append(tmp_path / "auto.h5", table, masks, chunk_rows=chunk_rows)
        assert sizes[auto.encoding] == auto.stored_bytes <= slack * min(sizes.values()), (kind, sizes)
        chosen[kind] = auto.encoding
    # runs recurring across rows favour int32; a random rank order in a window favours Lehmer
    assert chosen["tied"] == encodings.INT32.name and chosen["windowed"] == encodings.LEHMER.name


def test_sample_is_whole_chunks_spread_over_the_table():
    table = np.arange(95, dtype=np.int32)[:, None]  # 10 chunks of 10 rows, the last one short
    picked = encodings.sample(table, 10)[:, 0]
    np.testing.assert_array_equal(picked, np.concatenate([np.arange(c * 10, c * 10 + 10) for c in (1, 3, 6, 8)]))
    np.testing.assert_array_equal(encodings.sample(table[:40], 10), table[:40])  # 4 chunks: the whole table


def test_size_well_below_raw(tmp_path):
    # Sizes, not speed: a regression here means an encoding lost its structure.
    with SelectionLog(tmp_path / "a.h5", "w") as log:
        window = log.append(0, "windowed", make("windowed", 2048, 256)[0])
        uniform = log.append(0, "random", make("random", 2048, 256)[0])
        runs = log.append(0, "tied", make("tied", 2048, 256)[0])
    assert window.ratio < 0.40 and uniform.ratio < 0.50 and runs.ratio < 0.05, (window, uniform, runs)


def test_one_log_holds_entries_in_both_encodings(tmp_path):
    path, random, runs = tmp_path / "a.h5", make("random")[0], make("tied")[0]
    with SelectionLog(path, "w", encoding=encodings.LEHMER.name) as log:
        log.append(0, 0, random)
    with SelectionLog(path, "a") as log:
        log.append(0, 1, runs)
    with SelectionLog(path) as log:
        assert [e.encoding for e in log] == [encodings.LEHMER.name, encodings.INT32.name]
        np.testing.assert_array_equal(log.read(0, 0), random)
        np.testing.assert_array_equal(log.read(0, 1), runs)


def test_encoding_option_is_checked(tmp_path):
    with pytest.raises(ValueError, match="encoding must be one of 'auto', 'sorted-gaps-lehmer-v1', 'int32-v1', "
                                         "got 'zstd'"):
        SelectionLog(tmp_path / "a.h5", "w", encoding="zstd")
    assert not (tmp_path / "a.h5").exists()


def test_int32_entry_problems_are_named(tmp_path):
    table, _ = make("random")
    path = tmp_path / "a.h5"
    with SelectionLog(path, "w", encoding=encodings.INT32.name, chunk_rows=64) as log:
        for layer in "LMNO":
            log.append("s", layer, table)
    with h5py.File(path, "r+") as f:  # valid checksums, wrong data
        f["samples/s/L/table"][5, :2] = table[5, 1::-1]  # two ranks swapped: only the fingerprint can tell
        f["samples/s/M/table"][70, 0] = 300  # an index past n_keys
        f["samples/s/N"].attrs["encoding"] = "zstd-v9"
        del f["samples/s/O/table"]
        f["samples/s/O/table"] = table.astype(np.int64)
    with SelectionLog(path) as log:
        with pytest.raises(SelectionLogError, match="sample 's' layer 'L': selection read back has fingerprint"):
            log.read("s", "L")
        with pytest.raises(SelectionLogError,
                           match=r"layer 'M': stored table holds indices in \[0, 300\], outside \[-1, n_keys = 300\)"):
            log.read("s", "M", slice(64, 128))
        np.testing.assert_array_equal(log.read("s", "M", slice(0, 64)), table[:64])
        with pytest.raises(SelectionLogError, match="layer 'N': unknown encoding 'zstd-v9'; this reader knows"):
            log.read("s", "N")
        with pytest.raises(SelectionLogError, match="layer 'O': corrupt encoding: table has shape .* dtype int64"):
            log.read("s", "O")


def test_int32_corrupted_chunk_is_named(tmp_path):
    table, _ = make("random")
    path = tmp_path / "a.h5"
    append(path, table, {}, encoding=encodings.INT32.name, chunk_rows=64)
    corrupt_chunk(path, "samples/0/0/table", 2)  # rows 128..191
    with SelectionLog(path) as log:
        np.testing.assert_array_equal(log.read(0, 0, slice(192, 300)), table[192:])
        with pytest.raises(SelectionLogError, match="dataset 'table' is corrupted"):
            log.read(0, 0, slice(130, 140))


def test_int32_fixture_still_reads():
    spec = importlib.util.spec_from_file_location("make_int32", DATA / "make_selection_log_int32.py")
    make_int32 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_int32)
    v1 = make_int32.formulas()
    expected = {("rollout-0", "0"): (v1.windows(50, 8), "1ee53146fa1088429c9d07e9565d1846", "int32-v1"),
                ("rollout-0", "1"): (v1.windows(50, 8, v1.CU_SEQLENS), "abaaa080871e8b8b52e839f30cbbc6d9", "int32-v1"),
                ("7", "layers.2.indexer"): (v1.scattered(), "0042f558bc5e57b30872d532d6f739f4",
                                            "sorted-gaps-lehmer-v1")}
    with SelectionLog(DATA / "selection_log_int32.h5") as log:
        assert log.metadata["format_version"] == 1 and log.keys() == list(expected)
        for key, (table, known, name) in expected.items():
            info = log.info(*key)
            assert (info.fingerprint, info.encoding) == (known, name) and fingerprint(table) == known
            np.testing.assert_array_equal(log.read(*key), table)
            np.testing.assert_array_equal(log.read(*key, slice(15, 33)), table[15:33])
        np.testing.assert_array_equal(log.info("rollout-0", "1").cu_seqlens, v1.CU_SEQLENS)
