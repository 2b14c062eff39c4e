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
    >>> import torch, neptune_fusion as nf
    >>> @nf.program
    ... def column_sum_of_softmax(x):
    ...     e = nf.exp(x - x.max(axis=-1, keepdims=True))
    ...     return (e / e.sum(axis=-1, keepdims=True)).sum(axis=0)
    >>> first, second = partition(column_sum_of_softmax.trace(torch.randn(4, 8)))
    >>> [b.name for b in second.program.inputs]     # the first kernel's row statistics, materialised
    ['x', 'max0', 'sum0']
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from neptune_fusion.analysis.chains import chain_axis, transitive_reads
from neptune_fusion.analysis.masks import conjuncts
from neptune_fusion.ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Size,
    Unary,
    Where,
    free_axes,
    product_factors,
    rename_reads,
    substitute_index,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import InputBuffer, OutputSpec, Program, Stage
from neptune_fusion.transform.distribute import distribute_constant_terms

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
    if axis is None or program.loop_axis is not None:
        return None  # (a program whose loop a transform chose is one kernel: partition_loops cut it)
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


def _main_chain(program: Program, long_axes: frozenset[str]) -> tuple[str, list[Stage], set[str]] | None:
    """(the main chain's axis, its reductions, every reduced axis) where some axis is too long for
    a tile and no transform chose the program's loop; None otherwise."""
    axis = chain_axis(program)
    if not long_axes or axis is None or program.loop_axis is not None:
        return None
    reductions = _reductions(program)
    return axis, [st for st in reductions if st.reduce_axis == axis], {st.reduce_axis for st in reductions}


def _recomputed_per_tile(program: Program, long_axes: frozenset[str]) -> tuple[set[str], str] | None:
    """(stages for a later group, why) where a reduction of the main chain lacks an axis that
    another of its reductions has and that is too long for a tile (`long_axes`, not reduced
    anywhere): that axis is tiled across the grid (schedule/tiles.py), and every one of its tiles
    would compute the reduction again (a norm's statistics under each tile of a matmul's output).
    An earlier kernel computes it once; the reductions reading it follow in a later one."""
    found = _main_chain(program, long_axes)
    if found is None:
        return None
    axis, chain, reduced = found
    tiled = {a for st in chain for a in st.axes if a in long_axes and a not in reduced}
    seeds = {st.name for st in chain if tiled - set(st.axes)}
    readers = {st.name: transitive_reads(program, st.name) for st in program.stages if isinstance(st, Stage)}
    upstream = set().union(*(readers[n] for n in seeds)) if seeds else set()
    if any(program.stage(n).reduce_op is not None for n in upstream - seeds if n in readers):
        # it reads a contraction (attention's scores under a softmax's max): the later kernel
        # computes that again for its own tiles, so an earlier one would add a pass, not save one
        return None
    # everything the earlier kernel does not need runs in the later one: the readers of its
    # reductions, and the reductions that have every tiled axis (a matmul beside its basis sum)
    late = {n for n in readers if n not in seeds and n not in upstream}
    if not seeds or not any(st.name in late and tiled & set(st.axes) for st in chain):
        return None
    why = (f"the reduction(s) {sorted(seeds)} over {axis!r} lack the axis {sorted(tiled)} that the grid tiles: "
           "computed once in an earlier kernel, not again under every tile of it")
    return late, why


def _tiled_apart(program: Program, long_axes: frozenset[str]) -> tuple[set[str], str] | None:
    """(stages for a later group, why) where reductions of the main chain keep different axes too
    long for a tile (`x @ wk` beside `x @ wv`): the grid would tile both, and each of its programs
    would compute each reduction again under every tile of the other's axis. The first reduction
    stays; those whose long axes are not nested with its own, and their readers, follow."""
    found = _main_chain(program, long_axes)
    if found is None:
        return None
    _, chain, reduced = found
    tiled = {st.name: {a for a in st.axes if a in long_axes and a not in reduced} for st in chain}
    readers = {st.name: transitive_reads(program, st.name) for st in program.stages if isinstance(st, Stage)}
    if len(chain) < 2:
        return None
    head = chain[0].name
    apart = {st.name for st in chain[1:]
             if not (tiled[st.name] <= tiled[head] or tiled[head] <= tiled[st.name])
             and head not in readers[st.name] and st.name not in readers[head]}
    if not apart:
        return None
    late = {n for n, reads in readers.items() if n in apart or reads & apart}
    return late, (f"the reduction(s) {sorted(apart)} keep long axes other than {head!r}'s "
                  f"({sorted(set().union(*(tiled[n] for n in apart)))} against {sorted(tiled[head])}): in one kernel "
                  "each would be computed again under every grid tile of the other's")


def _wide_outputs(program: Program) -> tuple[set[str], str] | None:
    """(outputs for a later group, why) where an output has more than one axis beyond the axes of
    the main chain's reductions (`x.sum() * y`): the fused loop's kernel writes at most one such
    axis (a second pass over its loop axis, or one more axis after the loop). A later kernel
    reads the reductions materialised and writes the output (an element-wise program). Also in a
    backward's kernel whose loop `partition_loops` chose (`x.mean()`'s gradient, spread over x)."""
    axis = program.loop_axis or chain_axis(program)
    if axis is None:
        return None
    covered = set().union(*(st.axes for st in _reductions(program) if st.reduce_axis == axis))
    reductions = {st.name for st in _reductions(program)}
    # (a reduction's value returned as it is, or cast, is written by that reduction's own loop)
    wide = {o.stage for o in program.outputs if len(set(program.stage(o.stage).axes) - covered) > 1
            and not _returns_reduction(program.stage(o.stage).body, reductions)}
    if not wide:
        return None
    return wide, (f"the output(s) {sorted(wide)} have more than one axis beyond those of the reductions over "
                  f"{axis!r}, which the fused loop's kernel cannot write")


def _returns_reduction(body: Expr, reductions: set[str]) -> bool:
    while isinstance(body, Cast):
        body = body.x
    return isinstance(body, Reduce) or (isinstance(body, Load) and body.buffer in reductions)


