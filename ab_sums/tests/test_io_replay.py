"""LogReplaySource gives back exactly what the live indexer selected.

The engine-side test (a training step fed by a rollout's log is bitwise
equal to one that selects live) belongs with the engine; this checks the
source it will read from.
"""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import same_bits
from hyscale_core.io import LogReplaySource, SelectionLog, fingerprint

N, H, D, TOPK = 300, 4, 16, 64

MASKS = {
    "causal": dict(causal=True),
    "packed": dict(causal=True, cu_seqlens=np.array([0, 1, 8, 150, 300])),
    "packed_non_causal": dict(causal=False, cu_seqlens=np.array([0, 100, 300])),
    "q_pos": dict(causal=True, q_pos=np.arange(0, 2 * N, 2) + 1),
}


def live(seed, masks):
    rng = np.random.default_rng(seed)
    n_keys = 2 * N + 1 if "q_pos" in masks else N
    q = rng.standard_normal((N, H, D), dtype=np.float32)
    k = rng.standard_normal((n_keys, D), dtype=np.float32)
    w = rng.standard_normal((N, H), dtype=np.float32)
    return hs.indexer_topk(q, k, w, TOPK, **masks), n_keys


def test_replayed_selections_are_bitwise_the_live_ones(tmp_path):
    path = tmp_path / "rollout.h5"
    selections = {}
    with SelectionLog(path, "w") as log:
        for layer, (name, masks) in enumerate(MASKS.items()):
            selections[layer], n_keys = live(layer, masks)
            log.append("sample-0", layer, selections[layer], n_keys=n_keys, **masks)
    with LogReplaySource(path, "sample-0") as source:
        assert source.layers() == [str(i) for i in range(len(MASKS))]
        for layer, masks in enumerate(MASKS.values()):
            replayed = source.selection(layer)
            assert same_bits(replayed, selections[layer])
            assert source.fingerprint(layer) == fingerprint(selections[layer])
            info = source.info(str(layer))
            assert info.causal == masks["causal"] and info.shape == (N, TOPK)
            # the logged masks reproduce the live selection when fed back to the indexer
            assert same_bits(live(layer, {k: v for k, v in info.mask_kwargs().items() if v is not None})[0], replayed)
    assert not source.log._file.id.valid  # a source opened from a path closes its log


def test_missing_layers_and_samples_are_key_errors(tmp_path):
    path = tmp_path / "rollout.h5"
    with SelectionLog(path, "w") as log:
        log.append(0, "attn.0", live(0, MASKS["causal"])[0])
    with SelectionLog(path) as log:
        source = LogReplaySource(log, 0)
        with pytest.raises(KeyError, match=f"layer 'attn.1' of sample '0' is not in {path}"):
            source.selection("attn.1")
        with pytest.raises(KeyError, match="layer 'attn.1'"):
            source.fingerprint("attn.1")
        source.close()
        assert len(log) == 1  # a source given an open log leaves it open
        with pytest.raises(KeyError, match="sample '1' is not in"):
            LogReplaySource(log, 1)
