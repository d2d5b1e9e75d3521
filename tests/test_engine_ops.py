"""Engine primitives: every gradient by name against finite differences (float64)."""
from __future__ import annotations

import weakref

import numpy as np
import pytest

from hyscale_core.engine import attention, ops
from hyscale_core.engine.optim import AdamW
from hyscale_core.engine.tensor import Function, Tensor, backward, no_grad


def leaf(rng, *shape, name=None):
    return Tensor(rng.standard_normal(shape), requires_grad=True, name=name)


def check_gradients(build, inputs, rtol=1e-5, eps=1e-6):
    """Compare backward() with central differences of sum(out * probe)."""
    rng = np.random.default_rng(99)
    out = build()
    probe = rng.standard_normal(out.shape)
    loss = ops.Mul.apply(out, ops.constant(probe))
    backward(loss, np.ones(loss.shape))
    for t in inputs:
        analytic = t.grad
        numeric = np.zeros_like(t.data)
        flat = t.data.reshape(-1)
        for i in range(flat.size):
            saved = flat[i]
            flat[i] = saved + eps
            up = float((build().data * probe).sum())
            flat[i] = saved - eps
            down = float((build().data * probe).sum())
            flat[i] = saved
            numeric.reshape(-1)[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=1e-7, err_msg=f"gradient of {t.name}")
        t.grad = None


@pytest.mark.parametrize("rows", [1, 7, 63, 300])
def test_matmul_rows_keep_their_bits_whatever_rows_share_the_call(rows):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((301, 256)).astype(np.float32)
    w = rng.standard_normal((256, 192)).astype(np.float32)
    full = ops.rowwise_matmul(x, w)
    np.testing.assert_allclose(full, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    for start in (0, 1, 301 - rows):
        part = ops.rowwise_matmul(x[start:start + rows], w)
        assert part.tobytes() == full[start:start + rows].tobytes()
    assert ops.rowwise_matmul(x.reshape(7, 43, 256), w).tobytes() == full.tobytes()


def test_matmul_gradients():
    rng = np.random.default_rng(0)
    x, w = leaf(rng, 2, 3, 4, name="x"), leaf(rng, 4, 5, name="w")
    check_gradients(lambda: ops.MatMul.apply(x, w), [x, w])


def test_add_mul_silu_gradients():
    rng = np.random.default_rng(1)
    a, b = leaf(rng, 3, 4, name="a"), leaf(rng, 3, 4, name="b")
    check_gradients(lambda: ops.SiLU.apply(ops.Mul.apply(ops.Add.apply(a, b), b)), [a, b])


def test_rmsnorm_gradients():
    rng = np.random.default_rng(2)
    x, w = leaf(rng, 5, 8, name="x"), leaf(rng, 8, name="weight")
    check_gradients(lambda: ops.RMSNorm.apply(x, w), [x, w])


def test_rope_gradients_and_norm_preservation():
    rng = np.random.default_rng(3)
    x = leaf(rng, 6, 2, 8, name="x")
    cos, sin = ops.rope_tables(np, np.arange(6), 8)
    check_gradients(lambda: ops.RoPE.apply(x, ops.constant(cos), ops.constant(sin)), [x])
    y = ops.RoPE.apply(x, ops.constant(cos), ops.constant(sin)).data
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x.data, axis=-1), rtol=1e-6)  # float32 tables


def test_embedding_and_cross_entropy_gradients():
    rng = np.random.default_rng(4)
    table = leaf(rng, 7, 3, name="table")
    ids = ops.constant(np.array([1, 4, 4, 0, 6]))
    check_gradients(lambda: ops.Embedding.apply(table, ids), [table])
    logits = leaf(rng, 5, 7, name="logits")
    targets = ops.constant(np.array([0, 3, 3, 6, 1]))
    check_gradients(lambda: ops.CrossEntropy.apply(logits, targets), [logits])


def test_cross_entropy_value():
    logits = Tensor(np.log(np.array([[0.5, 0.25, 0.25]])), requires_grad=True)
    loss = ops.CrossEntropy.apply(logits, ops.constant(np.array([1])))
    assert loss.data == pytest.approx(np.log(4))


def test_gradients_accumulate_and_saved_state_is_freed():
    rng = np.random.default_rng(5)
    x = leaf(rng, 4, name="x")
    y = ops.Mul.apply(x, x)
    z = ops.Add.apply(y, x)  # x used twice: its gradient is 2x + 1
    ctx = y.ctx
    backward(z, np.ones(4))
    np.testing.assert_allclose(x.grad, 2 * x.data + 1)
    assert ctx.saved == () and ctx.parents == () and ctx.spent
    with pytest.raises(RuntimeError, match="a second time"):
        backward(z, np.ones(4))


