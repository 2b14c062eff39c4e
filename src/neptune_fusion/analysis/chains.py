"""Dataflow analysis: reductions along one axis and the chains of dependencies between them.

Example:
    >>> import torch
    >>> from neptune_fusion.library import attention
    >>> from neptune_fusion.transform.inline import inline_along, inline_elementwise
    >>> q = k = v = torch.randn(1, 2, 16, 8)
    >>> prog = inline_along(inline_elementwise(attention.trace(q, k, v, 0.5)), "k")
    >>> {axis: [st.name for st in stages] for axis, stages in reductions_along(prog).items()}
    {'k': ['max0', 'dot1', 'sum0']}
    >>> find_chains(prog)[0].depends                   # the sums read the running max
    {'max0': (), 'dot1': ('max0',), 'sum0': ('max0',)}
"""

from __future__ import annotations

from dataclasses import dataclass

from neptune_fusion.ir.expr import Reduce
from neptune_fusion.ir.program import Program, Stage


@dataclass(frozen=True)
class Chain:
    """Reductions over `axis` in topological order; `depends[x]` the members x reads."""

    axis: str
    members: tuple[str, ...]
    depends: dict[str, tuple[str, ...]]

    @property
    def length(self) -> int:
        """Longest dependency path among the members (1: no reduction reads another)."""
        depth: dict[str, int] = {}
        for m in self.members:
            depth[m] = 1 + max((depth[p] for p in self.depends[m]), default=0)
        return max(depth.values(), default=0)


def reductions_along(program: Program) -> dict[str, list[Stage]]:
    """Top-level reduction stages grouped by their reduce axis, in program order."""
    out: dict[str, list[Stage]] = {}
    for st in program.stages:
        if isinstance(st, Stage) and isinstance(st.body, Reduce):
            out.setdefault(st.body.axis, []).append(st)
    return out


def transitive_reads(program: Program, name: str) -> set[str]:
    """Every buffer `name` depends on, through any number of stages."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        cur = todo.pop()
        node = program.producer_of(cur)
        if node is None:
            continue
        for r in node.reads():
            if r not in seen:
                seen.add(r)
                todo.append(r)
    return seen


def find_chains(program: Program) -> list[Chain]:
    """All reduction chains, longest first (ties: more members first); the chain over the
    program's `loop_axis`, where it names one, before all others."""
    chains = []
    for axis, stages in reductions_along(program).items():
        names = [s.name for s in stages]
        depends = {s.name: tuple(n for n in names if n in transitive_reads(program, s.name)) for s in stages}
        chains.append(Chain(axis, tuple(names), depends))
    chains.sort(key=lambda c: (c.axis != program.loop_axis, -c.length, -len(c.members)))
    return chains


def chain_axis(program: Program) -> str | None:
    """The axis whose reductions form the longest chain (None if there is no reduction)."""
    chains = find_chains(program)
    return chains[0].axis if chains else None
