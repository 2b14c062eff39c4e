"""Choosing a template and its parameters from the shapes, and fitting the plan to the device's
shared memory and registers (`fit`).

Example:
    >>> plan = choose(Auto(), rows=4096, cols=4096, batch=32, full_sizes={"d": 128}, dtype="f16",
    ...               num_sms=132, interpreter=False)
    >>> plan.splits
    1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from neptune_fusion.schedule.templates import Auto, Autotune, Flash, Schedule, SplitK
from neptune_fusion.schedule.tiles import MAX_K_BLOCK, MAX_WHOLE, grid_block

MMA_ROWS = 64  # rows of one warpgroup's tensor-core instruction (wgmma)
TILED_HELD = 128  # width of the tile an axis longer than MAX_WHOLE is held in (at most)

# shared memory one multiprocessor gives its programs' pipeline stages (H100/H200: 227 KB, less
# what the compiler keeps for itself and for the row operands)
SHARED_BYTES = 200 * 1024

# a loop that streams memory: each thread of its 4 warps holds this many elements of each loaded
# tile (16-bit: two 16-byte vectors), so that many programs share a multiprocessor
STREAM_THREAD_ELEMENTS = 16
STREAM_ROWS = 16  # the fewest rows a tile is laid out with
MAX_GRID_AXIS = 65535  # CUDA's limit on grid axes 1 and 2 (split-K's chunks are axis 2)
REREAD_WIDENING = 8  # how much wider a streaming loop's tiles are when a second pass rereads its rows from L2
# a streaming loop with a second pass over its rows holds a row whole when it fits this many fp32
# values a thread (at 4 warps, or 8 for longer rows): the row is read from memory once and the
# second pass reuses it (tile/lower.py `LoweringConfig.whole_loop`)
WHOLE_ROW_THREAD_VALUES = 64

# a loop whose every tile runs an inner K-loop re-reads its rows' operand (too long to keep in the
# program) for each loop tile; where one wave of programs re-reads more than L2 holds, those reads
# come from HBM and each element read serves `block_col` products: the H100 / H200's ~1000 dense
# TFLOP/s over ~4.8 TB/s of HBM asks for about 200, and the loop tiles are this wide (a linear
# cross-entropy's vocabulary tiles)
INNER_LOOP_TILE = 256
L2_BYTES = 50 * 2**20  # H100's L2 (the H200 has 60 MB)
MAX_K_STAGES = 4  # pipeline stages of a matmul's K-loop when shared memory holds them


@dataclass(frozen=True)
class Plan:
    """A resolved schedule: everything the lowering needs to know about the mapping."""

    block_row: int
    block_col: int
    num_warps: int
    num_stages: int
    splits: int
    prefetch_dot: bool = False  # software-pipelined loops (tile/pipeline.py)

    @property
    def template(self) -> str:
        return "split_k" if self.splits > 1 else "flash"


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def choose(schedule: Schedule, *, rows: int, cols: int, batch: int, full_sizes: dict[str, int], dtype: str,
           num_sms: int, interpreter: bool, block_mapped: bool = False, streams: bool = False,
           rereads: bool = False, k_loop: bool = False, inner_loop_length: int = 0, reduces: bool = True) -> Plan:
    """Resolve `schedule` for these sizes (rows: tiled axis, cols: reduced axis, batch: programs per row tile).

    `block_mapped`: tiles are visited from a run-time block map (under split-K each split takes a
    share of each row tile's list), which gains from narrower key tiles: a partly visible tile wastes
    less. `streams` (`AxisRoles.streams`): each loaded element serves one row, so more rows per
    program only make fewer programs: the tiles are small and many programs share each
    multiprocessor, which keeps more loads in flight; with a second pass over each row (`rereads`,
    a softmax) whose rows one wave can keep in L2, the row segments are `REREAD_WIDENING` times as
    wide. `k_loop` (`AxisRoles.k_loop`): the loop tile is a matmul's K-step, as wide as an inner
    K-loop's (schedule/tiles.py `MAX_K_BLOCK`), with as many pipeline stages (up to `MAX_K_STAGES`) as shared memory holds for the widest output
    tile (`grid_block`): one such program fills a multiprocessor's registers, so deeper stages cost
    it no company. `inner_loop_length`: each loop tile runs inner K-loops over this many elements
    (schedule/tiles.py `inner_loop_axes`); where a wave of programs re-reads more of the rows'
    operand than L2 holds, the loop tiles are `INNER_LOOP_TILE` wide. `reduces` False: the loop has
    nothing to reduce (a program with no reduction), so its tiles are independent and each program
    takes one, as an element-wise kernel does: as many splits as loop tiles (no combine follows).

    Example:
        >>> pooling = choose(Auto(), rows=16384, cols=8192, batch=1, full_sizes={}, dtype="f16", num_sms=132,
        ...                  interpreter=False, streams=True)
        >>> (pooling.block_row, pooling.block_col, pooling.num_warps)
        (16, 128, 4)
    """
    if isinstance(schedule, Autotune):
        schedule = schedule.base
    # an axis too long to hold whole is walked a tile at a time (schedule/tiles.py): the registers
    # and each pipeline stage hold that tile, not the axis
    held = {a: n if n <= MAX_WHOLE else TILED_HELD for a, n in full_sizes.items()}
    head = max(held.values(), default=64)
    if interpreter:
        block_row = min(32, _pow2_at_least(rows))
        block_col = 32
        warps, stages = 4, 1
    else:
        block_row = 128 if rows >= 128 else _pow2_at_least(rows)
        block_col = 128 if head <= 128 else 64
        if dtype == "f32":
            block_row, block_col = min(block_row, 64), 32
        if block_mapped:
            block_col = min(block_col, 64)
        if k_loop:
            block_col = min(block_col, MAX_K_BLOCK)
        warps = 8 if block_row >= 128 else 4
        stages = 3 if head <= 128 else 2
        if k_loop and not streams:
            out_tile = sum(n if n <= MAX_WHOLE else grid_block(block_row, True) for n in full_sizes.values())
            stage_bytes = block_col * (block_row + out_tile) * (4 if dtype == "f32" else 2)
            stages = max(stages, min(MAX_K_STAGES, SHARED_BYTES // stage_bytes))
        wave = min(math.ceil(rows / block_row) * batch, num_sms)
        if inner_loop_length and not block_mapped and dtype != "f32" and wave * block_row * inner_loop_length * 2 > L2_BYTES:
            block_col = INNER_LOOP_TILE
        if streams:
            held_elems = math.prod(held.values())
            warps, stages = 4, 2
            tile = STREAM_THREAD_ELEMENTS * 32 * warps
            block_col = max(16, min(_pow2_at_least(cols), tile // (STREAM_ROWS * held_elems)))
            block_row = min(_pow2_at_least(rows), max(STREAM_ROWS, tile // (block_col * held_elems)))
            if rows < block_row:  # fewer rows than a tile lays out (a vector): its columns fill it instead
                block_row = _pow2_at_least(rows, 1)
                block_col = max(16, min(_pow2_at_least(cols), tile // (block_row * held_elems)))
            if not reduces:
                # nothing to reduce: no reason to lay out rows, and a tile of one long row segment is
                # one contiguous read (16 rows of a short segment each are 16 DRAM pages)
                block_col = max(16, min(_pow2_at_least(cols), tile // held_elems))
                block_row = min(_pow2_at_least(rows, 1), max(1, tile // (block_col * held_elems)))
            row_values = _pow2_at_least(cols) * held_elems
            if rereads and row_values <= WHOLE_ROW_THREAD_VALUES * 32 * 8:
                # the whole row in one tile: its second pass reads nothing again
                warps = 4 if row_values <= WHOLE_ROW_THREAD_VALUES * 32 * 4 else 8
                block_col = _pow2_at_least(cols)
                block_row = min(_pow2_at_least(rows, 1), max(1, WHOLE_ROW_THREAD_VALUES * 32 * warps // row_values))
            elif rereads and num_sms * block_row * cols * (4 if dtype == "f32" else 2) <= L2_BYTES // 2:
                # a second pass re-reads each row: while a wave's rows fit in the near half of L2
                # (each multiprocessor's partition) it reads them from there, and wider tiles walk
                # both passes in fewer, longer iterations; longer rows come back from HBM either
                # way, and the narrow streaming tile keeps more programs' loads in flight
                block_col = min(_pow2_at_least(cols), REREAD_WIDENING * block_col)
    splits = 1
    prefetch = False
    programs = math.ceil(rows / block_row) * batch
    if isinstance(schedule, SplitK):
        splits = schedule.splits or 0
    elif isinstance(schedule, Auto) and not reduces:
        splits = min(math.ceil(cols / block_col), MAX_GRID_AXIS)
    elif isinstance(schedule, Auto):
        # a streaming loop has no tile reuse to lose by splitting: it splits until about four
        # programs share each multiprocessor (its combine merges one state per row and split)
        fill = 4 * num_sms if streams and not rereads and not interpreter else num_sms
        splits = 0 if programs < fill and cols >= 4 * block_col else 1
    if splits != 1 and rows <= MMA_ROWS and not streams:
        # memory-bound (one row tile of at most one warpgroup's MMA rows: each loaded element
        # feeds few products, and no other row tile reads it): 64-wide key tiles, 4 warps, 2 stages
        # keep the most bytes in flight per multiprocessor, whether the split count is given or
        # chosen. More rows stay compute-bound when split (a matmul's few row tiles, all reading the
        # same columns) and keep their plan
        if not interpreter:
            block_col, warps, stages = 64, 4, 2
    if splits == 0:
        # about four programs per multiprocessor keep enough loads in flight, rounded down so no
        # multiprocessor gets an extra one; each chunk at least four tiles long. The combine merges
        # splits x rows partial states, so programs with several rows (packed GQA groups,
        # speculative decoding) take fewer splits
        wanted = max(1, (4 * num_sms) // max(1, programs * (1 if streams else min(4, rows))))
        # chunks of four tiles leave most multiprocessors idle when there are few programs (packed
        # GQA at short lengths); shorter chunks until each multiprocessor has one
        by_length = cols // (4 * block_col)
        to_fill = min(num_sms // max(1, programs), math.ceil(cols / block_col))
        splits = max(1, min(wanted, max(by_length, to_fill), 128))
    if splits > 1:
        # chunks are whole tiles: drop splits that would be left without any
        chunk_tiles = math.ceil(math.ceil(cols / block_col) / splits)
        splits = math.ceil(math.ceil(cols / block_col) / chunk_tiles)
        # with at most two programs per multiprocessor, a third stage keeps more bytes in flight
        # and still fits twice in shared memory; with more programs per multiprocessor, they keep
        # the loads in flight themselves and 2 stages stay
        resident = math.ceil(programs * splits / num_sms)
        stage_bytes = block_col * sum(held.values()) * (4 if dtype == "f32" else 2)
        if not interpreter and resident <= 2 and resident * 3 * stage_bytes <= SHARED_BYTES:
            stages = max(stages, 3)
    if isinstance(schedule, (Flash, SplitK)):
        block_row = schedule.block_q or block_row
        block_col = schedule.block_k or block_col
        warps = schedule.num_warps or warps
        stages = schedule.num_stages or stages
        if schedule.prefetch_dot is not None:
            prefetch = schedule.prefetch_dot
    if (splits > 1 and not interpreter and not streams
            and not (isinstance(schedule, (Flash, SplitK)) and schedule.block_q)):
        block_row = _pow2_at_least(rows) if rows <= 64 else block_row
    return Plan(block_row, block_col, warps, stages, splits, prefetch)


def candidates(plan: Plan, *, rows: int, cols: int, interpreter: bool, limit: int = 8) -> list[Plan]:
    """Plans worth timing around `plan` (the heuristic choice first)."""
    out = [plan]

    def add(**changes: int | bool) -> None:
        p = Plan(**{**plan.__dict__, **changes})
        if p not in out and p.block_col <= max(16, _pow2_at_least(cols)) and p.block_row <= max(16, _pow2_at_least(rows)):
            out.append(p)

    if plan.splits > 1:
        for splits in (plan.splits // 2, plan.splits * 2):
            if splits > 1 and cols // splits >= 2 * plan.block_col:
                add(splits=splits)
        add(block_col=128 if plan.block_col != 128 else 64)
        add(num_stages=3 if plan.num_stages != 3 else 2)
        add(num_warps=8 if plan.num_warps != 8 else 4)
    else:
        add(block_col=64 if plan.block_col != 64 else 128)
        add(num_stages=2 if plan.num_stages != 2 else 3)
        add(block_row=64, num_warps=4)
        add(num_warps=4 if plan.num_warps != 4 else 8)
        add(block_col=64 if plan.block_col != 64 else 128, num_stages=4)
        add(prefetch_dot=not plan.prefetch_dot)
        add(prefetch_dot=not plan.prefetch_dot, block_col=64 if plan.block_col != 64 else 128)
    if interpreter:
        out = out[:2]
    return out[:limit]


def fit(plan: Plan, usage: Callable[[Plan], tuple[int, int]], shared_bytes: int, registers: int, *,
        narrow_first: bool = False) -> Plan:
    """`plan`, shrunk until its kernel fits the device: `usage(plan)` is (bytes of shared memory,
    registers per thread) of the kernel that plan gives, `shared_bytes` and `registers` what one
    program may have. The plan is returned unchanged when it fits.

    Shared memory: fewer pipeline stages down to two, then narrower loop tiles down to 32, then a
    single stage, then fewer rows, then the narrowest loop tiles. A loop of two stages keeps one
    tile's copy in flight while the dots run; one stage serialises them, so a narrower tile is
    given up first. Registers: more warps (up to eight) spread the same tile over more threads,
    then fewer rows (the accumulators shrink with them), then narrower loop tiles; with
    `narrow_first`, narrower loop tiles (down to 32) come before fewer rows when they alone make
    the plan fit (a loop whose per-iteration tiles outweigh what it carries). Pipeline stages
    given up for shared memory come back where a later narrowing made room for them. Where nothing
    shrinks any more the smallest plan is returned: the device's compiler reports what still does
    not fit when it loads the kernel.

    Example:
        >>> def usage(p):  # a resident 64 KB tile and 64 KB a stage; a 128 x 256 fp32 accumulator
        ...     return 65536 * (1 + p.num_stages), p.block_row * 256 // (32 * p.num_warps) + 40
        >>> fit(Plan(128, 64, 4, 3, 8), usage, 232448, 255)
        Plan(block_row=128, block_col=64, num_warps=8, num_stages=2, splits=8, prefetch_dot=False)
    """
    stages = plan.num_stages

    def fits(p: Plan) -> bool:
        shared, regs = usage(p)
        return shared <= shared_bytes and regs <= registers

    while True:
        shared, regs = usage(plan)
        if shared > shared_bytes:
            if plan.num_stages > 2:
                smaller = replace(plan, num_stages=plan.num_stages - 1)
            elif plan.block_col > 32:
                smaller = replace(plan, block_col=plan.block_col // 2)
            elif plan.num_stages > 1:
                smaller = replace(plan, num_stages=1)
            elif plan.block_row > 16:
                smaller = replace(plan, block_row=plan.block_row // 2)
            elif plan.block_col > 16:
                smaller = replace(plan, block_col=plan.block_col // 2)
            else:
                return plan
        elif regs > registers:
            narrowed = _narrowed_to_fit(plan, usage, registers) if narrow_first else None
            if plan.num_warps < 8:
                smaller = replace(plan, num_warps=plan.num_warps * 2)
            elif narrowed is not None:
                smaller = narrowed
            elif plan.block_row > 16:
                smaller = replace(plan, block_row=plan.block_row // 2)
            elif plan.block_col > 16:
                smaller = replace(plan, block_col=plan.block_col // 2)
            else:
                return plan
        else:
            while plan.num_stages < stages and fits(deeper := replace(plan, num_stages=plan.num_stages + 1)):
                plan = deeper
            return plan
        plan = smaller


def _narrowed_to_fit(plan: Plan, usage: Callable[[Plan], tuple[int, int]], registers: int) -> Plan | None:
    """The widest loop tile (at least 32) with which `plan` fits the registers, if any."""
    narrower = plan
    while narrower.block_col > 32:
        narrower = replace(narrower, block_col=narrower.block_col // 2)
        if usage(narrower)[1] <= registers:
            return narrower
    return None
