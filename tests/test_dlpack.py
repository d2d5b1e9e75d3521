"""Arrays from other frameworks by DLPack (hyscale_core._backend, _dlpack):
host tensors imported without a copy, bfloat16 through its relabelling, and
every producer that cannot be imported a TypeError naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

import hyscale_core as hs
from helpers import HAS_GPU
from hyscale_core._backend import as_array
from hyscale_core._dlpack import _DLManagedTensor, _capsule_pointer
from hyscale_core._dtypes import bfloat16


class Producer:
    """A foreign host tensor over a NumPy array: it offers only the DLPack
    protocol, reports ``device``, and hands out legacy capsules whose dtype
    code is ``code`` (None: the array's own) if given."""

    def __init__(self, array, device=(1, 0), code=None):
        self.array, self.device, self.code = array, device, code

    def __dlpack__(self, **kwargs):
        if self.code is None:
            return self.array.__dlpack__(**kwargs)
        capsule = self.array.__dlpack__()
        _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor.dtype.code = self.code
        return capsule

    def __dlpack_device__(self):
        return self.device


class Failing(Producer):
    """A producer whose export fails; counts its calls."""

    calls = 0

    def __dlpack__(self, **kwargs):
        Failing.calls += 1
        raise RuntimeError("stream sync failed")


SCORES = np.random.default_rng(3).standard_normal((3, 40)).astype(np.float32)


@pytest.mark.parametrize("device", [(1, 0), (3, 0), (11, 0)], ids=["cpu", "cuda_host", "rocm_host"])
def test_host_tensors_are_imported_without_a_copy(device):
    backend, imported = as_array(Producer(SCORES, device), "a")
    assert backend == "cpu" and np.shares_memory(imported, SCORES)
    np.testing.assert_array_equal(hs.topk(Producer(SCORES, device), 5)[1], hs.topk(SCORES, 5)[1])


def test_bfloat16_tensors_are_relabelled_without_a_copy():
    bits = SCORES.astype(bfloat16).view(np.uint16)
    backend, imported = as_array(Producer(bits, code=4), "a")  # kDLBfloat
    assert backend == "cpu" and imported.dtype == bfloat16 and np.shares_memory(imported, bits)
    np.testing.assert_array_equal(hs.topk(Producer(bits, code=4), 5)[1], hs.topk(bits.view(bfloat16), 5)[1])


def test_a_dtype_numpy_cannot_import_is_named():
    complex32 = Producer(np.zeros((3, 4), np.float32), code=5)  # kDLComplex, 32 bits: torch.chalf
    with pytest.raises(TypeError, match=r"^a cannot be imported through DLPack \(Producer, DLPack dtype complex32\)"):
        hs.topk(complex32, 2)
    with pytest.raises(TypeError, match=r"^k cannot be imported through DLPack"):
        hs.indexer_scores(np.zeros((2, 1, 4), np.float32), complex32, np.ones((2, 1), np.float32))


def test_a_failing_producer_is_named_with_its_error():
    Failing.calls = 0
    with pytest.raises(TypeError, match=r"^a cannot be imported through DLPack \(Failing, DLPack dtype unknown\): "
                                        r"stream sync failed"):
        hs.topk(Failing(SCORES), 2)
    assert Failing.calls <= 2  # NumPy's import, then one try for a legacy capsule


@pytest.mark.parametrize("device, message", [
    (None, r"must give \(device_type, device_id\), got None"),
    ((), r"must give \(device_type, device_id\), got \(\)"),
    (("cpu", 0), r"must give \(device_type, device_id\), got \('cpu', 0\)"),
])
def test_a_malformed_device_is_named(device, message):
    with pytest.raises(TypeError, match=r"^a: Producer.__dlpack_device__\(\) " + message):
        hs.topk(Producer(SCORES, device), 2)


def test_unsupported_devices_are_named():
    with pytest.raises(TypeError, match="a lives on DLPack device type 14, which is not supported"):
        hs.topk(Producer(SCORES, (14, 0)), 2)  # kDLOneAPI


@pytest.mark.skipif(HAS_GPU, reason="CuPy sees a GPU: a CUDA producer is imported there")
def test_cuda_tensors_without_cupy_are_named():
    with pytest.raises(TypeError, match="a lives on a CUDA device but CuPy is not available"):
        hs.topk(Producer(SCORES, (2, 0)), 2)


def test_device_arrays_must_live_on_the_current_device():
    """The kernels launch on the current device: an argument on another GPU is
    named with both devices (the check as_array makes for CuPy arrays and CUDA
    DLPack imports)."""
    from hyscale_core._backend import check_device

    check_device("q", 0, 0)
    with pytest.raises(ValueError, match=r"^kv lives on GPU 1 but the current device is GPU 0; call inside "
                                         r"`with cupy.cuda.Device\(1\):`"):
        check_device("kv", 1, 0)


@pytest.mark.gpu
def test_an_array_on_another_gpu_is_refused():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        scores = cupy.asarray(SCORES)
    with pytest.raises(ValueError, match="a lives on GPU 1 but the current device is GPU 0"):
        hs.topk(scores, 5)
    with cupy.cuda.Device(1):
        np.testing.assert_array_equal(hs.topk(scores, 5)[1].get(), hs.topk(SCORES, 5)[1])
