"""Compiled (numba) kernels, each tested against a plain-numpy reference; internal to shardreplay."""
