"""Every public function of the package carries its docstring at run time
(help() and IDEs read __doc__): a docstring built as a literal plus a shared
note is no docstring, so the ops add their shared precision note with a
decorator."""
from __future__ import annotations

import inspect

import hyscale_core as hs


def _public_functions():
    return {name: getattr(hs, name) for name in sorted(dir(hs))
            if not name.startswith("_") and inspect.isfunction(getattr(hs, name))}


def test_every_public_function_has_a_docstring():
    missing = [name for name, fn in _public_functions().items() if not (fn.__doc__ or "").strip()]
    assert not missing, missing


def test_the_ops_docstrings_end_with_their_precision_note():
    for name in ("indexer_scores", "indexer_topk", "indexer_scores_at", "indexer_scores_at_backward",
                 "indexer_kl_loss", "sparse_attention", "sparse_attention_backward"):
        doc = getattr(hs, name).__doc__
        assert "Parameters" in doc or "Returns" in doc or "Determinism" in doc, name
        assert "Precision" in doc, name
