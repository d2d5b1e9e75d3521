"""Sharded selection, sparse attention and training over `mpiexec -n 2` and `-n 3`
(CPU backend, uneven lengths) against the single-process results computed here;
a failing rank ends the job with an error, no hang."""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
import mpi_ranks as cases
from helpers import run_ranks
from hyscale_core.mpi import contiguous_layout, costmodel, zigzag_layout

pytestmark = pytest.mark.mpi

@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def sharded(request, tmp_path_factory):
    """(P, results of every group on P ranks)."""
    out = tmp_path_factory.mktemp("mpi") / f"np{request.param}.npz"
    done = run_ranks(request.param, out, "indexer", "attention", "engine", "transport")
    assert done.returncode == 0, done.stdout
    with np.load(out) as data:
        return request.param, dict(data)


@pytest.mark.parametrize("case", cases.INDEXER_CASES, ids=[c[0] for c in cases.INDEXER_CASES])
def test_indexer_topk_is_bitwise_the_single_process_one(sharded, case):
    n_ranks, got = sharded
    name, n, _, cu = case
    indices, scores = hs.indexer_topk(*cases.indexer_data(n), cases.INDEXER_TOPK, cu_seqlens=cu, return_scores=True)
    np.testing.assert_array_equal(got[f"indexer/{name}/indices"], indices)
    assert got[f"indexer/{name}/scores"].tobytes() == scores.tobytes()
    counts = case_layout(name, n, n_ranks, 64, cu).counts
    sent, received = costmodel.allgather_bytes(counts, 16 * 4)  # the float32 keys are all-gathered
    np.testing.assert_array_equal(got[f"indexer/{name}/bytes"], np.stack([sent, received], axis=1))


def case_layout(name, n, n_ranks, align, cu=None):
    if name.startswith("contiguous"):
        return contiguous_layout(n, n_ranks, align=align)
    return zigzag_layout(n, n_ranks, cu, align=align)


def single_process_attention(n):
    data = cases.attention_data(n)
    out, lse, probs = hs.sparse_attention(data["q"], data["kv"], data["indices"], d_v=cases.D_V, return_probs=True)
    dq, dkv = hs.sparse_attention_backward(data["q"], data["kv"], data["indices"], out, lse, data["dout"],
                                           d_v=cases.D_V)
    return {"out": out, "lse": lse, "probs": probs, "dq": dq, "dkv": dkv}


@pytest.mark.parametrize("case", cases.ATTENTION_CASES, ids=[c[0] for c in cases.ATTENTION_CASES])
def test_sparse_attention_matches_one_process(sharded, case):
    n_ranks, got = sharded
    name, n, _ = case
    ref = single_process_attention(n)
    for exchange in cases.EXCHANGES:
        key = f"attention/{name}/{exchange}"
        for label in ("out", "lse", "probs", "dq"):  # every query row is computed as in one process
            assert got[f"{key}/{label}"].tobytes() == ref[label].tobytes(), f"{exchange} {label}"
        dkv = got[f"{key}/dkv"]  # P partial sums added in rank order: a few ulps
        np.testing.assert_allclose(dkv, ref["dkv"], rtol=0, atol=(n_ranks + 1) * 2e-7 * np.abs(ref["dkv"]).max())
    # both exchanges add the same contributions in the same order
    assert got[f"attention/{name}/allgather/dkv"].tobytes() == got[f"attention/{name}/fetch/dkv"].tobytes()


@pytest.mark.parametrize("case", cases.ATTENTION_CASES, ids=[c[0] for c in cases.ATTENTION_CASES])
def test_bytes_moved_equal_the_cost_model(sharded, case):
    n_ranks, got = sharded
    name, n, _ = case
    counts = case_layout(name, n, n_ranks, 1).counts
    row = cases.D_QK * 4
    fetched = got[f"attention/{name}/fetched"]
    models = {
        "allgather": (costmodel.allgather_bytes(counts, row), costmodel.allgather_bytes(counts, row)[::-1]),
        "fetch": (costmodel.fetch_bytes(fetched, row), costmodel.fetch_backward_bytes(fetched, row)),
    }
    for exchange, (forward, backward) in models.items():
        key = f"attention/{name}/{exchange}"
        np.testing.assert_array_equal(got[f"{key}/forward_bytes"], np.stack(forward, axis=1))
        step = 2 * np.stack(forward, axis=1) + np.stack(backward, axis=1)  # the backward fetches again
        np.testing.assert_array_equal(got[f"{key}/step_bytes"], step)


