"""Materialising a shared intermediate a chunk at a time: a schedule for reductions that no single
kernel computes (Programs -> a typed plan).

Linear cross-entropy's backward has two reductions, dh[i, d] = sum_v G[i, v] w[v, d] and
dW[v, d] = sum_i G[i, v] h[i, d], of one intermediate G (the logits' gradient) whose logits contract
the hidden axis d. Each would recompute the logits (a contraction over d) while accumulating a
tile that holds all of d: no grid tiling or inner loop computes that in one kernel. Here G is
materialised instead, for a chunk of one of its axes at a time, by one fused kernel (the
contraction and its epilogue, the chunk's offset a parameter), and each reduction becomes a plain
contraction of the chunk with an input, which cuBLAS does best (`torch.einsum`). A reduction over
the chunked axis adds its chunk's part to an fp32 accumulator; the others write their slice. The
chunked axis is the one whose accumulated results are smallest; the chunk is as long as the memory
budget allows (`chunk_length`). A one-hot term of G (`where(t[i] == v, c[i], 0)`, the target's -1 in
softmax - one_hot) stays out of the chunks: the contractions over v take it once as rows of their
operand at t (a gather), the others see it added into each chunk (`OneHot`).

Example:
    >>> import torch
    >>> from neptune_fusion.library import linear_cross_entropy
    >>> from neptune_fusion.schedule.partition import partition_loops
    >>> from neptune_fusion.transform.grad import differentiate
    >>> h, w, t = torch.randn(8, 600), torch.randn(16, 600), torch.randint(0, 16, (8,))
    >>> grad = differentiate(linear_cross_entropy.trace(h, w, t), ("h", "w"))
    >>> plan = materialise(partition_loops(grad.backward, grad.held), {"i": 8, "v": 16, "d": 600})
    >>> plan.shared, plan.axis, [(c.spec, c.over_chunk) for c in plan.contractions]
    ('grad_dot0', 'v', [('iv,id->vd', False), ('iv,vd->id', True)])
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, replace
from typing import Any, Sequence

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    Binary,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Size,
    Where,
    free_axes,
    loads_of,
    rebuild,
    walk,
)
from neptune_fusion.ir.program import OutputSpec, Program, Stage, axis_sources
from neptune_fusion.schedule.partition import Group, needed_stages

PASS = "materialise"
OFFSET_PARAM = "chunk_start"
LENGTH_PARAM = "chunked_length"  # the chunked axis's whole length (`size` of it inside a chunk)
# the materialised chunk may take this share of the results' own size (at least MIN_CHUNK_BYTES)
CHUNK_SHARE = 1 / 16
MIN_CHUNK_BYTES = 16 << 20
CHUNK_MULTIPLE = 128  # whole tiles of the producer's kernel


@dataclass(frozen=True)
class Contraction:
    """One reduction of the groups as `torch.einsum(spec, shared chunk, operand)`: the result it
    computes, the input it contracts the chunk with, whether it sums over the chunked axis
    (accumulated across chunks) and the constant factor of its product."""

    result: str
    spec: str
    operand: str
    operand_axes: tuple[str, ...]
    over_chunk: bool
    scale: float
    summed: str = ""  # the axis it sums over


@dataclass(frozen=True)
class OneHot:
    """A term `where(t[j] == axis, c[j], 0)` of the shared stage, kept out of what the producer
    computes (`t` and `c` any expressions over the one axis `j`). A contraction summing over `axis`
    gets its part once, after the chunks: the operand's rows at t, times c (a gather), so a chunked
    sum never rounds small parts against it; the other contractions see it added into each chunk
    (one entry per `j`). `values` computes t and c (its two outputs over `own`); an index outside
    the axis adds nothing, as the where does."""

    axis: str
    own: str
    values: Program


@dataclass(frozen=True)
class Materialised:
    """The plan: `producer` computes the stage `shared` for a chunk of `axis` (its inputs in
    `sliced` cut along that axis at the given dim, the chunk's start in the parameter
    `OFFSET_PARAM`), then each contraction runs on it. `results` are the groups' results in order,
    `result_axes` the axes of each."""

    producer: Program
    shared: str
    axis: str
    sliced: tuple[tuple[str, int], ...]
    contractions: tuple[Contraction, ...]
    results: tuple[str, ...]
    result_axes: tuple[tuple[str, ...], ...]
    one_hot: OneHot | None = None


def materialise(groups: Sequence[Group], sizes: dict[str, int]) -> Materialised:
    """The chunked plan of `groups` (whose kernels cannot be planned), or FusionError naming the
    condition that fails: every result a sum of one shared stage times an input's element."""
    if not groups:
        raise ValueError("no groups to materialise")
    members: list[tuple[str, Stage, Group]] = []
    for group in groups:
        for result in group.results:
            members.append((result, _result_stage(group, result), group))
    inputs = frozenset(b.name for g in groups for b in g.program.inputs)
    shared_names = {_factors_of(stage, inputs)[0].buffer for _, stage, _ in members}
    if len(shared_names) != 1:
        raise FusionError(PASS, members[0][1].name, "sum", f"the reductions read different intermediates {sorted(shared_names)}")
    shared = shared_names.pop()
    home = next(g for g in groups if any(isinstance(s, Stage) and s.name == shared for s in g.program.stages))
    shared_axes = home.program.stage(shared).axes
    axis = _chunk_axis(members, shared_axes, sizes)
    contractions = tuple(_contraction(result, stage, axis, inputs) for result, stage, _ in members)
    program, one_hot = _without_one_hot(home.program, shared, contractions)
    producer, sliced = _producer(program, shared, axis)
    return Materialised(producer, shared, axis, sliced, contractions, tuple(r for r, _, _ in members),
                        tuple(stage.axes for _, stage, _ in members), one_hot)


