"""Selection replay: checkpointed recomputation never re-runs the indexer
top-k, checks fingerprints, and gives bitwise the gradients of no checkpointing."""
from __future__ import annotations

import numpy as np
import pytest

from hyscale_core.engine import backward
from hyscale_core.engine.model import DSAConfig, TinyDSA
from hyscale_core.engine.selection import LiveSelection, ReplaySelection, SelectionMismatchError, SelectionStore

CFG = DSAConfig(vocab=32, d_model=32, n_layers=2, heads=2, d_v=16, rope_dim=8, d_ff=64, index_heads=2,
                index_dim=8, topk=8)


def batch(n=40, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab, n)
    rows = np.arange(n - 8, n)
    return ids, rows, rng.integers(0, CFG.vocab, rows.size)


def gradients(recompute: bool, xp=np):
    model = TinyDSA(CFG, seed=1, xp=xp)
    selector = LiveSelection(CFG.topk)
    loss, total, kls = model.forward(*(xp.asarray(a) for a in batch()), selector, recompute=recompute)
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
