"""The fusion pipeline: named Program -> Program stages, recorded for `explain`.

Example:
    >>> import torch
    >>> from neptune_fusion.library import softmax
    >>> steps = fuse(softmax.trace(torch.randn(4, 8)))
    >>> steps[-1].name
    "rolling update along 'a1' (derived repair terms)"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from neptune_fusion.algebra.repair import repair_finite_from_identity, terms_vanish_while_identity
from neptune_fusion.analysis.chains import chain_axis
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    REDUCER_IDENTITY,
    RUNNING_STAND_IN,
    Accumulator,
    Binary,
    Const,
    Expr,
    Index,
    Load,
    Reduce,
    Running,
    Unary,
    Where,
    transform_bottom_up,
)
from neptune_fusion.ir.program import FusedLoop, InputBuffer, OutputSpec, Program, Stage
from neptune_fusion.transform.inline import inline_along, inline_elementwise, inline_stages, reindex_reductions
from neptune_fusion.transform.layout import needs_unit_row, widest_output, with_unit_row
from neptune_fusion.transform.normalize import hoist_invariant_factors
from neptune_fusion.transform.polynomial import expand_polynomial_reductions
from neptune_fusion.transform.rolling import nonnegative_sums, rolling_update
from neptune_fusion.transform.split_k import split_k_update


@dataclass(frozen=True)
class Step:
    """One named pass of the pipeline and the program it produced (what `explain` prints)."""

    name: str
    program: Program


def fuse(program: Program, splits: int = 1) -> list[Step]:
    """Run the fusion passes; the last step's program has one FusedLoop and the output stages."""
    steps = [Step("input", program)]
    axis = chain_axis(program)
    if axis is None:
        return _elementwise_steps(program, steps)
    p = inline_elementwise(program)
    steps.append(Step("inline elementwise stages", p))
    reindexed = reindex_reductions(p)
    if reindexed is not p:
        p = reindexed
        steps.append(Step("a reduction read at other axes: one copy for each", p))
    p = hoist_invariant_factors(p)
    steps.append(Step("commute normalisations past linear reductions", p))
    p = inline_along(p, axis)
    steps.append(Step(f"inline stages indexed by the loop axis {axis!r} (recomputed per tile, never stored)", p))
    members = {st.name for st in p.stages if isinstance(st, Stage) and st.reduce_axis == axis}
    outputs = {o.stage for o in p.outputs}
    p = inline_stages(p, lambda st: st.name not in members and st.name not in outputs)
    steps.append(Step("inline everything else into the loop and the outputs", p))
    expanded = expand_polynomial_reductions(p, axis)
    if expanded is not p:
        p = expanded
        steps.append(Step("expand sums that need final running values into basis sums (Welford-style)", p))
    p = rolling_update(p, axis)
    steps.append(Step(f"rolling update along {axis!r} (derived repair terms)", p))
    if needs_unit_row(p):
        p = with_unit_row(p)
        steps.append(Step("a reduction to a single value: a row axis of extent 1 to tile", p))
    return with_split_k(steps, splits) if splits > 1 else steps


def _elementwise_steps(program: Program, steps: list[Step]) -> list[Step]:
    """A program with no reduction: every output computed from the inputs in the second pass of a
    loop with no members over the last axis of the output of the most axes (walked in tiles, or
    held in one tile), its other axes rows and batch as for any loop."""
    p = inline_elementwise(program)
    steps.append(Step("inline elementwise stages", p))
    first = widest_output(p)
    if not first.axes:
        raise FusionError("analysis", program.name, first.name,
                          "the program has no reduction and no output with an axis to tile (its values are 0-d)")
    axis = first.axes[-1]
    p = p.with_stages([FusedLoop(f"loop_{axis}", axis, (), {}, {}), *p.stages])
    steps.append(Step(f"no reduction: the outputs as the second pass of a loop over {axis!r}", p))
    if needs_unit_row(p):
        p = with_unit_row(p)
        steps.append(Step("outputs of one axis: a row axis of extent 1 to tile", p))
    return steps


