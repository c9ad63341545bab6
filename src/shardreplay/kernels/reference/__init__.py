"""Plain-numpy twins of the check kernels, which a process runs until numba loads (docs/internals.md,
"Numpy twins and lazy kernels")."""
