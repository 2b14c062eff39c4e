"""What a tile kernel asks of the GPU: shared memory and registers, as Triton compiles it for Hopper.

The schedule checks every plan against the device with these numbers before anything is compiled
(schedule/auto.py `fit`). A kernel's `Footprint` is read off its tile IR once and is symbolic in
the block sizes, stages and warps, so it prices any plan of the same program without lowering it
again.

Shared memory (bytes), an upper bound of what Triton 3.6 allocates for sm_90:

- resident tiles: a tile loaded before the loops that a dot reads inside them (attention's query
  tile) is kept in shared memory for the whole loop (wgmma reads it from there);
- pipelined tiles: each tile a dot of the loop reads (every tile, in a loop without dots) is
  buffered `depth` deep, `depth` being `num_stages` when a dot of the loop runs on wgmma (the
  asynchronous dot still reads its slot while the next one is filled) and `num_stages - 1`
  otherwise (mma.sync); a load computed an iteration ahead (tile/pipeline.py) one slot more.
  Other loads of a loop of dots are pipelined too when their elements are 32-bit or wider
  (gathered ids), not when narrower (mask tables). With one stage nothing is pipelined: each dot
  operand is staged in shared memory at its dot, so the largest one counts;
- conversions: a dot operand computed in the loop (the probabilities P) passes through shared
  memory on its way to mma.sync's register layout (wgmma takes it from registers), and so does a
  2-D tile a loop of dots loads beside them (a gathered mask) on its way to the dots' layout;
- loops nested in a loop add their buffers to the outer loop's; loops one after the other reuse
  them; a store after the loops converts its tile through shared memory the loops no longer use;
- `SLACK_BYTES` for mbarriers and cross-warp reduction scratch.

Registers (32-bit, per thread), a conservative count, not ptxas's: the fp32 values the loop carries
(accumulators, running statistics) plus the largest tile computed per iteration, once for each
dot that computes such a tile and once more (a score tile and the probabilities made from it are
live together; a loop with a second such dot, a backward pass's dP beside its scores, holds both
and what is made from them), spread over the program's threads, plus `ADDRESS_REGISTERS` for
pointers, offsets and masks. Above 255 ptxas spills to local memory: a 128 x 256 fp32 accumulator
over 4 warps is 256 values a thread on its own.

Example:
    >>> from neptune_fusion.tile.ir import Loop, Op, TileKernel, TVal
    >>> i32 = lambda n: TVal(n, (), "i32")
    >>> q, k = TVal("q", ("r", "d"), "f16"), TVal("k", ("c", "d"), "f16")
    >>> s = TVal("s", ("r", "c"), "f32")
    >>> body = [Op(k, "load", (), {"buffer": "k"}), Op(s, "dot", (q, k), {"k": "d"})]
    >>> kernel = TileKernel("demo", [], ("r", "c", "d"), {"r": "BR", "c": "BC", "d": "BD"}, [], [
    ...     Op(q, "load", (), {"buffer": "q"}), Loop(i32("j"), i32("lo"), i32("hi"), "BC", body)],
    ...     num_warps=4, num_stages=3, constexprs={"BR": 128, "BC": 64, "BD": 128})
    >>> shared_memory_estimate(kernel)  # q resident (32 KB), k three slots deep (3 x 16 KB), slack
    82944
    >>> from neptune_fusion.schedule.tiles import AxisTiling
    >>> usage = plan_usage(kernel, lambda plan: AxisTiling((("d", 128),)))  # any plan of its program
    >>> usage(Plan(128, 64, 4, 2, 1))[0]  # one stage fewer: 16 KB less
    66560
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

from neptune_fusion.schedule.auto import Plan
from neptune_fusion.schedule.tiles import AxisTiling
from neptune_fusion.tile.ir import Assign, If, Loop, Op, Stmt, Store, TileKernel, TVal

_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1, "i8": 1, "i16": 2, "u8": 1}
_SIXTEEN_BIT = ("f16", "bf16")
_FLOATS = ("f32", "f16", "bf16")

# H100 / H200 (sm_90): the most shared memory one program may use (cudaDevAttrMaxSharedMemoryPerBlockOptin,
# what Triton checks a kernel against when it loads it) and the registers one thread can address
HOPPER_SHARED_BYTES = 232448
HOPPER_REGISTERS = 255
SLACK_BYTES = 1024  # mbarriers of the pipelined copies, scratch of cross-warp reductions
ADDRESS_REGISTERS = 40  # pointers, offsets, loop bounds and masks beside the tile values


@dataclass(frozen=True)
class Tile:
    """A tile's shape as the constexpr names of its block sizes, and its element size in bytes."""

    blocks: tuple[str, ...]
    itemsize: int

    def elements(self, constexprs: Mapping[str, int]) -> int:
        return math.prod(constexprs.get(b, 1) for b in self.blocks)

    def nbytes(self, constexprs: Mapping[str, int]) -> int:
        return self.elements(constexprs) * self.itemsize


