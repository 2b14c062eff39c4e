"""Inlining: replace loads of a stage by the stage's body (Program -> Program).

Example:
    >>> import torch
    >>> from neptune_fusion.library import softmax
    >>> prog = softmax.trace(torch.randn(4, 8))
    >>> [st.name for st in prog.stages]
    ['max0', 'ew0', 'sum0', 'ew1']
    >>> [st.name for st in inline_elementwise(prog).stages]   # exp(x - max0) now inside sum0
    ['max0', 'sum0', 'ew1']
"""

from __future__ import annotations

from typing import Callable, Mapping

from neptune_fusion.ir.expr import Expr, Index, Load, loads_of, substitute_index, transform_bottom_up
from neptune_fusion.ir.program import FusedLoop, Node, Program, Stage


def inline_into(expr: Expr, stage: Stage) -> Expr:
    """`expr` with every load of `stage` replaced by its body at the load's indices."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Load) and node.buffer == stage.name:
            return substitute_index(stage.body, dict(zip(stage.axes, node.index)))
        return None

    return transform_bottom_up(expr, rule)


def inline_elementwise_into(expr: Expr, stages: Mapping[str, Stage]) -> Expr:
    """`expr` with every element-wise stage of `stages` it reads inlined, recursively (the
    reductions it reads stay loads).

    Example:
        >>> import torch
        >>> from neptune_fusion.ir.printer import format_expr
        >>> from neptune_fusion.library import softmax
        >>> prog = softmax.trace(torch.randn(4, 8))
        >>> format_expr(inline_elementwise_into(prog.stage("sum0").body, {st.name: st for st in prog.stages}))
        'sum[a1](exp(x[a0, a1] - max0[a0]))'
    """
    while names := sorted(n for n in loads_of(expr) if n in stages and stages[n].reduce_op is None):
        for name in names:
            expr = inline_into(expr, stages[name])
    return expr


def _rewrite_node(node: Node, stage: Stage) -> Node:
    if isinstance(node, Stage):
        return Stage(node.name, node.axes, inline_into(node.body, stage))
    members = tuple(Stage(m.name, m.axes, inline_into(m.body, stage)) for m in node.members)
    return FusedLoop(node.name, node.axis, members, node.producers, node.repairs, node.mode, node.splits)


def inline_stages(program: Program, should_inline: Callable[[Stage], bool]) -> Program:
    """Inline every stage for which `should_inline` holds. A program output stays, and the
    stages that read it compute it again instead (a normalised x returned beside its matmul)."""
    outputs = {o.stage for o in program.outputs}
    stages: list[Node] = list(program.stages)
    changed = True
    while changed:
        changed = False
        for st in stages:
            if not (isinstance(st, Stage) and should_inline(st)):
                continue
            if st.name not in outputs:
                stages = [_rewrite_node(n, st) for n in stages if n is not st]
                changed = True
                break
            if any(n is not st and st.name in n.reads() for n in stages):
                stages = [n if n is st or st.name not in n.reads() else _rewrite_node(n, st) for n in stages]
                changed = True
                break
    return program.with_stages(stages)


def inline_elementwise(program: Program) -> Program:
    """Inline all elementwise (non-reduction) stages that are not outputs."""
    return inline_stages(program, lambda st: st.reduce_op is None)


def inline_along(program: Program, axis: str) -> Program:
    """Inline every non-output stage indexed by `axis` (e.g. the scores of attention).

    Such values are recomputed inside the fused loop over `axis` instead of stored:
    that is what keeps a query-by-key matrix out of memory.
    """
    return inline_stages(program, lambda st: axis in st.axes)


def reindex_reductions(program: Program) -> Program:
    """A reduction read at other axes than its own becomes a reduction of its own over those
    axes, its body read there (`sum0[i] = sum_d x[i, d]^2` read at `j` in the Gram matrix of
    normalised rows: `sum0_at_j[j] = sum_d x[j, d]^2`). Each copy is then a loop member over
    the same axis for its own rows; the value is the same, computed where it is needed.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def cosine(x):
        ...     y = x / nf.sqrt((x * x).sum(axis=-1, keepdims=True))
        ...     return nf.einsum("id,jd->ij", y, y)
        >>> [(st.name, st.axes) for st in reindex_reductions(inline_elementwise(cosine.trace(torch.randn(4, 8)))).stages]
        [('sum0', ('i',)), ('sum0_at_j', ('j',)), ('dot0', ('i', 'j'))]
    """
    reductions = {st.name: st for st in program.stages if isinstance(st, Stage) and st.reduce_op is not None}
    made: dict[tuple[str, tuple[str, ...]], Stage] = {}

    def rule(node: Expr) -> Expr | None:
        if not (isinstance(node, Load) and node.buffer in reductions):
            return None
        stage = reductions[node.buffer]
        if not all(isinstance(i, Index) for i in node.index):
            return None
        axes = tuple(i.axis for i in node.index)  # type: ignore[union-attr]
        if axes == stage.axes or len(set(axes)) != len(axes) or stage.body.axis in axes:  # type: ignore[union-attr]
            return None
        key = (stage.name, axes)
        if key not in made:
            body = substitute_index(stage.body, {a: Index(b) for a, b in zip(stage.axes, axes)})
            made[key] = Stage(f"{stage.name}_at_{'_'.join(axes)}", axes, transform_bottom_up(body, rule))
        return Load(made[key].name, node.index)

    rewritten = [Stage(n.name, n.axes, transform_bottom_up(n.body, rule)) if isinstance(n, Stage) else n
                 for n in program.stages]
    if not made:
        return program
    stages: list[Node] = []
    for node in rewritten:
        stages.append(node)
        # each copy right after its original: it reads what the original reads
        stages.extend(st for (name, _), st in made.items() if isinstance(node, Stage) and name == node.name)
    out = program.with_stages(stages)
    out.validate()
    return out
