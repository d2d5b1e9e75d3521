"""hyscale-core inside a JAX program: JAX arrays in, JAX arrays out, by DLPack.

hyscale-core depends on no deep-learning framework. Any array with
``__dlpack__`` goes straight into its functions: here JAX arrays (bfloat16
indexer inputs, float32 attention inputs) into ``hs.indexer_topk`` and
``hs.sparse_attention``; the results (NumPy on the host, CuPy on a GPU)
go back into JAX with ``jnp.from_dlpack``. The program prints the buffer
addresses on both sides of each crossing, so you can see which ones copied:

* JAX -> hyscale-core is zero-copy on the CPU and on a GPU.
* hyscale-core -> JAX is zero-copy on a GPU (CuPy's buffers are aligned
  enough). On the CPU, JAX's client imports a buffer in place only when it
  is 64-byte aligned, and NumPy allocates at 16 bytes, so JAX copies the
  result (N * k * 4 bytes for a selection): a one-off copy of the output,
  never of the inputs.

The results are checked against a plain JAX computation of the same thing.

    pip install jax            # CPU; jax[cuda12] + hyscale-core[cuda] for the GPU
    python examples/jax_dlpack.py

Without JAX it says so and exits 0 (JAX is not a dependency of hyscale-core).
"""
from __future__ import annotations

import sys

import numpy as np

import hyscale_core as hs
from hyscale_core._backend import as_array, cupy_module


def address(x) -> int:
    """Data address of a NumPy or CuPy array."""
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr


def address_seen_by_hyscale(x) -> int:
    """Where hyscale-core's import of ``x`` (the one every hs function makes) puts its data."""
    return address(as_array(x, "x")[1])


def crossing(what: str, before: int, after: int) -> None:
    verdict = "zero-copy" if before == after else "copied"
    print(f"  {what:44s} {before:#16x} -> {after:#16x}  {verdict}")


def reference(jnp, jax, q, k, w, q_mla, kv, sel_j, topk, d_v):
    """Plain JAX: materialised causal indexer scores + lax.top_k (-1 where a row has
    fewer than ``topk`` keys, as hyscale-core gives), and attention (out, lse) at ``sel_j``."""
    logits = jnp.einsum("thd,sd->ths", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = jnp.einsum("th,ths->ts", w, jnp.maximum(logits, 0))
    n = scores.shape[0]
    scores = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(n)[:, None], scores, -jnp.inf)
    ref_scores, ref_sel = jax.lax.top_k(scores, topk)
    ref_sel = jnp.where(jnp.isfinite(ref_scores), ref_sel, -1)
    valid = sel_j >= 0
    picked = kv[jnp.where(valid, sel_j, 0)]  # [N, k, d_qk]
    att = jnp.einsum("thd,tkd->thk", q_mla, picked) / np.sqrt(q_mla.shape[2])
    att = jnp.where(valid[:, None, :], att, -jnp.inf)
    out = jnp.einsum("thk,tkd->thd", jax.nn.softmax(att, axis=-1), picked[..., :d_v])
    return ref_sel, out, jax.nn.logsumexp(att, axis=-1)


def shared_fraction(ours: np.ndarray, theirs: np.ndarray) -> float:
    """Mean over rows of |ours & theirs| / max(|ours|, |theirs|) over the valid (>= 0)
    keys: 1 only when both select the same keys, whichever side misses or adds one."""
    shares = []
    for a, b in zip(ours, theirs):
        a, b = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        shares.append(len(a & b) / max(len(a), len(b), 1))
    return float(np.mean(shares))


def main() -> int:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("JAX is not installed, so there is nothing to show: `pip install jax` and run again. "
              "(hyscale-core itself never needs JAX.)")
        return 0
    if jax.default_backend() == "gpu" and cupy_module() is None:
        print("JAX runs on a GPU but CuPy sees none: install hyscale-core[cuda] for the GPU backend")
        return 0
    n, heads, dim, topk = 512, 8, 64, 32  # indexer: N, H_I, d_I, top-k
    h, d_qk, d_v = 4, 96, 64  # attention: heads, latent width, value width
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(keys[0], (n, heads, dim), dtype=jnp.bfloat16)
    k = jax.random.normal(keys[1], (n, dim), dtype=jnp.bfloat16)
    w = jax.random.normal(keys[2], (n, heads), dtype=jnp.float32)
    q_mla = jax.random.normal(keys[3], (n, h, d_qk), dtype=jnp.float32)
    kv = jax.random.normal(keys[4], (n, d_qk), dtype=jnp.float32)
    print(f"JAX {jax.__version__} on {jax.default_backend()}, hyscale-core {hs.__version__}")
    print("buffer addresses (JAX side -> hyscale-core side, or back):")
    for name, x in (("q  bfloat16 [512, 8, 64]", q), ("k  bfloat16 [512, 64]", k), ("w  float32 [512, 8]", w),
                    ("q_mla float32 [512, 4, 96]", q_mla), ("kv float32 [512, 96]", kv)):
        crossing(f"in:  {name}", x.unsafe_buffer_pointer(), address_seen_by_hyscale(x))

    selection = hs.indexer_topk(q, k, w, topk)  # JAX arrays straight in
    out, lse = hs.sparse_attention(q_mla, kv, selection, d_v=d_v)
    sel_j, out_j, lse_j = (jnp.from_dlpack(a) for a in (selection, out, lse))
    crossing("out: selection int32 [512, 32]", address(selection), sel_j.unsafe_buffer_pointer())
    crossing("out: attention out float32 [512, 4, 64]", address(out), out_j.unsafe_buffer_pointer())
    crossing("out: lse float32 [512, 4]", address(lse), lse_j.unsafe_buffer_pointer())

    ref_sel, ref_out, ref_lse = reference(jnp, jax, q, k, w, q_mla, kv, sel_j, topk, d_v)
    same = shared_fraction(np.asarray(sel_j), np.asarray(ref_sel))
    err = float(jnp.max(jnp.abs(out_j - ref_out)))
    lse_err = float(jnp.max(jnp.abs(lse_j - ref_lse)))
    print(f"selections shared with JAX's own top-k: {100 * same:.1f}% (rounding may swap keys tied at the k-th)")
    print(f"attention vs JAX at the same selection: max |difference| out {err:.2e}, lse {lse_err:.2e}")
    return 0 if same > 0.99 and err < 1e-4 and lse_err < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