@dataclass(frozen=True)
class Dot:
    """One `tl.dot`: its (m, n, k) block names, whether both operands are 16-bit, and its A operand
    when the loop computes it (rather than loading it)."""

    m: str
    n: str
    k: str
    sixteen_bit: bool
    computed_a: Tile | None = None

    def on_wgmma(self, constexprs: Mapping[str, int], num_warps: int) -> bool:
        """Whether Triton lowers it to Hopper's asynchronous wgmma (its conditions for MMA v3: a
        warpgroup multiple, 64-row multiples, 16-bit operands), not mma.sync or FMA."""
        c = constexprs
        return (self.sixteen_bit and num_warps % 4 == 0 and c.get(self.m, 1) % 64 == 0
                and c.get(self.n, 1) % 8 == 0 and c.get(self.k, 1) >= 16)


@dataclass(frozen=True)
class LoopUse:
    """What one loop keeps: the tiles it loads per iteration ((tile, computed an iteration ahead),
    split by whether a dot reads them), its dots, its reductions, the loops nested in it, the
    values it carries and the largest tile it computes per iteration."""

    dot_loads: tuple[tuple[Tile, bool], ...]
    other_loads: tuple[tuple[Tile, bool], ...]
    dots: tuple[Dot, ...]
    reduced: tuple[Tile, ...]
    inner: tuple[LoopUse, ...]
    carried: tuple[Tile, ...]
    work: Tile | None
    # work tiles live at once: one per dot computing one, and one more; where the work tile is a
    # nested loop's accumulator (a K-loop's), updated in place, what is made from it (exp of the
    # logits) is consumed by the reductions as it is made: half a tile more
    work_copies: float = 2

    def shared_bytes(self, c: Mapping[str, int], stages: int, warps: int) -> int:
        wgmma = [d.on_wgmma(c, warps) for d in self.dots]
        if stages <= 1:
            own = max((t.nbytes(c) for t, _ in self.dot_loads), default=0)
        else:
            depth = stages if any(wgmma) else stages - 1
            # a loop of dots pipelines the loads its dots read and those of 32-bit elements or
            # wider (gathered ids); a loop without dots all of them
            loads = self.dot_loads + tuple(t for t in self.other_loads if not self.dots or t[0].itemsize >= 4)
            own = sum(t.nbytes(c) * (depth + ahead) for t, ahead in loads)
        convert = max((d.computed_a.nbytes(c) for d, w in zip(self.dots, wgmma)
                       if d.computed_a is not None and not w), default=0)
        if self.dots:
            # a tile loaded beside the dots (a gathered mask) meets the scores in the mma layout,
            # converted through shared memory
            convert = max([convert] + [t.nbytes(c) for t, _ in self.other_loads if len(t.blocks) > 1])
        # a loop of dots reduces rows of the mma layout, each row within one warp; other reductions
        # may combine every warp's part through shared memory
        reduce = 0 if self.dots else _reduce_scratch(self.reduced, c, warps)
        inner = max((loop.shared_bytes(c, stages, warps) for loop in self.inner), default=0)
        return own + convert + reduce + inner

    def register_values(self, c: Mapping[str, int]) -> int:
        """fp32 values live at once in this loop's body: carried state, the work tiles, and what
        its nested loops hold on top."""
        work = int(self.work_copies * self.work.elements(c)) if self.work is not None else 0
        own = sum(t.elements(c) for t in self.carried)
        return own + max(work, max((loop.register_values(c) for loop in self.inner), default=0))


def _reduce_scratch(reduced: tuple[Tile, ...], c: Mapping[str, int], warps: int) -> int:
    """Shared memory a cross-warp reduction combines through: one fp32 partial per warp and result."""
    return max((t.elements(c) * 4 * warps for t in reduced), default=0)


