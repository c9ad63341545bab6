"""Compiled (numba) kernels, each beside a plain-numpy reference; internal to shardreplay."""
