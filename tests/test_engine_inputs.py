"""Bad input to the engine: a ValueError/TypeError naming the argument and the
bad value; nothing wraps, broadcasts, divides by zero or trains on silently."""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from hyscale_core.engine import AdamW, DSAConfig, LiveSelection, ReplaySelection, Tensor, TinyDSA, backward, ops

CFG = DSAConfig(vocab=16, d_model=16, n_layers=1, heads=2, d_v=8, rope_dim=4, d_ff=16, index_heads=2, index_dim=8,
                topk=4)
IDS = np.arange(7) % 16
ROWS, TARGETS = np.array([5, 6]), np.array([1, 2])
NAN, INF = math.nan, math.inf


def forward(model, ids=IDS, rows=ROWS, targets=TARGETS, **options):
    return model.forward(ids, rows, targets, LiveSelection(model.cfg.topk), **options)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("change, error, message", [
    ({"ids": np.r_[-1, IDS[1:]]}, ValueError, r"ids[0] = -1 is out of range [0, 16)"),
    ({"ids": np.r_[IDS[:3], 16, IDS[4:]]}, ValueError, r"ids[3] = 16 is out of range [0, 16)"),
    ({"targets": np.array([2, -15])}, ValueError, r"targets[1] = -15 is out of range [0, 16)"),
    ({"targets": np.array([16, 2])}, ValueError, r"targets[0] = 16 is out of range [0, 16)"),
    ({"rows": np.array([-2, -1])}, ValueError, r"rows[0] = -2 is out of range [0, 7)"),
    ({"rows": np.array([6, 7])}, ValueError, r"rows[1] = 7 is out of range [0, 7)"),
    ({"targets": np.array([1, 2, 3])}, ValueError, "got 2 rows and 3 targets"),
    ({"ids": IDS.astype(np.float32)}, TypeError, "ids must have an integer dtype, got float32"),
    ({"rows": np.array([True, False])}, TypeError, "rows must have an integer dtype, got bool"),
    ({"targets": None}, TypeError, "targets must have an integer dtype, got object"),
    ({"ids": IDS.reshape(1, 7)}, ValueError, "ids must have 1 dimension, got shape (1, 7)"),
    ({"ids": np.zeros(0, dtype=np.int64)}, ValueError, "ids must hold at least one token"),
    ({"rows": np.zeros(0, dtype=np.int64), "targets": np.zeros(0, dtype=np.int64)}, ValueError,
     "rows and targets are empty"),
])
def test_forward_refuses_bad_ids_rows_and_targets(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        forward(TinyDSA(CFG), **change)


def test_forward_takes_integer_lists_and_unsigned_ids():
    model = TinyDSA(CFG)
    expected = forward(model).total
    assert forward(model, list(IDS), list(ROWS), list(TARGETS)).total == expected
    assert forward(model, IDS.astype(np.uint8), ROWS.astype(np.int32)).total == expected


def test_a_row_listed_twice_counts_twice_in_the_mean():
    """rows [6, 6] is the mean of two equal terms: the loss and every gradient
    are those of rows [6] (the row's two gradients are summed, not one kept)."""
    runs = []
    for rows, targets in ((np.array([6, 6]), np.array([1, 1])), (np.array([6]), np.array([1])),
                          (np.array([6, 6]), np.array([1, 1]))):
        model = TinyDSA(CFG)
        out = forward(model, rows=rows, targets=targets, kl_on_loss_rows=True)
        backward(out.loss)
        runs.append((out.total, {p.name: p.grad for p in model.parameters()}))
    (twice, grads_twice), (once, grads_once), (_, grads_again) = runs
    assert twice == pytest.approx(once, rel=1e-6)
    for name, grad in grads_once.items():
        np.testing.assert_allclose(grads_twice[name], grad, rtol=1e-4, atol=1e-6, err_msg=name)
        assert grads_twice[name].tobytes() == grads_again[name].tobytes(), f"{name} differs run to run"


@pytest.mark.parametrize("shape", [(4,), (1, 1), (), (5, 4), (4, 3), (1, 3, 4)])
def test_backward_seed_must_have_the_root_shape(shape):
    x = Tensor(np.ones((3, 4), np.float32), requires_grad=True)
    y = ops.Add.apply(x, ops.constant(np.zeros((3, 4), np.float32)))
    with pytest.raises(ValueError, match=re.escape(f"grad must have the root's shape (3, 4), got shape {shape}")):
        backward(y, np.ones(shape, np.float32))
    assert x.grad is None
    backward(y, np.full((3, 4), 2, np.float32))  # the refusal left the tape as it was
    np.testing.assert_array_equal(x.grad, np.full((3, 4), 2, np.float32))


def test_backward_seed_of_a_scalar_root_may_be_a_number():
    x = Tensor(np.ones(3), requires_grad=True)
    loss = ops.CrossEntropy.apply(ops.Reshape.apply(x, shape=(1, 3)), ops.constant(np.array([0])))
    backward(loss, 2.0)
    np.testing.assert_allclose(x.grad, 2 * (np.full(3, 1 / 3) - [1, 0, 0]))


@pytest.mark.parametrize("settings, error, message", [
    ({"lr": NAN}, ValueError, "lr must be finite and > 0, got nan"),
    ({"lr": INF}, ValueError, "lr must be finite and > 0, got inf"),
    ({"lr": 0.0}, ValueError, "lr must be finite and > 0, got 0.0"),
    ({"lr": 10**400}, ValueError, "lr must be finite and > 0, got 1000"),
    ({"lr": "0.1"}, TypeError, "lr must be a real number, got '0.1'"),
    ({"lr": True}, TypeError, "lr must be a real number, got True"),
    ({"eps": NAN}, ValueError, "eps must be finite and > 0, got nan"),
    ({"eps": 0}, ValueError, "eps must be finite and > 0, got 0"),
    ({"weight_decay": NAN}, ValueError, "weight_decay must be finite and >= 0, got nan"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay must be finite and >= 0, got -0.1"),
    ({"lr": 0.5, "weight_decay": 2.0}, ValueError, "lr * weight_decay must be < 1"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be finite and > 0, got -1.0"),
    ({"max_grad_norm": NAN}, ValueError, "max_grad_norm must be finite and > 0, got nan"),
    ({"max_grad_norm": 0}, ValueError, "max_grad_norm must be finite and > 0, got 0"),
    ({"max_grad_norm": INF}, ValueError, "max_grad_norm must be finite and > 0, got inf"),
    ({"betas": (0.9, 0.95, 0.99)}, ValueError, "betas must be a pair (beta1, beta2), got (0.9, 0.95, 0.99)"),
    ({"betas": 0.9}, ValueError, "betas must be a pair (beta1, beta2), got 0.9"),
    ({"betas": (1.0, 0.9)}, ValueError, "betas[0] must be in [0, 1), got 1.0"),
    ({"betas": (0.9, NAN)}, ValueError, "betas[1] must be finite and >= 0, got nan"),
    ({"betas": (-0.1, 0.9)}, ValueError, "betas[0] must be finite and >= 0, got -0.1"),
])
def test_adamw_refuses_bad_settings(settings, error, message):
    p = Tensor(np.array([1.0, -2.0], np.float32), requires_grad=True)
    with pytest.raises(error, match=re.escape(message)):
        AdamW([p], **{"lr": 0.1, **settings})


def test_adamw_takes_numpy_numbers_and_refuses_non_tensors():
    p = Tensor(np.array([1.0, -2.0], np.float32), requires_grad=True)
    opt = AdamW([p], lr=np.float32(0.1), betas=[np.float64(0.9), 0.95], max_grad_norm=None)
    p.grad = np.array([0.5, -0.5], np.float32)
    opt.step()
    np.testing.assert_allclose(p.data, [0.9, -1.9], rtol=1e-6)  # one step moves each by lr against the sign
    with pytest.raises(TypeError, match=re.escape("params must hold Tensors, got params[1] = ndarray")):
        AdamW([p, np.ones(2)])


@pytest.mark.parametrize("change, error, message", [
    ({"rope_dim": 3}, ValueError, "DSAConfig.rope_dim must be even (RoPE rotates pairs of dims), got 3"),
    ({"rope_dim": -2}, ValueError, "DSAConfig.rope_dim must be >= 0, got -2"),
    ({"topk": 0}, ValueError, "DSAConfig.topk must be in [1, 1048576], got 0"),
    ({"topk": 2**20 + 1}, ValueError, "DSAConfig.topk must be in [1, 1048576], got 1048577"),
    ({"heads": 0}, ValueError, "DSAConfig.heads must be >= 1, got 0"),
    ({"d_v": 0}, ValueError, "DSAConfig.d_v must be >= 1, got 0"),
    ({"vocab": -1}, ValueError, "DSAConfig.vocab must be >= 1, got -1"),
    ({"n_layers": 0}, ValueError, "DSAConfig.n_layers must be >= 1, got 0"),
    ({"d_ff": 0}, ValueError, "DSAConfig.d_ff must be >= 1, got 0"),
    ({"index_heads": 0}, ValueError, "DSAConfig.index_heads must be >= 1, got 0"),
    ({"d_model": 16.0}, TypeError, "DSAConfig.d_model must be an integer, got 16.0"),
    ({"index_dim": True}, TypeError, "DSAConfig.index_dim must be an integer, got True"),
    ({"kl_weight": NAN}, ValueError, "DSAConfig.kl_weight must be finite and >= 0, got nan"),
    ({"kl_weight": -1.0}, ValueError, "DSAConfig.kl_weight must be finite and >= 0, got -1.0"),
    ({"kl_weight": "1"}, TypeError, "DSAConfig.kl_weight must be a real number, got '1'"),
    ({"attention_dtype": "int32"}, TypeError, "DSAConfig.attention_dtype must be one of: float16, bfloat16, "
                                              "float32, float64, got 'int32'"),
    ({"attention_dtype": "float8"}, TypeError, "got 'float8'"),
    ({"attention_dtype": None}, TypeError, "got None"),
])
def test_config_refuses_sizes_the_model_cannot_use(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        dataclasses.replace(CFG, **change)


@pytest.mark.parametrize("change", [{"rope_dim": 0}, {"attention_dtype": "float64"}, {"kl_weight": 0},
                                    {"topk": 64}])
def test_config_edges_the_model_can_use_train(change):
    model = TinyDSA(dataclasses.replace(CFG, **change))
    out = forward(model, recompute=True)
    backward(out.loss)
    assert np.isfinite(out.total) and all(np.isfinite(p.grad).all() for p in model.parameters())


def test_rope_tables_need_an_even_dim():
    with pytest.raises(ValueError, match=re.escape("dim must be even (RoPE rotates pairs of dims), got 3")):
        ops.rope_tables(np, np.arange(5), 3)


@pytest.mark.parametrize("options, error, message", [
    ({"topk": -1}, ValueError, "topk must be in [0, 1048576], got -1"),
    ({"topk": 2.0}, TypeError, "topk must be an integer, got 2.0"),
    ({"causal": "yes"}, TypeError, "causal must be a bool, got 'yes'"),
])
def test_replay_selection_refuses_bad_options(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ReplaySelection(None, **options)