def _without_one_hot(program: Program, shared: str, contractions: Sequence[Contraction]
                     ) -> tuple[Program, OneHot | None]:
    """`program` with the shared stage's term `where(t == v, c, 0)` taken out, and that term (None
    where the stage has none): `t` and `c` free of `v` and over one other axis `j` of the stage
    (whose axes are j and v), `t` reading no stage that varies along v, and some contraction summing
    over `v` (the one the term would dominate), none of those with an operand indexed by `j`."""
    stage = program.stage(shared)
    body = stage.body
    if not (isinstance(body, Binary) and body.op == "add"):
        return program, None
    by_name = {st.name: st for st in program.all_stages()}
    summed_over = {c.summed for c in contractions}

    def over(expr: Expr, axis: str) -> bool:  # an expression over `axis` only, reading no v-indexed stage
        return free_axes(expr) <= {axis} and all(n not in by_name or set(by_name[n].axes) <= {axis}
                                                 for n in loads_of(expr))

    for term, rest in ((body.a, body.b), (body.b, body.a)):
        if not (isinstance(term, Where) and isinstance(term.b, Const) and term.b.value == 0
                and isinstance(term.cond, Binary) and term.cond.op == "eq"):
            continue
        for index, hot in ((term.cond.a, term.cond.b), (term.cond.b, term.cond.a)):
            if not (isinstance(hot, Index) and hot.axis in summed_over and len(stage.axes) == 2
                    and hot.axis in stage.axes):
                continue
            (own,) = [a for a in stage.axes if a != hot.axis]
            if not (over(index, own) and over(term.a, own)) or any(
                    own in c.operand_axes for c in contractions if c.summed == hot.axis):
                continue
            made = [Stage("one_hot_index", (own,), index), Stage("one_hot_coefficient", (own,), term.a)]
            needed = needed_stages([st for st in program.all_stages() if st.name != shared] + made,
                                   {st.name for st in made})
            reading = set().union(*(st.reads() for st in needed))
            measured = {n.axis for st in needed for n in walk(st.body) if isinstance(n, Size)}
            reading |= {program.axis_sizes[a][0] for a in measured if a in program.axis_sizes}  # for their sizes
            inputs = tuple(b for b in program.inputs if b.name in reading)
            sizes = {**axis_sources(inputs), **{a: src for a, src in program.axis_sizes.items() if src[0] in reading}}
            values = replace(program, name=f"{program.name}_one_hot", stages=tuple(needed), inputs=inputs,
                             outputs=tuple(OutputSpec(st.name, (own,)) for st in made), axis_sizes=sizes,
                             loop_axis=None)
            values.validate()
            kept = replace(program, stages=tuple(Stage(stage.name, stage.axes, rest)
                                                 if isinstance(st, Stage) and st.name == shared else st
                                                 for st in program.stages))
            return kept, OneHot(hot.axis, own, values)
    return program, None


