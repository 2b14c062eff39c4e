"""The tile IR: what one GPU program does, as operations on tiles.

A `TVal` is a tile value: a name, the tile axes it varies along (a subset of the
kernel's tile axes, always in the kernel's canonical order; () for a scalar) and
an element dtype. Operations combine tile values with broadcasting by axis name,
so the code generator only has to insert `[:, None]`-style expansions.

Example:
    >>> TVal("s0", ("q", "k"), "f32")
    TVal(name='s0', axes=('q', 'k'), dtype='f32')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union


@dataclass(frozen=True)
class TVal:
    """A tile value: name, the tile axes it varies along (canonical order) and element dtype."""

    name: str
    axes: tuple[str, ...]
    dtype: str


@dataclass
class Op:
    """`out = kind(args; attrs)`. Kinds and their attrs:

    const(value) | param(name) | size(axis) | stride(buffer, dim) | program_id(dim) |
    arange(axis; args: start) | unary(op) | binary(op) | where | cast(dtype) |
    reduce(op, axis) | dot(precision; args: a, b[, acc]) | load(buffer; args: offsets[, mask], other) |
    full(value) (a tile of `out.axes` filled with value)
    """

    out: TVal
    kind: str
    args: tuple[TVal, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Store:
    """Write `value` at `buffer + base + offsets` where `mask` holds."""

    buffer: str
    base: TVal  # scalar (per-program) offset
    offsets: TVal
    value: TVal
    mask: TVal | None


@dataclass
class Assign:
    """Rebind a loop-carried variable to a new value at the end of a loop body."""

    target: TVal
    value: TVal


@dataclass
class Loop:
    """`for var in range(start, stop, step)`: `var` is a scalar i32 tile value inside `body`."""

    var: TVal
    start: TVal
    stop: TVal
    step: str  # a constexpr name or literal
    body: list[Stmt]
    comment: str = ""
    peeled: bool = False  # its last iteration (at `stop`) follows the loop as straight-line code
    ahead: tuple[str, ...] = ()  # ops computing the next iteration's values (kept a stage longer)


@dataclass
class If:
    """`if cond: body` (a scalar condition; values rebound inside keep their new values after)."""

    cond: TVal
    body: list[Stmt]
    comment: str = ""


Stmt = Union[Op, Store, Assign, Loop, If]


@dataclass(frozen=True)
class ArgSource:
    """What the launcher passes for a kernel argument: a buffer's pointer (`kind` "input",
    "output" or "scratch", `name` the buffer), a scalar parameter ("param"), an axis's extent
    ("size", `name` the axis) or a buffer's stride ("stride", dim `dim` of buffer `name`).

    Example:
        >>> str(ArgSource("stride", "q", 2)), ArgSource("size", "k") == ArgSource("size", "k")
        ('stride:q:2', True)
    """

    kind: str
    name: str
    dim: int | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("input", "output", "scratch", "param", "size", "stride")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"kernel argument source kind must be one of {self.KINDS}, got {self.kind!r}")
        if (self.kind == "stride") != (self.dim is not None):
            raise ValueError(f"a {self.kind!r} source {'needs' if self.kind == 'stride' else 'takes no'} dim")

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" + ("" if self.dim is None else f":{self.dim}")


@dataclass(frozen=True)
class GridFactor:
    """One factor of a grid dimension: the value of `size` (an axis's size argument `size_<axis>`
    or a held axis's constexpr `SIZE_<AXIS>`), or with `block` (a block-size constexpr) the number
    of blocks covering it, cdiv(size, block)."""

    size: str
    block: str | None = None

    def value(self, env: dict[str, int]) -> int:
        n = env[self.size]
        return n if self.block is None else -(-n // env[self.block])

    def __str__(self) -> str:
        return self.size if self.block is None else f"cdiv({self.size}, {self.block})"


@dataclass(frozen=True)
class GridDim:
    """One grid dimension, the product of its factors (1 when it has none).

    Example:
        >>> dim = GridDim((GridFactor("size_q", "BLOCK_R"), GridFactor("size_h")))
        >>> str(dim), dim.value({"size_q": 100, "BLOCK_R": 32, "size_h": 8})
        ('cdiv(size_q, BLOCK_R) * size_h', 32)
    """

    factors: tuple[GridFactor, ...] = ()

    def value(self, env: dict[str, int]) -> int:
        return math.prod(f.value(env) for f in self.factors)

    def times(self, factor: GridFactor) -> GridDim:
        return GridDim((*self.factors, factor))

    def __str__(self) -> str:
        return " * ".join(map(str, self.factors)) or "1"


@dataclass
class KernelArg:
    """One kernel parameter: a pointer, an int size/stride, a float/int scalar, or a constexpr."""

    name: str
    kind: str  # "pointer" | "int" | "float" | "constexpr"
    source: ArgSource  # what the launcher passes


@dataclass
class TileKernel:
    """A whole kernel: its arguments, grid, tile axes and statements."""

    name: str
    args: list[KernelArg]
    tile_axes: tuple[str, ...]
    block_sizes: dict[str, str]  # tile axis -> constexpr name of its block size
    grid: list[GridDim]  # per grid dimension, over sizes and constexprs
    body: list[Stmt]
    num_warps: int
    num_stages: int
    constexprs: dict[str, int]
    notes: list[str] = field(default_factory=list)
    # programmatic dependent launch between two kernels of one call: "primary" lets the next kernel
    # launch while it runs, "dependent" waits for the previous kernel's writes before anything else
    grid_dependency: str = "none"
    # int arguments Triton must not specialise on (== 1, divisible by 16): the length of the loop
    # axis, which changes from call to call (a growing KV cache), so one compiled kernel serves it all
    do_not_specialize: list[str] = field(default_factory=list)
    # full axes not held whole: tiled across the grid or walked by inner loops (schedule/tiles.py)
    tiled_axes: tuple[str, ...] = ()


def format_tile_kernel(kernel: TileKernel) -> str:
    """Readable text of a tile kernel (for `explain`)."""
    lines = [f"tile kernel {kernel.name}: grid ({', '.join(map(str, kernel.grid))}), tile axes {kernel.tile_axes}, "
             f"blocks {kernel.constexprs}, warps {kernel.num_warps}, stages {kernel.num_stages}"]
    lines.extend(f"  note: {n}" for n in kernel.notes)

    def fmt(stmts: list[Stmt], indent: str) -> None:
        for st in stmts:
            if isinstance(st, Op):
                attrs = ", ".join(f"{k}={v}" for k, v in st.attrs.items())
                args = ", ".join(a.name for a in st.args)
                inner = ", ".join(x for x in (args, attrs) if x)
                lines.append(f"{indent}{st.out.name}: {st.out.dtype}[{','.join(st.out.axes)}] = {st.kind}({inner})")
            elif isinstance(st, Store):
                mask = f" if {st.mask.name}" if st.mask else ""
                lines.append(f"{indent}store {st.buffer}[{st.base.name} + {st.offsets.name}] = {st.value.name}{mask}")
            elif isinstance(st, Assign):
                lines.append(f"{indent}{st.target.name} <- {st.value.name}")
            elif isinstance(st, If):
                note = f"   # {st.comment}" if st.comment else ""
                lines.append(f"{indent}if {st.cond.name}:{note}")
                fmt(st.body, indent + "  ")
            else:
                note = f"   # {st.comment}" if st.comment else ""
                lines.append(f"{indent}for {st.var.name} in range({st.start.name}, {st.stop.name}, {st.step}):{note}")
                fmt(st.body, indent + "  ")
                if st.peeled:
                    lines.append(f"{indent}# last iteration, {st.var.name} = {st.stop.name}:")

    fmt(kernel.body, "  ")
    return "\n".join(lines)
