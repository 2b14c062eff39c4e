"""Rolling update: fuse the reductions along one axis into a single loop (Program -> Program).

Reductions that read the *final* value of an earlier reduction along the same axis
read its *running* value instead, and their accumulators are corrected with the
derived repair function whenever that running value changes (DESIGN.md section 1).
For plain attention this is exactly FlashAttention's online softmax.

Example:
    >>> import torch
    >>> from neptune_fusion.ir.printer import format_program
    >>> from neptune_fusion.library import attention
    >>> from neptune_fusion.transform.inline import inline_along, inline_elementwise
    >>> q = k = v = torch.randn(1, 2, 16, 8)
    >>> prog = inline_along(inline_elementwise(attention.trace(q, k, v, 0.5)), "k")
    >>> print(format_program(rolling_update(prog, "k")))
    program attention(q[b, h, q, d], k[b, h, k, d], v[b, h, k, d2], scale):
      rolling loop over k:
        max0[b, h, q] = max[k](sum[d](q[b, h, q, d] * k[b, h, k, d]) * scale)
        dot1[b, h, q, d2] = sum[k](exp(sum[d](q[b, h, q, d] * k[b, h, k, d]) * scale - max0[b, h, q]) * v[b, h, k, d2])
            repair when max0 change: t <- t * exp(max0.old - max0.new)
        sum0[b, h, q] = sum[k](exp(sum[d](q[b, h, q, d] * k[b, h, k, d]) * scale - max0[b, h, q]))
            repair when max0 change: t <- t * exp(max0.old - max0.new)
      ew2[b, h, q, d2] = dot1[b, h, q, d2] / sum0[b, h, q]
      return ew2
"""

from __future__ import annotations

from neptune_fusion.algebra.repair import derive_repair, nonnegative_map, positive_map
from neptune_fusion.analysis.chains import transitive_reads
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import Expr, Index, Load, Reduce, walk
from neptune_fusion.ir.program import FusedLoop, Node, Program, Stage


def _loads_of_member(expr: Expr, name: str) -> list[Load]:
    return [n for n in walk(expr) if isinstance(n, Load) and n.buffer == name]


def build_fused_loop(program: Program, axis: str, mode: str = "rolling", splits: int = 1) -> FusedLoop:
    """The FusedLoop for all top-level reductions of `program` along `axis`, repairs derived."""
    members = [st for st in program.stages
               if isinstance(st, Stage) and isinstance(st.body, Reduce) and st.body.axis == axis]
    if not members:
        raise FusionError("rolling update", "-", f"reductions over {axis}", f"the program has no reduction over axis {axis!r}")
    names = {m.name for m in members}
    producers = {m.name: tuple(sorted(names & m.reads())) for m in members}
    order = _topological(members, producers)
    repairs: dict[str, Expr | None] = {}
    positive, nonnegative = _signs(order, producers)
    for m in order:
        assert isinstance(m.body, Reduce)
        where = f"{m.body.op} over {axis}"
        direct = producers[m.name]
        for other in m.reads() - names:
            hidden = transitive_reads(program, other) & names
            if hidden:
                raise FusionError(
                    "rolling update", m.name, where,
                    f"reads {other!r}, which depends on reduction(s) {sorted(hidden)} along the same axis "
                    f"through a stage that was not inlined",
                )
        for p in direct:
            prod = program.stage(p)
            for load in _loads_of_member(m.body, p):
                if load.index != tuple(Index(a) for a in prod.axes) or not set(prod.axes) <= set(m.axes):
                    raise FusionError(
                        "rolling update", m.name, where,
                        f"reads the running value {p!r} at indices other than its own axes {prod.axes}",
                    )
        known = frozenset(positive & set(direct))
        # sums of terms of either sign: their partial sums are unbounded (derive_repair refuses exp of them)
        signed_sums = frozenset(p for p in direct if program.stage(p).body.op == "sum" and p not in nonnegative)
        repairs[m.name] = derive_repair(m.name, m.body.op, axis, m.body.body, direct, known, signed_sums,
                                        frozenset(nonnegative)).h if direct else None
    return FusedLoop(f"loop_{axis}", axis, tuple(order), producers, repairs, mode, splits)


def _signs(order: list[Stage], producers: dict[str, tuple[str, ...]]) -> tuple[set[str], set[str]]:
    """(members whose running value is > 0 once they have a term, sum members whose terms are all
    >= 0), producers first: what is known of a producer's sign serves its readers' proofs."""
    positive: set[str] = set()
    nonnegative: set[str] = set()
    for m in order:
        assert isinstance(m.body, Reduce)
        direct = producers.get(m.name, ())
        known = frozenset(positive & set(direct))
        if m.body.op in ("sum", "max", "min") and positive_map(m.body.body, direct, known):
            positive.add(m.name)
        if m.body.op == "sum" and (m.name in positive or nonnegative_map(m.body.body, direct, known)):
            nonnegative.add(m.name)
    return positive, nonnegative


def nonnegative_sums(loop: FusedLoop) -> frozenset[str]:
    """The sum members of `loop` whose terms are all >= 0, as `build_fused_loop` proved them."""
    return frozenset(_signs(list(loop.members), loop.producers)[1])


def _topological(members: list[Stage], producers: dict[str, tuple[str, ...]]) -> list[Stage]:
    done: list[Stage] = []
    placed: set[str] = set()
    pending = list(members)
    while pending:
        for st in pending:
            if set(producers[st.name]) <= placed:
                done.append(st)
                placed.add(st.name)
                pending.remove(st)
                break
        else:
            raise FusionError("rolling update", pending[0].name, "cycle", "reductions depend on each other cyclically")
    return done


def place_loop(program: Program, loop: FusedLoop) -> Program:
    """Replace the loop's member stages by `loop`, after what it reads and before its readers."""
    names = {m.name for m in loop.members}
    needed: set[str] = set()
    for m in loop.members:
        needed |= transitive_reads(program, m.name)
    rest = [n for n in program.stages if not (isinstance(n, Stage) and n.name in names)]
    # what the loop reads comes first, including an earlier fused loop (it defines its members)
    before = [n for n in rest if _defines(n) & needed]
    after = [n for n in rest if not _defines(n) & needed]
    stages: list[Node] = [*before, loop, *after]
    out = program.with_stages(stages)
    out.validate()
    return out


def _defines(node: Node) -> set[str]:
    return {m.name for m in node.members} if isinstance(node, FusedLoop) else {node.name}


def rolling_update(program: Program, axis: str) -> Program:
    """Fuse all reductions along `axis` into one rolling loop with derived repair terms."""
    return place_loop(program, build_fused_loop(program, axis))
