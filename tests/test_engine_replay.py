"""Selection replay: checkpointed recomputation never re-runs the indexer
top-k, checks fingerprints, and gives bitwise the gradients of no checkpointing."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import hyscale_core as hs
from hyscale_core.engine import backward, ops
from hyscale_core.engine.model import DSAConfig, TinyDSA
from hyscale_core.engine.selection import (LiveSelection, ReplaySelection, SelectionMismatchError, SelectionStore,
                                           checksum)
from hyscale_core.engine.tensor import Tensor

CFG = DSAConfig(vocab=32, d_model=32, n_layers=2, heads=2, d_v=16, rope_dim=8, d_ff=64, index_heads=2,
                index_dim=8, topk=8)


def batch(n=40, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab, n)
    rows = np.arange(n - 8, n)
    return ids, rows, rng.integers(0, CFG.vocab, rows.size)


def gradients(recompute: bool, xp=np, data=None, cfg=CFG):
    model = TinyDSA(cfg, seed=1, xp=xp)
    selector = LiveSelection(cfg.topk)
    loss, total, kls, _ = model.forward(*(xp.asarray(a) for a in data or batch()), selector, recompute=recompute)
    calls_after_forward = selector.calls
    backward(loss)
    return {p.name: p.grad for p in model.parameters()}, total, kls, calls_after_forward, selector.calls


@pytest.mark.parametrize("backend", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_recompute_replays_and_matches_bitwise(backend):
    xp = np
    if backend == "gpu":
        import cupy as xp
    plain, total_plain, kls_plain, _, plain_calls = gradients(recompute=False, xp=xp)
    replayed, total_replayed, kls_replayed, forward_calls, all_calls = gradients(recompute=True, xp=xp)
    assert forward_calls == all_calls == CFG.n_layers  # backward ran no indexer top-k
    assert plain_calls == CFG.n_layers
    assert kls_plain == kls_replayed and total_replayed == pytest.approx(total_plain, rel=1e-6)
    for name, grad in plain.items():
        assert grad is not None, name
        assert grad.tobytes() == replayed[name].tobytes(), f"gradient of {name} differs"


def test_indexer_parameters_get_gradient_only_from_the_kl_loss():
    grads, *_ = gradients(recompute=False)
    assert all(np.abs(grads[f"layer0.{p}"]).max() > 0 for p in ("iq", "ik", "iw"))


def test_replay_checks_fingerprints_and_names_the_layer():
    store = SelectionStore()
    model = TinyDSA(CFG, seed=1)
    model.forward(*batch(), LiveSelection(CFG.topk, store=store))
    tampered = SelectionStore()
    for layer in store.layers():
        tampered.put(layer, store.selection(layer))
    bad = tampered.selection("layer1").copy()
    bad[0, 0] = (bad[0, 0] + 1) % 40
    tampered._entries["layer1"] = (bad, tampered.fingerprint("layer1"))
    with pytest.raises(SelectionMismatchError, match="layer 'layer1'"):
        model.forward(*batch(), ReplaySelection(tampered))
    loss, *_ = model.forward(*batch(), ReplaySelection(store))
    assert np.isfinite(loss.data)


def test_backward_runs_no_selection_at_all(monkeypatch):
    """Counted at the library: hs.indexer_topk (and the materialised path) run
    once per layer in the forward and never in the backward."""
    calls = {"indexer_topk": 0, "indexer_scores": 0, "topk": 0}
    for name in calls:
        original = getattr(hs, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(hs, name, counted)
    model = TinyDSA(CFG, seed=1)
    out = model.forward(*batch(), LiveSelection(CFG.topk), recompute=True)
    assert calls == {"indexer_topk": CFG.n_layers, "indexer_scores": 0, "topk": 0}
    backward(out.loss)
    assert calls == {"indexer_topk": CFG.n_layers, "indexer_scores": 0, "topk": 0}
    assert all(p.grad is not None for p in model.parameters())


def test_indexer_input_is_detached_and_top_k_passes_no_gradient():
    """The block output's gradient reaches no indexer parameter; the KL loss's
    reaches only the indexer parameters, not the block input."""
    block = TinyDSA(CFG, seed=2).blocks[0]
    rng = np.random.default_rng(3)
    n = 24
    rope = ops.rope_tables(np, np.arange(n), CFG.rope_dim)
    indexer = {f"layer0.{p}" for p in ("iq", "ik", "iw")}
    for seed_kl in (False, True):
        x = Tensor(rng.standard_normal((n, CFG.d_model)).astype(np.float32), requires_grad=True)
        for p in block.parameters():
            p.grad = None
        y, kl = block.forward(x, rope, LiveSelection(CFG.topk))
        backward(kl) if seed_kl else backward(y, rng.standard_normal(y.shape).astype(np.float32))
        got = {p.name for p in block.parameters() if p.grad is not None and np.abs(p.grad).max() > 0}
        if seed_kl:
            assert got == indexer and x.grad is None
        else:
            assert got == {p.name for p in block.parameters()} - indexer and np.abs(x.grad).max() > 0


def test_kl_rows_average_the_indexer_loss_over_those_rows():
    ids, rows, targets = batch()
    model = TinyDSA(CFG, seed=1)
    store = SelectionStore()
    full = model.forward(ids, rows, targets, LiveSelection(CFG.topk, store=store))
    on_rows = model.forward(ids, rows, targets, ReplaySelection(store), kl_on_loss_rows=True)
    assert on_rows.logits.tobytes() == full.logits.tobytes()
    assert on_rows.kls != full.kls
    everything = model.forward(ids, np.arange(ids.size), np.zeros(ids.size, dtype=np.int64), ReplaySelection(store),
                               kl_on_loss_rows=True)
    assert everything.kls == pytest.approx(full.kls, rel=1e-6)


def test_recompute_that_selects_again_with_the_same_kernel_is_also_exact():
    """Selecting again is harmless only while the score computation is bitwise the same."""
    plain, *_ = gradients(recompute=False)
    model = TinyDSA(CFG, seed=1)
    again = LiveSelection(CFG.topk)
    out = model.forward(*batch(), LiveSelection(CFG.topk), recompute=True, recompute_selector=again)
    backward(out.loss)
    assert again.calls == CFG.n_layers
    for p in model.parameters():
        assert p.grad.tobytes() == plain[p.name].tobytes(), p.name


def test_a_step_fed_by_a_rollout_log_is_bitwise_the_live_step(tmp_path):
    """Issue 7: selections logged by a rollout and replayed from the HDF5 log give
    exactly the live step's loss and gradients."""
    from hyscale_core.io import LogReplaySource, SelectionLog

    ids, rows, targets = batch(seed=4)
    rollout = LiveSelection(CFG.topk)
    TinyDSA(CFG, seed=1).forward(ids, rows, targets, rollout)
    with SelectionLog(tmp_path / "rollout.h5", "w") as log:
        for layer in rollout.store.layers():
            log.append("step-0", layer, rollout.store.selection(layer), n_keys=ids.size)
    live, total_live, _, _, _ = gradients(recompute=True, data=(ids, rows, targets))
    model = TinyDSA(CFG, seed=1)
    with LogReplaySource(tmp_path / "rollout.h5", "step-0") as source:
        out = model.forward(ids, rows, targets, ReplaySelection(source), recompute=True)
        backward(out.loss)
    assert out.total == total_live
    for p in model.parameters():
        assert p.grad.tobytes() == live[p.name].tobytes(), p.name


