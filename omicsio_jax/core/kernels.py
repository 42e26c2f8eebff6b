"""numba helpers the kernels share: `prefetch`, LLVM's cache-line prefetch as a function numba compiles."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for the cache line of ``array.flat[index]`` (a C-contiguous array) to be fetched for writing,
    without waiting for it: a kernel that will update a row of a table too large for the caches
    names it a few iterations ahead, so the misses overlap instead of stalling one by one. A hint
    only: nothing is read, and an index past the array faults nothing."""
    if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(
            fn, [pointer, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)]
        )  # write, keep, data
        return context.get_dummy_value()

    return types.void(array, index), codegen