def with_split_k(steps: Sequence[Step], splits: int) -> list[Step]:
    """`fuse(program)`'s steps followed by the split-K update into `splits` chunks: what
    `fuse(program, splits)` returns, without running the passes (and their proofs) again."""
    p = steps[-1].program
    axis = next(n.axis for n in p.stages if isinstance(n, FusedLoop))
    p = split_k_update(p, axis, splits)
    return [*steps, Step(f"split-K update: {splits} chunks along {axis!r}", p)]


SPLIT_AXIS = "split"


def combine_program(fused: Program) -> Program:
    """The program that merges split-K partial states: generated from the repair functions.

    Inputs are `part_<member>[split, *member axes]`; each member becomes a reduction
    over the split axis of its repaired partial state: `X = f_c h(X_c, R_c, R)`.
    The output stages of `fused` follow unchanged.
    """
    loop = next(n for n in fused.stages if isinstance(n, FusedLoop))
    inputs = []
    stages: list[Stage] = []
    split = Index(SPLIT_AXIS)
    axis_sizes = {SPLIT_AXIS: (f"part_{loop.members[0].name}", 0)}
    for m in loop.members:
        inputs.append(InputBuffer(f"part_{m.name}", (SPLIT_AXIS, *m.axes)))
        for i, a in enumerate(m.axes):
            axis_sizes.setdefault(a, (f"part_{m.name}", i + 1))

    def part(name: str) -> Load:
        return Load(f"part_{name}", (split, *(Index(a) for a in loop.member(name).axes)))

    # A chunk's partial sum of non-negative terms is >= 0; written as |part| (equal to it, NaN
    # kept) the combine's own repair derivation sees that too, as it saw it in the main loop, and
    # accepts exponentials of it (derive_repair refuses them for sums of terms of either sign).
    nonnegative = nonnegative_sums(loop)

    def own_part(name: str) -> Expr:
        return Unary("abs", part(name)) if name in nonnegative else part(name)

    for m in loop.members:
        producers = loop.producers.get(m.name, ())
        body: Expr = own_part(m.name)
        if producers:
            repair = loop.repairs[m.name]
            assert repair is not None

            def rule(node: Expr, m: Stage = m, repair: Expr = repair) -> Expr | None:
                if isinstance(node, Accumulator):
                    return own_part(m.name)
                if isinstance(node, Running):
                    prod = loop.member(node.stage)
                    if node.which == "old":
                        # A chunk whose running value ended at its identity computed its readers
                        # with the stand-in (RUNNING_STAND_IN). Where their terms vanish there (a
                        # max/min), it saw nothing: repairing it from the identity gives 0 by itself
                        # when h stays finite there. Otherwise repair it from the stand-in.
                        ident = REDUCER_IDENTITY[prod.reduce_op]
                        if prod.reduce_op in RUNNING_STAND_IN and not (
                                prod.reduce_op in ("max", "min")
                                and terms_vanish_while_identity(m, prod, loop.producers[m.name])
                                and repair_finite_from_identity(repair, node.stage, ident)):
                            return Where(Binary("eq", part(node.stage), Const(ident)),
                                         Const(RUNNING_STAND_IN[prod.reduce_op]), part(node.stage))
                        return part(node.stage)
                    return Load(node.stage, tuple(Index(a) for a in prod.axes))
                return None

            body = transform_bottom_up(repair, rule)
            if m.reduce_op in ("max", "min"):
                # a chunk's max/min that saw nothing stays +-inf, never inf * 0 = NaN through its repair
                ident = Const(REDUCER_IDENTITY[m.reduce_op])
                body = Where(Binary("eq", part(m.name), ident), ident, body)
        assert m.reduce_op is not None
        stages.append(Stage(m.name, m.axes, Reduce(m.reduce_op, SPLIT_AXIS, body)))
    post = [n for n in fused.stages if isinstance(n, Stage)]
    outputs = tuple(OutputSpec(o.stage, o.dims) for o in fused.outputs)
    other_inputs = [b for b in fused.inputs if any(b.name in st.reads() for st in post)]
    for b in other_inputs:
        for i, a in enumerate(b.dims):
            if a is not None:
                axis_sizes.setdefault(a, (b.name, i))
    prog = Program(f"{fused.name}_combine", tuple(inputs + other_inputs), fused.params, tuple(stages + post),
                   outputs, axis_sizes, dict(fused.param_kinds))
    prog.validate()
    return prog