def test_checksum_sees_one_changed_entry_and_a_swap():
    table = np.random.default_rng(5).integers(-1, 500, (300, 16)).astype(np.int32)
    base = checksum(table)
    assert base == checksum(table.copy()) and base.startswith("sum64:")
    changed, swapped = table.copy(), table.copy()
    changed[217, 9] += 1
    swapped[3, [0, 1]] = swapped[3, [1, 0]]
    assert len({base, checksum(changed), checksum(swapped), checksum(table.reshape(600, 8))}) == 4


def test_checksum_does_not_depend_on_its_row_blocks(monkeypatch):
    """The table is summed _ROWS rows at a time; any block size gives the same value."""
    from hyscale_core.engine import selection

    table = np.random.default_rng(7).integers(-1, 1 << 30, (300, 16)).astype(np.int32)
    whole = checksum(table)  # one block
    for rows in (1, 7, 64):
        monkeypatch.setattr(selection, "_ROWS", rows)
        assert checksum(table) == whole, rows


@pytest.mark.gpu
def test_checksum_is_the_same_on_the_gpu():
    import cupy as cp

    table = np.random.default_rng(6).integers(-1, 1 << 30, (5000, 64)).astype(np.int32)
    assert checksum(cp.asarray(table)) == checksum(table)


def test_bfloat16_attention_replays_bitwise_and_stays_near_float32():
    """attention_dtype='bfloat16' (the GPU kernels' operands) inside the float32 model."""
    cfg16 = dataclasses.replace(CFG, attention_dtype="bfloat16")
    plain, *_ = gradients(recompute=False, cfg=cfg16)
    replayed, *_ = gradients(recompute=True, cfg=cfg16)
    f32, *_ = gradients(recompute=False)
    for name, grad in plain.items():
        assert grad.dtype == np.float32 and grad.tobytes() == replayed[name].tobytes(), name
        assert np.linalg.norm(grad - f32[name]) <= 0.05 * np.linalg.norm(f32[name]), name


