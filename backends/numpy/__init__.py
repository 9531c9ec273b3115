"""The numpy backend: the CPU arithmetic. Its dispatch (:mod:`.dispatch`), and the compiled
kernels (:mod:`.kernels`) that compute the oracle's numbers fast."""