def _shifted_reads(program: Program) -> tuple[set[str], str] | None:
    """(stages for a later group, why) where a stage reads a reduction at indices other than its
    own axes (a slice's gradient reads its upstream one shifted): a kernel holds only its own
    rows of a reduction, so an earlier kernel writes it and the readers follow in a later one."""
    reductions = {st.name: st for st in _reductions(program)}
    # positions computed from the axes alone (a slice's, a concatenation's); a gathered position (a
    # target's class, read through a load) is the one-hot term the fused kernels compute themselves,
    # and a read under another axis's name (x @ x.T's) is a reduction the chain's kernels share
    shifted = {st.name: ld.buffer for st in program.stages if isinstance(st, Stage) for ld in walk(st.body)
               if isinstance(ld, Load) and ld.buffer in reductions
               and any(not isinstance(component, Index) for component in ld.index)
               and not any(isinstance(n, Load) for component in ld.index for n in walk(component))}
    if not shifted:
        return None
    readers = {st.name: transitive_reads(program, st.name) for st in program.stages if isinstance(st, Stage)}
    late = set(shifted) | {n for n, reads in readers.items() if reads & set(shifted)}
    return late, f"the stage(s) {sorted(shifted)} read {sorted(set(shifted.values()))} at other positions than their own"


def partition(program: Program, long_axes: frozenset[str] = frozenset(),
              narrow: frozenset[str] = frozenset()) -> list[Group]:
    """Groups of `program` that each fit one kernel, in the order they must run. `long_axes`: the
    axes too long to hold in a tile at the call's sizes (a reduction recomputed under each tile of
    one of them is computed once, in an earlier group). `narrow`: the inputs stored as 16-bit
    floats, whose contractions leave terms constant along them to a basis sum
    (transform/distribute.py) before the program is cut."""
    program = distribute_constant_terms(program, narrow)
    found = (_shifted_reads(program) or _apart(program) or _recomputed_per_tile(program, long_axes)
             or _tiled_apart(program, long_axes) or _wide_outputs(program))
    if found is None:
        return [Group(program, tuple(f"output:{j}" for j in range(len(program.outputs))))]
    late, _ = found
    first, second = _split(program, late)
    if not first.program.stages or not second.program.stages:
        return [Group(program, tuple(f"output:{j}" for j in range(len(program.outputs))))]
    groups: list[Group] = []
    for part in (first, second):
        for sub in partition(part.program, long_axes, narrow):
            groups.append(Group(sub.program, tuple(_resolve(r, part) for r in sub.results)))
    return groups


def split_at(program: Program, reduction: str) -> list[Group] | None:
    """Two groups where the reduction `reduction` cannot join the fused loop of the reductions it
    reads (no repair exists for its map, or it reads them through a stage the loop cannot hold):
    it and every stage that reads it run in a later kernel, which reads those reductions as
    materialised inputs and so needs no repair for them. None where `reduction` is not one of
    `program`'s reductions, or no other reduction would stay in the earlier kernel (cutting would
    not remove what failed).

    Example: a max of values scaled by a row sum of either sign (no monotone repair exists):
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def scaled_max(x):
        ...     return (x * x.sum(axis=-1, keepdims=True)).max(axis=-1)
        >>> first, second = split_at(scaled_max.trace(torch.randn(4, 8)), "max0")
        >>> [b.name for b in second.program.inputs]
        ['x', 'sum0']
    """
    stages = {st.name: st for st in program.stages if isinstance(st, Stage)}
    if reduction not in stages or stages[reduction].reduce_op is None:
        return None
    late = {n for n in stages if n == reduction or reduction in transitive_reads(program, n)}
    if not any(st.reduce_op is not None and n not in late for n, st in stages.items()):
        return None
    return _both_parts(program, late)


def split_unrelated(program: Program) -> list[Group] | None:
    """Two groups where `program` holds reductions that neither read each other nor share their
    axes (projections of one input, `x @ wq` and `x @ wk`): one kernel's tile would hold the union
    of their output axes. The first reduction and what it relates to stay; the others and every
    stage that reads them follow in a later kernel. None where every reduction relates to the first.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def two_projections(x, a, b):
        ...     return x @ a, x @ b
        >>> first, second = split_unrelated(two_projections.trace(*(torch.randn(4, 4) for _ in range(3))))
        >>> [len(g.program.outputs) for g in (first, second)]
        [1, 1]
    """
    reductions = _reductions(program)
    if len(reductions) < 2:
        return None
    reads = {st.name: transitive_reads(program, st.name) for st in program.stages if isinstance(st, Stage)}
    head = reductions[0]

    def related(st: Stage) -> bool:
        nested = set(st.axes) <= set(head.axes) or set(head.axes) <= set(st.axes)
        return head.name in reads[st.name] or st.name in reads[head.name] or nested

    unrelated = {st.name for st in reductions[1:] if not related(st)}
    if not unrelated:
        return None
    late = {n for n, r in reads.items() if n in unrelated or r & unrelated}
    return _both_parts(program, late)