def _log(path, table, **masks):
    from hyscale_core.io import LogReplaySource, SelectionLog

    with SelectionLog(path, "w") as log:
        for layer in [f"layer{i}" for i in range(CFG.n_layers)]:
            log.append("s", layer, table, **masks)
    return LogReplaySource(path, "s")


def test_replay_refuses_a_table_of_another_width(tmp_path):
    """A selection of k = 4 replayed into a topk = 8 model: refused, naming both,
    from a log and from a store; accepted when the replay names its width."""
    ids, rows, targets = batch()
    model = TinyDSA(CFG, seed=1)
    narrow = LiveSelection(4)
    live = model.forward(ids, rows, targets, narrow)  # a live selector of its own width is fine
    with _log(tmp_path / "k4.h5", narrow.store.selection("layer0")) as source:
        with pytest.raises(ValueError, match=re.escape("layer 'layer0' has shape (40, 4), expected (40, 8)")):
            model.forward(ids, rows, targets, ReplaySelection(source))
    with pytest.raises(ValueError, match=re.escape("expected (40, 8): one row per query and topk = 8 columns")):
        model.forward(ids, rows, targets, ReplaySelection(narrow.store))
    assert model.forward(ids, rows, targets, ReplaySelection(narrow.store, topk=4)).total == live.total


def test_replay_refuses_a_log_made_without_the_causal_mask(tmp_path):
    """Every query reads the last key (the future for all but one): the log says
    causal=False, so a causal replay refuses it; causal=False replays it."""
    ids, rows, targets = batch()
    n = ids.size
    future = np.stack([np.full(n, n - 1)] + [np.arange(n)] * (CFG.topk - 1), axis=1).astype(np.int32)
    with _log(tmp_path / "future.h5", future, causal=False) as source:
        with pytest.raises(SelectionMismatchError, match="layer 'layer0' was made with causal=False"):
            TinyDSA(CFG, seed=1).forward(ids, rows, targets, ReplaySelection(source))
        out = TinyDSA(CFG, seed=1).forward(ids, rows, targets, ReplaySelection(source, causal=False))
    assert np.isfinite(out.total)


def test_replay_refuses_a_log_made_over_other_keys(tmp_path):
    ids, rows, targets = batch()
    live = LiveSelection(CFG.topk)
    TinyDSA(CFG, seed=1).forward(ids, rows, targets, live)
    with _log(tmp_path / "keys.h5", live.store.selection("layer0"), n_keys=ids.size + 3) as source:
        with pytest.raises(SelectionMismatchError, match="layer 'layer0' was made over 43 keys, the layer has 40"):
            TinyDSA(CFG, seed=1).forward(ids, rows, targets, ReplaySelection(source))


def test_checkpoint_replays_a_live_selection_of_its_own_width():
    """A live selector wider than the model's topk (a dense stage) checkpoints
    and replays its own tables: bitwise the gradients without checkpointing."""
    wide = dataclasses.replace(CFG, topk=40)
    plain, *_ = gradients(recompute=False, cfg=wide)
    model = TinyDSA(CFG, seed=1)
    out = model.forward(*batch(), LiveSelection(40), recompute=True)
    backward(out.loss)
    for p in model.parameters():
        assert p.grad.tobytes() == plain[p.name].tobytes(), p.name
