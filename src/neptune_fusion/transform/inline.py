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

from typing import Callable

from neptune_fusion.ir.expr import Expr, Load, substitute_index, transform_bottom_up
from neptune_fusion.ir.program import FusedLoop, Node, Program, Stage


def inline_into(expr: Expr, stage: Stage) -> Expr:
    """`expr` with every load of `stage` replaced by its body at the load's indices."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Load) and node.buffer == stage.name:
            return substitute_index(stage.body, dict(zip(stage.axes, node.index)))
        return None

    return transform_bottom_up(expr, rule)


def _rewrite_node(node: Node, stage: Stage) -> Node:
    if isinstance(node, Stage):
        return Stage(node.name, node.axes, inline_into(node.body, stage))
    members = tuple(Stage(m.name, m.axes, inline_into(m.body, stage)) for m in node.members)
    return FusedLoop(node.name, node.axis, members, node.producers, node.repairs, node.mode, node.splits)


def inline_stages(program: Program, should_inline: Callable[[Stage], bool]) -> Program:
    """Inline every stage for which `should_inline` holds, except program outputs."""
    outputs = {o.stage for o in program.outputs}
    stages: list[Node] = list(program.stages)
    changed = True
    while changed:
        changed = False
        for st in stages:
            if isinstance(st, Stage) and st.name not in outputs and should_inline(st):
                stages = [_rewrite_node(n, st) for n in stages if n is not st]
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