def split_conflicting(program: Program, axis: str) -> list[Group] | None:
    """Two groups where `axis` is summed over by some reductions and is an output axis of others
    that neither read (a weight's gradient `sum_a g[a, z] * h[a, y]` beside a norm's backward
    `sum_z g[a, z] * w[z, y]`): one kernel would have to hold the axis whole. The reductions that
    keep it as an output axis, and every stage that reads them, follow in a later kernel; where
    they read the summing ones instead, those go later. None where the two sides read each other,
    no reduction would stay in the first kernel, or the later kernel would read a reduction the
    first one materialises (linear cross-entropy's logits: its backward is chunked instead,
    schedule/materialise.py).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def both_ways(g, w, h):
        ...     return nf.einsum("az,zy->ay", g, w).sum(axis=0), nf.einsum("az,ay->zy", g, h)
        >>> first, second = split_conflicting(both_ways.trace(*(torch.randn(4, 4) for _ in range(3))), "z")
        >>> [len(o.dims) for o in first.program.outputs], [len(o.dims) for o in second.program.outputs]
        ([1], [2])
    """
    stages = {st.name: st for st in program.stages if isinstance(st, Stage)}
    reads = {n: transitive_reads(program, n) for n in stages}
    summing = {n for n, st in stages.items()
               if any(isinstance(node, Reduce) and node.axis == axis for node in walk(st.body))}
    keeping = {n for n, st in stages.items() if axis in st.axes and st.reduce_op is not None} - summing
    if not summing or not keeping:
        return None
    for late_seeds, early in ((keeping, summing), (summing, keeping)):
        late = {n for n in stages if n in late_seeds or reads[n] & late_seeds}
        if late & early or not any(stages[n].reduce_op is not None for n in stages if n not in late):
            continue
        first, second = _split(program, late)
        if first.program.stages and second.program.stages and all(r.startswith("output:") for r in first.results):
            return [first, second]
    return None


def split_independent(program: Program) -> list[Group] | None:
    """Two groups where reductions over different axes neither read each other (a weight's
    gradient summed over tokens beside a norm weight's summed over the batch): the first
    reduction and those it relates to stay; the others and their readers follow in a later kernel.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def both(g, h, v):
        ...     return nf.einsum("btz,bty->bzy", g, h), v.sum(axis=0)
        >>> first, second = split_independent(both.trace(torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(2, 5)))
        >>> [len(g.program.outputs) for g in (first, second)]
        [1, 1]
    """
    reductions = _reductions(program)
    if not reductions:
        return None
    reads = {st.name: transitive_reads(program, st.name) for st in program.stages if isinstance(st, Stage)}
    head = reductions[0]
    apart = {st.name for st in reductions[1:] if st.reduce_axis != head.reduce_axis
             and head.name not in reads[st.name] and st.name not in reads[head.name]}
    late = {n for n, r in reads.items() if n in apart or r & apart}
    if not apart or head.name in late:
        return None
    return _both_parts(program, late)


def split_chained(program: Program) -> list[Group] | None:
    """Two groups where a reduction reads another (a weight's gradient summed over a batch axis
    after its sum over tokens: one loop would hold the inner sum's axis whole beside the outer's):
    the last such reduction and its readers follow in a later kernel, which reads the other
    finished. None where no reduction reads another.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def batch_summed(g, h):
        ...     return nf.einsum("btz,bty->bzy", g, h).sum(axis=0)
        >>> first, second = split_chained(batch_summed.trace(torch.randn(2, 3, 4), torch.randn(2, 3, 5)))
        >>> [b.name for b in second.program.inputs]
        ['dot0']
    """
    stages = [st for st in program.stages if isinstance(st, Stage)]
    reductions = {st.name for st in stages if st.reduce_op is not None}
    for st in reversed(stages):
        if st.reduce_op is not None and transitive_reads(program, st.name) & reductions:
            return split_at(program, st.name)
    return None


def split_to_fit(program: Program, long_axes: frozenset[str], any_reductions: bool = True
                 ) -> tuple[list[Group], str] | None:
    """Groups for a program whose one kernel's tile cannot be planned, and why they run apart:
    reductions that share no axes (`split_unrelated`), else an axis too long to hold (`long_axes`)
    summed by some reductions and kept by others (`split_conflicting`), else, with `any_reductions`,
    reductions over different axes (`split_independent`) or a reduction that reads another
    (`split_chained`). None where none applies.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def two_projections(x, a, b):
        ...     return x @ a, x @ b
        >>> groups, why = split_to_fit(two_projections.trace(*(torch.randn(4, 4) for _ in range(3))), frozenset())
        >>> len(groups), why
        (2, 'reductions that share no axes run apart')
    """
    apart = split_unrelated(program)
    if apart is not None:
        return apart, "reductions that share no axes run apart"
    axes = dict.fromkeys(a for st in program.stages if isinstance(st, Stage) for a in st.axes if a in long_axes)
    for axis in axes:
        apart = split_conflicting(program, axis)
        if apart is not None:
            return apart, f"the reductions summing over axis {axis!r} and those keeping it run apart"
    if not any_reductions:
        return None
    apart = split_independent(program)
    if apart is not None:
        return apart, "reductions over different axes that do not read each other run apart"
    apart = split_chained(program)
    if apart is not None:
        return apart, "a reduction that reads another runs in a later kernel"
    return None


def why_apart(program: Program, long_axes: frozenset[str] = frozenset(),
              narrow: frozenset[str] = frozenset()) -> str | None:
    """Why `program` needs more than one kernel (None when it does not)."""
    program = distribute_constant_terms(program, narrow)
    found = (_shifted_reads(program) or _apart(program) or _recomputed_per_tile(program, long_axes)
             or _tiled_apart(program, long_axes) or _wide_outputs(program))
    return None if found is None else found[1]


def _resolve(result: str, part: Group) -> str:
    """A result of a sub-group named in terms of the group it was partitioned from."""
    if result.startswith("output:"):
        return part.results[int(result.split(":")[1])]
    return result


def _fresh(name: str, taken: set[str]) -> str:
    """`name`, or `name_k` with the first k that no stage in `taken` has (added to `taken`)."""
    k, fresh = 0, name
    while fresh in taken:
        k += 1
        fresh = f"{name}_{k}"
    taken.add(fresh)
    return fresh


