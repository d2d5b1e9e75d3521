"""The communication cost model of hyscale_core.mpi (pure arithmetic, no MPI)."""
from __future__ import annotations

import numpy as np

from hyscale_core.mpi import costmodel


def test_allgather_moves_every_foreign_row_once():
    counts = np.array([3, 5, 2])
    sent, received = costmodel.allgather_bytes(counts, 10)
    np.testing.assert_array_equal(received, [70, 50, 80])
    np.testing.assert_array_equal(sent, [60, 100, 40])
    assert sent.sum() == received.sum()


def test_fetch_counts_rows_and_ids_both_ways():
    fetched = np.array([[9, 2, 0], [1, 9, 3], [4, 0, 9]])  # fetched[r, o]; the diagonal moves nothing
    sent, received = costmodel.fetch_bytes(fetched, 100)
    f, s = np.array([2, 4, 4]), np.array([5, 2, 3])
    np.testing.assert_array_equal(received, f * 100 + s * costmodel.ID_BYTES)
    np.testing.assert_array_equal(sent, f * costmodel.ID_BYTES + s * 100)
    back_sent, back_received = costmodel.fetch_backward_bytes(fetched, 100)
    np.testing.assert_array_equal(back_sent, f * 100)
    np.testing.assert_array_equal(back_received, s * 100)


def test_choice_follows_the_slowest_rank():
    counts = np.array([1000, 1000])
    assert costmodel.choose_exchange(counts, np.array([600, 10]), 8) == "fetch"
    assert costmodel.choose_exchange(counts, np.array([700, 10]), 8) == "allgather"  # ids tip it: 700 * 12 > 8000
    assert costmodel.choose_exchange(counts, np.array([0, 0]), 8) == "fetch"
    np.testing.assert_array_equal(costmodel.fetch_bound(np.array([16, 1 << 20]), 2048), [16 * 2048, 16])