def test_the_tape_keeps_only_what_functions_save():
    """An intermediate no Function saved is freed when the caller drops it."""
    rng = np.random.default_rng(6)
    x = leaf(rng, 1000, name="x")
    y = ops.Add.apply(x, x)  # Add saves nothing
    z = ops.SiLU.apply(ops.Add.apply(y, x))  # SiLU saves its own input, not y
    y_data = weakref.ref(y.data)
    del y
    assert y_data() is None
    backward(z, np.ones(1000))
    sig = 1 / (1 + np.exp(-3 * x.data))
    np.testing.assert_allclose(x.grad, 3 * (sig * (1 + 3 * x.data * (1 - sig))))


def test_without_grad_functions_keep_nothing():
    """Under no_grad no Function is recorded, so what one saved goes with it."""
    x = leaf(np.random.default_rng(10), 1000, name="x")
    with no_grad():
        y = ops.Add.apply(x, x)
        z = ops.SiLU.apply(y)  # SiLU saves its input
    y_data = weakref.ref(y.data)
    del y
    assert y_data() is None and z.ctx is None and not z.requires_grad


def test_needs_input_grad_is_honoured():
    calls = []

    class Probe(Function):
        def forward(self, a, b):
            return a * b

        def backward(self, g):
            calls.append(self.needs_input_grad)
            return g, None

    a = Tensor(np.ones(3), requires_grad=True)
    out = Probe.apply(a, Tensor(np.ones(3)))
    backward(out, np.ones(3))
    assert calls == [(True, False)]
    with no_grad():
        assert not Probe.apply(a, a).requires_grad


def test_backward_errors():
    with pytest.raises(ValueError, match="does not require a gradient"):
        backward(Tensor(np.ones(1)))
    with pytest.raises(ValueError, match="non-scalar root"):
        backward(ops.Mul.apply(Tensor(np.ones(2), requires_grad=True), ops.constant(np.ones(2))))


def test_adamw_clips_decays_and_descends():
    p = Tensor(np.array([3.0, -2.0]), requires_grad=True)
    opt = AdamW([p], lr=0.1, weight_decay=0.01, max_grad_norm=1.0)
    for _ in range(200):
        loss = ops.Mul.apply(p, p)
        backward(loss, np.ones(2))
        norm = opt.step()
    assert norm < 1.0 and np.abs(p.data).max() < 0.05
    with pytest.raises(ValueError, match="lr must be finite and > 0, got -1"):
        AdamW([p], lr=-1)


def test_adamw_clips_the_global_norm_before_the_moments():
    a = Tensor(np.array([3.0, -4.0]), requires_grad=True)
    b = Tensor(np.array([12.0]), requires_grad=True)
    opt = AdamW([a, b], lr=0.1, betas=(0.5, 0.75), weight_decay=0.5, max_grad_norm=6.5)
    a.grad, b.grad = np.array([30.0, -40.0]), np.array([120.0])  # global norm 130: scaled by 1/20
    start = a.data.copy()
    assert opt.step() == pytest.approx(130.0)
    np.testing.assert_allclose(opt.m[0], 0.5 * np.array([1.5, -2.0]))
    np.testing.assert_allclose(opt.v[1], 0.25 * np.array([6.0]) ** 2)
    # first step: bias-corrected m / sqrt(v) is the sign; the decay is decoupled
    np.testing.assert_allclose(a.data, start * (1 - 0.1 * 0.5) - 0.1 * np.sign([30.0, -40.0]), rtol=1e-7)
    assert a.grad is None and b.grad is None
    a.grad = np.array([0.3, 0.4])  # norm 0.5 < 6.5: not scaled
    opt.step()
    np.testing.assert_allclose(opt.m[0], 0.5 * 0.5 * np.array([1.5, -2.0]) + 0.5 * np.array([0.3, 0.4]))


def test_swiglu_gradients():
    rng = np.random.default_rng(7)
    x, w1, w3, w2 = leaf(rng, 3, 4, name="x"), leaf(rng, 4, 6, name="w1"), leaf(rng, 4, 6, name="w3"), \
        leaf(rng, 6, 4, name="w2")
    check_gradients(lambda: ops.swiglu(x, w1, w3, w2), [x, w1, w3, w2])
    h = x.data @ w1.data
    np.testing.assert_allclose(ops.swiglu(x, w1, w3, w2).data, (h / (1 + np.exp(-h)) * (x.data @ w3.data)) @ w2.data)