def _both_parts(program: Program, late: set[str]) -> list[Group] | None:
    """`_split(program, late)`'s two groups, or None where either would hold no stage."""
    first, second = _split(program, late)
    if not first.program.stages or not second.program.stages:
        return None
    return [first, second]


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
    # a reduction the first part returns as it stands (cast at its own axes: a training forward's
    # saved statistic in fp32, a saved projection in its 16-bit dtype, as model code's own tensor
    # holds it) is read from that output, known by its stage's name, not written twice
    returned = {body.x.buffer: o.stage for _, o in early_out
                if isinstance(body := stages[o.stage].body, Cast) and isinstance(body.x, Load)
                and body.x.buffer in boundary and body.x.index == tuple(Index(a) for a in stages[o.stage].axes)}
    boundary = [n for n in boundary if n not in returned]
    taken = set(stages)  # a part of a part may already write `__mat_n` for the groups after its whole
    mats = [Stage(_fresh(f"{MATERIALISED_PREFIX}{n}", taken), stages[n].axes,
                  Cast(Load(n, tuple(Index(a) for a in stages[n].axes)), "f32")) for n in boundary]
    first_outputs = [o for _, o in early_out] + [OutputSpec(m.name, m.axes) for m in mats]
    first_stages = needed_stages([st for st in program.stages if isinstance(st, Stage) and st.name not in late] + mats,
                           {o.stage for o in first_outputs})
    first = subprogram(program, f"{program.name}_part1", first_stages, first_outputs, [])
    second_stages = [replace(st, body=rename_reads(st.body, returned)) for st in program.stages
                     if isinstance(st, Stage) and (st.name in late or st.name in copied)]
    mat_inputs = [InputBuffer(n, stages[n].axes) for n in boundary]
    mat_inputs += [InputBuffer(out, stages[out].axes) for out in returned.values()]
    second = subprogram(program, f"{program.name}_part2", second_stages, [o for _, o in late_out], mat_inputs)
    return (Group(first, tuple(f"output:{j}" for j, _ in early_out) + tuple(boundary)),
            Group(second, tuple(f"output:{j}" for j, _ in late_out)))


def read_only_as_contraction_factor(program: Program, buffer: str) -> bool:
    """Whether `program` reads `buffer` only as a factor of products summed over an axis the read
    varies along (a contraction's operand, which the kernel multiplies in the dots' dtype), read
    directly or through element-wise stages that only re-index it (views), and at least once.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def project_then_scale(h, w, c):
        ...     return (h @ w) * c
        >>> program = project_then_scale.trace(*(torch.randn(4, 4) for _ in range(3)))
        >>> read_only_as_contraction_factor(program, "w"), read_only_as_contraction_factor(program, "c")
        (True, False)
    """
    stages = [st for st in program.stages if isinstance(st, Stage)]
    aliases = {buffer}
    for st in stages:  # in program order: a view of a view follows the one it reads
        if st.reduce_op is None and isinstance(st.body, Load) and st.body.buffer in aliases:
            aliases.add(st.name)
    if any(o.stage in aliases for o in program.outputs):
        return False
    found = False

    def factor_reads(expr: Any, summed: str | None) -> bool:
        nonlocal found
        if isinstance(expr, Load) and expr.buffer in aliases:
            found = True
            return summed is not None and summed in free_axes(expr)
        if isinstance(expr, Binary) and expr.op == "mul":
            return factor_reads(expr.a, summed) and factor_reads(expr.b, summed)
        if isinstance(expr, Where) and Const(0.0) in (expr.a, expr.b):
            # a factor set to 0 where a guard holds is still a factor: where(c, 0, x) * y = where(c, 0, x * y)
            value = expr.b if expr.a == Const(0.0) else expr.a
            return factor_reads(expr.cond, None) and factor_reads(value, summed)
        if isinstance(expr, Reduce):
            return factor_reads(expr.body, expr.axis if expr.op == "sum" else None)
        return all(factor_reads(child, None) for child in expr.children())

    return all(factor_reads(st.body, None) for st in stages if st.name not in aliases) and found


def is_product_of_operands(program: Program, name: str) -> bool:
    """Whether stage `name` is a matrix product: a sum over k of loaded factors, two of which each
    keep an axis of the result the other lacks (`x @ w`, not `(x * x).sum(-1)` nor `x @ v`).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def both(x, w):
        ...     return x @ w, (x * x).sum(axis=-1)
        >>> program = both.trace(torch.randn(4, 4), torch.randn(4, 4))
        >>> is_product_of_operands(program, "dot0"), is_product_of_operands(program, "sum0")
        (True, False)
    """
    body = program.stage(name).body
    if not (isinstance(body, Reduce) and body.op == "sum"):
        return False
    factors, _ = product_factors(body.body)
    if not all(isinstance(f, Load) for f in factors):
        return False  # a computed factor (exp(s - m) of attention's weights): not a plain product
    axes = [free_axes(f) for f in factors]
    kept = set(program.stage(name).axes)
    return any((a - b) & kept and (b - a) & kept for a in axes for b in axes)


def narrow_materialised(groups: list[Group], dtype: str) -> list[Group]:
    """`groups` with each reduction one group writes for later ones in `dtype` (a 16-bit float),
    not fp32, where every later group reads it only as a contraction's factor (those multiply
    their operands in `dtype` anyway: the result is the same, the traffic half), or where it is a
    matrix product (`is_product_of_operands`), which model code's own tensors hold in their dtype
    (a projection written for the attention or the activation after it); normalisers, statistics
    and partial sums stay fp32.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def two_projections(x, a, b):
        ...     return (x @ a) @ b
        >>> program = two_projections.trace(*(torch.randn(4, 4) for _ in range(3)))
        >>> first, second = split_at(program, "dot1")
        >>> narrowed = narrow_materialised([first, second], "f16")
        >>> narrowed[0].program.stage("__mat_dot0").body.dtype
        'f16'
    """
    out: list[Group] = []
    for k, group in enumerate(groups):
        program = group.program
        written = dict(zip(group.results, (o.stage for o in program.outputs)))
        # what the group returns to its caller keeps the dtype the caller compiled for
        returned = {stage for r, stage in written.items() if r.startswith("output:")}
        own = {st.name for st in program.stages}
        narrowed = set()
        for result, stage in written.items():
            if result.startswith("output:") or stage in returned or not isinstance(program.stage(stage).body, Cast):
                continue
            readers = [g.program for g in groups[k + 1:] if any(b.name == result for b in g.program.inputs)]
            if readers and ((result in own and is_product_of_operands(program, result))
                            or all(read_only_as_contraction_factor(p, result) for p in readers)):
                narrowed.add(stage)
        if narrowed:
            program = replace(program, stages=tuple(
                replace(st, body=replace(st.body, dtype=dtype)) if st.name in narrowed else st
                for st in program.stages))
        out.append(Group(program, group.results))
    return out


