"""Lowering of a fused Program to a tile kernel.

The fused program is one `FusedLoop` followed by output stages. Axes get roles:
the *row* axis is tiled per program (block_q), the loop *col* axis is walked in
tiles (block_k), *batch* axes become program ids, *full* axes (head dims) are held
whole in a tile, or, when too long for that, tiled across the grid (an axis stored values are
indexed by: a matmul's output) or walked by inner loops (a long contraction: a K-loop), as
schedule/tiles.py decides. A reduction to a single value has a declared row axis of extent 1
(transform/layout.py `with_unit_row`). Every expression is lowered generically: loads compute addresses
from their index expressions (so gathers work), contractions of two operands
become `dot`, other reductions become row reductions, and values that do not
depend on the loop are computed once before it. Mask analysis splits the loop into
tiles that need mask arithmetic and tiles that need none, and skips the rest.

Example:
    >>> kernel = example_kernel()
    >>> from neptune_fusion.tile.ir import format_tile_kernel
    >>> for line in format_tile_kernel(kernel).splitlines()[:2]:
    ...     print(line)
    tile kernel fused_kernel: grid (cdiv(size_q, BLOCK_R), size_b * size_h), tile axes ('q', 'k', 'd', 'd2'), blocks {'BLOCK_R': 16, 'BLOCK_C': 16, 'BLOCK_D': 16, 'SIZE_D': 8, 'BLOCK_D2': 16, 'SIZE_D2': 8}, warps 4, stages 1
      note: affine mask region (1*row + -1*col + c >= 0): tiles outside it are skipped, tiles inside it run without mask arithmetic
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from neptune_fusion.algebra.repair import contribution_vanishes, terms_vanish_while_identity
from neptune_fusion.analysis.masks import MaskInfo, analyze_masks
from neptune_fusion.ir.errors import UnsupportedProgramError
from neptune_fusion.ir.expr import (
    NARROW_INT_DTYPES,
    REDUCER_IDENTITY,
    RUNNING_STAND_IN,
    Accumulator,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Running,
    Size,
    Unary,
    Where,
    free_axes,
    loads_of,
    substitute_index,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import FusedLoop, Program, Stage
from neptune_fusion.schedule.pipeline import SPLIT_AXIS
from neptune_fusion.schedule.tiles import AxisTiling, choose_tiling, sums_loaded_products
from neptune_fusion.tile.guards import guarded_branch, nonnegative_index
from neptune_fusion.tile.ir import (
    ArgSource,
    Assign,
    GridDim,
    GridFactor,
    KernelArg,
    Loop,
    Op,
    Stmt,
    Store,
    TileKernel,
    TVal,
)
from neptune_fusion.transform.layout import UNIT_ROW, elementwise_row_axes
from neptune_fusion.transform.normalize import product_of

LOG2E = 1.4426950408889634
BLOCK_MAP_PREFIX = "__blockmap_"
BLOCK_MAP_ROW = "__row_tile__"
BLOCK_MAP_TILE = "__tile__"
STRIDE_PREFIX = "__stride__"
FLOAT_DTYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class AxisRoles:
    """What each axis is in a kernel: tiled rows, the reduced (loop) axis, program-id batch axes,
    head-dim axes held whole, and axes only outputs have."""

    row: str
    col: str
    batch: tuple[str, ...]
    full: tuple[str, ...]
    epilogue: tuple[str, ...] = ()  # axes only outputs have (a split-K combine's second pass)
    # the loop streams memory: its rows share no loaded tile (`rows_share_loads`), so each loaded
    # element serves one row
    streams: bool = False
    # an output is indexed by the loop axis: a second pass reads the rows again (a softmax)
    rereads: bool = False
    # every member sums element-wise values of loaded tiles over the loop axis (a matmul's K-loop,
    # schedule/tiles.py `sums_loaded_products`): the loop tile is only a K-step
    k_loop: bool = False

    @property
    def tile_axes(self) -> tuple[str, ...]:
        return (self.row, self.col, *self.full, *self.epilogue)

    @property
    def held(self) -> frozenset[str]:
        """The axes a tile holds besides the rows and the loop axis."""
        return frozenset((*self.full, *self.epilogue))


@dataclass
class LoweringConfig:
    """Everything shape-dependent the lowering needs (resolved by the schedule)."""

    input_dtypes: dict[str, str]
    full_sizes: dict[str, int]
    block_row: int
    block_col: int
    num_warps: int
    num_stages: int
    splits: int = 1
    dot_dtype: str = "f16"
    partial_outputs: bool = False  # split-K: store member states to scratch instead of outputs
    block_map_axes: tuple[str, ...] | None = None  # visit tiles from run-time lists (batch axes they depend on)
    block_epilogue: int = 128  # tile size of second passes over output-only axes
    tma_buffers: frozenset[str] = frozenset()  # inputs whose tiles may be read through tensor descriptors
    # in a kernel that tiles axes, blocks of tiled axes (K-steps, grid tiles) too, not only [tile, held] ones
    tiled_descriptors: bool = True
    positive_params: frozenset[str] = frozenset()  # float parameters whose value is > 0 (specialised on)
    # one-axis grid whose programs walk row tiles (heaviest first) across this many batch entries at
    # once; None: the (row tiles, batch) grid
    grid_group: int | None = None
    # block sizes of the full axes, and which are tiled across the grid or walked by inner loops
    # (schedule/tiles.py); None: chosen from the sizes by `choose_tiling`
    tiling: AxisTiling | None = None
    # the loop axis is no longer than one loop tile (`block_col`): the loop's one tile is computed
    # without a loop, and a second pass over that axis reuses what it loaded (a row read once)
    whole_loop: bool = False
    notes: list[str] = field(default_factory=list)


def descriptor_hazards(program: Program) -> frozenset[str]:
    """Inputs a fused program must read through pointers, not tensor descriptors: the plain
    operands of a sum whose other operand is computed in registers from loads alone (`exp(x) * g`
    against `w`: no dot of its own) and whose accumulator no repair rescales. Triton 3.6 keeps
    such a dot's wgmma in flight across iterations, and with its copy-engine operand it wrote
    garbage (NaN) into rows on the H200, at 8 warps and at 4 (bench/NOTES.md); pointer loads were
    correct, and so were attention's P @ V (a rescaled accumulator) and a backward's P^T @ dO (P
    made from the iteration's own dot: the loop waits on it every iteration).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> from neptune_fusion.schedule.pipeline import fuse
        >>> p = nf.program(lambda x, g, w: nf.einsum("ik,ke->ie", nf.exp(x) * g, w))
        >>> fused = list(fuse(p.trace(torch.randn(64, 32), torch.randn(32), torch.randn(32, 16))))[-1].program
        >>> sorted(descriptor_hazards(fused))
        ['g', 'w']
    """
    inputs = {b.name for b in program.inputs}
    repaired: set[Expr] = set()
    stages: dict[str, Expr] = {}
    for node in program.stages:
        if isinstance(node, FusedLoop):
            repaired |= {m.body for m in node.members if node.producers.get(m.name)}
            stages.update((m.name, m.body) for m in node.members)
        else:
            stages[node.name] = node.body

    def needs_a_dot(expr: Expr, seen: frozenset[str] = frozenset()) -> bool:
        # an operand made from another reduction of the same iteration (a backward's P from S): the
        # loop waits for that dot every iteration, and the accumulating one is not kept in flight
        for n in walk(expr):
            if isinstance(n, Reduce):
                return True
            if isinstance(n, Load) and n.buffer in stages and n.buffer not in seen:
                if needs_a_dot(stages[n.buffer], seen | {n.buffer}):
                    return True
        return False

    found: set[str] = set()
    for body in stages.values():
        for node in walk(body):
            if not (isinstance(node, Reduce) and node.op == "sum") or node in repaired:
                continue
            factors = _product_factors(node.body)
            plain = [f for f in factors if _plain_input_load(f, inputs) is not None]
            computed = [f for f in factors if f not in plain and node.axis in free_axes(f)]
            if computed and not any(needs_a_dot(f) for f in computed):
                found |= {_plain_input_load(f, inputs) for f in plain} - {None}
    return frozenset(found)


def _product_factors(expr: Expr) -> list[Expr]:
    if isinstance(expr, Binary) and expr.op == "mul":
        return _product_factors(expr.a) + _product_factors(expr.b)
    return [expr]


def _sum_terms(expr: Expr) -> list[Expr]:
    """The terms of `expr` read as a sum (`a - b` is `a + (-1) * b`): what a sum distributes over.

    Example:
        >>> from neptune_fusion.ir.expr import Load
        >>> x, w = Load("x", ()), Load("w", ())
        >>> len(_sum_terms(x * w + w - x))
        3
    """
    if isinstance(expr, Binary) and expr.op == "add":
        return _sum_terms(expr.a) + _sum_terms(expr.b)
    if isinstance(expr, Binary) and expr.op == "sub":
        return _sum_terms(expr.a) + [Binary("mul", Const(-1.0), t) for t in _sum_terms(expr.b)]
    return [expr]


def _plain_input_load(expr: Expr, inputs: set[str]) -> str | None:
    """The input `expr` reads as it is stored (possibly converted), or None."""
    while isinstance(expr, Cast):
        expr = expr.x
    return expr.buffer if isinstance(expr, Load) and expr.buffer in inputs else None


def fused_loop_of(program: Program) -> FusedLoop:
    """The single FusedLoop of a fused program (UnsupportedProgramError otherwise)."""
    loops = [n for n in program.stages if isinstance(n, FusedLoop)]
    if len(loops) != 1:
        raise UnsupportedProgramError("tile lowering", program.name, "program",
                                      f"expected exactly one fused loop, found {len(loops)}")
    return loops[0]


def assign_roles(program: Program) -> AxisRoles:
    """Row, loop, batch and full axes of a fused program (see module docstring)."""
    loop = fused_loop_of(program)
    if loop.members:
        # the fewest axes, and of those the member whose axes most others share (a LayerNorm's row
        # statistics, not its weight's column sums)
        smallest = min(loop.members, key=lambda m: (len(m.axes), -sum(set(m.axes) <= set(n.axes) for n in loop.members)))
        if not smallest.axes and UNIT_ROW not in program.derived_axes:
            raise UnsupportedProgramError("tile lowering", smallest.name, f"{smallest.reduce_op} over {loop.axis}",
                                          "a reduction to a single value has no row axis to tile "
                                          "(transform/layout.py `with_unit_row` declares one)")
        # axes the members contract inside the loop body (a head dim a backward sums over) are held
        # in the tile, never rows: the row is the last of the smallest member's other axes
        inner = {n.axis for m in loop.members for n in walk(m.body.body) if isinstance(n, Reduce)}
        spatial = tuple(a for a in smallest.axes if a not in inner) or smallest.axes
    else:  # no reduction: the rows are the first output's other axes (schedule/pipeline.py)
        spatial = elementwise_row_axes(program, loop.axis)
    # a program per index of a batch axis reads every operand once per index: an operand of a
    # contraction that the axis does not index (a matmul's weight across its rows) is instead
    # shared by a tile of it, so such an axis is held in the tile (tiled across the grid)
    reused = reused_operand_axes(loop.members)
    # of a matmul's two output axes, the one whose operand is computed in the loop (a centred x)
    # is the row: the row operand of a dot is read from registers, the other from shared memory
    computed_axes = computed_operand_axes(loop.members)
    computed = [a for a in computed_axes if a in spatial[:-1] and a in reused]
    # (a row already on the computed operand stays: a batched `rmsnorm(x) @ w`'s tokens, not its batch)
    if spatial and spatial[-1] in reused and spatial[-1] not in computed_axes and computed:
        spatial = (*(a for a in spatial if a != computed[0]), computed[0])
    row = spatial[-1] if spatial else UNIT_ROW
    # a batch axis indexes the whole program's grid: every member has it (dK's and dV's sums
    # over one loop, of head dims d and d2, hold those in the tile)
    everywhere = set.intersection(*(set(m.axes) for m in loop.members)) if loop.members else set(spatial)
    shared = [a for a in spatial[:-1] if a in reused or a not in everywhere]
    running = {m.name for m in loop.members}  # (their running values are not operands)
    loads = [free_axes(n) for m in loop.members for n in walk(m.body) if isinstance(n, Load) and n.buffer not in running]
    other = [a for a in shared if a in everywhere and not any(a in axes and row in axes for axes in loads)]
    if len(shared) > 1 and other:
        # a dot's tile holds the row and one axis of the other operand: further output axes that
        # one operand alone has (bhld's b and h, from `blc,hdc->bhld`) go across the grid, each
        # program then reading that operand's slice for its index
        shared = [a for a in shared if a == other[-1] or a not in everywhere]
    batch = tuple(a for a in spatial[:-1] if a not in shared)
    full: list[str] = list(shared)
    known = {row, loop.axis, *batch}

    def note(axes: set[str] | tuple[str, ...]) -> None:
        for a in axes:
            if a not in known and a not in full:
                full.append(a)

    for st in program.all_stages():
        member = st in loop.members
        if member:
            note(st.axes)
        for node in walk(st.body):
            if isinstance(node, Reduce):
                note({node.axis})
            if isinstance(node, Index) and (member or node.axis not in st.axes):
                note({node.axis})
    epilogue: list[str] = []
    for st in program.all_stages():
        for a in st.axes:
            if a not in known and a not in full and a not in epilogue:
                epilogue.append(a)
    for m in loop.members:
        if loop.axis in m.axes:
            raise UnsupportedProgramError("tile lowering", m.name, f"{m.reduce_op} over {loop.axis}",
                                          "a member of the loop is indexed by the loop axis")
    # (a loop with no members has nothing to read again: its outputs' pass is its only one)
    second_pass = bool(loop.members) and any(loop.axis in program.stage(spec.stage).axes for spec in program.outputs)
    streams = not rows_share_loads(loop.members, row, loop.axis, set(full))
    return AxisRoles(row, loop.axis, tuple(batch), tuple(full), tuple(epilogue), streams, second_pass,
                     sums_loaded_products(program))


def rows_share_loads(members: tuple[Stage, ...], row: str, col: str, held: set[str]) -> bool:
    """Whether a member reads, along the loop axis `col`, a tile without the `row` axis that
    carries an axis held in the tile: such a tile is loaded once for all the rows of a program.
    A vector along the loop (a bias over the keys) is not counted: it costs little beside the rest.

    Example:
        >>> x, v = Load("x", (Index("i"), Index("j"))), Load("v", (Index("i"), Index("j")))
        >>> pooled = Stage("s", ("i",), Reduce("sum", "j", Binary("mul", x, v)))
        >>> rows_share_loads((pooled,), "i", "j", set())
        False
        >>> q, k = Load("q", (Index("i"), Index("d"))), Load("k", (Index("j"), Index("d")))
        >>> scores = Stage("s", ("i", "j"), Reduce("sum", "d", Binary("mul", q, k)))
        >>> rows_share_loads((scores,), "i", "j", {"d"})
        True
    """
    for m in members:
        for node in walk(m.body):
            if isinstance(node, Load):
                axes = free_axes(node)
                if col in axes and row not in axes and axes & held:
                    return True
    return False


def reused_operand_axes(members: tuple[Stage, ...]) -> set[str]:
    """Axes across which an operand of a contraction is reused: a summed product whose factors
    each read a matrix along the summed axis and each carry an axis the other lacks (the output
    axes of a matmul), never an axis every operand carries (attention's heads) or one only an
    index expression lacks (a mask's factor).

    Example:
        >>> h, w = Load("h", (Index("i"), Index("d"))), Load("w", (Index("v"), Index("d")))
        >>> logits = Stage("s", ("i", "v"), Reduce("sum", "d", Binary("mul", h, w)))
        >>> sorted(reused_operand_axes((logits,)))
        ['i', 'v']
    """
    def reads_matrix_along(expr: Expr, axis: str) -> bool:
        loads = (n for n in walk(expr) if isinstance(n, Load))
        return any(axis in (axes := free_axes(ld)) and len(axes) > 1 for ld in loads)

    out: set[str] = set()
    for m in members:
        for node in walk(m.body):
            factors = _summed_product(node)
            if factors is None:
                continue
            a, b = free_axes(factors[0]), free_axes(factors[1])
            if (a - b and b - a and reads_matrix_along(factors[0], node.axis)
                    and reads_matrix_along(factors[1], node.axis)):
                out |= a ^ b
    return out


def _without_casts(expr: Expr) -> Expr:
    while isinstance(expr, Cast):
        expr = expr.x
    return expr


def _summed_product(node: Expr) -> tuple[Expr, Expr] | None:
    """The two operands of `node` where it is a sum of a product (through casts) whose factors fall
    into two groups, each joined by output axes the other lacks, else None. A factor with no such
    axis (a row statistic of the summed axis) goes with a computed operand, a loaded one staying
    as it is loaded.

    Example:
        >>> g, x, r = (Load(n, tuple(map(Index, axes))) for n, axes in (("g", "az"), ("x", "ay"), ("r", "a")))
        >>> [sorted(loads_of(o)) for o in _summed_product(Reduce("sum", "a", g * x * r))]   # dW = (g r)^T x
        [['g', 'r'], ['x']]
    """
    if not (isinstance(node, Reduce) and node.op == "sum"):
        return None
    factors = _product_factors(_without_casts(node.body))
    if len(factors) < 2:
        return None
    own = [free_axes(f) - {node.axis} for f in factors]
    carried = [axes for axes in own if axes]
    common = set.intersection(*carried) if carried else set()
    groups: list[tuple[set[str], list[int]]] = []  # (axes, factor positions), joined by shared axes
    for i, axes in enumerate(own):
        if not axes - common:
            continue
        touching = [g for g in groups if g[0] & axes]
        joined = (set(axes - common).union(*(g[0] for g in touching)), sorted([i, *(j for g in touching for j in g[1])]))
        groups = [g for g in groups if g not in touching] + [joined]
    if len(groups) != 2:
        return None
    first, second = sorted((g[1] for g in groups), key=lambda positions: positions[0])
    rest = [i for i, axes in enumerate(own) if not axes - common]
    if rest:
        computed = [g for g in (first, second) if len(g) > 1 or not isinstance(_without_casts(factors[g[0]]), Load)]
        (computed[0] if computed else first).extend(rest)

    return (product_of([(factors[i], False) for i in sorted(first)]),
            product_of([(factors[i], False) for i in sorted(second)]))


def computed_operand_axes(members: tuple[Stage, ...]) -> list[str]:
    """Output axes of a contraction's operand that is computed, not loaded as it is (a centred
    `x - mean` against a loaded weight): the axes it carries and the other operand lacks.

    Example:
        >>> x, w, mean = Load("x", (Index("i"), Index("k"))), Load("w", (Index("k"), Index("e"))), Load("m", (Index("i"),))
        >>> centred = Stage("s", ("i", "e"), Reduce("sum", "k", Binary("mul", Binary("sub", x, mean), w)))
        >>> computed_operand_axes((centred,))
        ['i']
    """
    out: list[str] = []
    for m in members:
        factors = _summed_product(m.body)
        if factors is None:
            continue
        for a, b in (factors, factors[::-1]):
            if not isinstance(_without_casts(a), Load) and isinstance(_without_casts(b), Load):
                out += sorted(free_axes(a) - free_axes(b) - {m.body.axis})  # type: ignore[union-attr]
    return out


class _Scope:
    def __init__(self, stmts: list[Stmt]) -> None:
        self.stmts = stmts
        self.memo: dict[Expr | tuple[Expr, tuple[str, ...]], TVal] = {}


@dataclass
class _Ctx:
    """What loads and placeholders mean where an expression is being lowered."""

    values: dict[str, TVal]  # member/stage name -> its value here (running or final)
    placeholders: dict[Expr, TVal]
    valid: dict[str, TVal | None]  # tile axis -> its in-bounds mask (None: always in bounds)
    replace: dict[Expr, Expr]  # mask where-nodes -> what they become in this kind of tile
    variant: bool  # inside the loop body
    guards: dict[Load, TVal] = field(default_factory=dict)  # loads valid only where their mask holds (guards.py)


class KernelBuilder:
    """Builds one TileKernel for a fused program."""

    def __init__(self, program: Program, config: LoweringConfig, name: str) -> None:
        self.program = program
        self.config = config
        self.loop = fused_loop_of(program)
        self.roles = assign_roles(program)
        for axis in self.roles.full:
            if axis not in config.full_sizes:
                raise UnsupportedProgramError("tile lowering", program.name, f"axis {axis}",
                                              "the size of a full (head-dim) axis must be known at compile time")
        self.tiling = config.tiling or choose_tiling(
            program, {a: config.full_sizes[a] for a in self.roles.full}, config.block_row, config.block_col,
            num_warps=config.num_warps)
        self.name = name
        self.counter = 0
        self.body: list[Stmt] = []
        self.scopes = [_Scope(self.body)]
        self.args: list[KernelArg] = []
        self.arg_index: dict[str, TVal] = {}
        self.consts: dict[tuple[str, str], TVal] = {}
        self.descriptors: dict[tuple[object, ...], TVal] = {}
        self.tile_start: dict[str, TVal] = {}
        # a loop held in one tile: its column offsets, their mask and its scope (`_emit_loop` inline)
        self._whole_tile: tuple[TVal, TVal | None, _Scope] | None = None
        self.variant_axes = {self.roles.col, BLOCK_MAP_TILE}  # indices that change inside a loop
        self.member_names = {m.name for m in self.loop.members}
        self.producer_names = {p for ps in self.loop.producers.values() for p in ps}
        self.vanishing: dict[tuple[str, str], bool] = {}  # (member, max/min producer) -> terms_vanish_while_identity
        self.loop_axes_of = {m.name: m.axes for m in self.loop.members}
        self.block = {self.roles.row: "BLOCK_R", self.roles.col: "BLOCK_C"}
        self.constexprs: dict[str, int] = {"BLOCK_R": config.block_row, "BLOCK_C": config.block_col}
        for axis in self.roles.full:
            size = config.full_sizes[axis]
            self.block[axis] = f"BLOCK_{axis.upper()}"
            self.constexprs[f"BLOCK_{axis.upper()}"] = self.tiling.block(axis)
            self.constexprs[f"SIZE_{axis.upper()}"] = size
        for axis in self.roles.epilogue:
            self.block[axis] = f"BLOCK_{axis.upper()}"
            self.constexprs[f"BLOCK_{axis.upper()}"] = config.block_epilogue
        int_params = {p for p, k in program.param_kinds.items() if k == "int"}
        int_buffers = frozenset(b.name for b in program.inputs if b.kind != "float")
        self.masks: MaskInfo = analyze_masks(self.loop, self.roles.row, int_params, contribution_vanishes, int_buffers,
                                             self.roles.held)

    # --- values -----------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def op(self, kind: str, axes: tuple[str, ...], dtype: str, args: tuple[TVal, ...] = (),
           scope: _Scope | None = None, prefix: str = "v", **attrs: object) -> TVal:
        out = TVal(self.fresh(prefix), self._canon(axes), dtype)
        (scope or self.scopes[-1]).stmts.append(Op(out, kind, args, dict(attrs)))
        return out

    def _canon(self, axes: tuple[str, ...] | set[str]) -> tuple[str, ...]:
        order = self.roles.tile_axes
        return tuple(a for a in order if a in set(axes))

    def union(self, *vals: TVal) -> tuple[str, ...]:
        s: set[str] = set()
        for v in vals:
            s |= set(v.axes)
        return self._canon(s)

    def kernel_arg(self, name: str, kind: str, source: ArgSource, dtype: str) -> TVal:
        if name not in self.arg_index:
            self.args.append(KernelArg(name, kind, source))
            self.arg_index[name] = TVal(name, (), dtype)
        return self.arg_index[name]

    def size(self, axis: str) -> TVal:
        if axis in self.roles.full:
            return TVal(f"SIZE_{axis.upper()}", (), "i32")
        return self.kernel_arg(f"size_{axis}", "int", ArgSource("size", axis), "i32")

    def const(self, value: object, scope: _Scope | None = None) -> TVal:
        dtype = "bool" if isinstance(value, bool) else ("i32" if isinstance(value, int) else "f32")
        key = (type(value).__name__, repr(value))
        if key not in self.consts:
            self.consts[key] = self.op("const", (), dtype, scope=self.scopes[0], prefix="c", value=value)
        return self.consts[key]

    def to(self, v: TVal, dtype: str, scope: _Scope | None = None) -> TVal:
        if v.dtype == dtype:
            return v
        return self.op("cast", v.axes, dtype, (v,), scope=scope, prefix="t", to_dtype=dtype)

    def bin(self, op: str, a: TVal, b: TVal, scope: _Scope | None = None, nonnegative: bool = False) -> TVal:
        """`a op b`; `nonnegative`: both operands are known not to be negative (grid and tile
        arithmetic, an index of axes and sizes), where floor division and modulo are the machine's."""
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            a, b = self._promote(a, b, scope)
            return self.op("binary", self.union(a, b), "bool", (a, b), scope=scope, op=op)
        if op in ("and", "or"):
            dt = "bool" if a.dtype == b.dtype == "bool" else "i32"
            if dt == "bool" and bool(a.axes) != bool(b.axes):
                # a scalar condition selects: Triton's interpreter cannot `&` a tile with a
                # comparison of a loaded scalar (the compiled kernel computes the same)
                s, tile = (a, b) if not a.axes else (b, a)
                pick = (tile, self.const(False)) if op == "and" else (self.const(True), tile)
                return self.op("where", tile.axes, "bool", (s, *pick), scope=scope)
            return self.op("binary", self.union(a, b), dt, (self.to(a, dt, scope), self.to(b, dt, scope)), scope=scope, op=op)
        a, b = self._promote(a, b, scope)
        if op == "div" and a.dtype not in FLOAT_DTYPES:
            a, b = self.to(a, "f32", scope), self.to(b, "f32", scope)
        if nonnegative and op in ("floordiv", "mod"):
            return self.op("binary", self.union(a, b), a.dtype, (a, b), scope=scope, op=op, nonnegative=True)
        return self.op("binary", self.union(a, b), a.dtype, (a, b), scope=scope, op=op)

    def _promote(self, a: TVal, b: TVal, scope: _Scope | None) -> tuple[TVal, TVal]:
        if a.dtype in FLOAT_DTYPES or b.dtype in FLOAT_DTYPES:
            return self.to(a, "f32", scope), self.to(b, "f32", scope)
        if "i64" in (a.dtype, b.dtype):
            return self.to(a, "i64", scope), self.to(b, "i64", scope)
        if a.dtype == "bool" and b.dtype == "bool":
            return a, b
        return self.to(a, "i32", scope), self.to(b, "i32", scope)

    # --- expressions --------------------------------------------------------------
    def is_variant(self, expr: Expr, ctx: _Ctx) -> bool:
        if not ctx.variant:
            return False
        loop_axes = self.variant_axes
        if any(isinstance(n, (Index, Reduce)) and n.axis in loop_axes for n in walk(expr)):
            return True
        if loads_of(expr) & self.member_names:
            return True
        return any(isinstance(n, (Accumulator, Running)) for n in walk(expr))

    def emit(self, expr: Expr, ctx: _Ctx) -> TVal:
        if expr in ctx.placeholders:
            return ctx.placeholders[expr]
        variant = self.is_variant(expr, ctx)
        scope = self.scopes[-1] if variant else self.scopes[0]
        # a value computed from masked loads is not the same value outside their guard
        guarded = () if not ctx.guards else tuple(sorted(
            {ctx.guards[n].name for n in walk(expr) if isinstance(n, Load) and n in ctx.guards}))
        key = (expr, guarded) if guarded else expr
        if key in scope.memo:
            return scope.memo[key]
        saved = self.scopes
        if not variant:
            self.scopes = [self.scopes[0]]
        try:
            out = self._emit(expr, ctx if variant else _Ctx(ctx.values, {}, ctx.valid, {}, False, ctx.guards))
        finally:
            self.scopes = saved
        scope.memo[key] = out
        return out

    def _emit(self, expr: Expr, ctx: _Ctx) -> TVal:
        if expr in ctx.replace:
            return self.emit(ctx.replace[expr], ctx)
        if isinstance(expr, Const):
            return self.const(expr.value, self.scopes[-1])
        if isinstance(expr, Param) and expr.name.startswith(STRIDE_PREFIX):
            buf, _, dim = expr.name[len(STRIDE_PREFIX):].rpartition(":")
            return self.kernel_arg(f"stride_{buf}_{dim}", "int", ArgSource("stride", buf, int(dim)), "i32")
        if isinstance(expr, Param):
            kind = self.program.param_kinds.get(expr.name, "float")
            return self.kernel_arg(f"param_{expr.name}", "int" if kind == "int" else "float",
                                   ArgSource("param", expr.name), "i32" if kind == "int" else "f32")
        if isinstance(expr, Size):
            return self.size(expr.axis)
        if isinstance(expr, Index):
            if expr.axis not in self.bindings:
                raise UnsupportedProgramError("tile lowering", self.program.name, f"axis {expr.axis}",
                                              "index of an axis that has no binding in this kernel")
            return self.bindings[expr.axis]
        if isinstance(expr, Load):
            return self._load(expr, ctx)
        if isinstance(expr, Unary):
            return self._unary(expr, ctx)
        if isinstance(expr, Binary):
            if expr.op == "pow":
                power = self._power(expr, ctx)
                return power if power is not None else self._general_power(expr, ctx)
            a, b = self.emit(expr.a, ctx), self.emit(expr.b, ctx)
            return self.bin(expr.op, a, b, nonnegative=nonnegative_index(expr.a) and nonnegative_index(expr.b))
        if isinstance(expr, Where):
            c = self.emit(expr.cond, ctx)
            taken = guarded_branch(expr.cond, expr.a)
            if taken is not None:
                guard = self.to(self.emit(taken.guard, ctx), "bool")
                a = self.emit(taken.branch, _Ctx(ctx.values, ctx.placeholders, ctx.valid, ctx.replace, ctx.variant,
                                                 {**ctx.guards, **dict.fromkeys(taken.loads, guard)}))
            else:
                a = self.emit(expr.a, ctx)
            b = self.emit(expr.b, ctx)
            a, b = self._promote(a, b, None)
            c = self.to(c, "bool")
            return self.op("where", self.union(c, a, b), a.dtype, (c, a, b))
        if isinstance(expr, Cast):
            x = self.emit(expr.x, ctx)
            if expr.dtype in FLOAT_DTYPES:
                # a cast to a narrower float rounds; compute stays in f32
                return self.to(self.to(x, expr.dtype), "f32") if expr.dtype != "f32" else self.to(x, "f32")
            return self.to(x, expr.dtype)
        if isinstance(expr, Reduce):
            return self._reduce(expr, ctx)
        raise UnsupportedProgramError("tile lowering", self.program.name, "expression",
                                      f"cannot lower {type(expr).__name__}")

    def _unary(self, expr: Unary, ctx: _Ctx) -> TVal:
        if expr.op == "exp":
            # exp(x) = exp2(x * log2 e), with log2 e folded into scalar factors of x
            return self._unary_f32("exp2", self._times_log2e(expr.x, ctx))
        x = self.emit(expr.x, ctx)
        if expr.op == "neg":
            return self.op("unary", x.axes, x.dtype if x.dtype != "bool" else "i32", (x,), op="neg")
        if expr.op == "not":
            return self.op("unary", x.axes, "bool", (self.to(x, "bool"),), op="not")
        if expr.op == "abs":
            return self.op("unary", x.axes, x.dtype, (x,), op="abs")
        return self._unary_f32(expr.op, x)

    def _power(self, expr: Binary, ctx: _Ctx) -> TVal | None:
        """`a ** c` for a constant c, a nonzero multiple of 1/2 with |c| <= 8: products of `a` and
        of `sqrt(a)`, inverted for c < 0 (None for any other power: `_general_power`)."""
        c = expr.b.value if isinstance(expr.b, Const) else None
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not float(2 * c).is_integer() or not 0 < abs(c) <= 8:
            return None
        base = self.emit(expr.a, ctx)
        whole, half = divmod(abs(float(c)), 1.0)
        factors = [base] * int(whole) + ([self._unary_f32("sqrt", base)] if half else [])
        out = factors[0]
        for f in factors[1:]:
            out = self.bin("mul", out, f)
        out = self.bin("div", self.const(1.0), out) if c < 0 else out
        if half and whole:  # torch takes |a| ** c at -inf, except for c = +-0.5 (its sqrt)
            out = self._where(self.bin("eq", base, self.const(-math.inf)), self.const(math.inf if c > 0 else 0.0), out)
        if half and whole and c < 0:  # and at -0.0 (1 / (0 * -0.0) would be -inf)
            out = self._where(self.bin("eq", base, self.const(0.0)), self.const(math.inf), out)
        return out

    def _general_power(self, expr: Binary, ctx: _Ctx) -> TVal:
        """`a ** b` for any b, as torch.pow computes it on floats: exp2(b * log2 |a|), negated for a
        negative a and an odd integer b, NaN for a negative a and a fractional b (-inf ** b is
        |a| ** b), and 1 where b is 0, where a is 1 and for (-1) ** +-inf. A constant b decides
        its cases here; a tensor b, per element."""
        a = self.to(self.emit(expr.a, ctx), "f32")
        if isinstance(expr.b, Const):
            c = float(expr.b.value)
            if c == 0:
                return self.op("full", a.axes, "f32", value=1.0)
            if math.isnan(c):
                return self._where(self.bin("eq", a, self.const(1.0)), self.const(1.0), self.const(math.nan))
            b = self.const(c)
            known: tuple[bool, bool, bool] | None = (math.isinf(c), c.is_integer() or math.isinf(c),
                                                     c.is_integer() and c % 2 == 1)  # infinite, integer, odd
            infinite_b, integer_b, odd_b = (self.const(f) for f in known)
        else:
            known = None
            # integer and odd through a conversion to int32: from 2^24 on every float is an even
            # integer, and so is inf. A scalar base or exponent is broadcast to the other's tile first:
            # Triton's interpreter mistypes comparisons of converted scalars
            b = self.to(self.emit(expr.b, ctx), "f32")
            axes = self.union(a, b)
            if {len(a.axes), len(b.axes)} != {len(axes)}:
                zeros = self.op("full", axes, "f32", value=0.0)
                a, b = (x if len(x.axes) == len(axes) else self.bin("add", x, zeros) for x in (a, b))
            infinite_b = self.bin("eq", self._unary_f32("abs", b), self.const(math.inf))
            large = self.bin("ge", self._unary_f32("abs", b), self.const(float(2 ** 24)))
            whole = self.to(self.to(b, "i32"), "f32")
            integer_b = self.bin("or", large, self.bin("eq", whole, b))
            odd_b = self.bin("and", self.bin("and", self._not(large), self.bin("eq", whole, b)),
                             self.bin("eq", self.bin("and", self.to(b, "i32"), self.const(1)), self.const(1)))
        out = self._unary_f32("exp2", self.bin("mul", b, self._unary_f32("log2", self._unary_f32("abs", a))))
        # an odd power keeps the sign of -0.0 too ((-0.0) ** -3 is -inf); a fractional one of -0.0 is 0
        negative = self.bin("lt", a, self.const(0.0))
        signed = self.bin("or", negative, self.bin("lt", self.bin("div", self.const(1.0), a), self.const(0.0)))
        if known is None or known[2]:
            out = self._where(self.bin("and", signed, odd_b), self.op("unary", out.axes, "f32", (out,), op="neg"), out)
        if known is None or not known[1]:
            fractional = self.bin("and", negative, self._not(integer_b))
            undefined = self.bin("and", fractional, self.bin("ne", a, self.const(-math.inf)))
            out = self._where(undefined, self.const(math.nan), out)
        one = self.bin("eq", a, self.const(1.0))
        if known is None or known[0]:
            one = self.bin("or", one, self.bin("and", self.bin("eq", a, self.const(-1.0)), infinite_b))
        if known is None:
            one = self.bin("or", one, self.bin("eq", b, self.const(0.0)))
        return self._where(one, self.const(1.0), out)

    def _not(self, x: TVal) -> TVal:
        return self.op("unary", x.axes, "bool", (self.to(x, "bool"),), op="not")

    def _where(self, cond: TVal, a: TVal, b: TVal) -> TVal:
        a, b = self._promote(a, b, None)
        return self.op("where", self.union(cond, a, b), a.dtype, (cond, a, b))

    def _unary_f32(self, op: str, x: TVal) -> TVal:
        x = self.to(x, "f32")
        return self.op("unary", x.axes, "f32", (x,), op=op)

    def _times_log2e(self, expr: Expr, ctx: _Ctx) -> TVal:
        expr = ctx.replace.get(expr, expr)
        if isinstance(expr, Binary) and expr.op in ("add", "sub"):
            return self.bin(expr.op, self._times_log2e(expr.a, ctx), self._times_log2e(expr.b, ctx))
        if isinstance(expr, Unary) and expr.op == "neg":
            x = self._times_log2e(expr.x, ctx)
            return self.op("unary", x.axes, x.dtype, (x,), op="neg")
        if isinstance(expr, Binary) and expr.op in ("mul", "div"):
            for tile, scalar in ((expr.a, expr.b), (expr.b, expr.a)):
                if expr.op == "div" and scalar is not expr.b:
                    continue
                # loop-invariant scalars only: a running value (a repair's r, r') changes per tile
                if not free_axes(scalar) and not loads_of(scalar) and not self.is_variant(scalar, ctx):
                    s = self.emit(scalar, ctx)
                    s = self.to(s, "f32", self.scopes[0])
                    factor = self.const(LOG2E)
                    folded = (self.bin("mul", s, factor, self.scopes[0]) if expr.op == "mul"
                              else self.bin("div", factor, s, self.scopes[0]))
                    return self.bin("mul", self.emit(tile, ctx), folded)
        x = self.emit(expr, ctx)
        return self.bin("mul", x, self.const(LOG2E))

    def _load(self, expr: Load, ctx: _Ctx) -> TVal:
        if expr.buffer in ctx.values:
            if expr.buffer in self.loop_axes_of and expr.index != tuple(Index(a) for a in self.loop_axes_of[expr.buffer]):
                # a program holds its own rows of a reduction only; another row's value lives elsewhere
                raise UnsupportedProgramError(
                    "tile lowering", expr.buffer, "load",
                    f"the reduction {expr.buffer!r} is read at indices {[str(i) for i in expr.index]} other than its "
                    f"own axes {self.loop_axes_of[expr.buffer]}")
            return ctx.values[expr.buffer]
        if expr.buffer not in self.config.input_dtypes:
            stage = self.program.stage(expr.buffer)
            if isinstance(self.program.producer_of(expr.buffer), FusedLoop):
                raise UnsupportedProgramError("tile lowering", expr.buffer, "load", "value of a loop member is not available here")
            return self.emit(substitute_index(stage.body, dict(zip(stage.axes, expr.index))), ctx)
        scalar, tile, mask_axes = self.address(expr.buffer, expr.index)
        guard = ctx.guards.get(expr)
        tma = self._tma_load(expr, scalar, ctx) if guard is None else None
        if tma is not None:
            return self._widened(tma)
        base = self.emit(scalar, ctx) if scalar is not None else None
        offset = self.emit(tile, ctx) if tile is not None else None
        mask: TVal | None = guard
        for axis in self._canon(mask_axes):
            v = ctx.valid.get(axis)
            if v is not None:
                mask = v if mask is None else self.bin("and", mask, v)
        self.kernel_arg(f"{expr.buffer}_ptr", "pointer", ArgSource("input", expr.buffer), "ptr")
        dtype = self.config.input_dtypes[expr.buffer]
        zero = self.const(0)
        args = (base or zero, offset or zero) + ((mask,) if mask is not None else ())
        axes = offset.axes if offset is not None else ()
        return self._widened(self.op("load", axes, dtype, args, prefix="ld", buffer=expr.buffer))

    def _widened(self, loaded: TVal) -> TVal:
        """A narrow integer (int8, int16, uint8: read as stored) as int32, what integers compute in."""
        return self.to(loaded, "i32") if loaded.dtype in NARROW_INT_DTYPES else loaded

    def _tma_load(self, expr: Load, scalar: Expr | None, ctx: _Ctx) -> TVal | None:
        """A 2-D tile read through a tensor descriptor (the copy engine), when the load is a plain
        [tile axis, tile axis] block of a buffer whose last dimension is contiguous. Out-of-range
        elements read as zero, so no mask is needed.

        Where every axis of the kernel is held whole, the inner axis is a held one (a head dim) and
        the outer one the rows or the loop axis. In a kernel that tiles axes across the grid or by
        inner loops (always Triton's: Gluon takes none of those) either axis may be any tiled one:
        a matmul's K-steps are read by descriptors too, with no address tiles in registers."""
        if expr.buffer not in self.config.tma_buffers:
            return None
        index = expr.index
        tiled = [(d, i) for d, i in enumerate(index) if not (isinstance(i, Const) and i.value == 0)
                 and {n.axis for n in walk(i) if isinstance(n, Index)} & set(self.roles.tile_axes)]
        if len(tiled) != 2:
            return None
        (d_outer, outer), (d_inner, inner) = tiled
        if not (isinstance(outer, Index) and isinstance(inner, Index) and d_inner == len(index) - 1):
            return None
        held = [a for a in self.roles.full if a not in self.tiling.grid + self.tiling.loops]
        if self.tiling.tiled and self.config.tiled_descriptors:
            if not all(a.axis in self.tile_start or a.axis in held for a in (outer, inner)):
                return None
        elif not (inner.axis in held and outer.axis in (self.roles.row, self.roles.col) and outer.axis in self.tile_start):
            return None
        key = ("desc", expr.buffer, outer.axis, d_outer, inner.axis)
        if key not in self.descriptors:
            base = self.emit(scalar, _Ctx({}, {}, {}, {}, False)) if scalar is not None else self.const(0)
            self.kernel_arg(f"{expr.buffer}_ptr", "pointer", ArgSource("input", expr.buffer), "ptr")
            stride = self.kernel_arg(f"stride_{expr.buffer}_{d_outer}", "int", ArgSource("stride", expr.buffer, d_outer),
                                     "i32")
            self.descriptors[key] = self.op(
                "make_desc", (), "desc", (base, self.size(outer.axis), stride), scope=self.scopes[0], prefix="desc",
                buffer=expr.buffer, block=(self.block[outer.axis], self.block[inner.axis]),
                inner_size=self.size(inner.axis).name)
        # (a held inner axis starts at 0: the load names no second coordinate)
        starts = (self.tile_start.get(outer.axis) or self.const(0),
                  *((self.tile_start[inner.axis],) if inner.axis in self.tile_start else ()))
        dtype = self.config.input_dtypes[expr.buffer]
        # the value's axes are in the kernel's canonical order; a block stored the other way round
        # is transposed as it is read (Triton folds that into the shared-memory layout of a dot)
        transposed = self._canon((outer.axis, inner.axis)) != (outer.axis, inner.axis)
        return self.op("desc_load", (outer.axis, inner.axis), dtype, (self.descriptors[key], *starts), prefix="ld",
                       **({"transposed": True} if transposed else {}))

    def address(self, buffer: str, index: tuple[Expr, ...]) -> tuple[Expr | None, Expr | None, set[str]]:
        """(scalar i64 offset, tile i32 offset, tile axes it depends on) of element `index` of `buffer`.

        The per-program part (batch indices) is 64-bit so large tensors do not overflow; the
        part that varies across the tile stays 32-bit, and its terms are ordered so that the
        ones independent of the loop axis are computed once before the loop.
        """
        tile_axes = set(self.roles.tile_axes)
        scalar_terms: list[Expr] = []
        tile_terms: list[tuple[bool, Expr]] = []
        mask_axes: set[str] = set()
        for dim, idx in enumerate(index):
            if isinstance(idx, Const) and idx.value == 0:
                continue
            stride = Param(f"{STRIDE_PREFIX}{buffer}:{dim}")
            used = {n.axis for n in walk(idx) if isinstance(n, Index)} & tile_axes
            if not used:
                scalar_terms.append(Binary("mul", Cast(idx, "i64"), Cast(stride, "i64")))
            else:
                tile_terms.append((self.roles.col in used, Binary("mul", idx, stride)))
                mask_axes |= used
        tile_terms.sort(key=lambda t: t[0])
        scalar = None
        for term in scalar_terms:
            scalar = term if scalar is None else Binary("add", scalar, term)
        tile = None
        for _, term in tile_terms:
            tile = term if tile is None else Binary("add", tile, term)
        return scalar, tile, mask_axes

    # --- reductions ---------------------------------------------------------------
    def _positive_factor(self, expr: Expr) -> tuple[Expr, Expr] | None:
        """(x, p) if expr is x * p (or where(c, x * p, +-inf)) with p a parameter known positive."""
        if isinstance(expr, Binary) and expr.op == "mul":
            for x, p in ((expr.a, expr.b), (expr.b, expr.a)):
                if isinstance(p, Param) and p.name in self.config.positive_params:
                    return x, p
        if (isinstance(expr, Where) and isinstance(expr.b, Const) and isinstance(expr.b.value, float)
                and math.isinf(expr.b.value)):
            inner = self._positive_factor(expr.a)
            if inner is not None:
                return Where(expr.cond, inner[0], expr.b), inner[1]
        return None

    def contraction(self, expr: Reduce, ctx: _Ctx) -> tuple[TVal, TVal] | None:
        """(A, B) operands if `expr` is sum over a tile axis of a product that maps to a dot."""
        if expr.op != "sum" or expr.axis not in self.roles.tile_axes:
            return None
        factors = _product_factors(expr.body)
        if len(factors) < 2:
            return None
        vals = [self.emit(f, ctx) for f in factors]
        k = expr.axis
        others = set().union(*(set(v.axes) for v in vals)) - {k}
        if len(others) != 2 or not all(k in v.axes or not v.axes for v in vals):
            return None
        x, y = self._canon(others)
        side_a = [v for v in vals if set(v.axes) <= {x, k} and v.axes]
        side_b = [v for v in vals if set(v.axes) <= {y, k} and v.axes and v not in side_a]
        scalars = [v for v in vals if not v.axes]
        if len(side_a) + len(side_b) + len(scalars) != len(vals) or not side_a or not side_b:
            return None
        a = side_a[0]
        for v in side_a[1:] + scalars:
            a = self.bin("mul", a, v)
        b = side_b[0]
        for v in side_b[1:]:
            b = self.bin("mul", b, v)
        if set(a.axes) != {x, k} or set(b.axes) != {y, k}:
            return None
        valid = ctx.valid.get(k)
        if valid is not None:
            if not self._is_plain_load(a):
                a = self.op("where", self.union(valid, a), a.dtype, (valid, a, self._zero(a.dtype)))
            if not self._is_plain_load(b):
                b = self.op("where", self.union(valid, b), b.dtype, (valid, b, self._zero(b.dtype)))
        dot_dtype = self.config.dot_dtype
        return self.to(a, dot_dtype), self.to(b, dot_dtype)

    def _is_plain_load(self, v: TVal) -> bool:
        for st in reversed(self.scopes[-1].stmts + self.scopes[0].stmts):
            if isinstance(st, Op) and st.out == v:
                return st.kind in ("load", "desc_load")
        return False

    def _zero(self, dtype: str) -> TVal:
        return self.to(self.const(0.0), dtype, self.scopes[0]) if dtype in FLOAT_DTYPES else self.const(0)

    def dot(self, a: TVal, b: TVal, k: str, acc: TVal | None = None) -> TVal:
        axes = self._canon((set(a.axes) | set(b.axes)) - {k})
        args = (a, b) if acc is None else (a, b, self.to(acc, "f32"))
        precision = "ieee" if self.config.dot_dtype == "f32" else None
        return self.op("dot", axes, "f32", args, prefix="dot", k=k, precision=precision)

    def _reduce(self, expr: Reduce, ctx: _Ctx) -> TVal:
        if expr.op not in ("sum", "max", "min"):
            raise UnsupportedProgramError("tile lowering", self.program.name, f"{expr.op} over {expr.axis}",
                                          "only sum, max and min reductions are lowered to kernels")
        if expr.axis not in self.roles.tile_axes or expr.axis == self.roles.row:
            raise UnsupportedProgramError(
                "tile lowering", self.program.name, f"{expr.op} over {expr.axis}",
                f"a reduction over {expr.axis!r}, which is split across programs (rows {self.roles.row!r}, "
                f"batch {self.roles.batch}); only the fused reductions over {self.roles.col!r} and reductions "
                "over whole head-dim axes fit one kernel")
        if expr.axis in self.tiling.loops:
            return self._k_loop(expr, ctx)
        return self._tile_reduce(expr, ctx)

    def _tile_reduce(self, expr: Reduce, ctx: _Ctx) -> TVal:
        """`expr` over the axis's tile as bound here: one dot, or one reduction of the tile."""
        operands = self.contraction(expr, ctx)
        if operands is not None:
            return self.dot(operands[0], operands[1], expr.axis)
        split = self._split_sum(expr, ctx) if expr.op == "sum" else None
        if split is not None:
            return split
        pulled = self._positive_factor(ctx.replace.get(expr.body, expr.body)) if expr.op in ("max", "min") else None
        if pulled is not None:
            # max_j(x * p) = max_j(x) * p for p > 0: one multiply per row instead of per element
            inner, factor = pulled
            return self.bin("mul", self.emit(Reduce(expr.op, expr.axis, inner), ctx), self.emit(factor, ctx))
        body = self.emit(expr.body, ctx)
        if body.dtype not in FLOAT_DTYPES:
            body = self.to(body, "f32")
        body = self.to(body, "f32")
        valid = ctx.valid.get(expr.axis)
        if expr.axis not in body.axes:
            if expr.op != "sum":
                return body
            ones = self.op("full", (expr.axis,), "f32", prefix="ones", value=1.0)
            if valid is not None:
                ones = self.op("where", ones.axes, "f32", (valid, ones, self._zero("f32")))
            count = self.op("reduce", (), "f32", (ones,), op="sum", axis=expr.axis)
            return self.bin("mul", body, count)
        if valid is not None:
            ident = self.const(REDUCER_IDENTITY[expr.op])
            body = self.op("where", self.union(valid, body), "f32", (valid, body, ident))
        out_axes = tuple(a for a in body.axes if a != expr.axis)
        return self.op("reduce", out_axes, "f32", (body,), prefix="red", op=expr.op, axis=expr.axis)

    def _split_sum(self, expr: Reduce, ctx: _Ctx, acc: TVal | None = None) -> TVal | None:
        """A sum of terms of which some are contractions, reduced term by term (plus `acc`, an
        accumulator the sum adds to): a reduction of its own tile for each other term, then a dot
        for each contraction, accumulating onto the rest where it has the dot's shape
        (`sum_k (x[i,k] + 1) w[k,e]` as the column sums of w and a dot), where reducing the whole
        body would hold the axes of every term at once (rows x k x e); None where no term is a
        contraction."""
        terms = _sum_terms(expr.body)
        if len(terms) < 2:
            return None
        operands = [self.contraction(Reduce("sum", expr.axis, t), ctx) for t in terms]
        if all(o is None for o in operands):
            return None
        total = acc
        for term, ops in zip(terms, operands):
            if ops is None:
                part = self.to(self.emit(Reduce("sum", expr.axis, term), ctx), "f32")  # shared with equal sums
                total = part if total is None else self.bin("add", total, part)
        for ops in operands:
            if ops is None:
                continue
            out_axes = self._canon((set(ops[0].axes) | set(ops[1].axes)) - {expr.axis})
            if total is not None and total.axes == out_axes:
                total = self.dot(ops[0], ops[1], expr.axis, total)
            else:
                product = self.dot(ops[0], ops[1], expr.axis)
                total = product if total is None else self.bin("add", total, product)
        return total

    def _k_loop(self, expr: Reduce, ctx: _Ctx) -> TVal:
        """`expr` over an axis too long for one tile: an inner loop over its tiles, accumulating in
        fp32 (a contraction as a dot with an accumulator), placed where the reduction is needed."""
        axis = expr.axis
        if axis in self.bindings:
            raise UnsupportedProgramError("tile lowering", self.program.name, f"{expr.op} over {axis}",
                                          f"a reduction over {axis!r} nested in another over it")
        outer = self.scopes[-1]
        body: list[Stmt] = []
        self.scopes.append(_Scope(body))
        var = TVal(self.fresh("k_"), (), "i32")
        block = self.block[axis]
        self.bindings[axis] = self.op("arange", (axis,), "i32", (var,), prefix="offs", block=block)
        self.tile_start[axis] = var
        inner = _Ctx(ctx.values, ctx.placeholders, {**ctx.valid, axis: self._full_valid(axis)}, ctx.replace, True)
        self.variant_axes.add(axis)
        try:
            operands = self.contraction(expr, inner)
            if operands is not None:
                a, b = operands
                acc = TVal(self.fresh("kacc"), self._canon((set(a.axes) | set(b.axes)) - {axis}), "f32")
                new = self.dot(a, b, axis, acc)
            else:
                part = self.to(self._tile_reduce(expr, inner), "f32")
                acc = TVal(self.fresh("kacc"), part.axes, "f32")
                new = self.bin("add" if expr.op == "sum" else expr.op, acc, part)
            body.append(Assign(acc, self.to(new, "f32")))
        finally:
            self.variant_axes.discard(axis)
            del self.bindings[axis]
            del self.tile_start[axis]
            self.scopes.pop()
        outer.stmts.append(Op(acc, "full", (), {"value": REDUCER_IDENTITY[expr.op]}))
        outer.stmts.append(Loop(var, self.const(0), self.size(axis), block, body,
                                f"inner loop over {axis!r} ({self.config.full_sizes[axis]}) in tiles of {self.tiling.block(axis)}"))
        note = f"inner loops over {axis!r} in tiles of {self.tiling.block(axis)}, accumulating in fp32"
        if note not in self.config.notes:
            self.config.notes.append(note)
        return acc

    # --- kernel structure ---------------------------------------------------------------
    def build(self) -> TileKernel:
        roles, cfg = self.roles, self.config
        # program ids: rows (heaviest tiles first), flattened batch, split
        n_rows = self.size(roles.row)
        n_tiles = self.op("cdiv", (), "i32", (n_rows,), prefix="ntiles", block="BLOCK_R")
        row_tiles = GridFactor(f"size_{roles.row}", "BLOCK_R")
        batch = tuple(GridFactor(f"size_{a}") for a in roles.batch)
        if cfg.grid_group is not None:
            pid_r, pid_b = self._grouped_program_ids(n_tiles, cfg.grid_group)
            grid = [GridDim((row_tiles, *batch)), GridDim()]
        else:
            pid_r = self.op("program_id", (), "i32", prefix="pid", dim=0)
            pid_b = self.op("program_id", (), "i32", prefix="pid", dim=1)
            grid = [GridDim((row_tiles,)), GridDim(batch)]
        row_tile = self.bin("sub", self.bin("sub", n_tiles, self.const(1)), pid_r) if self._heavier_later() else pid_r
        r0 = self.bin("mul", row_tile, TVal("BLOCK_R", (), "i32"))
        self.bindings: dict[str, TVal] = {}
        rest = self._grid_tiles(pid_b, grid)
        for axis in reversed(roles.batch):
            size = self.size(axis)
            self.bindings[axis] = self.bin("mod", rest, size, nonnegative=True)
            rest = self.bin("floordiv", rest, size, nonnegative=True)
        self.bindings[roles.row] = self.op("arange", (roles.row,), "i32", (r0,), prefix="rows", block="BLOCK_R")
        self.tile_start[roles.row] = r0
        held = [a for a in roles.full if a not in self.tiling.loops]  # K-loop axes are bound by their loops
        for axis in held:
            start = self.tile_start.get(axis, self.const(0))
            self.bindings[axis] = self.op("arange", (axis,), "i32", (start,), prefix="offs", block=self.block[axis])
        valid: dict[str, TVal | None] = {roles.row: self.bin("lt", self.bindings[roles.row], n_rows)}
        for axis in held:
            valid[axis] = self._full_valid(axis)
        state = self._init_state()
        if cfg.whole_loop:
            if cfg.block_map_axes is not None or cfg.splits > 1:
                raise UnsupportedProgramError("tile lowering", self.program.name, f"loop over {roles.col}",
                                              "a loop held in one tile has no block map and no split")
            self.config.notes.append(f"loop over {roles.col} held in one tile of BLOCK_C (its length is at most "
                                     f"{cfg.block_col}): no loop, and a second pass reuses its loads")
            self._emit_loop(self.const(0), self.size(roles.col), True, state, valid, "", inline=True)
        elif not self.loop.members:
            pass  # nothing to reduce: the outputs' second pass is the only walk over the axis
        elif cfg.block_map_axes is not None:
            self._emit_block_map_loops(row_tile, state, valid)
        else:
            for start, stop, masked, comment in self._loop_segments(r0):
                self._emit_loop(start, stop, masked, state, valid, comment)
        self._emit_outputs(state, valid)
        if cfg.splits > 1:
            grid.append(GridDim((GridFactor(self._splits().name),)))
        # neither the loop's length nor the split count (a run-time argument, not a constexpr) selects
        # a compiled kernel: a decode loop over a growing KV cache runs one kernel for every length
        varying = (ArgSource("size", SPLIT_AXIS),) if cfg.whole_loop else (
            ArgSource("size", roles.col), ArgSource("size", SPLIT_AXIS))
        return TileKernel(self.name, self.args, roles.tile_axes, self.block, grid, self.body, cfg.num_warps,
                          cfg.num_stages, self.constexprs, list(cfg.notes),
                          do_not_specialize=[a.name for a in self.args if a.source in varying],
                          tiled_axes=self.tiling.grid + self.tiling.loops)

    def _heavier_later(self) -> bool:
        """Whether a later row tile visits no fewer loop tiles than an earlier one, so that the
        programs walk the row tiles from the last (heaviest first, the wave's tail the lightest).
        The visible loop range of a row grows by the row coefficient of each affine bound on the
        loop index: a causal mask's bound k <= q when rows are queries, q >= k shrinking it when
        rows are keys (a backward's loop over queries)."""
        return sum(c.row_coeff for c in self.masks.constraints if c.col_coeff) >= 0

    def _grid_tiles(self, pid_b: TVal, grid: list[GridDim]) -> TVal:
        """Peel the tile index of each grid-tiled axis off the batch program id (innermost first)
        and widen grid axis 1 to match; what remains indexes the batch."""
        rest = pid_b
        for axis in self.tiling.grid:
            if self.config.grid_group is not None:
                raise UnsupportedProgramError("tile lowering", self.program.name, f"axis {axis}",
                                              "a grid-tiled axis needs the plain (row tiles, batch) grid")
            block = self.block[axis]
            tiles = self.op("cdiv", (), "i32", (self.size(axis),), prefix="ntiles", block=block)
            self.tile_start[axis] = self.bin("mul", self.bin("mod", rest, tiles, nonnegative=True), TVal(block, (), "i32"))
            rest = self.bin("floordiv", rest, tiles, nonnegative=True)
            grid[1] = grid[1].times(GridFactor(f"SIZE_{axis.upper()}", block))
            self.config.notes.append(
                f"axis {axis!r} ({self.config.full_sizes[axis]}) tiled across the grid in blocks of "
                f"{self.tiling.block(axis)}: values not indexed by it are recomputed by every program")
        return rest

    def _full_valid(self, axis: str) -> TVal | None:
        """In-bounds mask of a full axis's offsets (None where its blocks cover it exactly)."""
        size, block = self.config.full_sizes[axis], self.constexprs[self.block[axis]]
        exact = size % block == 0 if axis in self.tiling.grid + self.tiling.loops else size == block
        return None if exact else self.bin("lt", self.bindings[axis], self.size(axis))

    def _grouped_program_ids(self, n_tiles: TVal, group: int) -> tuple[TVal, TVal]:
        """(row program, batch entry) of a one-axis grid that runs the row tiles of `group` batch
        entries (heads) interleaved, heaviest row tile first across them, so each wave of programs
        starts with its group's longest row tiles and ends with the shortest. `group` 1 is the plain
        order on one axis (for batches larger than a second grid axis holds)."""
        self.constexprs["GROUP_B"] = group
        self.config.notes.append(f"one-axis grid: the row tiles of {group} batch entries interleaved, heaviest first")
        group_size = TVal("GROUP_B", (), "i32")
        batch = self.const(1)
        for axis in self.roles.batch:
            batch = self.bin("mul", batch, self.size(axis))
        pid = self.op("program_id", (), "i32", prefix="pid", dim=0)
        per_group = self.bin("mul", n_tiles, group_size)
        index = self.bin("floordiv", pid, per_group, nonnegative=True)
        first = self.bin("mul", index, group_size)
        width = self.bin("min", self.bin("sub", batch, first), group_size)
        local = self.bin("sub", pid, self.bin("mul", index, per_group))
        return (self.bin("floordiv", local, width, nonnegative=True),
                self.bin("add", first, self.bin("mod", local, width, nonnegative=True)))

    def _init_state(self) -> dict[str, TVal]:
        state: dict[str, TVal] = {}
        for m in self.loop.members:
            extra = [a for a in m.axes if a not in self.roles.batch]
            if not set(self.roles.batch) <= set(m.axes) or not set(extra) <= set(self.roles.tile_axes):
                raise UnsupportedProgramError("tile lowering", m.name, f"{m.reduce_op} over {self.loop.axis}",
                                              f"member axes {m.axes} do not fit the tile roles {self.roles}")
            state[m.name] = self.op("full", tuple(extra), "f32", prefix=f"acc_{m.name}_",
                                    value=REDUCER_IDENTITY[m.reduce_op])
        return state

    def _loop_segments(self, r0: TVal) -> list[tuple[TVal, TVal, bool, str]]:
        """[start, stop) tile ranges of the loop: (start, stop, needs mask arithmetic, comment)."""
        n = self.size(self.roles.col)
        r1 = self.bin("add", r0, TVal("BLOCK_R", (), "i32"))
        r1 = self.bin("sub", r1, self.const(1))
        zero = self.const(0)
        ctx = _Ctx({}, {}, {}, {}, False)
        boxes = self.masks.boxes()
        bounds = [self._box_bounds(box, r0, r1, n, ctx) for box in boxes]
        if self.config.splits > 1:
            c_lo, c_hi = self._split_chunk()
            bounds = [(self.bin("max", lo, c_lo), self.bin("min", hi, c_hi), flo, fhi) for lo, hi, flo, fhi in bounds]
        if not self.masks.masks:
            self.config.notes.append(f"no mask: tiles [0, {n.name}) visited; only the last partial tile is masked")
        else:
            text = " OR ".join("(" + " AND ".join(f"{c.row_coeff}*row + {c.col_coeff}*col + c >= 0" for c in box) + ")"
                               for box in boxes)
            self.config.notes.append(f"affine mask region {text}: tiles outside it are skipped, "
                                     "tiles inside it run without mask arithmetic")
        if len(bounds) == 2 and not self._always_touch(boxes):
            return self._two_box_segments(bounds)
        if len(bounds) == 1:
            any_lo, any_hi, full_lo, full_hi = bounds[0]
        else:
            # the hull of the non-empty boxes (an empty one, lo >= hi, must not widen it)
            far = self.const(1 << 30)
            any_lo, any_hi = far, zero
            full_lo, full_hi = bounds[0][2], bounds[0][3]
            for i, (b_lo, b_hi, b_flo, b_fhi) in enumerate(bounds):
                empty = self.bin("ge", b_lo, b_hi)
                any_lo = self.bin("min", any_lo, self.op("where", (), "i32", (empty, far, b_lo)))
                any_hi = self.bin("max", any_hi, self.op("where", (), "i32", (empty, zero, b_hi)))
                if i:
                    full_lo, full_hi = self._merge_full(full_lo, full_hi, b_flo, b_fhi)
        start, stop = self._aligned(any_lo, any_hi)
        return self._segments(start, stop, full_lo, self.bin("min", full_hi, any_hi), "")

    @staticmethod
    def _always_touch(boxes: list[tuple]) -> bool:
        """Two boxes that both reach the start (or both the end) of the loop axis overlap there, so
        their union has no gap to skip: one range of tiles with one merged fully visible part runs
        fewer loops (faster than a loop per region: each loop costs its own prologue and tail)."""
        no_lower = [not any(c.col_coeff > 0 for c in box) for box in boxes]
        no_upper = [not any(c.col_coeff < 0 for c in box) for box in boxes]
        return all(no_lower) or all(no_upper)

    def _aligned(self, lo: TVal, hi: TVal) -> tuple[TVal, TVal]:
        """[lo, hi) widened to whole tiles; an empty range stays empty."""
        bc = TVal("BLOCK_C", (), "i32")
        start = self.bin("mul", self.bin("floordiv", self.bin("max", lo, self.const(0)), bc, nonnegative=True), bc)
        stop = self.bin("mul", self.op("cdiv", (), "i32", (self.bin("max", hi, start),), prefix="nt", block="BLOCK_C"), bc)
        return start, stop

    def _segments(self, start: TVal, stop: TVal, full_lo: TVal, full_hi: TVal,
                  label: str) -> list[tuple[TVal, TVal, bool, str]]:
        """Tile-aligned [start, stop) split into masked / fully visible / masked loops."""
        bc, zero = TVal("BLOCK_C", (), "i32"), self.const(0)
        fs = self.bin("mul", self.op("cdiv", (), "i32", (self.bin("max", full_lo, zero),), prefix="fs", block="BLOCK_C"), bc)
        fs = self.bin("min", self.bin("max", fs, start), stop)
        fe = self.bin("mul", self.bin("floordiv", self.bin("max", full_hi, zero), bc, nonnegative=True), bc)
        fe = self.bin("min", self.bin("max", fe, fs), stop)
        return [
            (start, fs, True, f"tiles that need masks{label} (before the fully visible range)"),
            (fs, fe, False, f"fully visible tiles{label}: no mask arithmetic"),
            (fe, stop, True, f"tiles that need masks{label} (after the fully visible range)"),
        ]

    def _two_box_segments(self, bounds: list[tuple[TVal, TVal, TVal, TVal]]) -> list[tuple[TVal, TVal, bool, str]]:
        """A union of two boxes (attention sink + window, prefix-LM): the tiles of the first box, then
        those of the second outside the first. Tiles in the gap between them are never visited."""
        (a_lo, a_hi, a_flo, a_fhi), (b_lo, b_hi, b_flo, b_fhi) = bounds
        a_start, a_stop = self._aligned(a_lo, a_hi)
        b_start, b_stop = self._aligned(b_lo, b_hi)
        empty_a = self.bin("ge", a_lo, a_hi)
        a_stop = self.op("where", (), "i32", (empty_a, a_start, a_stop))
        out = self._segments(a_start, a_stop, a_flo, self.bin("min", a_fhi, a_hi), " of the first region")
        before = (b_start, self.bin("max", self.bin("min", b_stop, a_start), b_start))
        after = (self.bin("min", self.bin("max", b_start, a_stop), b_stop), b_stop)
        for p0, p1 in (before, after):
            out += self._segments(p0, p1, b_flo, self.bin("min", b_fhi, b_hi), " of the second region")
        return out

    def _box_bounds(self, box: tuple, r0: TVal, r1: TVal, n: TVal, ctx: _Ctx) -> tuple[TVal, TVal, TVal, TVal]:
        """(any_lo, any_hi, full_lo, full_hi) of the loop axis for one box of affine constraints."""
        zero = self.const(0)
        any_lo, any_hi, full_lo, full_hi = zero, n, zero, n
        for c in box:
            off = self.to(self.emit(c.offset, ctx), "i32")
            # rows of the tile where a*row is smallest / largest
            row_min, row_max = (r0, r1) if c.row_coeff >= 0 else (r1, r0)

            def a_times(row: TVal, c=c) -> TVal:
                return self.bin("mul", row, self.const(c.row_coeff)) if c.row_coeff else zero

            if c.col_coeff > 0:  # col >= -offset - a*row
                neg_off = self.op("unary", (), "i32", (off,), op="neg")
                any_lo = self.bin("max", any_lo, self.bin("sub", neg_off, a_times(row_max)))
                full_lo = self.bin("max", full_lo, self.bin("sub", neg_off, a_times(row_min)))
            else:  # col <= offset + a*row
                any_hi = self.bin("min", any_hi, self.bin("add", self.bin("add", off, a_times(row_max)), self.const(1)))
                full_hi = self.bin("min", full_hi, self.bin("add", self.bin("add", off, a_times(row_min)), self.const(1)))
        return any_lo, any_hi, full_lo, full_hi

    def _merge_full(self, lo1: TVal, hi1: TVal, lo2: TVal, hi2: TVal) -> tuple[TVal, TVal]:
        """A fully visible range inside the union of two: their union if they touch, else the longer."""
        touch = self.bin("le", self.bin("max", lo1, lo2), self.bin("min", hi1, hi2))
        longer_first = self.bin("ge", self.bin("sub", hi1, lo1), self.bin("sub", hi2, lo2))
        lo = self.op("where", (), "i32", (touch, self.bin("min", lo1, lo2), self.op("where", (), "i32", (longer_first, lo1, lo2))))
        hi = self.op("where", (), "i32", (touch, self.bin("max", hi1, hi2), self.op("where", (), "i32", (longer_first, hi1, hi2))))
        return lo, hi

    def _vanishes_while_identity(self, member: str, producer: str) -> bool:
        """Whether `member`'s terms are its identity wherever the max/min `producer`'s are (cached)."""
        key = (member, producer)
        if key not in self.vanishing:
            self.vanishing[key] = terms_vanish_while_identity(
                self.loop.member(member), self.loop.member(producer), self.loop.producers[member])
        return self.vanishing[key]

    def _repairs_from_stand_in(self, member: str, producer: str) -> bool:
        """Whether `member` is repaired from the stand-in for `producer` at its identity (see
        RUNNING_STAND_IN) rather than from `new` to `new`: always for a sum (its running value may
        come back to 0 after terms that cancel), for a max/min unless the member's terms vanish
        wherever the producer's are its identity."""
        op = self.loop.member(producer).reduce_op
        if op == "sum":
            return True
        return op in ("max", "min") and not self._vanishes_while_identity(member, producer)

    def _old_value(self, member: str, producer: str, old: TVal, new: TVal) -> TVal:
        """The running value of `producer` that `member`'s accumulator was computed with: the
        repair's r. A producer still at its identity was stood in for (RUNNING_STAND_IN). Where
        the member's terms vanish there anyway (a max/min), the accumulator holds only identities
        and is repaired from `new` to `new` (h(t, r, r) = t), never through inf * 0; otherwise the
        terms computed with the stand-in count and are repaired from it."""
        op = self.loop.member(producer).reduce_op
        if op not in RUNNING_STAND_IN:
            return old
        from_stand_in = self._repairs_from_stand_in(member, producer)
        key = Running(producer, "stand-in-old" if from_stand_in else "guarded-old")
        memo = self.scopes[-1].memo
        if key not in memo:
            fresh = self.bin("eq", old, self.const(REDUCER_IDENTITY[op]))
            replacement = self.const(RUNNING_STAND_IN[op]) if from_stand_in else new
            memo[key] = self.op("where", old.axes, "f32", (fresh, replacement, old), prefix="old")
        return memo[key]

    def _emit_block_map_loops(self, row_tile: TVal, state: dict[str, TVal], valid: dict[str, TVal | None]) -> None:
        """Visit the tiles a run-time block map lists for this row tile: fully visible ones with no
        mask arithmetic, partly visible ones with it; empty tiles are never visited. Under split-K
        each split visits its own contiguous share of each list."""
        axes = self.config.block_map_axes or ()
        self.bindings[BLOCK_MAP_ROW] = row_tile
        batch_index = tuple(Index(a) for a in axes)
        ctx = _Ctx({}, {}, {}, {}, False)
        for kind, masked in (("full", False), ("partial", True)):
            count = self.emit(Load(f"{BLOCK_MAP_PREFIX}{kind}_count", (*batch_index, Index(BLOCK_MAP_ROW))), ctx)
            first = self.const(0)
            if self.config.splits > 1:
                split = self._split_id()
                share = self.op("cdiv", (), "i32", (count,), prefix="share", block=self._splits().name)
                first = self.bin("min", self.bin("mul", split, share), count)
                count = self.bin("min", self.bin("add", first, share), count)
            var = TVal(self.fresh("t_"), (), "i32")
            self.bindings[BLOCK_MAP_TILE] = var

            def start_of(_: TVal, kind: str = kind) -> TVal:
                idx = Load(f"{BLOCK_MAP_PREFIX}{kind}_index",
                           (*batch_index, Index(BLOCK_MAP_ROW), Index(BLOCK_MAP_TILE)))
                tile = self.emit(idx, _Ctx({}, {}, {}, {}, True))
                return self.bin("mul", tile, TVal("BLOCK_C", (), "i32"))

            self._emit_loop(first, count, masked, state, valid,
                            f"{kind} tiles listed by the block map", var=var, start_of=start_of, exact=True, step="1")
            del self.bindings[BLOCK_MAP_TILE]

    def _emit_loop(self, start: TVal, stop: TVal, masked: bool, state: dict[str, TVal],
                   valid: dict[str, TVal | None], comment: str, var: TVal | None = None,
                   start_of: Callable[[TVal], TVal] | None = None, exact: bool = False, step: str = "BLOCK_C",
                   inline: bool = False) -> None:
        """One loop over tiles of the loop axis. `start_of` maps the loop variable to the tile's first
        index (default: the variable itself); `exact`: unmasked tiles are wholly visible, residual too.
        `inline`: the one tile at `start`, emitted without a loop; its bindings and loads stay for a
        second pass over the loop axis (`_whole_tile`)."""
        roles = self.roles
        body: list[Stmt] = []
        scope = _Scope(body)
        self.scopes.append(scope)
        var = start if inline else (var or TVal(self.fresh("start_"), (), "i32"))
        first = start_of(var) if start_of is not None else var
        self.bindings[roles.col] = self.op("arange", (roles.col,), "i32", (first,), prefix="cols", block="BLOCK_C")
        self.tile_start[roles.col] = first
        inner_valid = dict(valid)
        replace: dict[Expr, Expr] = {}
        if masked:
            inner_valid[roles.col] = self.bin("lt", self.bindings[roles.col], self.size(roles.col))
        else:
            inner_valid[roles.col] = None
            replace = {node: value for m in self.masks.masks for node, value in m.replacements(exact).items()}
        ctx = _Ctx({}, {}, inner_valid, replace, True)
        new_state: dict[str, TVal] = {}
        for m in self.loop.members:
            assert isinstance(m.body, Reduce)
            producers = self.loop.producers.get(m.name, ())
            if producers:
                repair = self.loop.repairs[m.name]
                assert repair is not None
                repair = self._bind_accumulator(repair, f"__acc__{m.name}", state[m.name], ctx)
                ctx.placeholders = {}
                for p in producers:
                    ctx.placeholders[Running(p, "old")] = self._old_value(m.name, p, state[p], ctx.values[p])
                    ctx.placeholders[Running(p, "new")] = ctx.values[p]
                acc = self.emit(repair, ctx)
                ctx.placeholders = {}
                stand_in = any(self._repairs_from_stand_in(m.name, p) for p in producers)
                if m.reduce_op in ("max", "min") or stand_in:
                    # an accumulator that has seen nothing stays at its identity: repairing it could
                    # compute 0 * inf (a factor overflowing or underflowing), which is NaN
                    ident = self.const(REDUCER_IDENTITY[m.reduce_op])
                    acc = self.op("where", acc.axes, "f32", (self.bin("eq", state[m.name], ident), state[m.name], acc))
            else:
                acc = state[m.name]
            # the repair before the operands: emitted right before its dot, it delays the dot in
            # masked loops (slower on the H200)
            operands = self.contraction(m.body, ctx) if m.reduce_op == "sum" else None
            split = self._split_sum(m.body, ctx, acc) if m.reduce_op == "sum" and operands is None else None
            if operands is not None:
                new = self.dot(operands[0], operands[1], roles.col, acc)
            elif split is not None:
                new = split
            else:
                contribution = self.emit(m.body, ctx)
                new = self.bin(m.reduce_op if m.reduce_op != "sum" else "add", acc, contribution)
            new = self.to(new, "f32")
            new_state[m.name] = new
            if m.reduce_op in ("max", "min") or (m.reduce_op in RUNNING_STAND_IN and m.name in self.producer_names):
                # readers see the stand-in for a running value still at its identity
                ident = self.const(REDUCER_IDENTITY[m.reduce_op])
                is_ident = self.bin("eq", new, ident)
                stand_in = self.const(RUNNING_STAND_IN[m.reduce_op])
                ctx.values[m.name] = self.op("where", new.axes, "f32", (is_ident, stand_in, new), prefix="safe")
            else:
                ctx.values[m.name] = new
        for m in self.loop.members:
            body.append(Assign(state[m.name], new_state[m.name]))
        self.scopes.pop()
        if inline:
            self.body.extend(body)
            self._whole_tile = (self.bindings[roles.col], inner_valid[roles.col], scope)
        del self.bindings[roles.col]
        del self.tile_start[roles.col]
        if not inline:
            self.body.append(Loop(var, start, stop, step, body, comment))

    def _bind_accumulator(self, repair: Expr, name: str, value: TVal, ctx: _Ctx) -> Expr:
        """`repair` reading `value` where it names the accumulator. Each accumulator is a distinct
        named value, so CSE cannot merge the repairs of different members."""
        self.member_names.add(name)
        ctx.values[name] = value
        return transform_bottom_up(repair, lambda n: Load(name, ()) if isinstance(n, Accumulator) else None)

    def _finished(self, state: dict[str, TVal], valid: dict[str, TVal | None]) -> dict[str, TVal]:
        """The members' final values. Where a producer ended at its identity (a max that saw
        nothing: a fully masked row), its readers were computed with the stand-in
        (RUNNING_STAND_IN); repair them from it to the identity itself, so the kernel computes what the unfused program does there
        (exp(x - -inf) = inf, exp(-inf - -inf) = nan), as the reference executor's `_finish` does.
        Readers of a member repaired this way are repaired from its old value to its new one."""
        final = dict(state)
        finished: dict[str, TVal] = {}  # member -> where this repair changed it
        at_identity: dict[str, TVal] = {}  # member -> where it ended at its identity
        used: dict[str, TVal] = {}  # member -> the value its readers were computed with
        self.scopes.append(_Scope(self.body))
        ctx = _Ctx(final, {}, valid, {}, True)
        for m in self.loop.members:
            producers = self.loop.producers.get(m.name, ())
            ctx.placeholders = {}
            flags: list[TVal] = []
            for p in producers:
                op = self.loop.member(p).reduce_op
                if op in RUNNING_STAND_IN:
                    if p not in at_identity:
                        at_identity[p] = self.bin("eq", state[p], self.const(REDUCER_IDENTITY[op]))
                        used[p] = self.op("where", state[p].axes, "f32",
                                          (at_identity[p], self.const(RUNNING_STAND_IN[op]), state[p]), prefix="old")
                    flags.append(at_identity[p])
                if p in finished:
                    flags.append(finished[p])
                ctx.placeholders[Running(p, "old")] = used.get(p, state[p])
                ctx.placeholders[Running(p, "new")] = final[p]
            if not flags:
                continue
            differs = flags[0]
            for flag in flags[1:]:
                differs = self.bin("or", differs, flag)
            repair = self.loop.repairs[m.name]
            assert repair is not None
            repair = self._bind_accumulator(repair, f"__final__{m.name}", state[m.name], ctx)
            fixed = self.to(self.emit(repair, ctx), "f32")
            final[m.name] = self.op("where", self.union(differs, fixed, state[m.name]), "f32",
                                    (differs, fixed, state[m.name]), prefix="fin")
            finished[m.name] = differs
        ctx.placeholders = {}
        self.scopes.pop()
        return {name: final[name] for name in state}

    def _emit_outputs(self, state: dict[str, TVal], valid: dict[str, TVal | None]) -> None:
        if not self.config.partial_outputs:
            state = self._finished(state, valid)  # split-K partial states are finished by the combine
        scope = _Scope(self.body)
        self.scopes.append(scope)
        ctx = _Ctx(dict(state), {}, valid, {}, False)
        if self.config.partial_outputs:
            for m in self.loop.members:
                self._store(f"part_{m.name}", m.axes, state[m.name], valid, scratch=True)
        else:
            passes: dict[str, list[Stage]] = {}
            for out in self.program.outputs:
                stage = self.program.stage(out.stage)
                extra = [a for a in stage.axes if a == self.roles.col or a in self.roles.epilogue]
                if len(extra) > 1:
                    raise UnsupportedProgramError("tile lowering", stage.name, "output",
                                                  f"an output with {len(extra)} axes {extra} beyond the reduction (at most one) is not supported")
                if extra:
                    passes.setdefault(extra[0], []).append(stage)
                    continue
                value = state[stage.name] if stage.name in self.member_names else self.emit(stage.body, ctx)
                self._store(f"out_{stage.name}", stage.axes, value, valid)
            for axis, stages in passes.items():
                self._emit_second_pass(stages, state, valid, axis)
        self.scopes.pop()

    def _emit_second_pass(self, stages: list[Stage], state: dict[str, TVal], valid: dict[str, TVal | None],
                          axis: str) -> None:
        """Outputs indexed by the reduced axis (softmax probabilities) or by an axis only outputs
        have: one more pass over that axis, reading the final values of the reductions."""
        lo, hi = self.const(0), self.size(axis)
        if axis == self.roles.col and self.config.splits > 1:
            if self.loop.members:
                raise UnsupportedProgramError("tile lowering", stages[0].name, "output",
                                              "a split-K kernel writes partial states; its combine does the second pass")
            lo, hi = self._split_chunk()  # nothing to merge: each program writes its chunk's outputs
        if axis == self.roles.col and self.config.whole_loop:
            self._emit_whole_tile_pass(stages, state, valid)
            return
        block = self.block[axis]
        # whole tiles without the axis's mask, then the partial last tile with it: a mask that
        # varies along the contiguous axis (its length is not specialised) makes every load and
        # store of the pass element-wise instead of vectorised (a chunk is whole tiles but the last)
        whole = self.bin("add", lo, self.bin("mul", self.bin("floordiv", self.bin("sub", hi, lo), TVal(block, (), "i32"),
                                                                      nonnegative=True),
                                             TVal(block, (), "i32")))
        for start, stop, masked, comment in (
                (lo, whole, False, f"second pass over {axis}, whole tiles: outputs indexed by it"),
                (whole, hi, True, f"second pass over {axis}, the partial last tile")):
            body: list[Stmt] = []
            self.scopes.append(_Scope(body))
            var = TVal(self.fresh("start_"), (), "i32")
            self.bindings[axis] = self.op("arange", (axis,), "i32", (var,), prefix="cols", block=block)
            inner_valid = dict(valid)
            inner_valid[axis] = self.bin("lt", self.bindings[axis], self.size(axis)) if masked else None
            ctx = _Ctx(dict(state), {}, inner_valid, {}, True)
            self.variant_axes.add(axis)
            try:
                for stage in stages:
                    self._store(f"out_{stage.name}", stage.axes, self.emit(stage.body, ctx), inner_valid, variant=True)
            finally:
                self.variant_axes.discard(axis)
            self.scopes.pop()
            del self.bindings[axis]
            self.body.append(Loop(var, start, stop, block, body, comment))

    def _emit_whole_tile_pass(self, stages: list[Stage], state: dict[str, TVal], valid: dict[str, TVal | None]) -> None:
        """The second pass of a loop held in one tile (`LoweringConfig.whole_loop`): the outputs over
        the same tile, reusing every value the loop computed that reads no loop member (its loads:
        the row is read from memory once). Values that read a member are computed again from its
        final value."""
        assert self._whole_tile is not None, "the loop's one tile is emitted first"
        cols, col_valid, loop_scope = self._whole_tile
        col = self.roles.col
        scope = _Scope(self.body)
        # (a key is an expression, or one with the guards it was read under: tile/guards.py)
        scope.memo = {key: value for key, value in loop_scope.memo.items()
                      if self._reads_no_member(key[0] if isinstance(key, tuple) else key)}
        self.scopes.append(scope)
        self.bindings[col] = cols
        inner_valid = {**valid, col: col_valid}
        ctx = _Ctx(dict(state), {}, inner_valid, {}, True)
        try:
            for stage in stages:
                self._store(f"out_{stage.name}", stage.axes, self.emit(stage.body, ctx), inner_valid, variant=True)
        finally:
            self.scopes.pop()
            del self.bindings[col]

    def _reads_no_member(self, expr: Expr) -> bool:
        """Whether `expr` means the same inside the loop and after it: it reads no loop member (a
        running value there, the final one after) and no accumulator."""
        return not (loads_of(expr) & self.member_names) and not any(
            isinstance(n, (Accumulator, Running)) for n in walk(expr))

    def _splits(self) -> TVal:
        """The split count of a split-K kernel: a run-time argument (the launcher passes the plan's
        count as the size of the split axis), so every split count runs one compiled kernel."""
        return self.kernel_arg(f"size_{SPLIT_AXIS}", "int", ArgSource("size", SPLIT_AXIS), "i32")

    def _split_chunk(self) -> tuple[TVal, TVal]:
        """[start, stop) of this program's chunk of the loop axis under split-K: whole loop tiles."""
        pid_s = self._split_id()
        n = self.size(self.roles.col)
        per = self.op("cdiv", (), "i32", (n,), prefix="per", block=self._splits().name)
        chunk = self.bin("mul", self.op("cdiv", (), "i32", (per,), prefix="chunk", block="BLOCK_C"),
                         TVal("BLOCK_C", (), "i32"))
        c_lo = self.bin("mul", pid_s, chunk)
        return c_lo, self.bin("min", self.bin("add", c_lo, chunk), n)

    def _split_id(self) -> TVal:
        """This program's split (grid axis 2), read once per kernel."""
        if "__split__" not in self.bindings:
            self.bindings["__split__"] = self.op("program_id", (), "i32", scope=self.scopes[0], prefix="pid", dim=2)
        return self.bindings["__split__"]

    def _store(self, buffer: str, axes: tuple[str, ...], value: TVal, valid: dict[str, TVal | None],
               scratch: bool = False, variant: bool = False) -> None:
        index: list[Expr] = [Index(a) for a in axes]
        if scratch:
            self._split_id()
            index.insert(0, Index("__split__"))
        scalar, tile, mask_axes = self.address(buffer, tuple(index))
        ctx = _Ctx({}, {}, valid, {}, variant)
        base = self.emit(scalar, ctx) if scalar is not None else self.const(0)
        offset = self.emit(tile, ctx) if tile is not None else self.const(0)
        mask: TVal | None = None
        for axis in self._canon(mask_axes):
            v = valid.get(axis)
            if v is not None:
                mask = v if mask is None else self.bin("and", mask, v)
        kind = "scratch" if scratch else "output"
        self.kernel_arg(f"{buffer}_ptr", "pointer", ArgSource(kind, buffer), "ptr")
        axes_all = self._canon(set(value.axes) | set(offset.axes))
        if offset.axes != axes_all:
            offset = self.bin("add", offset, self.op("full", axes_all, "i32", prefix="z", value=0))
        if value.axes != axes_all:
            value = self.bin("add", value, self.op("full", axes_all, "f32", prefix="z", value=0.0))
        self.scopes[-1].stmts.append(Store(buffer, base, offset, value, mask))


def example_kernel(block: int = 16) -> TileKernel:
    """Causal attention over 16 tokens (head dim 8, fp32) fused and lowered in `block`-sized tiles:
    the small kernel the examples of the tile layer and the code generators work on."""
    import torch

    from neptune_fusion.library import causal_attention
    from neptune_fusion.transform.inline import inline_along, inline_elementwise
    from neptune_fusion.transform.rolling import rolling_update

    q = torch.randn(1, 1, 16, 8)
    fused = rolling_update(inline_along(inline_elementwise(causal_attention.trace(q, q, q, 0.5)), "k"), "k")
    config = LoweringConfig({"q": "f32", "k": "f32", "v": "f32"}, {"d": 8, "d2": 8}, block_row=block,
                            block_col=block, num_warps=4, num_stages=1)
    return lower(fused, config)


def lower(program: Program, config: LoweringConfig, name: str = "fused_kernel") -> TileKernel:
    """Lower a fused program (one FusedLoop + output stages) to a tile kernel."""
    return KernelBuilder(program, config, name).build()
