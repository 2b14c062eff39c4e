"""Partitioning a program into groups that each fuse into one kernel (Program -> Programs).

A kernel runs one fused loop over the axis of the program's main reduction chain and tiles the
axes of that chain's smallest reduction (its rows, its batch) across programs. A reduction over one
of those axes combines values that different programs compute, so it cannot sit in that kernel:
`z = softmax(x, axis=-1).sum(axis=0)` needs every row's max and sum finished before it sums over
rows. Such a reduction goes to a group of its own, before the main chain when the chain reads it
and after it otherwise, with everything downstream of it. The reductions one group reads from
another are materialised in device memory (fp32) and read back as inputs; elementwise stages are
recomputed where they are needed instead of being stored. Each group is an ordinary Program, fused
and compiled on its own (and partitioned again if it still needs it); the executable runs the
kernels in order.

Example:
    >>> # [p1, p2] = partition(program); p2.inputs include p1's materialised reductions
"""

from __future__ import annotations

from dataclasses import dataclass

from neptune_fusion.analysis.chains import chain_axis, transitive_reads
from neptune_fusion.ir.expr import Cast, Index, Load, Reduce
from neptune_fusion.ir.program import InputBuffer, OutputSpec, Program, Stage

MATERIALISED_PREFIX = "__mat_"


@dataclass(frozen=True)
class Group:
    """One kernel's program and what its outputs are, in order: `results[i]` names output i,
    either `output:<j>` (the whole program's output j) or a reduction later groups read."""

    program: Program
    results: tuple[str, ...]


def _reductions(program: Program) -> list[Stage]:
    return [st for st in program.stages if isinstance(st, Stage) and isinstance(st.body, Reduce)]


def _apart(program: Program) -> tuple[set[str], str] | None:
    """(stages for a later group, why) where the main chain's kernel cannot compute them all."""
    axis = chain_axis(program)
    if axis is None:
        return None
    chain = [st for st in _reductions(program) if st.reduce_axis == axis]
    # the axes of the chain's smallest reduction are its rows and batch, tiled across programs; the
    # others of its reductions (a head dim) are held in each program's tile (tile/lower.py `assign_roles`)
    tiled = set(min(chain, key=lambda st: len(st.axes)).axes)
    across = [st.name for st in _reductions(program) if st.reduce_axis != axis and st.reduce_axis in tiled]
    if not across:
        return None
    readers = {st.name: transitive_reads(program, st.name) for st in program.stages if isinstance(st, Stage)}
    upstream = [n for n in across if any(n in readers[c.name] for c in chain)]
    seeds = set(upstream) if upstream else set(across)
    late = {n for n, reads in readers.items() if reads & seeds}
    if not upstream:
        late |= seeds
    why = (f"the reduction(s) {sorted(seeds)} run over {sorted({program.stage(n).reduce_axis for n in seeds})}, "
           f"which the fused loop over {axis!r} tiles across programs")
    return late, why


def partition(program: Program) -> list[Group]:
    """Groups of `program` that each fit one kernel, in the order they must run."""
    found = _apart(program)
    if found is None:
        return [Group(program, tuple(f"output:{j}" for j in range(len(program.outputs))))]
    late, _ = found
    first, second = _split(program, late)
    if not first.program.stages or not second.program.stages:
        return [Group(program, tuple(f"output:{j}" for j in range(len(program.outputs))))]
    groups: list[Group] = []
    for part in (first, second):
        for sub in partition(part.program):
            groups.append(Group(sub.program, tuple(_resolve(r, part) for r in sub.results)))
    return groups


def why_apart(program: Program) -> str | None:
    """Why `program` needs more than one kernel (None when it does not)."""
    found = _apart(program)
    return None if found is None else found[1]


def _resolve(result: str, part: Group) -> str:
    """A result of a sub-group named in terms of the group it was partitioned from."""
    if result.startswith("output:"):
        return part.results[int(result.split(":")[1])]
    return result


def _split(program: Program, late: set[str]) -> tuple[Group, Group]:
    """(the stages outside `late`, the stages in `late` with the elementwise stages they need)."""
    stages = {st.name: st for st in program.stages if isinstance(st, Stage)}
    inputs = {b.name: b for b in program.inputs}
    boundary: list[str] = []  # reductions of the first group the second reads
    copied: set[str] = set()  # elementwise stages of the first group the second recomputes
    todo = [r for n in late for r in stages[n].reads()]
    while todo:
        name = todo.pop()
        if name in late or name in copied or name in boundary or name in inputs:
            continue
        if stages[name].reduce_op is None:
            copied.add(name)
            todo.extend(stages[name].reads())
        else:
            boundary.append(name)
    boundary.sort(key=list(stages).index)
    outputs = list(enumerate(program.outputs))
    early_out = [(j, o) for j, o in outputs if o.stage not in late]
    late_out = [(j, o) for j, o in outputs if o.stage in late]
    mats = [Stage(f"{MATERIALISED_PREFIX}{n}", stages[n].axes,
                  Cast(Load(n, tuple(Index(a) for a in stages[n].axes)), "f32")) for n in boundary]
    first_outputs = [o for _, o in early_out] + [OutputSpec(m.name, m.axes) for m in mats]
    first_stages = _needed([st for st in program.stages if isinstance(st, Stage) and st.name not in late] + mats,
                           {o.stage for o in first_outputs})
    first = _program(program, f"{program.name}_part1", first_stages, first_outputs, [])
    second_stages = [st for st in program.stages if isinstance(st, Stage) and (st.name in late or st.name in copied)]
    mat_inputs = [InputBuffer(n, stages[n].axes) for n in boundary]
    second = _program(program, f"{program.name}_part2", second_stages, [o for _, o in late_out], mat_inputs)
    return (Group(first, tuple(f"output:{j}" for j, _ in early_out) + tuple(boundary)),
            Group(second, tuple(f"output:{j}" for j, _ in late_out)))


def _needed(stages: list[Stage], roots: set[str]) -> list[Stage]:
    """The stages `roots` depend on, in order (dead stages of a group left out)."""
    by_name = {st.name: st for st in stages}
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep or name not in by_name:
            continue
        keep.add(name)
        todo.extend(by_name[name].reads())
    return [st for st in stages if st.name in keep]


def _program(program: Program, name: str, stages: list[Stage], outputs: list[OutputSpec],
             extra_inputs: list[InputBuffer]) -> Program:
    reads: set[str] = set()
    for st in stages:
        reads |= st.reads()
    inputs = tuple(b for b in program.inputs if b.name in reads) + tuple(extra_inputs)
    held = {b.name for b in inputs}
    axis_sizes = {a: src for a, src in program.axis_sizes.items() if src[0] in held}
    for b in extra_inputs:
        for dim, a in enumerate(b.dims):
            if a is not None:
                axis_sizes.setdefault(a, (b.name, dim))
    out = Program(name, inputs, program.params, tuple(stages), tuple(outputs), axis_sizes,
                  dict(program.param_kinds), dict(program.derived_axes))
    out.validate()
    return out
