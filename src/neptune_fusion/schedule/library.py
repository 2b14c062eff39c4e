"""A contraction handed to the GEMM library (Programs -> a typed plan).

A program whose one output is a contraction `out[o] = sum_k A(o_a, k) * B(o_b, k)` of two
operands, each a product of factors over its own output axes (and batch axes both share) and k,
can run as: each operand that is not an input as it stands written once, in the inputs' 16-bit
dtype, by a kernel of its own (its program: a normalised `x` is a row reduction and a second pass,
a gated `silu(a) * b` an element-wise pass),
then `torch.einsum` of the two, which cuBLAS computes. The fused K-loop kernel computes the
operand at every K-step instead and saves that traffic, but reaches a smaller share of the tensor
cores than cuBLAS, and loads the operand's sources again for every tile of output columns. The
choice is the estimate of the two: the GEMM's FLOPs at cuBLAS's rate plus the writer's traffic (its
sources read, the operand written) at HBM's, against the larger of the FLOPs at the K-loop's share
of that rate and the sources' bytes loaded once per column tile. A normalised `x` read in the GEMM's
dtype costs the writer what it saves, so the library wins where the other side is long (about 2600
columns on the H200: a model's width after a normalisation, not attention's head dim); sources wider
than the operand or read at several places (a backward's fp32 results, gathered at two offsets) tip
it at any width. The written operands may take at most the memory of the
output or of the inputs they are computed from (the fused kernel holds none).

Example:
    >>> import torch
    >>> from neptune_fusion.library import rmsnorm_matmul
    >>> x, w = torch.randn(64, 512).half(), torch.randn(512, 4096).half()
    >>> plan = library_contraction(rmsnorm_matmul.trace(x, w), {"i": 64, "k": 512, "e": 4096}, "f16")
    >>> plan.spec, [op.input for op in plan.operands], plan.operands[0].axes
    ('ik,ke->ie', [None, 'w'], ('i', 'k'))
    >>> library_contraction(rmsnorm_matmul.trace(x, w), {"i": 64, "k": 128, "e": 512}, "f16").reason[:29]
    'the fused K-loop is estimated'
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass

from neptune_fusion.ir.expr import Binary, Cast, Const, Expr, Index, Load, Reduce, free_axes, product_factors, walk
from neptune_fusion.ir.program import InputBuffer, OutputSpec, Program, Stage
from neptune_fusion.schedule.partition import length_axes, needed_stages, subprogram

PASS = "library"
# cuBLAS's 16-bit GEMM on the H200 at a model's sizes (~780 TFLOP/s), the share of it the
# generated K-loop kernel reaches, and HBM as a streaming kernel reads it: machine figures
LIBRARY_GEMM_FLOPS = 780e12
K_LOOP_SHARE = 0.87
HBM_BYTES_PER_S = 4.0e12
# the widest tile of output columns a K-loop plan holds beside its rows (schedule/tiles.py's
# accumulator of 128 x 256 values): the fewest times it recomputes an operand
K_LOOP_TILE_COLUMNS = 256
GEMM_DTYPES = {"f16": 2, "bf16": 2}  # the dtypes cuBLAS multiplies at full tensor-core rate, their sizes
ITEM_BYTES = {**GEMM_DTYPES, "f32": 4, "i32": 4, "i64": 8, "bool": 1, "i8": 1, "u8": 1, "i16": 2}


@dataclass(frozen=True)
class Operand:
    """One side of the contraction over `axes` (its tensor's dims, in order): the input `input`
    read as it is, or the one output of `program` (written by its kernels)."""

    axes: tuple[str, ...]
    input: str | None = None
    program: Program | None = None


@dataclass(frozen=True)
class LibraryContraction:
    """The plan: `torch.einsum(spec, *operands)` computes the output stage `stage`; `widened`:
    the program writes it in fp32 for a later kernel (a backward's partial result), so the GEMM
    returns its fp32 accumulator unrounded; the estimates (seconds) behind the choice."""

    stage: str
    spec: str
    operands: tuple[Operand, Operand]
    library_s: float
    fused_s: float
    widened: bool = False

    def describe(self) -> str:
        """What `explain` prints."""
        sides = [f"operand {j}: " + (f"input {op.input!r}" if op.input is not None else
                                     f"written by {op.program.name} over {list(op.axes)}")  # type: ignore[union-attr]
                 for j, op in enumerate(self.operands)]
        return "\n".join([f"{self.stage} = torch.einsum({self.spec!r}, operand 0, operand 1) (cuBLAS)", *sides,
                          f"estimated {self.library_s * 1e6:.3g} us against {self.fused_s * 1e6:.3g} us for the "
                          "fused K-loop kernel"])


@dataclass(frozen=True)
class Declined:
    """Why the output stays with the fused kernels; `estimated`: the program has the form, and
    the estimate chose the fused kernel."""

    reason: str
    estimated: bool = False


def library_contraction(program: Program, sizes: dict[str, int], dtype: str,
                        input_dtypes: Mapping[str, str] | None = None) -> LibraryContraction | Declined:
    """The library plan of `program` at these axis sizes and GEMM dtype, or why not;
    `input_dtypes`: each input's dtype where it differs from `dtype` (an fp32 result of an
    earlier kernel is an operand a kernel writes in `dtype`, not one cuBLAS reads as it is)."""
    if len(program.outputs) != 1:
        return Declined(f"the program has {len(program.outputs)} outputs, not one")
    if not all(isinstance(st, Stage) for st in program.stages):
        return Declined("the program is already fused")
    out = program.outputs[0]
    stage = program.stage(out.stage)
    body = stage.body
    widened = False
    if isinstance(body, Cast) and body.dtype in (dtype, "f32") and isinstance(body.x, Load) \
            and body.x.index == tuple(Index(a) for a in stage.axes) \
            and any(st.name == body.x.buffer and st.axes == stage.axes for st in program.stages):
        # a reduction written for a later kernel, in the inputs' dtype (what the library returns)
        # or in fp32 (its accumulator, unrounded)
        widened = body.dtype != dtype
        stage = program.stage(body.x.buffer)
        body = stage.body
    if not (isinstance(body, Reduce) and body.op == "sum"):
        return Declined(f"its output {stage.name!r} is not a sum reduction")
    if tuple(out.dims) != stage.axes:
        return Declined(f"its output is a permutation of {stage.name!r}'s axes")
    if dtype not in GEMM_DTYPES:
        return Declined(f"its inputs are {dtype}, not a 16-bit dtype cuBLAS multiplies at full rate")
    factors, scale = product_factors(body.body)
    split = _sides(factors, stage.axes, body.axis)
    if split is None:
        return Declined(f"the body of {stage.name!r} is not a product of two sides over disjoint output axes "
                        f"that both index {body.axis!r}")
    inputs = {b.name: b for b in program.inputs}
    sides = [split[0], split[1]]
    input_dtypes = input_dtypes or {}
    direct = [_direct_input(side, inputs, input_dtypes, dtype) for side in sides]
    home = None  # the side the loose factors and the constant join: one written anyway, else the smaller
    if split[2] or scale != 1.0:
        written_sides = [j for j in (0, 1) if direct[j] is None]
        home = written_sides[0] if written_sides else min((0, 1), key=lambda j: _elements(_side_axes(sides[j], body.axis,
                                                                                          stage.axes), sizes))
        sides[home] = (*sides[home], *split[2])
        direct[home] = None
    operands = []
    for j in (0, 1):
        found = direct[j]
        if found is not None:
            operands.append(Operand(found[1], input=found[0]))
            continue
        name = f"{stage.name}_operand{j}"
        # written in the GEMM's dtype whatever else the writer reads (an fp32 statistic)
        expr = Cast(_product(sides[j], scale if j == home else 1.0), dtype)
        others = [st for st in program.stages if st.name != stage.name]
        read = {n.buffer for n in walk(expr) if isinstance(n, Load)}
        axes = _source_order(_side_axes(sides[j], body.axis, stage.axes), [*needed_stages(others, read), expr],
                             inputs, sizes, input_dtypes, dtype)
        stages = needed_stages(others + [Stage(name, axes, expr)], {name})
        writer = subprogram(program, f"{program.name}_operand{j}", stages, [OutputSpec(name, axes)], [])
        # an axis only an input it does not read gives the size of (a position k sized by w): that
        # input comes along for its size
        # (also an axis whose length it reads, `Size`, which would otherwise be a parameter)
        lengths = set(length_axes(writer, program).values())
        sizers = {program.axis_sizes[a][0] for a in _unsized_axes(writer) | lengths if a in program.axis_sizes}
        if sizers:
            writer = subprogram(program, writer.name, stages, [OutputSpec(name, axes)],
                                [inputs[n] for n in sorted(sizers)])
        unsized = _unsized_axes(writer) | set(length_axes(writer, program).values())
        if unsized:
            return Declined(f"operand {j} of {stage.name!r} would have axes {sorted(unsized)} that no input it "
                            "reads gives the size of")
        operands.append(Operand(axes, program=writer))
    flops = 2.0 * _elements(stage.axes, sizes) * sizes[body.axis]
    written = sum(_elements(op.axes, sizes) for op in operands if op.program is not None)
    # the fused kernel holds no operand; the library route may hold at most what the output it
    # allocates anyway takes, or what the inputs it is computed from already take (a gated
    # down-projection's operand from its two halves), not an operand larger than both (an outer
    # product of two vectors)
    allowed = max(_elements(stage.axes, sizes),
                  sum(_elements(tuple(inputs[n].dims), sizes) for op in operands if op.program is not None
                      for n in {b.name for b in op.program.inputs} if inputs[n].kind == "float"))
    if written > allowed:
        return Declined(f"the written operands ({written} elements) would take more memory than the output "
                        f"and the inputs they are computed from ({allowed})", estimated=True)
    writer_bytes = reread_bytes = 0.0
    for j, op in enumerate(operands):
        if op.program is None:
            continue
        loaded = _loaded_bytes(op.program, sizes, input_dtypes, dtype)
        writer_bytes += loaded + _elements(op.axes, sizes) * GEMM_DTYPES[dtype]
        # the fused kernel computes this side again for every tile of the other side's columns
        columns = _elements(tuple(a for a in operands[1 - j].axes if a in stage.axes and a not in op.axes), sizes)
        reread_bytes += math.ceil(columns / K_LOOP_TILE_COLUMNS) * loaded
    library_s = flops / LIBRARY_GEMM_FLOPS + writer_bytes / HBM_BYTES_PER_S
    fused_s = max(flops / (LIBRARY_GEMM_FLOPS * K_LOOP_SHARE), reread_bytes / HBM_BYTES_PER_S)
    if library_s >= fused_s:
        return Declined(f"the fused K-loop is estimated faster ({fused_s * 1e6:.3g} us) than writing the operands "
                        f"for cuBLAS ({library_s * 1e6:.3g} us)", estimated=True)
    return LibraryContraction(stage.name, _spec([operands[0].axes, operands[1].axes], stage.axes),
                              (operands[0], operands[1]), library_s, fused_s, widened)


def _sides(factors: list[Expr], out_axes: tuple[str, ...], k: str
           ) -> tuple[tuple[Expr, ...], tuple[Expr, ...], tuple[Expr, ...]] | None:
    """(side A's factors, side B's, the loose ones over k and batch axes alone): the sides are the
    two groups of factors connected by the output axes only one of them indexes (batch axes, which
    both index, the fewest that separate them); each side indexes k."""
    axes_of = [free_axes(f) for f in factors]
    for size in range(len(out_axes)):
        for batch in itertools.combinations(out_axes, size):
            own = set(out_axes) - set(batch)
            parent = list(range(len(factors)))
            for i, j in itertools.combinations(range(len(factors)), 2):
                if axes_of[i] & axes_of[j] & own:
                    parent[_root(parent, i)] = _root(parent, j)
            root = [_root(parent, i) for i in range(len(factors))]
            roots = sorted({root[i] for i in range(len(factors)) if axes_of[i] & own})
            if len(roots) != 2:
                continue
            sides = [tuple(f for i, f in enumerate(factors) if axes_of[i] & own and root[i] == r) for r in roots]
            indexed = [set().union(*(free_axes(f) for f in side)) for side in sides]
            if all(k in ax and set(batch) <= ax for ax in indexed) and set(out_axes) <= indexed[0] | indexed[1]:
                loose = tuple(f for i, f in enumerate(factors) if not axes_of[i] & own)
                return sides[0], sides[1], loose
    return None


def _loaded_bytes(program: Program, sizes: dict[str, int], input_dtypes: Mapping[str, str], dtype: str) -> float:
    """Bytes a kernel computing `program` loads from its inputs: each distinct load once per
    element of the axes its index reads (a gather at two offsets loads twice)."""
    inputs = {b.name for b in program.inputs}
    loads = {node for st in program.stages for node in walk(st.body)
             if isinstance(node, Load) and node.buffer in inputs}
    return float(sum(math.prod(sizes.get(a, 1) for a in set().union(*(free_axes(i) for i in load.index)))
                     * ITEM_BYTES.get(input_dtypes.get(load.buffer, dtype), 4) for load in loads))


def _unsized_axes(program: Program) -> set[str]:
    """Axes of `program`'s stages whose size none of its inputs gives."""
    used = set()
    for st in program.stages:
        used |= set(st.axes) | ({st.body.axis} if isinstance(st.body, Reduce) else set())
    return used - set(program.axis_sizes) - set(program.derived_axes)


def _root(parent: list[int], i: int) -> int:
    while parent[i] != i:
        i = parent[i]
    return i


def _side_axes(side: tuple[Expr, ...], k: str, out_axes: tuple[str, ...]) -> tuple[str, ...]:
    """A written operand's axes: its output axes in the output's order, then k (contiguous)."""
    indexed = set().union(*(free_axes(f) for f in side))
    return tuple(a for a in out_axes if a in indexed) + (k,)


def _source_order(axes: tuple[str, ...], computed: list[Stage | Expr], inputs: dict[str, InputBuffer],
                  sizes: dict[str, int], input_dtypes: Mapping[str, str], dtype: str) -> tuple[str, ...]:
    """A written operand's axes in the order its largest source holds them (the writer's stores then
    run along that load's contiguous dim; cuBLAS reads an operand of either order): a gradient
    `g[tokens, hidden]` summed over tokens is written [tokens, hidden], not transposed."""
    loads = list(dict.fromkeys(node for item in computed for node in walk(item if isinstance(item, Expr) else item.body)
                               if isinstance(node, Load) and node.buffer in inputs
                               and not (isinstance(item, Stage) and isinstance(item.body, Reduce))))
    dims = [[a for i in load.index for a in sorted(free_axes(i)) if a in axes] for load in loads]
    sized = [(math.prod(sizes.get(a, 1) for a in set(d)) * ITEM_BYTES.get(input_dtypes.get(load.buffer, dtype), 4), d)
             for load, d in zip(loads, dims) if set(d) == set(axes)]
    if not sized:
        return axes
    # the first of the largest, in the order the program reads them (the same plan in every process)
    return tuple(dict.fromkeys(max(sized, key=lambda found: found[0])[1]))


def _direct_input(side: tuple[Expr, ...], inputs: dict[str, InputBuffer], input_dtypes: Mapping[str, str],
                  dtype: str) -> tuple[str, tuple[str, ...]] | None:
    """(input, its axes) where the side is one input of the GEMM's dtype read at its own axes, as
    the tensor stands."""
    if len(side) != 1:
        return None
    (load,) = side
    if not (isinstance(load, Load) and load.buffer in inputs and all(isinstance(i, Index) for i in load.index)):
        return None
    axes = tuple(i.axis for i in load.index)  # type: ignore[attr-defined]
    if len(set(axes)) != len(axes) or tuple(inputs[load.buffer].dims) != axes or inputs[load.buffer].kind != "float" \
            or input_dtypes.get(load.buffer, dtype) != dtype:
        return None
    return load.buffer, axes


def _product(factors: tuple[Expr, ...], scale: float) -> Expr:
    expr = factors[0]
    for f in factors[1:]:
        expr = Binary("mul", expr, f)
    return Binary("mul", expr, Const(scale)) if scale != 1.0 else expr


def _elements(axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def _spec(operand_axes: list[tuple[str, ...]], out_axes: tuple[str, ...]) -> str:
    """The einsum spec, single-letter axis names kept as they are (for reading)."""
    names = list(dict.fromkeys([*operand_axes[0], *operand_axes[1], *out_axes]))
    letters = {a: a for a in names if len(a) == 1 and a in string.ascii_letters}
    free = iter(c for c in string.ascii_letters if c not in letters.values())
    letters.update({a: next(free) for a in names if a not in letters})
    return ",".join("".join(letters[a] for a in axes) for axes in operand_axes) + "->" + "".join(letters[a] for a in out_axes)


__all__ = ["Declined", "LibraryContraction", "Operand", "library_contraction"]