@dataclass(frozen=True)
class Footprint:
    """The resources of a kernel, symbolic in its block sizes, stages and warps (see the module
    docstring): the tiles resident during its loops, its loops (in order), the operands of dots
    outside the loops (a software-pipelined loop's prologue and peeled last iteration), the
    reductions outside the loops, and its stored tiles."""

    resident: tuple[Tile, ...]
    loops: tuple[LoopUse, ...]
    staged: tuple[tuple[Tile, ...], ...]
    reduced: tuple[Tile, ...]
    stores: tuple[Tile, ...]

    def shared_bytes(self, constexprs: Mapping[str, int], num_stages: int, num_warps: int) -> int:
        """Bytes of shared memory the kernel compiled with these block sizes, stages and warps needs
        (an upper bound)."""
        c = constexprs
        resident = sum(t.nbytes(c) for t in self.resident)
        loops = max((loop.shared_bytes(c, num_stages, num_warps) for loop in self.loops), default=0)
        staged = max((sum(t.nbytes(c) for t in operands) for operands in self.staged), default=0)
        after = max(max((t.nbytes(c) for t in self.stores), default=0),
                    _reduce_scratch(self.reduced, c, num_warps))
        return max(resident + max(loops, staged), after) + SLACK_BYTES

    def registers(self, constexprs: Mapping[str, int], num_warps: int) -> int:
        """32-bit registers a thread needs (a conservative count, see the module docstring)."""
        values = max((loop.register_values(constexprs) for loop in self.loops), default=0)
        return -(-values // (32 * num_warps)) + ADDRESS_REGISTERS


def _walk(body: list[Stmt]) -> Iterator[Stmt]:
    """Statements of `body` and of the conditionals in it, not entering loops."""
    for st in body:
        if isinstance(st, If):
            yield from _walk(st.body)
        else:
            yield st


def _deep(body: list[Stmt]) -> Iterator[Stmt]:
    for st in _walk(body):
        yield st
        if isinstance(st, Loop):
            yield from _deep(st.body)


def footprint(kernel: TileKernel) -> Footprint:
    """The kernel's `Footprint`, read off its tile IR."""
    defs = {st.out.name: st for st in _deep(kernel.body) if isinstance(st, Op)}
    row = kernel.tile_axes[0] if kernel.tile_axes else ""

    def tile(v: TVal, itemsize: int | None = None) -> Tile:
        return Tile(tuple(kernel.block_sizes.get(a, "") for a in v.axes), itemsize or _BYTES.get(v.dtype, 4))

    def elements(v: TVal) -> int:
        return tile(v).elements(kernel.constexprs)

    def source(v: TVal) -> Op | None:
        """The op defining a dot operand, seen through casts (the operand cast to the dot's dtype)."""
        op = defs.get(v.name)
        while op is not None and op.kind == "cast":
            op = defs.get(op.args[0].name)
        return op

    def is_load(op: Op | None) -> bool:
        return op is not None and op.kind in ("load", "desc_load") and bool(op.out.axes)

    def loaded_operands(dot: Op) -> list[Op]:
        return [op for v in dot.args[:2] if is_load(op := source(v))]

    # a loaded dot operand is staged in the dtype the dot reads it in: an fp16 tile cast to fp32 for
    # an fp32 dot (a split-K combine's) takes twice its loaded bytes
    operand_bytes: dict[int, int] = {}
    for d in defs.values():
        if d.kind == "dot":
            for v in d.args[:2]:
                op = source(v)
                if is_load(op):
                    assert op is not None
                    widest = max(_BYTES.get(v.dtype, 4), _BYTES.get(op.out.dtype, 4), operand_bytes.get(id(op), 0))
                    operand_bytes[id(op)] = widest

    def operand(op: Op) -> Tile:
        return tile(op.out, operand_bytes.get(id(op)))

    in_loops = [st for loop in _walk(kernel.body) if isinstance(loop, Loop) for st in _deep(loop.body)]
    loop_dots = [st for st in in_loops if isinstance(st, Op) and st.kind == "dot"]
    dot_operands = {id(op) for d in defs.values() if d.kind == "dot" for op in loaded_operands(d)}
    scratch_buffers = {a.source.name for a in kernel.args if a.source.kind == "scratch"}

    def loop_use(loop: Loop) -> LoopUse:
        body = list(_walk(loop.body))
        ops = [st for st in body if isinstance(st, Op)]
        loads = [(op, op.out.name in loop.ahead) for op in ops if is_load(op)]
        axes = {op.out.axes[0] for op in ops if op.kind == "arange" and op.out.axes}
        dots = []
        for d in (op for op in ops if op.kind == "dot"):
            a, b = d.args[0], d.args[1]
            x = next(ax for ax in d.out.axes if ax in a.axes)
            y = next(ax for ax in d.out.axes if ax in b.axes)
            computed = not is_load(source(a))
            dots.append(Dot(kernel.block_sizes.get(x, ""), kernel.block_sizes.get(y, ""),
                            kernel.block_sizes.get(d.attrs["k"], ""),
                            a.dtype in _SIXTEEN_BIT and b.dtype in _SIXTEEN_BIT, tile(a) if computed else None))
        # per-iteration work: the row tiles of floats computed along the loop's own axis (integer
        # tiles are addresses, which the compiler folds into the loads)
        work = [op.out for op in ops if op.kind not in ("load", "desc_load") and op.out.dtype in _FLOATS
                and row in op.out.axes and set(op.out.axes) & axes]
        largest = max(work, key=elements, default=None)
        work_dots = sum(1 for d in ops if d.kind == "dot" and row in d.out.axes and set(d.out.axes) & axes)
        nested = [st for st in body if isinstance(st, Loop)]
        copies = 1.5 if nested and not any(op.kind == "dot" for op in ops) else max(2, 1 + work_dots)
        return LoopUse(
            tuple((operand(op), ahead) for op, ahead in loads if id(op) in dot_operands),
            tuple((tile(op.out), ahead) for op, ahead in loads if id(op) not in dot_operands),
            tuple(dots),
            tuple(tile(op.out, 4) for op in ops if op.kind == "reduce" and op.out.axes),
            tuple(loop_use(st) for st in body if isinstance(st, Loop)),
            tuple(tile(st.target, 4) for st in body if isinstance(st, Assign) and st.target.axes),
            tile(largest, 4) if largest is not None else None, copies)

    top = [st for st in _walk(kernel.body) if isinstance(st, Op)]
    read_in_loops = {id(op) for d in loop_dots for op in loaded_operands(d)}
    resident = [op for op in top if is_load(op) and id(op) in read_in_loops]
    staged = tuple(tuple(operand(op) for op in loaded_operands(d) if id(op) not in read_in_loops)
                   for d in top if d.kind == "dot")
    # values are computed in fp32 and stored in the output's dtype, the inputs' own unless it is a
    # split-K partial state (fp32 scratch); Triton converts them to it before their layout
    floats = [_BYTES[op.out.dtype] for op in defs.values() if is_load(op) and op.out.dtype in _FLOATS]
    stored = max(floats, default=4)
    stores = tuple(tile(st.value, 4 if st.buffer in scratch_buffers else stored)
                   for st in _deep(kernel.body) if isinstance(st, Store) and st.value.axes)
    loops = tuple(loop_use(st) for st in _walk(kernel.body) if isinstance(st, Loop))
    reduced = tuple(tile(op.out, 4) for op in top if op.kind == "reduce" and op.out.axes)
    return Footprint(tuple(operand(op) for op in resident), loops, staged, reduced, stores)


def shared_memory_estimate(kernel: TileKernel) -> int:
    """Bytes of shared memory Triton needs for the kernel as it stands (an upper bound, see the
    module docstring)."""
    return footprint(kernel).shared_bytes(kernel.constexprs, kernel.num_stages, kernel.num_warps)


def register_estimate(kernel: TileKernel) -> int:
    """32-bit registers per thread the kernel as it stands needs (see the module docstring)."""
    return footprint(kernel).registers(kernel.constexprs, kernel.num_warps)


def narrow_loops_first(kernel: TileKernel) -> bool:
    """Whether a loop of `kernel` computes more than one work tile per iteration (two dots along the
    loop's axis): its work tiles, not its carried state, fill the registers, so narrower loop
    tiles relieve them without giving up the reuse of each loaded tile across many rows."""
    return any(loop.work_copies > 2 for loop in footprint(kernel).loops)


def plan_usage(kernel: TileKernel, tiling_of: Callable[[Plan], AxisTiling]) -> Callable[[Plan], tuple[int, int]]:
    """(bytes of shared memory, registers per thread) of the kernel any plan gives the program
    `kernel` was lowered from, priced from `kernel`: another plan changes block sizes, stages and
    warps, not which tiles the kernel holds. `tiling_of(plan)`: the full axes' blocks under a plan
    (schedule/tiles.py `choose_tiling`). Example: the module docstring's.
    """
    fp = footprint(kernel)
    row, col = kernel.tile_axes[0], kernel.tile_axes[1]

    def usage(plan: Plan) -> tuple[int, int]:
        c = {**kernel.constexprs, kernel.block_sizes[row]: plan.block_row, kernel.block_sizes[col]: plan.block_col}
        c.update((kernel.block_sizes[a], b) for a, b in tiling_of(plan).blocks if a in kernel.block_sizes)
        return fp.shared_bytes(c, plan.num_stages, plan.num_warps), fp.registers(c, plan.num_warps)

    return usage


TRITON_MAX_NUMEL = 2**20  # Triton refuses a tensor of more elements (its `TRITON_MAX_TENSOR_NUMEL`)


def largest_tile(kernel: TileKernel) -> tuple[int, str]:
    """The element count of the kernel's largest tile value, and that value's name.

    Example:
        >>> from neptune_fusion.tile.lower import example_kernel
        >>> largest_tile(example_kernel(16))[0]
        256
    """
    best = (0, "")
    for st in _deep(kernel.body):
        if isinstance(st, Op) and st.out.axes:
            n = math.prod(kernel.constexprs.get(kernel.block_sizes.get(a, ""), 1) for a in st.out.axes)
            best = max(best, (n, st.out.name))
    return best
