"""The numba kernels of the CPU arithmetic: the oracle's numbers, bit for bit, fast."""
