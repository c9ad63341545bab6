"""Importing this readies numba's CPU target for compiled calls: it imports and registers
the typing and lowering of everything numba supports (about 200 modules, half a
CPU-second), which numba otherwise does at a process's first compiled call.

For a fork server whose children all call kernels: readied once there, every child
inherits it (the learners' server preloads this module).
"""

from __future__ import annotations

from numba.core.registry import cpu_target

cpu_target.typing_context.refresh()
cpu_target.target_context.refresh()
