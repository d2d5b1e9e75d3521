"""Variants of the sparse-attention kernels for A/B runs, and a bitwise
check of the forward's and backward's outputs between trees.

    python -m benchmarks.run sparse_attention_variants patch TREE VARIANT
    python -m benchmarks.run sparse_attention_variants outputs PATH.npz
    python -m benchmarks.run sparse_attention_variants compare A.npz B.npz [...]

``patch`` rewrites ``TREE/cuda/sparse_attention.cu`` (and ``tiles.cuh``), or
for the ``dq_`` variants ``TREE/cuda/sparse_attention_dq.cuh``, of a copy of
the repository into one of:

- ``evict_last``: the gathers under an L2 evict-last cache policy, the
  buffer's shared address passed through a shuffle so that it has no uniform
  part (with one, ptxas 13.0 overwrote the copies' policy descriptor and the
  kernel stopped with an illegal instruction);
- ``gathers_only``: no tensor products (waits, barriers, softmax kept): the
  time of the gathers and what the schedule adds to them;
- ``products_only``: no gathers (each thread still arrives on the buffers'
  barriers): the time of the products and softmax on whatever the buffers
  hold;
- ``dq_gathers_only``, ``dq_products_only``: the backward's dq kernel
  without its tensor products (logits, dp, ds kv), or without its gathers
  (the key tile holds whatever it held);
- ``dq_no_images``: the dq kernel without the bulk stores of its ds and p'
  images (the dkv rows that read them come out wrong).

``outputs`` runs the forward (out, lse, probs) and the backward (dq, dkv, with
and without precise_dkv) of the tree it is run from on
awkward inputs (-1 slots, a row without keys, trailing empty blocks, one key
repeated; h 16 to 128, k 7 to 2048) and saves them; ``compare`` says whether
saved outputs are bitwise identical to the first file's. Run each step from
inside the tree it concerns (``cd TREE && python -m benchmarks.run ...``): a
script run by path imports the package beside the script, not the tree's.
The timing itself is ``benchmarks.sparse_attention_gpu --impls "hs fwd"`` in
each tree, the trees alternating in one device call (benchmarks/NOTES.md,
"Where the forward's time goes at N = 131072").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

_GATHER = "    gather_regions<R0, R1>(tl.buf[buf], kv, keys, gl);"  # the forward's copies of a buffer half
_EVICT_LAST_LOOP = """    const u64 policy = l2_evict_last();
    const u32 base = __shfl_sync(FULL_MASK, smem_addr(tl.buf[buf]), 0);  // no uniform part in the address
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = gl.group + 16 * r;
        const u16* src = kv + (size_t)(keys[r] >= 0 ? keys[r] : 0) * D + gl.chunk * 8;
        #pragma unroll
        for (int region = R0; region < R1; ++region)
            cp_async16_at(base + region * REGION + row * 128 + ((gl.chunk ^ (row & 7)) << 4), src + region * 64,
                          keys[r] >= 0, policy);
    }"""
_COPY_AT = """// cp_async16's policy overload at a shared-memory address.
__device__ __forceinline__ void cp_async16_at(u32 addr, const void* gmem, bool valid, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\\n" ::"r"(addr),
                 "l"(gmem), "r"(valid ? 16 : 0), "l"(policy));
}
"""
_PRODUCTS = [  # (product call, what replaces it)
    ("""        wgmma_m64n64k16<F16, 0, 0>(s, wgmma_desc_k(q_tile, kk, 64), wgmma_desc_k(tile, kk, 64),
                                   !FRESH || kk > FIRST);""", "        (void)q_tile;"),
    ("""        wgmma_m64n256k16_rs<F16, 1>(o, frag, wgmma_desc_mn(tile + half * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);""",
     "        (void)frag;"),
    ("""        wgmma_m64n256k16<F16, 0, 1>(o, wgmma_desc_k(p_tile, kk, 64),
                                    wgmma_desc_mn(tile + half * 4 * REGION + kk * K_STEP_ROWS, REGION), 1);""",
     "        (void)p_tile;"),
]
_DQ_GATHERS = ["""        stage_key_row<0, 8>(kv_tile, kv, s_cur);""",
               """        stage_key_row<8, D / 32>(kv_tile, kv, s_cur);"""]
_DQ_PRODUCTS = ["""        issue_rows32<0, 16>(s, q_tile, rows);
        issue_rows32<0, 16>(dp, do_tile, rows);""", """        issue_rows32<16, D / 16>(s, q_tile, rows);
        issue_rows32<16, DV / 16>(dp, do_tile, rows);""", """        add_ds_kv(acc, rope, ds_tile, kv_tile, ln);"""]
_DQ_IMAGES = ["""        if (threadIdx.x == 0) bulk_store(image + (size_t)b * IMAGE_BYTES, ds_tile, IMAGE_BYTES);"""]
VARIANTS = ("evict_last", "gathers_only", "products_only", "dq_gathers_only", "dq_products_only", "dq_no_images")


def _replace(text: str, old: str, new: str, path: Path) -> str:
    if old not in text:
        raise SystemExit(f"{path}: the code this variant rewrites is not there (the kernel changed?)")
    return text.replace(old, new)


FORWARD_CUTS = ("gathers_only", "products_only")  # variants of the text of cuda/sparse_attention.cu alone


def forward_variant(text: str, variant: str, path: Path = Path("cuda/sparse_attention.cu")) -> str:
    """The text of the forward kernel's source ``text`` as ``variant`` (one of FORWARD_CUTS)."""
    if variant == "gathers_only":
        for old, new in _PRODUCTS:
            text = _replace(text, old, new, path)
        return text
    if variant == "products_only":
        return _replace(text, _GATHER, "    (void)keys;", path)
    raise SystemExit(f"{variant!r} is not one of {', '.join(FORWARD_CUTS)}")


def patch(tree: Path, variant: str) -> None:
    """Rewrite the forward kernel (or, for dq_*, the backward's dq kernel) of
    the repository copy at ``tree`` into ``variant``."""
    kernel = tree / "cuda" / ("sparse_attention_dq.cuh" if variant.startswith("dq_") else "sparse_attention.cu")
    text = kernel.read_text()
    cuts = {"dq_gathers_only": _DQ_PRODUCTS, "dq_products_only": _DQ_GATHERS, "dq_no_images": _DQ_IMAGES}
    if variant in cuts:
        for old in cuts[variant]:
            text = _replace(text, old, "", kernel)
    elif variant == "evict_last":
        text = _replace(text, _GATHER, _EVICT_LAST_LOOP, kernel)
        tiles = tree / "cuda" / "tiles.cuh"
        anchor = "__device__ __forceinline__ void cp_async_commit()"
        tiles.write_text(_replace(tiles.read_text(), anchor, _COPY_AT + anchor, tiles))
    elif variant in FORWARD_CUTS:
        text = forward_variant(text, variant, kernel)
    else:
        raise SystemExit(f"unknown variant {variant!r}; one of {', '.join(VARIANTS)}")
    kernel.write_text(text)
    print(f"{kernel}: {variant}")


def outputs(path: Path) -> None:
    """Save the forward's out, lse and probs and the backward's dq and dkv on awkward inputs to ``path`` (.npz)."""
    import cupy as cp
    import torch

    import hyscale_core as hs

    from .sparse_attention_gpu import inputs, to_cupy

    saved = {}
    for n, h, k in [(2500, 64, 2048), (2100, 128, 2048), (700, 64, 300), (300, 16, 7)]:
        tq, tkv, tdout, tidx = inputs(torch, n, h, k, seed=n + h + k)
        drop = torch.rand(tidx.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda") < 0.1
        tidx[drop] = -1
        tidx[5] = -1  # a row without keys
        tidx[6, 100:] = -1  # trailing blocks without keys
        tidx[7, :] = tidx[7, :1]  # one key repeated
        q, kv, dout, idx = (to_cupy(cp, x, torch) for x in (tq, tkv, tdout, tidx))
        out, lse, probs = hs.sparse_attention(q, kv, idx, return_probs=True)
        saved[f"out_{n}_{h}_{k}"] = cp.asnumpy(out.view(cp.uint16))
        saved[f"lse_{n}_{h}_{k}"] = cp.asnumpy(lse)
        saved[f"probs_{n}_{h}_{k}"] = cp.asnumpy(probs)
        for precise in (False, True):
            dq, dkv = hs.sparse_attention_backward(q, kv, idx, out, lse, dout, precise_dkv=precise)
            saved[f"dq_{n}_{h}_{k}_{int(precise)}"] = cp.asnumpy(dq.view(cp.uint16))
            saved[f"dkv_{n}_{h}_{k}_{int(precise)}"] = cp.asnumpy(dkv.view(cp.uint16))
    np.savez(path, **saved)
    print(f"saved {path} ({hs.__file__})")


def compare(first: Path, others: list[Path]) -> bool:
    """Whether every file in ``others`` holds bitwise the arrays of ``first``."""
    ref = np.load(first)
    same = True
    for other in others:
        got = np.load(other)
        bad = [name for name in ref.files
               if name not in got.files or not np.array_equal(ref[name].view(np.uint8), got[name].view(np.uint8))]
        print(f"{other}: " + ("IDENTICAL" if not bad else f"DIFFERS in {bad}"))
        same = same and not bad
    return same


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    p = steps.add_parser("patch", help="rewrite a repository copy's forward kernel into a variant")
    p.add_argument("tree", type=Path)
    p.add_argument("variant", choices=VARIANTS)
    o = steps.add_parser("outputs", help="save this tree's forward outputs on awkward inputs")
    o.add_argument("path", type=Path)
    c = steps.add_parser("compare", help="bitwise comparison of saved outputs with the first file")
    c.add_argument("first", type=Path)
    c.add_argument("others", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.step == "patch":
        patch(args.tree, args.variant)
    elif args.step == "outputs":
        outputs(args.path)
    elif not compare(args.first, args.others):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