@pytest.mark.parametrize("recompute, kl_on_loss_rows, attention_dtype", cases.ENGINE_VARIANTS)
def test_training_step_matches_one_process(sharded, recompute, kl_on_loss_rows, attention_dtype):
    from hyscale_core.engine import backward
    from hyscale_core.engine.model import TinyDSA
    from hyscale_core.engine.optim import AdamW
    from hyscale_core.engine.selection import LiveSelection

    _, got = sharded
    cfg = cases.engine_config(attention_dtype)
    model = TinyDSA(cfg, seed=1)
    selector = LiveSelection(cfg.topk)
    result = model.forward(*cases.engine_batch(), selector, recompute=recompute, kl_on_loss_rows=kl_on_loss_rows)
    backward(result[0])
    grads = {p.name: p.grad for p in model.parameters()}
    AdamW(model.parameters()).step()
    key = cases.engine_key(recompute, kl_on_loss_rows, attention_dtype)
    for layer in selector.store.layers():
        np.testing.assert_array_equal(got[f"{key}/selection/{layer}"], selector.store.selection(layer))
    totals = got[f"{key}/total"]
    assert (totals == totals[0]).all()  # every rank reports the same global values
    np.testing.assert_allclose(totals[0], [result[1]] + list(result[2]), rtol=1e-5)
    for p in model.parameters():
        params = got[f"{key}/param/{p.name}"]
        assert all(params[r].tobytes() == params[0].tobytes() for r in range(len(params))), p.name
        if attention_dtype == "float32":
            np.testing.assert_allclose(params[0], p.data, rtol=0, atol=1e-5, err_msg=p.name)
        else:  # each rank's dkv rounded to bfloat16 before the owner sums: Adam's first step, about
            # lr * sign(g), may differ only where g is within a bfloat16 ulp of max |g| from zero
            off, g = ~(np.abs(params[0] - p.data) <= 1e-5), np.abs(grads[p.name])
            assert (g[off] <= 2.0**-8 * g.max()).all(), p.name


def test_transport_moves_irregular_bfloat16_rows(sharded):
    n_ranks, got = sharded
    for rank in range(n_ranks):
        expect = np.concatenate([cases.transport_rows(p, rank, (p + rank) % 3) for p in range(n_ranks)])
        np.testing.assert_array_equal(got[f"transport/recv/{rank}"], expect.view(np.uint16))
        # (r + p) % 3 rows each way between ranks r and p, 12 bytes a row; a rank's rows to itself are not counted
        moved = sum((rank + p) % 3 for p in range(n_ranks) if p != rank) * 12
        np.testing.assert_array_equal(got[f"transport/bytes/{rank}"], [moved, moved])


@pytest.mark.gpu
def test_gpu_ranks_sharing_a_gpu_match_one_gpu(tmp_path):
    out = tmp_path / "gpu.npz"
    done = run_ranks(2, out, "gpu")
    assert done.returncode == 0, done.stdout
    import cupy as cp

    got = dict(np.load(out))
    q, k, w = (cp.asarray(a) for a in cases.indexer_data(cases.GPU_N, cases.GPU_HEADS, cases.GPU_DIM))
    np.testing.assert_array_equal(got["gpu/indices"], hs.indexer_topk(q, k, w, cases.INDEXER_TOPK).get())
    data = {key: cp.asarray(value) for key, value in cases.attention_data(cases.GPU_N).items()}
    out_, lse = hs.sparse_attention(data["q"], data["kv"], data["indices"], d_v=cases.D_V)
    dq, dkv = hs.sparse_attention_backward(data["q"], data["kv"], data["indices"], out_, lse, data["dout"],
                                           d_v=cases.D_V)
    for exchange in cases.EXCHANGES:  # float32 rounding of per-chunk products and per-rank partial sums
        for label, ref in (("out", out_), ("lse", lse), ("dq", dq), ("dkv", dkv)):
            ref = ref.get()
            np.testing.assert_allclose(got[f"gpu/{exchange}/{label}"], ref, rtol=0,
                                       atol=1e-5 * np.abs(ref[np.isfinite(ref)]).max(), err_msg=f"{exchange} {label}")
    assert got["gpu/allgather/dkv"].tobytes() == got["gpu/fetch/dkv"].tobytes()


def test_a_failing_rank_ends_the_job(tmp_path):
    done = run_ranks(3, tmp_path / "error.npz", "error")
    assert done.returncode != 0
    assert "kv must have one row per local position" in done.stdout
    assert not (tmp_path / "error.npz").exists()
