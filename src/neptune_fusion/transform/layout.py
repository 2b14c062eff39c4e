"""Layout transforms (Program -> Program): splitting an axis and fusing axes into one.

`pack_groups` is what makes grouped-query decode read K and V once per group: the
query-head axis `h` is split into (kv head, head in group), and the head-in-group
axis is fused with the query axis into one row axis. Loads of K and V index heads
as `h // G`, which simplifies to the kv-head axis, so they no longer depend on the
rows: one program reads each K/V tile once for all query heads of its group.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.ir.printer import format_expr
    >>> from neptune_fusion.transform.inline import inline_along, inline_elementwise
    >>> from neptune_fusion.transform.rolling import rolling_update
    >>> @nf.program
    ... def gqa_scores_max(q, k):               # 8 query heads share 2 key heads
    ...     return nf.einsum("bhqd,bhkd->bhqk", q, nf.repeat_interleave(k, 4, axis=1)).max(axis=-1)
    >>> prog = gqa_scores_max.trace(torch.randn(1, 8, 1, 16), torch.randn(1, 2, 32, 16))
    >>> fused = rolling_update(inline_along(inline_elementwise(prog), "k"), "k")
    >>> (m,) = pack_groups(fused, head="h", rows="q", group=4).stages[0].members
    >>> m.axes, format_expr(m.body)             # k no longer depends on the packed rows h_q
    (('b', 'h_kv', 'h_q'), 'max[k](sum[d](q[b, h_kv * 4 + h_q // |q|, h_q % |q|, d] * k[b, h_kv, k, d]))')
"""

from __future__ import annotations

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    Binary,
    Const,
    Expr,
    Index,
    Load,
    Reduce,
    Size,
    substitute_index,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import FusedLoop, Node, OutputSpec, Program, Stage


def group_divisor(program: Program, head: str, loop_axis: str) -> int | None:
    """G if every load that varies along `loop_axis` indexes `head` only as `head // G`, else None."""
    divisors: set[int] = set()
    for st in program.all_stages():
        for node in walk(st.body):
            if not isinstance(node, Load) or not any(
                isinstance(n, (Index, Reduce)) and getattr(n, "axis", None) == loop_axis
                for i in node.index for n in walk(i)
            ):
                continue
            for idx in node.index:
                direct = [n for n in walk(idx) if isinstance(n, Index) and n.axis == head]
                if not direct:
                    continue
                if (isinstance(idx, Binary) and idx.op == "floordiv" and idx.a == Index(head)
                        and isinstance(idx.b, Const) and isinstance(idx.b.value, int) and idx.b.value > 1):
                    divisors.add(idx.b.value)
                else:
                    return None
    return divisors.pop() if len(divisors) == 1 else None


def _simplify_group_index(expr: Expr, outer: str, inner: Expr, group: int) -> Expr:
    """(outer * G + inner) // G -> outer and (...) % G -> inner, valid because 0 <= inner < G."""
    packed = Binary("add", Binary("mul", Index(outer), Const(group)), inner)

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Binary) and node.a == packed and node.b == Const(group):
            if node.op == "floordiv":
                return Index(outer)
            if node.op == "mod":
                return inner
        return None

    return transform_bottom_up(expr, rule)