def needed_stages(stages: list[Stage], roots: set[str]) -> list[Stage]:
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


SIZE_PARAM_PREFIX = "size_of_"


def size_param(axis: str) -> str:
    """The parameter a kernel of `subprogram` reads an axis length from that its inputs do not give."""
    return SIZE_PARAM_PREFIX + axis


def length_axes(part: Program, whole: Program) -> dict[str, str]:
    """The axes whose lengths `part` (a `subprogram` of `whole`) reads as parameters, by parameter."""
    return {p: p.removeprefix(SIZE_PARAM_PREFIX) for p in part.params
            if p.startswith(SIZE_PARAM_PREFIX) and p not in whole.params}


def subprogram(program: Program, name: str, stages: list[Stage], outputs: list[OutputSpec],
             extra_inputs: list[InputBuffer]) -> Program:
    """`program`'s `stages` with these outputs, as a program of its own: the inputs they read (and
    `extra_inputs`, values another kernel writes), the axis sizes those give."""
    reads: set[str] = set()
    for st in stages:
        reads |= st.reads()
    extra_names = {b.name for b in extra_inputs}
    inputs = tuple(b for b in program.inputs if b.name in reads and b.name not in extra_names) + tuple(extra_inputs)
    # an axis none of the inputs read gives (an output's, where a reshape's gradient reads another
    # buffer) comes with the input that gives its size, passed for its shape
    axes = {a for st in stages for a in (*st.axes, *(n.axis for n in walk(st.body) if isinstance(n, (Reduce, Index, Size))))}
    for a in sorted(axes):  # an axis derived from another (an alias's extent) needs that one's size
        rule = program.derived_axes.get(a)
        if rule is not None and rule[0] != "const":
            axes |= {b for b in rule[1:] if isinstance(b, str)}
    derived = {a: rule for a, rule in program.derived_axes.items() if a in axes}
    givers = {b.name for b in inputs} | extra_names
    given = {a for a, src in program.axis_sizes.items() if src[0] in givers}
    given |= {a for b in extra_inputs for a in b.dims if a is not None}
    given |= {a for a, rule in program.derived_axes.items() if rule[0] == "const"}
    shapes = sorted({program.axis_sizes[a][0] for a in axes - given if a in program.axis_sizes}
                    & {b.name for b in program.inputs})
    inputs += tuple(b for b in program.inputs if b.name in shapes)
    held = {b.name for b in inputs}
    axis_sizes = {a: src for a, src in program.axis_sizes.items() if src[0] in held}
    for b in extra_inputs:
        for dim, a in enumerate(b.dims):
            if a is not None:
                axis_sizes.setdefault(a, (b.name, dim))
    # an axis sized by an input this part does not read (an alias of another axis, x @ x.T's
    # second x) takes its size from an axis of the same source that this part holds
    for a, src in program.axis_sizes.items():
        same = [axis_sizes[b] for b, other in program.axis_sizes.items() if other == src and b in axis_sizes]
        if a not in axis_sizes and same:
            axis_sizes[a] = same[0]
    # the length of an axis none of these inputs has (a mean over an axis an earlier kernel summed)
    # comes in as an integer parameter, `size_param(axis)`, which the caller passes with each call
    sized = sorted({n.axis for st in stages for n in walk(st.body) if isinstance(n, Size)} - set(axis_sizes))
    params, kinds = program.params, dict(program.param_kinds)
    if sized:
        swap = {Size(a): Param(size_param(a)) for a in sized}
        stages = [replace(st, body=transform_bottom_up(st.body, swap.get)) for st in stages]
        params = (*params, *(size_param(a) for a in sized))
        kinds.update({size_param(a): "int" for a in sized})
    loops = {st.reduce_axis for st in stages if st.reduce_op is not None}
    out = Program(name, inputs, params, tuple(stages), tuple(outputs), axis_sizes, kinds, derived,
                  program.loop_axis if program.loop_axis in loops else None)
    out.validate()
    return out


