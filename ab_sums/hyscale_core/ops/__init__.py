"""One subpackage per operation: a NumPy reference, a CPU backend (Numba),
a GPU backend (CuPy RawKernels from ``cuda/``) and the public function that
validates its arguments and picks the backend once."""