def pack_groups(program: Program, head: str, rows: str, group: int) -> Program:
    """Split `head` into (kv head, index in group) and fuse the index in group with `rows`."""
    if group < 2:
        raise FusionError("pack groups", program.name, f"axis {head}", f"group size must be >= 2, got {group}")
    outer, packed = f"{head}_kv", f"{head}_{rows}"
    in_group = Binary("floordiv", Index(packed), Size(rows))
    mapping = {
        head: Binary("add", Binary("mul", Index(outer), Const(group)), in_group),
        rows: Binary("mod", Index(packed), Size(rows)),
    }

    def rewrite_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
        if head in axes and rows not in axes:
            raise FusionError("pack groups", program.name, f"axis {head}",
                              f"a stage indexed by {head!r} but not {rows!r} cannot be packed")
        return tuple(outer if a == head else packed if a == rows else a for a in axes)

    stage_axes = {st.name: st.axes for st in program.all_stages()}

    def reindex_stage_loads(expr: Expr) -> Expr:
        # loads of other stages read them at their own axes, which the packing renames
        def rule(node: Expr) -> Expr | None:
            if isinstance(node, Load) and node.buffer in stage_axes:
                axes = stage_axes[node.buffer]
                if node.index == tuple(Index(a) for a in axes):
                    return Load(node.buffer, tuple(Index(a) for a in rewrite_axes(axes)))
            return None

        return transform_bottom_up(expr, rule)

    def rewrite_stage(st: Stage) -> Stage:
        body = substitute_index(reindex_stage_loads(st.body), mapping)
        body = _simplify_group_index(body, outer, in_group, group)
        return Stage(st.name, rewrite_axes(st.axes), body)

    for o in program.outputs:
        dims = [d for d in o.dims if d is not None]
        if head in dims and (rows not in dims or dims.index(rows) != dims.index(head) + 1):
            raise FusionError("pack groups", o.stage, "output",
                              f"output dims {o.dims} must have {rows!r} right after {head!r} to be packed")
    stages: list[Node] = []
    for node in program.stages:
        if isinstance(node, FusedLoop):
            members = tuple(rewrite_stage(m) for m in node.members)
            stages.append(FusedLoop(node.name, node.axis, members, node.producers, node.repairs, node.mode, node.splits))
        else:
            stages.append(rewrite_stage(node))
    outputs = tuple(
        OutputSpec(o.stage, rewrite_axes(tuple(d for d in o.dims if d is not None)), o.view or o.dims)
        for o in program.outputs
    )
    derived = dict(program.derived_axes)
    derived[outer] = ("div", head, group)
    derived[packed] = ("mulc", rows, group)
    out = Program(program.name, program.inputs, program.params, tuple(stages), outputs, dict(program.axis_sizes),
                  dict(program.param_kinds), derived, program.loop_axis)
    out.validate()
    return out


UNIT_ROW = "__row__"


def needs_unit_row(program: Program) -> bool:
    """Whether a fused loop has a member with no axes (a reduction to a single value), or has no
    members and outputs of no axis but the loop's: the tile lowering then has no axis to tile
    rows by."""
    loops = [n for n in program.stages if isinstance(n, FusedLoop)]
    return any(not m.axes for n in loops for m in n.members) or any(
        not n.members and not elementwise_row_axes(program, n.axis) for n in loops)


def widest_output(program: Program) -> Stage:
    """The first output stage of the most axes: a program with no reduction loops over its last
    axis and tiles its others (schedule/pipeline.py)."""
    return max((program.stage(o.stage) for o in program.outputs), key=lambda st: len(st.axes))


def elementwise_row_axes(program: Program, loop_axis: str) -> tuple[str, ...]:
    """What rows a loop with no members tiles: the widest output's axes but `loop_axis`."""
    return tuple(a for a in widest_output(program).axes if a != loop_axis)


def with_unit_row(program: Program) -> Program:
    """`program` with a degenerate row axis of extent 1 declared (Program -> Program).

    Nothing is indexed by it, so every value is the same as before; what it adds is an axis the
    tile lowering can map to one row tile of one row, so a reduction to a single value lowers like
    any row of a reduction. Split-K along the loop axis then fills the machine.
    """
    if UNIT_ROW in program.derived_axes:
        return program
    derived = dict(program.derived_axes)
    derived[UNIT_ROW] = ("const", 1, None)
    return Program(program.name, program.inputs, program.params, program.stages, program.outputs,
                   dict(program.axis_sizes), dict(program.param_kinds), derived, program.loop_axis)
