"""Engine primitives: every gradient by name against finite differences (float64)."""
from __future__ import annotations

import numpy as np
import pytest

from hyscale_core.engine import ops
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
    assert ctx.saved == () and y.ctx is None


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
    with pytest.raises(ValueError, match="bad AdamW settings"):
        AdamW([p], lr=-1)