def partition_loops(program: Program, held: frozenset[str]) -> list[Group]:
    """Groups of a program whose reductions loop over several axes (a backward pass: dQ sums over
    keys, dK and dV over queries), one kernel per loop.

    A reduction over a `held` axis (one the tiles hold whole or K-loop over: a head dim) whose
    axes include the loop axis of every kernel that reads it, and that is larger than every
    tensor the program holds, is recomputed inside those kernels, as scores are. Every other
    reduction is a loop of its own: those over the same axis, with the same axes apart from held
    ones, share a kernel (`_kernels`); what a kernel reads from an earlier one is materialised
    (fp32). An element-wise output goes with the last kernel it reads (or, reading none, into a
    group without a reduction); an element-wise operand that contractions of several kernels
    read is written once by a kernel of its own (`_written_once`).

    Example:
        >>> import torch
        >>> from neptune_fusion.library import attention
        >>> from neptune_fusion.transform.grad import differentiate
        >>> q = torch.randn(1, 2, 8, 4)
        >>> grad = differentiate(attention.trace(q, q, q, scale=0.5), ("q", "k", "v"))
        >>> [g.program.loop_axis for g in partition_loops(grad.backward, grad.held)]   # D, dK + dV, dQ
        ['d2', 'q', 'k']
    """
    stages = [st for st in program.stages if isinstance(st, Stage)]
    by_name = {st.name: st for st in stages}
    outputs = {o.stage for o in program.outputs}
    order = [st.name for st in stages]
    # a reduction not in `loops` is computed again inside each kernel that reads it
    loops: dict[str, tuple[str, frozenset[str]]] = {}  # loop reduction -> (axis, axes apart from held)

    def readers_through(name: str) -> set[str]:
        """The loop reductions that read `name`, through element-wise and recomputed stages."""
        found: set[str] = set()
        todo = [name]
        while todo:
            cur = todo.pop()
            for st in stages:
                if cur in st.reads() and st.name not in found:
                    if st.name in loops:
                        found.add(st.name)
                    else:
                        todo.append(st.name)
        return found

    # a reduction read at other positions than its own (through a reshape) is computed by a kernel
    # of its own: a kernel holds only its own rows of what it computes
    reductions = {st.name for st in stages if st.reduce_op is not None}
    shifted = {r for st in stages for r in _shifted_loads(st.name, by_name, reductions)}
    tied = _tie_tested(by_name, reductions)
    for st in reversed(stages):
        if st.reduce_op is None:
            continue
        readers = readers_through(st.name)
        # a reduction no larger than a tensor the program holds (dh's sum over a hidden axis, not
        # the logits) costs no more memory than that tensor: it is computed once, where recomputing
        # it in each kernel that reads it would redo a whole matmul when the axis is K-looped
        # (one a tie test compares, `x == max`, is computed once: values another kernel recomputed
        # in its own order could round apart from the max and miss every tie)
        if (st.name in outputs or st.name in shifted or st.name in tied or st.reduce_axis not in held or not readers
                or any(by_name[r].reduce_axis not in _axes_read_at(by_name[r].body, st.name, by_name, loops)
                       for r in readers)
                or program.holds_as_large(st.axes)):
            loops[st.name] = (st.reduce_axis, frozenset(st.axes) - held)

    written_once: set[str] = set()
    for st in reversed(stages):  # readers first: a stage only a shared one reads stays in its kernel
        if _written_once(program, st, by_name, loops, readers_through):
            loops[st.name] = (f"{SHARED_KEY}{st.name}", frozenset(st.axes))  # a kernel of its own
            written_once.add(st.name)
    if written_once:
        program = _unguarded_reads(program, written_once)

    def loop_reads(name: str) -> set[str]:
        """The loop reductions `name` reads, through element-wise and recomputed stages."""
        found: set[str] = set()
        todo = list(by_name[name].reads())
        while todo:
            cur = todo.pop()
            if cur in loops:
                found.add(cur)
            elif cur in by_name and cur not in found:
                found.add(cur)
                todo.extend(by_name[cur].reads())
        return found & set(loops)

    program = _loops_over_copies_shared(program, loops, loop_reads)
    by_name = {st.name: st for st in program.stages if isinstance(st, Stage)}
    kernels = _kernels(order, loops, loop_reads)
    kernel_of = {m: i for i, members in enumerate(kernels) for m in members}
    extra: dict[int, list[str]] = {}  # element-wise outputs, by the kernel they go with
    for name in order:
        if name in outputs and by_name[name].reduce_op is None:
            read = loop_reads(name)
            # one that reads a reduction at other positions than its own (a reshape's gradient)
            last = len(kernels) if _shifted_loads(name, by_name, set(loops)) else max(  # after them all
                (kernel_of[r] for r in read), default=len(kernels))
            extra.setdefault(last, []).append(name)
    groups: list[Group] = []
    later_reads = {n for name in order for n in loop_reads(name)}
    for i in range(len(kernels) + 1):
        members = (kernels[i] if i < len(kernels) else []) + extra.get(i, [])
        if members:
            groups.append(_loop_group(program, members, set(loops) - set(members), later_reads, i))
    return groups


# the loop key of an element-wise stage written once for the kernels that read it (`_written_once`)
SHARED_KEY = "written once: "


