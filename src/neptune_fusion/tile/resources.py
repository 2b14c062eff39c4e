"""Resource estimates of a tile kernel, used to keep a schedule within the device's limits.

Triton software-pipelines the loads inside a loop: each of them is kept `num_stages` deep
in shared memory. A schedule whose loop loads more than fits is shrunk before it is compiled.

Example:
    >>> # shared_memory_estimate(kernel) -> bytes
"""

from __future__ import annotations

import math

from neptune_fusion.tile.ir import If, Loop, Op, Stmt, TileKernel

_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1, "i8": 1, "i16": 2, "u8": 1}


def _tile_bytes(kernel: TileKernel, op: Op) -> int:
    elems = math.prod(kernel.constexprs[kernel.block_sizes[a]] for a in op.out.axes)
    return elems * _BYTES.get(op.out.dtype, 4)


def shared_memory_estimate(kernel: TileKernel) -> int:
    """Bytes of shared memory the pipelined loads of the kernel's loops need (a lower bound).

    A load computed one iteration ahead (tile/pipeline.py) is read an iteration later, so it is
    kept one stage deeper.
    """
    stages = max(1, kernel.num_stages)

    def loop_bytes(loop: Loop) -> int:
        return sum(_tile_bytes(kernel, st) * (stages + (st.out.name in loop.ahead)) for st in loop.body
                   if isinstance(st, Op) and st.kind in ("load", "desc_load") and st.out.axes)

    def worst(body: list[Stmt]) -> int:
        out = 0
        for st in body:
            if isinstance(st, Loop):
                out = max(out, loop_bytes(st), worst(st.body))
            elif isinstance(st, If):
                out = max(out, worst(st.body))
        return out

    return worst(kernel.body)
