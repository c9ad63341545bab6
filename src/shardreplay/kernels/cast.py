"""Values of any numeric dtype stored as a field's dtype inside compiled code, by the rules of
``spec/coerce.as_stored``: the one-step add takes a user's int64 step types, float64
observations or strided views as they come, with no conversion before the call.

A stored dtype is a runtime code (``codes.STORED_DTYPES``' index), so that one compiled form
serves every spec with the same input types.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype

from shardreplay.kernels.codes import FIRST_FLOAT, STORED_DTYPES, stored_code
from shardreplay.kernels.copy import _byte_pointer

__all__ = ["c_code", "fits", "item", "store_as"]

_BOOL, _U64, _F32 = 0, STORED_DTYPES.index(np.dtype(np.uint64)), FIRST_FLOAT
# Each integer code's range (the float codes' entries are unused); the top of uint64 is not
# an int64, and is never compared (every unsigned value fits uint64).
_LO = tuple(int(np.iinfo(d.name).min) if d.kind in "iu" else 0 for d in STORED_DTYPES)
_HI = tuple(min(int(np.iinfo(d.name).max), 2**63 - 1) if d.kind in "iu" else 0 for d in STORED_DTYPES)
_NUMBA_TYPES = tuple(types.boolean if d.kind == "b" else getattr(types, d.name) for d in STORED_DTYPES)


def c_code(array):  # pragma: no cover - compiled (overloaded below)
    """``array``'s dtype as a stored code when it is typed C-contiguous (-1: another
    layout or dtype), a compile-time constant."""


@overload(c_code)
def _c_code(array):  # pragma: no cover - compiling
    code = stored_code(as_dtype(array.dtype)) if array.layout == "C" else -1
    return lambda array: code


def item(array, i, k):  # pragma: no cover - compiled (overloaded below)
    """Value ``k`` (in C order) of row ``i`` of ``array``, of any layout: indexed directly
    for one or two axes (numba's ``flat`` of a strided array computes each index)."""


@overload(item)
def _item(array, i, k):  # pragma: no cover - compiling
    if array.ndim == 1:
        return lambda array, i, k: array[i]
    if array.ndim == 2:
        return lambda array, i, k: array[i, k]
    return lambda array, i, k: array.flat[i * (array.size // array.shape[0]) + k]


def fits(x, code, finite):  # pragma: no cover - compiled (overloaded below)
    """Whether the scalar ``x`` may be stored as the dtype of ``code``: a bool anywhere; an
    integer in an integer dtype whose range holds it, or in a float one; a float only in a
    float one, and (``finite``) not NaN or inf once stored."""


@overload(fits)
def _fits(x, code, finite):  # pragma: no cover - compiling
    if isinstance(x, types.Boolean):
        return lambda x, code, finite: True
    if isinstance(x, types.Float):
        def float_fits(x, code, finite):
            if code == _F32:
                return not finite or np.isfinite(np.float32(x))
            return code > _F32 and (not finite or np.isfinite(x))
        return float_fits
    if isinstance(x, types.Integer) and x.signed:
        def signed_fits(x, code, finite):
            return code >= _F32 or (code != _BOOL and _LO[code] <= x and (code == _U64 or x <= _HI[code]))
        return signed_fits
    if isinstance(x, types.Integer):
        def unsigned_fits(x, code, finite):
            return code >= _F32 or code == _U64 or (code != _BOOL and np.uint64(x) <= np.uint64(_HI[code]))
        return unsigned_fits
    return None


@intrinsic
def store_as(typingctx, dst, offset, x, code):  # pragma: no cover - compiled
    """Store the scalar ``x`` as the dtype of ``code`` at byte ``offset`` of ``dst`` (any
    alignment); nothing for another code. The caller checked it :func:`fits`."""
    if not isinstance(dst, types.Array):
        return None

    def codegen(context, builder, signature, args):
        d, off, value, c = args
        ptr = _byte_pointer(context, builder, signature.args[0], d, off)
        done = builder.append_basic_block("store.done")
        switch = builder.switch(c, done)
        for i, to in enumerate(_NUMBA_TYPES):
            block = builder.append_basic_block(f"store.{i}")
            switch.add_case(ir.Constant(c.type, i), block)
            with builder.goto_block(block):
                cast = context.cast(builder, value, signature.args[2], to)
                data = context.get_data_type(to)
                builder.store(context.get_value_as_data(builder, to, cast),
                              builder.bitcast(ptr, data.as_pointer()), align=1)
                builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return types.void(dst, types.intp, x, types.intp), codegen
