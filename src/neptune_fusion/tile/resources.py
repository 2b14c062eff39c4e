"""Resource estimates of a tile kernel, used to keep a schedule within the device's limits.

Triton software-pipelines the loads inside a loop: each of them is kept `num_stages` deep
in shared memory. A schedule whose loop loads more than fits is shrunk before it is compiled.

Example:
    >>> # shared_memory_estimate(kernel) -> bytes
"""

from __future__ import annotations

import math

from neptune_fusion.tile.ir import Loop, Op, Stmt, TileKernel

_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1}


def _tile_bytes(kernel: TileKernel, op: Op) -> int:
    elems = math.prod(kernel.constexprs[kernel.block_sizes[a]] for a in op.out.axes)
    return elems * _BYTES.get(op.out.dtype, 4)


def shared_memory_estimate(kernel: TileKernel) -> int:
    """Bytes of shared memory the pipelined loads of the kernel's loops need (a lower bound)."""
    worst = 0

    def loop_bytes(body: list[Stmt]) -> int:
        loads = sum(_tile_bytes(kernel, st) for st in body
                    if isinstance(st, Op) and st.kind in ("load", "desc_load") and st.out.axes)
        return loads * max(1, kernel.num_stages)

    for st in kernel.body:
        if isinstance(st, Loop):
            worst = max(worst, loop_bytes(st.body))
    return worst