def chunk_length(plan: Materialised, sizes: dict[str, int], itemsize: int) -> int:
    """Elements of the chunked axis per chunk: the materialised chunk within the budget
    (`chunk_budget`), whole tiles, at least one tile."""
    shared_axes = plan.producer.stage(plan.shared).axes
    per_index = math.prod(sizes[a] for a in shared_axes if a != plan.axis) * itemsize
    length = max(CHUNK_MULTIPLE, chunk_budget(plan, sizes, itemsize) // max(1, per_index) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)
    return min(length, sizes[plan.axis])


def chunk_budget(plan: Materialised, sizes: dict[str, int], itemsize: int) -> int:
    """Bytes the materialised chunk may take: a share of the results' own size (the gradients a
    backward returns anyway), at least `MIN_CHUNK_BYTES`."""
    results = sum(math.prod(sizes[a] for a in axes) * itemsize for axes in plan.result_axes)
    return max(MIN_CHUNK_BYTES, int(CHUNK_SHARE * results))


def accumulates_in_fp32(plan: Materialised, sizes: dict[str, int], itemsize: int) -> bool:
    """Whether the results summed over chunks are held in fp32 between chunks: when that costs no
    more than the chunk's budget; otherwise they add up in their own dtype (each chunk's part is
    computed in fp32 by the contraction and rounded once), as Liger's fused linear cross-entropy
    accumulates its weight gradient."""
    accumulated = sum(math.prod(sizes[a] for a in axes) * 4
                      for c, axes in zip(plan.contractions, plan.result_axes) if c.over_chunk)
    return itemsize >= 4 or accumulated <= chunk_budget(plan, sizes, itemsize)


def _result_stage(group: Group, result: str) -> Stage:
    if result.startswith("output:"):
        out = group.program.outputs[group.results.index(result)]
        stage = group.program.stage(out.stage)
        if tuple(out.dims) != stage.axes or out.view is not None:
            raise FusionError(PASS, stage.name, "output", "the output is a permuted or reshaped view of its stage")
        return stage
    return group.program.stage(result)


def _factors_of(stage: Stage, inputs: frozenset[str]) -> tuple[Load, Load, float]:
    """(the shared stage's load, the input's load, the constant factor) of `sum[x](S * input * c)`."""
    body = stage.body
    if not (isinstance(body, Reduce) and body.op == "sum"):
        raise FusionError(PASS, stage.name, "result", "it is not a sum reduction")
    loads: list[Load] = []
    scale = 1.0
    stack = [body.body]
    while stack:
        node = stack.pop()
        if isinstance(node, Binary) and node.op == "mul":
            stack += [node.a, node.b]
        elif isinstance(node, Const) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            scale *= float(node.value)
        elif isinstance(node, Load) and all(isinstance(i, Index) for i in node.index):
            loads.append(node)
        else:
            raise FusionError(PASS, stage.name, f"sum over {body.axis}",
                              "its body is not a product of two plainly indexed loads and constants")
    if len(loads) != 2:
        raise FusionError(PASS, stage.name, f"sum over {body.axis}", f"it multiplies {len(loads)} loads, not 2")
    staged = [ld for ld in loads if ld.buffer not in inputs]
    if len(staged) != 1:
        raise FusionError(PASS, stage.name, f"sum over {body.axis}", "it does not multiply one stage by one input")
    return staged[0], next(ld for ld in loads if ld is not staged[0]), scale


def _chunk_axis(members: list[tuple[str, Stage, Group]], shared_axes: tuple[str, ...], sizes: dict[str, int]) -> str:
    """The shared stage's axis whose accumulated results (those summing over it) are smallest."""
    def accumulated(axis: str) -> int:
        return sum(math.prod(sizes[a] for a in stage.axes) for _, stage, _ in members
                   if isinstance(stage.body, Reduce) and stage.body.axis == axis)
    return min(shared_axes, key=lambda a: (accumulated(a), -sizes[a]))


def _contraction(result: str, stage: Stage, axis: str, inputs: frozenset[str]) -> Contraction:
    shared, operand, scale = _factors_of(stage, inputs)
    assert isinstance(stage.body, Reduce)
    letters: dict[str, str] = {}

    def spell(indices: Sequence[Expr]) -> str:
        for i in indices:
            if i.axis not in letters:  # type: ignore[attr-defined]
                letters[i.axis] = next(c for c in string.ascii_letters if c not in letters.values())  # type: ignore[attr-defined]
        return "".join(letters[i.axis] for i in indices)  # type: ignore[attr-defined]

    names = [i.axis for i in shared.index] + [i.axis for i in operand.index] + list(stage.axes)  # type: ignore[attr-defined]
    for name in names:  # letters as the axes' own names where they are single letters, for reading
        if len(name) == 1 and name in string.ascii_letters and name not in letters.values():
            letters[name] = name
    spec = f"{spell(shared.index)},{spell(operand.index)}->{spell([Index(a) for a in stage.axes])}"
    operand_axes = tuple(i.axis for i in operand.index)  # type: ignore[attr-defined]
    return Contraction(result, spec, operand.buffer, operand_axes, stage.body.axis == axis, scale, stage.body.axis)


def _producer(program: Program, shared: str, axis: str) -> tuple[Program, tuple[tuple[str, int], ...]]:
    """The program computing `shared` for a chunk of `axis`: inputs indexed by the axis at a dim are
    cut there; elsewhere (comparisons, computed indices) the axis is offset by the chunk's start."""
    if not all(isinstance(node, Stage) for node in program.stages):
        raise FusionError(PASS, shared, "producer", "the program is already fused")
    stages = needed_stages(list(program.stages), {shared})  # type: ignore[arg-type]
    needed = {shared}.union(*(st.reads() for st in stages))
    sliced = tuple((b.name, b.dims.index(axis)) for b in program.inputs if axis in b.dims and b.name in needed)
    cut = {name for name, _ in sliced}
    staged = {st.name for st in stages}
    offset = Binary("add", Index(axis), Param(OFFSET_PARAM))

    def rewrite(expr: Expr) -> Expr:
        for node in walk(expr):
            if isinstance(node, Load) and node.buffer in cut:
                dim = dict(sliced)[node.buffer]
                if node.index[dim] != Index(axis):
                    raise FusionError(PASS, shared, f"load of {node.buffer!r}",
                                      f"it is read at a computed index of the chunked axis {axis!r}")

        return _shift(expr, axis, offset, dict(sliced), staged)

    body = [Stage(s.name, s.axes, rewrite(s.body)) for s in stages]
    inputs = tuple(b for b in program.inputs if b.name in needed)
    out = replace(program, name=f"{program.name}_{shared}", inputs=inputs,
                  params=(*[p for p in program.params if p in needed], OFFSET_PARAM, LENGTH_PARAM),
                  stages=tuple(body), outputs=(OutputSpec(shared, program.stage(shared).axes),),
                  param_kinds={**program.param_kinds, OFFSET_PARAM: "int", LENGTH_PARAM: "int"}, loop_axis=None)
    return out, sliced


def call_params(plan: Materialised) -> list[str]:
    """The producer's parameters that come from the call (not the chunk's offset and length)."""
    return [p for p in plan.producer.params if p not in (OFFSET_PARAM, LENGTH_PARAM)]


def chunk_arguments(plan: Materialised, named: dict[str, Any], start: int, n: int, whole: int) -> dict[str, Any]:
    """The producer's arguments for positions `start .. start + n` of the chunked axis (of length
    `whole`): the sliced inputs narrowed to them, the call's parameters, the offset and length."""
    cut = dict(plan.sliced)
    args = {b.name: named[b.name].narrow(cut[b.name], start, n) if b.name in cut else named[b.name]
            for b in plan.producer.inputs}
    args.update({p: named[p] for p in call_params(plan)})
    args[OFFSET_PARAM], args[LENGTH_PARAM] = start, whole
    return args


def _shift(expr: Expr, axis: str, offset: Expr, cut: dict[str, int], staged: set[str]) -> Expr:
    """`expr` with the chunked axis at its global position (`offset`) wherever it stands for one,
    and its size the whole axis's (`LENGTH_PARAM`): not inside a stage's index (stages are computed
    per chunk, in its local positions), not at the dim along which an input is cut, not under a
    reduction over an axis of that name."""
    if isinstance(expr, Index):
        return offset if expr.axis == axis else expr
    if isinstance(expr, Size) and expr.axis == axis:
        return Param(LENGTH_PARAM)
    if isinstance(expr, Load):
        if expr.buffer in staged:
            return expr
        return Load(expr.buffer, tuple(i if cut.get(expr.buffer) == k else _shift(i, axis, offset, cut, staged)
                                       for k, i in enumerate(expr.index)))
    if isinstance(expr, Reduce) and expr.axis == axis:
        return expr
    kids = expr.children()
    return rebuild(expr, tuple(_shift(k, axis, offset, cut, staged) for k in kids)) if kids else expr


__all__ = ["LENGTH_PARAM", "OFFSET_PARAM", "Contraction", "Materialised", "OneHot", "accumulates_in_fp32", "call_params",
           "chunk_arguments", "chunk_budget", "chunk_length", "materialise"]