def _tie_tested(by_name: dict[str, Stage], reductions: set[str]) -> set[str]:
    """The reductions whose values an equality between two computed values reads (a max's tie
    test `x == max`), directly or through element-wise stages."""
    found: set[str] = set()
    todo = [n.buffer for st in by_name.values() for c in walk(st.body)
            if isinstance(c, Binary) and c.op == "eq" and not isinstance(c.a, Const) and not isinstance(c.b, Const)
            for n in walk(c) if isinstance(n, Load)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        if name in reductions:
            found.add(name)
        else:
            todo.extend(by_name[name].reads())
    return found


def _written_once(program: Program, stage: Stage, by_name: dict[str, Stage],
                  loops: dict[str, tuple[str, frozenset[str]]], readers_through: Callable[[str], set[str]]) -> bool:
    """Whether the element-wise `stage` is written once for the kernels that read it, not computed
    again in each: an operand of contractions (`read_only_as_contraction_factor`) in at least two
    kernels, no larger than a tensor the program holds (never a score matrix), computed from what
    those kernels read anyway (inputs and loop reductions, not a reduction each would recompute),
    from at least two loads of its own size. Written once and read back by n kernels, it moves
    n + 1 tensors of its size; computed again, at least 2n (a SwiGLU gradient, the operand of the
    GEMMs of dx and of the weight, gathers four)."""
    if (stage.reduce_op is not None or len({loops[r] for r in readers_through(stage.name)}) < 2
            or not program.holds_as_large(stage.axes) or not read_only_as_contraction_factor(program, stage.name)):
        return False
    loads: set[Load] = set()
    todo: list[tuple[Expr, frozenset[str]]] = [(stage.body, frozenset({stage.name}))]
    while todo:
        expr, seen = todo.pop()
        for load in walk(expr):
            if not isinstance(load, Load):
                continue
            source = by_name.get(load.buffer)
            if source is None or load.buffer in loops:
                loads.add(load)
            elif source.reduce_op is not None or load.buffer in seen:
                return False  # a reduction each reader computes again: nothing to write once
            else:
                todo.append((substitute_index(source.body, dict(zip(source.axes, load.index))), seen | {load.buffer}))
    full = [load for load in loads if set().union(*(free_axes(i) for i in load.index)) >= set(stage.axes)]
    return len(full) >= 2


def _zero_unless(body: Expr) -> list[Expr] | None:
    """Conditions under all of which `body` is exactly 0, read off its where()s: a sum of
    `where(a_i, x_i, 0)` is 0 where every `~a_i` holds (whatever x_i is, NaN included)."""
    if isinstance(body, Where) and body.b == Const(0.0):
        return [Unary("not", body.cond)]
    if isinstance(body, Where) and body.a == Const(0.0):
        return [body.cond]
    if isinstance(body, Binary) and body.op in ("add", "sub"):
        a, b = _zero_unless(body.a), _zero_unless(body.b)
        return None if a is None or b is None else a + b
    if isinstance(body, Binary) and body.op == "mul":
        return _zero_unless(body.a) or _zero_unless(body.b)
    return None


def _unguarded_reads(program: Program, written: set[str]) -> Program:
    """`where(c, 0, e[i])` -> `e[i]` for the stages `written` for later kernels, where `e` is 0
    wherever `c` holds anyway (a chunk's gradient, guarded again where its reader sums it): the
    reader then takes the written tensor as it stands, a GEMM's operand cuBLAS reads directly.

    Example:
        >>> inside = Binary("lt", Index("j"), Const(4))
        >>> e = Stage("e", ("i", "j"), Where(inside, Load("x", (Index("i"), Index("j"))), Const(0.0)))
        >>> guarded = Where(Unary("not", inside), Const(0.0), Load("e", (Index("i"), Index("j"))))
        >>> s = Stage("s", ("i",), Reduce("sum", "j", guarded))
        >>> prog = Program("p", (InputBuffer("x", ("i", "j")),), (), (e, s), (OutputSpec("s", ("i",)),))
        >>> _unguarded_reads(prog, {"e"}).stage("s").body.body
        Load(buffer='e', index=(Index(axis='i'), Index(axis='j')))
    """
    by_name = {st.name: st for st in program.stages if isinstance(st, Stage)}

    def unguard(node: Expr) -> Expr | None:
        if not (isinstance(node, Where) and node.a == Const(0.0) and isinstance(node.b, Load)
                and node.b.buffer in written):
            return None
        stage = by_name[node.b.buffer]
        zero = _zero_unless(substitute_index(stage.body, dict(zip(stage.axes, node.b.index))))
        held = conjuncts(node.cond)
        return node.b if zero is not None and all(z in held for z in zero) else None

    return program.with_stages([replace(st, body=transform_bottom_up(st.body, unguard))
                                if isinstance(st, Stage) and st.name not in written else st
                                for st in program.stages])


def _loops_over_copies_shared(program: Program, loops: dict[str, tuple[str, frozenset[str]]],
                              loop_reads: Callable[[str], set[str]]) -> Program:
    """`program` with the loop reductions over copies of one axis (an axis the backward renamed
    apart, of the same extent: dK's and dV's sums over the queries of a projection) that have the
    same other axes summing over one name, so that they share a kernel and its loop; `loops`
    is updated. One that reads the other, or in whose body the name is free, keeps its own.

    Example:
        >>> x = Load("x", (Index("i"), Index("j")))
        >>> dk = Stage("dk", ("j",), Reduce("sum", "i_sum", substitute_index(x, {"i": Index("i_sum")})))
        >>> dv = Stage("dv", ("j",), Reduce("sum", "i_sum_1", substitute_index(x * x, {"i": Index("i_sum_1")})))
        >>> prog = Program("p", (InputBuffer("x", ("i", "j")),), (), (dk, dv), (OutputSpec("dk", ("j",)), OutputSpec("dv", ("j",))),
        ...                derived_axes={"i_sum": ("mulc", "i", 1), "i_sum_1": ("mulc", "i", 1)})
        >>> loops = {"dk": ("i_sum", frozenset({"j"})), "dv": ("i_sum_1", frozenset({"j"}))}
        >>> [st.reduce_axis for st in _loops_over_copies_shared(prog, loops, lambda name: set()).stages]
        ['i_sum', 'i_sum']
    """
    def extent_of(axis: str) -> str:
        while (how := program.derived_axes.get(axis)) is not None and how[0] == "mulc" and how[2] == 1:
            axis = str(how[1])
        return axis

    first: dict[tuple[str, frozenset[str]], str] = {}  # (extent, other axes) -> the loop named first
    renamed: dict[str, str] = {}
    for st in program.stages:
        if not isinstance(st, Stage) or st.name not in loops:
            continue
        axis, others = loops[st.name]
        key = (extent_of(axis), others)
        if key not in first:
            first[key] = st.name
            continue
        lead = first[key]
        target = loops[lead][0]
        if (target != axis and target not in free_axes(st.body) and lead not in loop_reads(st.name)
                and st.name not in loop_reads(lead)):
            renamed[st.name] = target
            loops[st.name] = (target, others)
    if not renamed:
        return program
    stages = []
    for st in program.stages:
        if isinstance(st, Stage) and st.name in renamed and isinstance(st.body, Reduce):
            body = Reduce(st.body.op, renamed[st.name], substitute_index(st.body.body, {st.body.axis: Index(renamed[st.name])}))
            st = replace(st, body=body)
        stages.append(st)
    return program.with_stages(stages)


def _axes_read_at(expr: Expr, name: str, by_name: dict[str, Stage], loops: dict[str, Any]) -> set[str]:
    """The axes of the positions at which `expr` reads `name`, directly or through stages computed
    again where they are read (not in `loops`): dK's sum over queries reads the scores S[q, k] of a
    projection written once for both as S[k_sum, k], at its loop axis.

    Example:
        >>> s = Stage("s", ("i", "j"), Reduce("sum", "d", Load("x", (Index("i"), Index("d")))))
        >>> e = Stage("e", ("i", "j"), Load("s", (Index("i"), Index("j"))))
        >>> sorted(_axes_read_at(Load("e", (Index("j"), Index("i_sum"))), "s", {"s": s, "e": e}, {}))
        ['i_sum', 'j']
    """
    found: set[str] = set()
    for load in walk(expr):
        if not isinstance(load, Load):
            continue
        if load.buffer == name:
            found |= set().union(*(free_axes(i) for i in load.index))
        elif load.buffer in by_name and load.buffer not in loops:
            stage = by_name[load.buffer]
            at = substitute_index(stage.body, dict(zip(stage.axes, load.index)))
            found |= _axes_read_at(at, name, by_name, loops)
    return found


def _shifted_loads(name: str, by_name: dict[str, Stage], reductions: set[str]) -> set[str]:
    """The `reductions` that stage `name` reads at positions that are not plain axes, directly or
    through element-wise stages (one read at such positions shifts what it reads too)."""
    todo, seen, found = [(name, False)], set(), set()
    while todo:
        current, shifted = todo.pop()
        stage = by_name.get(current)
        if stage is None or (current, shifted) in seen:
            continue
        seen.add((current, shifted))
        for load in walk(stage.body):
            if not isinstance(load, Load):
                continue
            moved = shifted or any(not isinstance(component, Index) for component in load.index)
            if load.buffer in reductions:
                if moved:
                    found.add(load.buffer)
            elif load.buffer in by_name and by_name[load.buffer].reduce_op is None:
                todo.append((load.buffer, moved))
    return found


def _kernels(order: list[str], loops: dict[str, tuple[str, frozenset[str]]],
             loop_reads: Callable[[str], set[str]]) -> list[list[str]]:
    """The loop reductions by kernel, in the order the kernels run: one kernel per (loop axis,
    tiled axes), unless the kernels would then read each other's results in a cycle; then the
    kernels of the cycle also by depth in the dependency order (those outside it stay whole: dK's
    and dV's sums share their loop while the forward's recomputed statistics and dQ, which reads
    them through D, part)."""
    reads = {name: loop_reads(name) for name in loops}

    def graph_of(keys: dict[str, Any]) -> dict[Any, set[Any]]:
        graph: dict[Any, set[Any]] = {key: set() for key in keys.values()}
        for name, key in keys.items():
            graph[key] |= {keys[r] for r in reads[name]} - {key}
        return graph

    def ranked(keys: dict[str, Any]) -> list[list[str]] | None:
        ordered = _topological(graph_of(keys))
        return None if ordered is None else [[n for n in order if keys.get(n) == key] for key in ordered]

    found = ranked(dict(loops))
    if found is None:  # a cycle between kernels: split those on one by depth
        # counted in reads of other kernels' reductions: a max and the sums that read it (a
        # softmax's statistics) stay in one loop, as the forward computes them
        depth: dict[str, int] = {}
        for name in order:
            if name in loops:
                depth[name] = max((depth[r] + (loops[r] != loops[name]) for r in reads[name]), default=0)
        cyclic = _on_a_cycle(graph_of(dict(loops)))
        found = ranked({name: (depth[name], *key) if key in cyclic else key for name, key in loops.items()})
        # depth never decreases along a read and increases along one between kernels: no cycle is left
        assert found is not None
    return found


def _on_a_cycle(graph: dict[Any, set[Any]]) -> set[Any]:
    """The keys of `graph` (key -> keys it reads) that reach themselves.

    Example:
        >>> sorted(_on_a_cycle({"a": {"b"}, "b": {"a"}, "c": {"a"}}))
        ['a', 'b']
    """
    def reached(start: Any) -> set[Any]:
        seen: set[Any] = set()
        todo = list(graph[start])
        while todo:
            key = todo.pop()
            if key not in seen:
                seen.add(key)
                todo.extend(graph[key])
        return seen

    return {key for key in graph if key in reached(key)}


def _topological(graph: dict[Any, set[Any]]) -> list[Any] | None:
    """The keys of `graph` (key -> keys it reads) with every key after what it reads; None on a cycle."""
    done: list[Any] = []
    placed: set[Any] = set()
    pending = list(graph)
    while pending:
        ready = [k for k in pending if graph[k] <= placed]
        if not ready:
            return None
        for k in ready:
            done.append(k)
            placed.add(k)
        pending = [k for k in pending if k not in placed]
    return done


def _loop_group(program: Program, members: list[str], elsewhere: set[str], materialise: set[str], index: int) -> Group:
    """The program of one kernel: `members`, what they read (other kernels' reductions as inputs)."""
    by_name = {st.name: st for st in program.stages if isinstance(st, Stage)}
    keep: set[str] = set()
    outside: set[str] = set()
    todo = list(members)
    while todo:
        name = todo.pop()
        if name in keep or name not in by_name:
            continue
        if name in elsewhere:
            outside.add(name)
            continue
        keep.add(name)
        todo.extend(by_name[name].reads())
    stages = [st for st in program.stages if isinstance(st, Stage) and st.name in keep]
    outputs: list[OutputSpec] = []
    results: list[str] = []
    for j, out in enumerate(program.outputs):
        if out.stage in members:
            outputs.append(out)
            results.append(f"output:{j}")
    for name in members:
        if name in materialise:
            mat = Stage(f"{MATERIALISED_PREFIX}{name}", by_name[name].axes,
                        Cast(Load(name, tuple(Index(a) for a in by_name[name].axes)), "f32"))
            stages.append(mat)
            outputs.append(OutputSpec(mat.name, mat.axes))
            results.append(name)
    inputs = [InputBuffer(n, by_name[n].axes) for n in sorted(outside, key=list(by_name).index)]
    # an axis no input of the kernel has (the key heads a head-group sum writes) gets its size from
    # the program input that has it, passed to the kernel unread
    reads = {r for st in stages for r in st.reads()}
    sized = {a for b in program.inputs if b.name in reads for a in b.dims} | {a for b in inputs for a in b.dims}
    missing = {a for st in stages for a in st.axes} - sized
    inputs += [program.input(n) for n in sorted({program.axis_sizes[a][0] for a in missing if a in program.axis_sizes})]
    loop = {by_name[m].reduce_axis for m in members if by_name[m].reduce_op is not None}
    sub = subprogram(program, f"{program.name}_k{index}", stages, outputs, inputs)
    return Group(replace(sub, loop_axis=loop.pop()) if len(loop) == 1 else sub, tuple(results))