def test_rope_tail_take_rows_reshape_gradients():
    rng = np.random.default_rng(8)
    x = leaf(rng, 5, 2, 7, name="x")
    cos, sin = (ops.constant(t.astype(np.float64)) for t in ops.rope_tables(np, np.arange(5), 4))
    rows = ops.constant(np.array([4, 0, 2]))
    check_gradients(lambda: ops.TakeRows.apply(ops.Reshape.apply(ops.RoPETail.apply(x, cos, sin), shape=(5, 14)),
                                               rows), [x])
    y = ops.RoPETail.apply(x, cos, sin).data
    np.testing.assert_array_equal(y[..., :3], x.data[..., :3])  # only the last 4 columns rotate


def test_attention_functions_gradients():
    """SparseAttention, IndexerScoresAt and IndexerKL against finite differences (float64 inputs)."""
    rng = np.random.default_rng(9)
    n, heads, d_qk, d_v, ih, idim = 6, 2, 5, 3, 2, 4
    indices = ops.constant(np.array([[0, -1, -1], [1, 0, -1], [2, 0, 1], [3, 1, 2], [2, 4, 3], [5, 0, 4]],
                                    dtype=np.int32))
    q, kv = leaf(rng, n, heads, d_qk, name="q"), leaf(rng, n, d_qk, name="kv")
    check_gradients(lambda: attention.SparseAttention.apply(q, kv, indices, d_v=d_v), [q, kv])
    iq, ik, iw = leaf(rng, n, ih, idim, name="iq"), leaf(rng, n, idim, name="ik"), leaf(rng, n, ih, name="iw")
    at = attention.IndexerScoresAt.apply(iq, ik, iw, indices).data
    mask = np.isfinite(at)

    class Finite(Function):  # -inf at -1 slots -> 0, so the probe sum stays finite
        def forward(self, x):
            return np.where(mask, x, 0.0)

        def backward(self, g):
            return (np.where(mask, g, 0.0),)

    # scores_at is float32 by contract: wider steps, looser match
    check_gradients(lambda: Finite.apply(attention.IndexerScoresAt.apply(iq, ik, iw, indices)), [iq, ik, iw],
                    rtol=2e-3, eps=1e-3)
    probs = ops.constant(attention.SparseAttention.apply(q, kv, indices, d_v=d_v).aux["probs"].astype(np.float64))
    scores = Tensor(np.where(mask, rng.standard_normal(at.shape), -np.inf), requires_grad=True, name="scores_at")
    kl = attention.IndexerKL.apply(scores, probs)
    backward(kl)
    analytic, scores.grad = scores.grad, None

    def value():
        return float(attention.IndexerKL.apply(scores, probs).data)

    for t, i in zip(*np.nonzero(mask)):
        keep = scores.data[t, i]
        scores.data[t, i] = keep + 1e-6
        up = value()
        scores.data[t, i] = keep - 1e-6
        down = value()
        scores.data[t, i] = keep
        assert analytic[t, i] == pytest.approx((up - down) / 2e-6, rel=1e-5, abs=1e-8), f"scores_at[{t}, {i}]"


def test_cast_rounds_forward_and_returns_the_gradient_in_the_input_dtype():
    from hyscale_core._dtypes import bfloat16

    x = Tensor(np.array([1.0, 1 + 2**-9, -3.0e-3], dtype=np.float32), requires_grad=True)
    y = ops.Cast.apply(x, dtype=bfloat16)
    rounded = float(np.float32(-3.0e-3).astype(bfloat16))
    assert y.dtype == bfloat16 and y.data.astype(np.float32).tolist() == [1.0, 1.0, rounded]
    backward(y, np.array([0.5, 2.0, 1 + 2**-9], dtype=bfloat16))
    assert x.grad.dtype == np.float32 and x.grad.tolist() == [0.5, 2.0, 1.0]
    assert ops.cast(x.data, np.float32) is x.data


def test_take_rows_sums_the_gradients_of_repeated_rows():
    rng = np.random.default_rng(11)
    x = leaf(rng, 5, 3, name="x")
    rows = ops.constant(np.array([4, 0, 4, 2, 4, 0]))
    check_gradients(lambda: ops.TakeRows.apply(x, rows), [x])
    g = rng.standard_normal((6, 3))
    backward(ops.TakeRows.apply(x, rows), g)
    assert x.grad.tobytes() == np.stack([g[1] + g[5], np.zeros(3), g[3], np.zeros(3),
                                         (g[0] + g[2]) + g[4]]).tobytes()  # summed left to right
