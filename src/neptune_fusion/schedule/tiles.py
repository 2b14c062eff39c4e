"""Per-axis tiling: how a kernel walks each axis its tile would otherwise hold whole.

The tile lowering gives a fused program's axes roles (tile/lower.py `AxisRoles`): tiled rows,
the loop axis, program-id batch axes, and "full" axes. A full axis short enough is held whole
in registers (attention's head dims). A longer one is tiled by what the program does with it:

- an axis that stored values are indexed by but that nothing reduces (a matmul's output axis)
  is tiled across the grid: each program computes one tile of it, and values not indexed by it
  (a row's norm) are recomputed by every program;
- an axis only reduced (a contraction too long for one tile) is walked by an inner loop over its
  tiles, accumulating in fp32 (a K-loop), wherever the reduction sits (inside the fused loop's
  body or after it);
- an axis both reduced and indexing stored values has no tiling here and is refused.

Block sizes come from the extents and a register / shared-memory budget, never from what the
program is called.

Example:
    >>> from neptune_fusion.schedule.tiles import AxisTiling
    >>> AxisTiling((("e", 128),), grid=("e",)).block("e")
    128
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from neptune_fusion.ir.errors import UnsupportedProgramError
from neptune_fusion.ir.expr import Reduce, walk
from neptune_fusion.ir.program import FusedLoop, Program

MAX_WHOLE = 512  # an axis at most this long is held whole in registers
# fp32 accumulator values of one program's tile of a grid-tiled axis (rows x that axis): 64 per
# thread at 8 warps, what a 128 x 128 matmul tile holds, where the loop computes other tiles beside
# it (scores, probabilities); 128 per thread (128 x 256) where it only sums products of loaded
# tiles (`sums_loaded_products`: a plain matmul's K-loop), whose operands wgmma reads from shared
# memory: each loaded element then serves twice the products
GRID_TILE_VALUES = 128 * 128
ACCUMULATOR_TILE_VALUES = 128 * 256
MAX_GRID_BLOCK = 256
MAX_K_BLOCK = 64  # K-loop tiles: fp16 operands of 128 x 64 keep three pipeline stages in shared memory
SHARED_BYTES = 200 * 1024
REGISTER_VALUES_PER_THREAD = 160  # fp32 values a thread may keep live in a tile's state


@dataclass(frozen=True)
class AxisTiling:
    """The block size of every full axis, and which of them are tiled across the grid (`grid`)
    or walked by an inner loop (`loops`); the others are held whole."""

    blocks: tuple[tuple[str, int], ...]
    grid: tuple[str, ...] = ()
    loops: tuple[str, ...] = ()

    def block(self, axis: str) -> int:
        return dict(self.blocks)[axis]

    @property
    def tiled(self) -> bool:
        return bool(self.grid or self.loops)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def axis_uses(program: Program) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """(axis -> (a stage that reduces over it, the reducer), axis -> a stage whose values it
    indexes) of a fused program."""
    reduced: dict[str, tuple[str, str]] = {}
    spatial: dict[str, str] = {}
    for st in program.all_stages():
        for a in st.axes:
            spatial.setdefault(a, st.name)
        for node in walk(st.body):
            if isinstance(node, Reduce):
                reduced.setdefault(node.axis, (st.name, node.op))
    return reduced, spatial


def sums_loaded_products(program: Program) -> bool:
    """Whether every member of the fused program's loop sums element-wise values of loaded tiles
    (a matmul's K-loop): no value per (row, loop) position comes from another reduction first
    (attention's scores), so the loop tile is only a K-step and the loop holds nothing but its
    accumulators.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> from neptune_fusion.schedule.pipeline import fuse
        >>> mm = nf.program(lambda x, w: nf.einsum("ik,ke->ie", x, w))
        >>> sums_loaded_products(fuse(mm.trace(torch.randn(4, 8), torch.randn(8, 2)))[-1].program)
        True
    """
    loops = [n for n in program.stages if isinstance(n, FusedLoop)]
    return bool(loops) and all(isinstance(m.body, Reduce) and m.body.op == "sum"
                               and not any(isinstance(n, Reduce) for n in walk(m.body.body))
                               for loop in loops for m in loop.members)


def grid_block(block_row: int, accumulators_only: bool) -> int:
    """The widest tile of a grid-tiled axis beside `block_row` rows (before the register check).

    Example:
        >>> grid_block(128, accumulators_only=True), grid_block(128, accumulators_only=False)
        (256, 128)
    """
    values = ACCUMULATOR_TILE_VALUES if accumulators_only else GRID_TILE_VALUES
    return min(MAX_GRID_BLOCK, max(16, values // block_row))


def inner_loop_axes(program: Program, full_sizes: dict[str, int]) -> tuple[str, ...]:
    """The full axes too long to hold that are only reduced: each is walked by an inner loop.

    Example:
        >>> import torch
        >>> from neptune_fusion.library import linear_logsumexp
        >>> from neptune_fusion.schedule.pipeline import fuse
        >>> fused = fuse(linear_logsumexp.trace(torch.randn(4, 8), torch.randn(6, 8)))[-1].program
        >>> inner_loop_axes(fused, {"d": 4096})
        ('d',)
    """
    reduced, spatial = axis_uses(program)
    return tuple(a for a, n in full_sizes.items() if _walked_by_inner_loop(a, n, reduced, spatial))


def _walked_by_inner_loop(axis: str, size: int, reduced: dict[str, Any], spatial: dict[str, str]) -> bool:
    return size > MAX_WHOLE and axis in reduced and axis not in spatial


def choose_tiling(program: Program, full_sizes: dict[str, int], block_row: int, block_col: int,
                  dtype_bytes: int = 2, num_stages: int = 1, num_warps: int = 4) -> AxisTiling:
    """Block sizes for the full axes of a fused program (see the module docstring). Grid tiles
    are narrowed until the loop's state fits in registers (`check_fits`)."""
    reduced, spatial = axis_uses(program)
    grid_width = grid_block(block_row, sums_loaded_products(program))
    blocks: list[tuple[str, int]] = []
    grid: list[str] = []
    loops: list[str] = []
    for axis, size in full_sizes.items():
        whole = _pow2(size)
        if size <= MAX_WHOLE:
            blocks.append((axis, whole))
        elif axis in spatial and axis not in reduced:
            blocks.append((axis, min(whole, grid_width)))
            grid.append(axis)
        elif _walked_by_inner_loop(axis, size, reduced, spatial):
            # both operand tiles of a step, `num_stages` deep, within shared memory
            fit = SHARED_BYTES // (max(1, num_stages) * (block_row + block_col) * dtype_bytes)
            blocks.append((axis, max(16, min(MAX_K_BLOCK, whole, 1 << (max(16, fit).bit_length() - 1)))))
            loops.append(axis)
        else:
            raise UnsupportedProgramError(
                "tile planning", reduced[axis][0], f"{reduced[axis][1]} over {axis}",
                f"axis {axis!r} (size {size}) is both reduced (here) and indexes the stored values of stage "
                f"{spatial[axis]!r}; held whole it takes more than {MAX_WHOLE} registers per row, and neither "
                "a grid tiling nor an inner loop over it computes both")
    sizes = dict(blocks)
    budget = _register_budget(num_warps)
    held_outputs = [a for a, _ in blocks if a not in grid and a in spatial and a not in reduced]
    if len(held_outputs) > 1 and _state_values(program, sizes, block_row) > budget:
        # several output axes short enough to hold whole (a batched matmul's rows beside its
        # columns) multiply into a state that does not fit: they are tiled across the grid too
        grid += held_outputs
    while grid and _state_values(program, sizes, block_row) > budget:
        widest = max(grid, key=lambda a: sizes[a])
        if sizes[widest] <= 16:
            break
        sizes[widest] //= 2
    return AxisTiling(tuple((a, sizes[a]) for a, _ in blocks), tuple(grid), tuple(loops))


def _state_values(program: Program, blocks: dict[str, int], block_row: int) -> int:
    """fp32 values of the fused loops' accumulators in one program (other axes count 1: rows are
    `block_row`, batch axes one entry)."""
    values = 0
    for loop in (n for n in program.stages if isinstance(n, FusedLoop)):
        for m in loop.members:
            values += block_row * math.prod(blocks.get(a, 1) for a in m.axes)
    return values


def _register_budget(num_warps: int) -> int:
    return num_warps * 32 * REGISTER_VALUES_PER_THREAD


def grid_tiles(tiling: AxisTiling, full_sizes: dict[str, int]) -> int:
    """How many programs the grid-tiled axes give each row tile (1: none is tiled)."""
    return math.prod(-(-full_sizes[a] // tiling.block(a)) for a in tiling.grid)


def check_fits(tiling: AxisTiling, program: Program, block_row: int, num_warps: int) -> None:
    """Refuse a tiled plan whose loop state cannot live in registers (checked before lowering).
    Plans that hold every axis whole are left to the schedule as before."""
    if not tiling.tiled:
        return
    blocks = dict(tiling.blocks)
    values = _state_values(program, blocks, block_row)
    budget = _register_budget(num_warps)
    if values > budget:
        raise UnsupportedProgramError(
            "tile planning", program.name, "loop state",
            f"the fused loop keeps {values} fp32 values per program (blocks {blocks}); {num_warps} warps hold "
            f"at most {budget}")
