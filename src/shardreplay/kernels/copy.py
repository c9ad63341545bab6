"""Byte copies between numpy arrays inside compiled code, at memory speed (why, and the
caller's duty to keep offsets in range: docs/internals.md, "Byte copies")."""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from shardreplay.kernels import cache_lock  # noqa: F401  (numba's cache, safe across processes)

_BYTE_PTR = ir.IntType(8).as_pointer()
STREAM_BYTES = 16  # the width of one non-temporal store
_PREFETCH = ir.FunctionType(ir.VoidType(), [_BYTE_PTR, *(ir.IntType(32),) * 3])  # llvm.prefetch's type


def _byte_pointer(context, builder, array_type, array, offset):  # pragma: no cover - compiling
    """``(uint8 *) array.data + offset``."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(builder.bitcast(data, _BYTE_PTR), [offset])


def _check_arrays(*array_types):  # pragma: no cover - compiling
    for t in array_types:
        if not isinstance(t, types.Array):
            raise numba.core.errors.TypingError(f"copy intrinsics take arrays, got {t}")


@intrinsic
def copy_at(typingctx, dst, dst_offset, src, src_offset, nbytes):  # pragma: no cover - compiled
    """``memcpy`` of ``nbytes`` from byte ``src_offset`` of ``src`` to byte
    ``dst_offset`` of ``dst``."""
    _check_arrays(dst, src)

    def codegen(context, builder, signature, args):
        d, d_off, s, s_off, n = args
        cgutils.raw_memcpy(builder, _byte_pointer(context, builder, signature.args[0], d, d_off),
                           _byte_pointer(context, builder, signature.args[2], s, s_off), n, 1)
        return context.get_dummy_value()
    return types.void(dst, types.intp, src, types.intp, types.intp), codegen


@intrinsic
def bytes_equal(typingctx, a, a_offset, b, b_offset, nbytes):  # pragma: no cover - compiled
    """``nbytes`` bytes from byte ``a_offset`` of ``a`` equal those from byte ``b_offset``
    of ``b`` (libc's ``memcmp``)."""
    _check_arrays(a, b)

    def codegen(context, builder, signature, args):
        x, x_off, y, y_off, n = args
        memcmp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), [_BYTE_PTR, _BYTE_PTR, n.type]), "memcmp")
        got = builder.call(memcmp, [_byte_pointer(context, builder, signature.args[0], x, x_off),
                                    _byte_pointer(context, builder, signature.args[2], y, y_off), n])
        return builder.icmp_signed("==", got, ir.Constant(ir.IntType(32), 0))
    return types.boolean(a, types.intp, b, types.intp, types.intp), codegen


def _copy_of(size: int) -> Any:
    """:func:`copy_at` of a constant ``size``: compiles to one load and store instead of
    a call (small fields are copied millions of times per exchange)."""
    @intrinsic
    def copy(typingctx, dst, dst_offset, src, src_offset):  # pragma: no cover - compiled
        _check_arrays(dst, src)

        def codegen(context, builder, signature, args):
            d, d_off, s, s_off = args
            cgutils.raw_memcpy(builder, _byte_pointer(context, builder, signature.args[0], d, d_off),
                               _byte_pointer(context, builder, signature.args[2], s, s_off),
                               ir.Constant(ir.IntType(64), size), 1)
            return context.get_dummy_value()
        return types.void(dst, types.intp, src, types.intp), codegen
    return copy


copy_1, copy_2, copy_4, copy_8 = (_copy_of(n) for n in (1, 2, 4, 8))


@numba.njit(cache=True, nogil=True, inline="always")
def copy_small_or_at(dst, dst_offset, src, src_offset, nbytes):  # pragma: no cover - compiled
    """:func:`copy_at`, with the common field sizes inlined."""
    if nbytes == 8:
        copy_8(dst, dst_offset, src, src_offset)
    elif nbytes == 4:
        copy_4(dst, dst_offset, src, src_offset)
    elif nbytes == 1:
        copy_1(dst, dst_offset, src, src_offset)
    elif nbytes == 2:
        copy_2(dst, dst_offset, src, src_offset)
    else:
        copy_at(dst, dst_offset, src, src_offset, nbytes)


@intrinsic
def misalignment(typingctx, array, offset):  # pragma: no cover - compiled
    """``(address of byte offset of array) % STREAM_BYTES``: whether streaming stores
    may start there."""
    _check_arrays(array)

    def codegen(context, builder, signature, args):
        ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1])
        address = builder.ptrtoint(ptr, ir.IntType(64))
        return builder.urem(address, ir.Constant(ir.IntType(64), STREAM_BYTES))
    return types.intp(array, types.intp), codegen


@intrinsic
def stream_copy_at(typingctx, dst, dst_offset, src, src_offset, nbytes):  # pragma: no cover - compiled
    """:func:`copy_at` of ``nbytes`` (a multiple of 16) to a 16-byte aligned destination
    with non-temporal stores: a sampled batch of frame stacks goes to memory without
    first reading every destination line into the cache. :func:`store_fence` must
    follow before another thread reads the destination."""
    _check_arrays(dst, src)

    def codegen(context, builder, signature, args):
        d, d_off, s, s_off, n = args
        dst_at = _byte_pointer(context, builder, signature.args[0], d, d_off)
        src_at = _byte_pointer(context, builder, signature.args[2], s, s_off)
        vec = ir.VectorType(ir.IntType(64), 2)
        step = ir.Constant(ir.IntType(64), STREAM_BYTES)
        mark = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, builder.udiv(n, step)) as loop:
            off = builder.mul(loop.index, step)
            value = builder.load(builder.bitcast(builder.gep(src_at, [off]), vec.as_pointer()), align=1)
            store = builder.store(value, builder.bitcast(builder.gep(dst_at, [off]), vec.as_pointer()),
                                  align=STREAM_BYTES)
            store.set_metadata("nontemporal", mark)
        return context.get_dummy_value()
    return types.void(dst, types.intp, src, types.intp, types.intp), codegen


def _prefetch_into(locality: int) -> Any:
    """An intrinsic that asks for the cache line at ``address`` (an integer) with LLVM's
    ``locality`` (3: every cache level; 2: not the first): a hint that never faults."""
    @intrinsic
    def prefetch(typingctx, address):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            fn = cgutils.get_or_insert_function(builder.module, _PREFETCH, "llvm.prefetch.p0i8")
            flags = (ir.Constant(ir.IntType(32), v) for v in (0, locality, 1))  # read, locality, data
            builder.call(fn, [builder.inttoptr(args[0], _BYTE_PTR), *flags])
            return context.get_dummy_value()
        return types.void(types.int64), codegen
    return prefetch


prefetch = _prefetch_into(3)
# A window's rows are more lines than the first-level cache holds (a batch of 256 windows of
# 512 bytes: 128 KiB); asked into every level, each evicts the last and the tree's lines.
prefetch_to_l2 = _prefetch_into(2)


@numba.njit(cache=True, nogil=True, inline="always")
def prefetch_rows(rows, slot):  # pragma: no cover - compiled
    """Ask for every cache line a window starting at ``slot`` reads: ``rows`` (int64
    ``[k, 3]``) holds per array its address, bytes per slot and bytes per window."""
    for r in range(rows.shape[0]):
        at = rows[r, 0] + slot * rows[r, 1]
        for line in range(at - at % 64, at + rows[r, 2], 64):
            prefetch_to_l2(line)


@intrinsic
def store_fence(typingctx):  # pragma: no cover - compiled
    """Order every earlier store (non-temporal ones included) before later ones."""
    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen
