"""hyscale_core.io.fingerprint: stable, order- and shape-sensitive, h5py-free."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from hyscale_core.io import fingerprint

TABLE = np.array([[3, 1, -1], [0, 2, 1]], dtype=np.int32)


def test_known_value_never_changes():
    # Logs written today are replayed by later versions: these values are part of the format.
    assert fingerprint(TABLE) == "ed22c9f4193966b41186ef252e215db7"
    assert fingerprint(np.zeros((0, 2048), dtype=np.int32)) == "74a96c5495dd51083bfa1efaeb3283c6"


def test_is_blake2b_128_of_domain_shape_and_int32_bytes():
    payload = b"hyscale-selection-v1\0" + np.array(TABLE.shape, "<i8").tobytes() + TABLE.astype("<i4").tobytes()
    assert fingerprint(TABLE) == hashlib.blake2b(payload, digest_size=16).hexdigest()


def test_same_table_same_fingerprint_any_layout_or_int_dtype():
    assert fingerprint(TABLE) == fingerprint(TABLE.copy())
    assert fingerprint(TABLE) == fingerprint(np.asfortranarray(TABLE))
    assert fingerprint(TABLE) == fingerprint(TABLE.astype(np.int64))
    assert fingerprint(TABLE) == fingerprint(TABLE.tolist())
    assert fingerprint(TABLE) == fingerprint(TABLE.astype(">i4"))


def test_rank_order_values_and_shape_all_count():
    prints = {fingerprint(TABLE), fingerprint(TABLE[:, ::-1]), fingerprint(TABLE.reshape(3, 2)),
              fingerprint(TABLE.T), fingerprint(np.where(TABLE == 2, 4, TABLE).astype(np.int32))}
    assert len(prints) == 5
    assert fingerprint(np.zeros((0, 3), np.int32)) != fingerprint(np.zeros((3, 0), np.int32))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="indices must have 2 dimensions"):
        fingerprint(np.arange(4, dtype=np.int32))
    with pytest.raises(TypeError, match="indices must hold integers, got dtype float32"):
        fingerprint(TABLE.astype(np.float32))
    with pytest.raises(ValueError, match="indices must fit int32"):
        fingerprint(np.array([[2**31]], dtype=np.int64))


def test_imports_without_h5py():
    probe = ("import sys; sys.modules['h5py'] = None\n"
             "from hyscale_core.io import fingerprint\n"
             "import numpy as np; print(fingerprint(np.zeros((1, 1), np.int32)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert len(out.strip()) == 32
