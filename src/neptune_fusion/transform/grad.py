"""Reverse-mode differentiation of Programs: the backward pass as another plain Program.

`differentiate(program, wrt)` returns a `Gradient`: the forward program with the values its
backward needs as extra outputs, and a backward Program whose outputs are the gradients of the
`wrt` inputs. The backward is written like any traced program (stages over named axes, one
reduction per stage), so the same pipeline fuses it; nothing here knows about attention.

What is derived, and how:
- Adjoints flow from the outputs back to the inputs, stage by stage in reverse order. A stage's
  contribution to a buffer it loads is `adjoint * partial` over the stage's frame (its axes and
  its reduce axis), summed over the frame axes the buffer does not have: one reduction stage per
  axis. A load at a computed index (a gather `s[i, target[i]]`, a head group `k[b, h // 2]`)
  contributes through `where(index == axis, ...)` over the buffer's own axis.
- Stabilisers: a max (min) whose value the outputs do not depend on, such as the running max that
  keeps `exp` finite, carries no gradient. That is proved, not assumed (`_free_stabilisers`): a
  shift of the max moves each sum that reads it by a factor (its repair, to first order), and
  SymPy shows the outputs' derivative along that motion is 0. A max that is itself an output, or
  that an output reads other than through an expression cancelling it (`max + sum`, `exp(max)`),
  fails the proof.
- Extrema: a max (min) that is not free gets torch's `amax` (`amin`) gradient, shared evenly among
  the entries equal to it (`torch.max(dim)` gives it all to one index; the even share does not
  depend on the order in which a fused or split loop visits the entries). That needs the tie test
  `x == max`, so the max must be bitwise the value of the entries it is compared with (see
  "Saved versus recomputed").
- Zero adjoints stay exactly zero: an adjoint that is 0 where a condition holds (the outputs'
  `where(m == -inf, 0, ...)` for rows with no visible key, a mask) guards every contribution
  made from it, so a value the forward discarded (0 / 0, inf - inf) never reaches a gradient. The
  guard sits on the partial (on the adjoint where the partial is finite wherever the inputs are,
  or lacks the condition's axes: it then holds no value the condition discarded), never around
  the product, which stays a contraction (a dot).
- Saved versus recomputed: a reduction no larger than some input or output of the program (a
  row statistic) is saved by the forward; larger ones (scores, logits) and element-wise stages
  are recomputed by the backward; a reduction read only by one output is recovered from that
  output where SymPy can solve for it (`u` from `o = u / l`), so it is not saved either. A free
  stabiliser and its sum of exponentials are saved as one value, `m + log(l)` (`normaliser.py`).
  A value a condition of the backward tests (a tie test, `m == -inf`) is never recovered (it
  would be rounded: `max0 = (max0 + sum0) - sum0`) nor read from an output (which may be fp16);
  it is saved in fp32 or recomputed (`_Reverse.compared`). A max with a tie test whose operand
  reads another reduction is recomputed, not saved: the fused forward rescales it as that
  reduction's running value changes, so it is not bitwise any entry (`_Reverse.saveable`).

Example:
    >>> import torch
    >>> from neptune_fusion.library import softmax_pooling
    >>> program = softmax_pooling.trace(torch.randn(4, 8), torch.randn(4, 8))
    >>> grad = differentiate(program, ("x", "v"))
    >>> grad.saved, grad.free_stabilisers   # max0 and sum0 saved as one log-normaliser
    (('lse_max0',), ('max0',))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from neptune_fusion.algebra import symbolic
from neptune_fusion.analysis.chains import find_chains
from neptune_fusion.analysis.masks import disjuncts
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Reduce,
    Size,
    Unary,
    Where,
    free_axes,
    loads_of,
    product_factors,
    rebuild,
    simplify,
    substitute_index,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import FusedLoop, InputBuffer, OutputSpec, Program, Stage, axis_sources
from neptune_fusion.transform.derivative import partial
from neptune_fusion.transform.inline import inline_elementwise_into
from neptune_fusion.transform.normaliser import save_log_normalisers

PASS = "differentiate"
MAX_BRANCHES = 6  # where() conditions enumerated by the stabiliser proof (2 ** 6 branches)


@dataclass(frozen=True)
class Gradient:
    """A program's backward, derived.

    `forward` is the program with `saved` appended to its outputs (each a row statistic, fp32,
    over its own axes: a reduction, possibly one that is also an output, or a log-normaliser);
    `backward` reads, by name, the forward inputs it needs, the saved values, the
    forward outputs in `outputs_read` (passed with the stage's own axes: size-1 dims dropped) and
    `grad_<i>` for the gradient of output i in `grads_read`. Its outputs are the gradients of
    `nonzero`, in that order; the other inputs of `wrt` get zero gradients.
    """

    forward: Program
    backward: Program
    wrt: tuple[str, ...]
    nonzero: tuple[str, ...]
    saved: tuple[str, ...]
    outputs_read: tuple[int, ...]
    grads_read: tuple[int, ...]
    free_stabilisers: tuple[str, ...]
    recovered: tuple[str, ...] = field(default=())
    # (input, dim, axis): an input's dim indexed by another input's axis (`table[q_idx]`): its
    # gradient holds that axis's positions only, so the call passes the input cut to the axis's
    # length and pads the gradient with zeros (a longer table's other entries get none)
    narrowed: tuple[tuple[str, int, str], ...] = ()
    held: frozenset[str] = frozenset()  # axes the forward's tiles hold whole (head dims): contractions


@dataclass(frozen=True)
class _Contribution:
    expr: Expr  # over the receiving buffer's axes
    zero_when: Expr | None  # where this holds, the contribution is exactly 0


def grad_name(output: int) -> str:
    """Name of the backward input holding the gradient of forward output `output`."""
    return f"grad_{output}"


def differentiate(program: Program, wrt: tuple[str, ...], sizes: Mapping[str, int] | None = None,
                  dtype: str = "f32") -> Gradient:
    """The backward of `program` with respect to the float inputs `wrt` (see the module doc);
    `sizes`, the call's axis sizes, let the forward save a long contraction its tensors do not
    span (`saves_by_size`): an activation in `dtype` (the call's, as torch's autograd keeps one),
    a statistic in fp32 (`_Reverse.activation`)."""
    if any(isinstance(node, FusedLoop) for node in program.stages):
        raise FusionError(PASS, program.name, "program", "differentiate the traced program, before fusion")
    for name in wrt:
        buf = program.input(name)
        if buf.kind != "float":
            raise FusionError(PASS, name, "input", f"only float inputs have gradients ({buf.kind} given)")
    program = _one_sum_a_stage(program)
    return save_log_normalisers(_Reverse(program, tuple(wrt), saves_by_size(program, sizes), dtype).run(), program)


# a reduction is saved where recomputing one of its values costs more tensor-core time than reading
# it back (at most 4 bytes): two flops per summed element at ~990 TFLOP/s against 4 bytes at ~3.35 TB/s
# (an H100's dense fp16 rate and HBM), so a sum over more than about 600 elements
SAVED_MIN_SUMMED = 600


def saves_by_size(program: Program, sizes: Mapping[str, int] | None) -> frozenset[str]:
    """The values the forward saves at these sizes though no input or output spans their axes:
    those no larger than the call's inputs and outputs together that are reductions whose
    recomputation would sum more than `SAVED_MIN_SUMMED` elements each (a projection `x @ w` of a
    width, or an MLP's hidden activations, as torch's autograd keeps them; not attention's scores
    over a head dim, nor logits larger than the weight and hidden states together), or element-wise
    values such a sum multiplies (the gated activations an MLP's down projection reads).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> @nf.program
        ... def gated(x, w):
        ...     return nf.sigmoid(x @ w).sum(axis=-1)
        >>> program = gated.trace(torch.randn(64, 1024), torch.randn(1024, 64))
        >>> sorted(saves_by_size(program, {"x": 64, "y": 1024, "z": 64}))
        ['dot0']
        >>> sorted(saves_by_size(program, {"x": 64, "y": 128, "z": 64}))
        []
    """
    if not sizes:
        return frozenset()
    held = sum(math.prod(sizes.get(a, 1) for a in dims if a is not None)
               for dims in [b.dims for b in program.inputs] + [o.dims for o in program.outputs])
    long = {st.name: st for st in program.all_stages()
            if st.reduce_op is not None and sizes.get(st.reduce_axis, 0) > SAVED_MIN_SUMMED}
    # an element-wise value a long contraction multiplies (`silu(gate) * up` before an MLP's down
    # projection) is written whole as that product's operand: saving it costs no more than that.
    # Not a view (a bare read, a head split): saving what it reads is the same. Not one computed
    # from a reduction along the summed axis (a softmax's probabilities): the fused loop keeps it
    # against running statistics and never writes it
    factors = {f.buffer for st in long.values() if st.reduce_op == "sum" and isinstance(st.body, Reduce)
               for f in product_factors(st.body.body)[0]
               if isinstance(f, Load) and st.reduce_axis not in _summed_before(program, f.buffer)}
    return frozenset(st.name for st in program.all_stages()
                     if (st.name in long or st.reduce_op is None and st.name in factors and not isinstance(st.body, Load))
                     and not program.holds_as_large(st.axes) and math.prod(sizes.get(a, 1) for a in st.axes) <= held)


def _summed_before(program: Program, name: str) -> set[str]:
    """The axes reduced by the reductions the element-wise value `name` reads, directly or
    through other element-wise values."""
    stages = {st.name: st for st in program.all_stages()}
    axes: set[str] = set()
    todo, seen = [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in stages:
            continue
        seen.add(current)
        stage = stages[current]
        if stage.reduce_op is not None and current != name:
            axes.add(stage.reduce_axis)
        else:
            todo.extend(stage.reads())
    return axes


def without_detach(program: Program) -> Program:
    """`program` with its `detach`es read as the values they hold: what runs forward (a gradient
    is derived from the program that has them).

    Example:
        >>> from neptune_fusion.ir.expr import Index, Load, Unary
        >>> p = Program("p", (InputBuffer("x", ("i",)),), (), (Stage("y", ("i",), Unary("detach", Load("x", (Index("i"),)))),),
        ...             (OutputSpec("y", ("i",)),), {"i": ("x", 0)})
        >>> without_detach(p).stages[0].body
        Load(buffer='x', index=(Index(axis='i'),))
    """
    def plain(node: Expr) -> Expr | None:
        return node.x if isinstance(node, Unary) and node.op == "detach" else None

    if not any(isinstance(n, Unary) and n.op == "detach" for st in program.all_stages() for n in walk(st.body)):
        return program
    stages = [replace(st, body=transform_bottom_up(st.body, plain)) if isinstance(st, Stage) else
              replace(st, members=tuple(replace(m, body=transform_bottom_up(m.body, plain)) for m in st.members))
              for st in program.stages]
    return replace(program, stages=tuple(stages))


def _one_sum_a_stage(program: Program) -> Program:
    """`program` with each sum of sums (an einsum contracting several letters, `bhld,nhd->bln`)
    written as a chain of stages, one sum each: the reverse pass differentiates a stage's one
    reduction.

    Example:
        >>> from neptune_fusion.ir.expr import Index, Load, Reduce
        >>> x = Load("x", (Index("i"), Index("j"), Index("k")))
        >>> p = Program("p", (InputBuffer("x", ("i", "j", "k")),), (), (Stage("s", ("i",), Reduce("sum", "j", Reduce("sum", "k", x))),),
        ...             (OutputSpec("s", ("i",)),), {"i": ("x", 0), "j": ("x", 1), "k": ("x", 2)})
        >>> [(st.name, st.axes) for st in _one_sum_a_stage(p).stages]
        [('s_over_k', ('i', 'j')), ('s', ('i',))]
    """
    taken = {st.name for st in program.all_stages()} | {b.name for b in program.inputs}
    stages: list[Stage] = []
    changed = False
    for st in program.stages:
        if not (isinstance(st, Stage) and isinstance(st.body, Reduce) and st.body.op == "sum"
                and isinstance(st.body.body, Reduce) and st.body.body.op == "sum"):
            stages.append(st)  # type: ignore[arg-type]
            continue
        changed = True
        outer, inner = st.body, st.body.body
        name = next(n for n in (f"{st.name}_over_{inner.axis}{'' if k == 0 else f'_{k}'}" for k in itertools.count())
                    if n not in taken)
        taken.add(name)
        axes = (*st.axes, outer.axis)
        split = _one_sum_a_stage(replace(program, stages=(Stage(name, axes, inner),)))
        stages.extend(split.stages)  # type: ignore[arg-type]
        stages.append(Stage(st.name, st.axes, Reduce("sum", outer.axis, Load(name, tuple(map(Index, axes))))))
    return replace(program, stages=tuple(stages)) if changed else program


class _Reverse:
    def __init__(self, program: Program, wrt: tuple[str, ...], by_size: frozenset[str] = frozenset(),
                 by_size_dtype: str = "f32") -> None:
        self.program = program
        self.wrt = wrt
        self.by_size = by_size  # values saved at the call's sizes (`saves_by_size`), in `by_size_dtype`
        self.by_size_dtype = by_size_dtype
        self.stages = {st.name: st for st in program.all_stages()}
        self.inputs = {b.name: b for b in program.inputs}
        self.active = _active(program, set(wrt))
        self.free = _free_stabilisers(program)
        self.contribs: dict[str, list[_Contribution]] = {}
        self.adjoint: dict[str, tuple[str, Expr | None]] = {}
        self.new: list[Stage] = []
        self.taken = set(self.stages) | set(self.inputs) | set(program.params)
        self.seeds: list[int] = []
        self.derived: dict[str, tuple[str, object, object]] = {}  # axes the backward adds (head-group members)
        self.narrowed: set[tuple[str, int, str]] = set()  # (input, its dim, the axis that indexes it): `Gradient`
        self.tied: set[str] = set()  # max/min stages whose gradient goes through a tie test

    # --- names and stages -------------------------------------------------------------
    def fresh(self, base: str) -> str:
        for n in itertools.count():
            name = base if n == 0 else f"{base}_{n}"
            if name not in self.taken:
                self.taken.add(name)
                return name
        raise AssertionError

    def axes_of(self, buffer: str) -> tuple[str | None, ...]:
        if buffer in self.stages:
            return self.stages[buffer].axes
        return self.inputs[buffer].dims

    def fixed_size(self, axis: str) -> bool:
        """Whether `axis` has a size fixed while tracing (a slice's or a concatenation's, also where
        it meets an input's dimension of that length)."""
        return {**self.program.derived_axes, **self.derived}.get(axis, ("",))[0] == "const"

    def same_extent(self, a: str, b: str) -> bool:
        """Whether a frame axis `a` may stand for a buffer's axis `b` position by position: the same
        axis, or neither of a fixed size (aliases of one dimension, x @ x.T's; an input gathered by
        an axis, `table[q_idx]`, whose extra length `Gradient.narrowed` cuts at the call)."""
        sources = self.program.axis_sizes
        return a == b or not (self.fixed_size(a) or self.fixed_size(b)) or (
            a in sources and sources.get(a) == sources.get(b))  # (one input dimension's: one extent)

    def const_sizes(self) -> dict[str, int]:
        """The axes of a size fixed while tracing, with their sizes."""
        return _const_sizes({**self.program.derived_axes, **self.derived})

    def renamed_apart(self, value: Expr, frame: tuple[str, ...], names: set[str]) -> tuple[Expr, tuple[str, ...]]:
        """`value` and `frame` with the frame axes in `names` renamed to fresh axes of their extent,
        so the buffer's axes of those names can be written into `value` without meeting them."""
        fresh = {a: self.fresh(f"{a}_sum") for a in frame if a in names}
        for a, b in fresh.items():
            self.derived[b] = ("mulc", a, 1)  # the extent of `a`
        if not fresh:
            return value, frame
        return substitute_index(value, {a: Index(b) for a, b in fresh.items()}), tuple(fresh.get(a, a) for a in frame)

    def merged_view(self, load: Load, value: Expr, frame: tuple[str, ...], target_axes: tuple[str | None, ...]
                    ) -> tuple[Expr, tuple[str, ...], dict[int, int]]:
        """`load` reads `buf[n // c0, (n // c1) % s1, ..., n % sk]` (a reshape that merged the
        buffer's axes into the frame's n): each n is one position of the buffer, n = the sum of
        its positions times their strides, so `value` is read there and n leaves the frame. The
        digits' positions in the load's index, with their strides ({} where it is no such read)."""
        merged = _unravelled(load.index, frame, self.const_sizes())
        if merged is None or any(target_axes[p] is None for p in merged[1]):
            return value, frame, {}
        n, digits = merged
        value, frame = self.renamed_apart(value, frame, {target_axes[p] for p in digits} - {n})  # type: ignore[misc]
        sizes = self.const_sizes()
        order = sorted(digits.items(), key=lambda item: -item[1])
        top = target_axes[order[0][0]]
        flat: Expr = Index(top)  # type: ignore[arg-type]
        flat = Binary("mul", flat, Const(order[0][1])) if order[0][1] != 1 else flat
        # positions the view does not reach (a buffer longer than the digit's range) get no
        # gradient; a buffer of exactly the view's extents (a reshape's) needs no test
        outside: list[Expr] = []
        for (p, stride), (_, above) in zip(order[1:], order):
            axis = Index(target_axes[p])  # type: ignore[arg-type]
            flat = Binary("add", flat, Binary("mul", axis, Const(stride)) if stride != 1 else axis)
            if sizes.get(axis.axis) != above // stride:
                outside.append(Binary("lt", axis, Const(above // stride)))
        if outside or sizes.get(top) != sizes[n] // order[0][1]:  # type: ignore[arg-type]
            outside.append(Binary("lt", flat, Const(sizes[n])))
        value = substitute_index(value, {n: flat})
        for condition in outside:
            value = Where(condition, value, Const(0.0))
        return value, tuple(a for a in frame if a != n), digits

    def emit(self, base: str, axes: tuple[str, ...], body: Expr) -> str:
        name = self.fresh(base)
        self.new.append(Stage(name, axes, simplify(whole_digits(body, self.const_sizes()))))
        return name

    # --- the pass ---------------------------------------------------------------------
    def run(self) -> Gradient:
        for i, out in enumerate(self.program.outputs):
            stage = self.stages[out.stage]
            if out.stage not in self.active:
                continue
            named = tuple(d for d in out.dims if d is not None)
            if named != stage.axes:
                raise FusionError(PASS, out.stage, "output", f"output dims {out.dims} do not list the stage's "
                                  f"axes {stage.axes} in order")
            self.taken.add(grad_name(i))
            seed = Load(grad_name(i), tuple(Index(d) if d is not None else Const(0) for d in out.dims))
            self.contribs.setdefault(out.stage, []).append(_Contribution(seed, None))
            self.seeds.append(i)
        for stage in reversed(self.program.all_stages()):
            if stage.name in self.contribs:
                self.backpropagate(stage)
        nonzero = tuple(name for name in self.wrt if name in self.contribs)
        grads = {name: self.finish(name, self._named_axes(name))[0] for name in nonzero}
        return self.assemble(nonzero, grads)

    def _named_axes(self, buffer: str) -> tuple[str, ...]:
        return tuple(a for a in self.axes_of(buffer) if a is not None)

    def finish(self, buffer: str, axes: tuple[str, ...]) -> tuple[str, Expr | None]:
        """The adjoint of `buffer` as one stage (its contributions summed) and where it is 0."""
        if buffer in self.adjoint:
            return self.adjoint[buffer]
        parts = self.contribs[buffer]
        zero: Expr | None = parts[0].zero_when
        for part in parts[1:]:
            zero = None if zero is None or part.zero_when is None else _and(zero, part.zero_when)
        only = parts[0].expr
        made = {st.name for st in self.new}
        if len(parts) == 1 and isinstance(only, Load) and only.index == tuple(map(Index, axes)) \
                and (only.buffer in made or (only.buffer not in self.stages and buffer not in self.inputs)):
            name = only.buffer  # already a stage of the backward (or, inside it, a seed): no copy
        else:
            total = parts[0].expr
            for part in parts[1:]:
                total = total + part.expr
            name = self.emit(f"grad_{buffer}", axes, total)
        self.adjoint[buffer] = (name, zero)
        return name, zero

    def backpropagate(self, stage: Stage) -> None:
        body = stage.body
        if isinstance(body, Reduce) and stage.name in self.free:
            return
        grad, zero = self.finish(stage.name, stage.axes)
        upstream: Expr = Load(grad, tuple(map(Index, stage.axes)))
        frame = stage.axes
        inner = body
        if isinstance(body, Reduce):
            frame, inner = (*stage.axes, body.axis), body.body
            if body.op in ("max", "min"):
                self.tied.add(stage.name)
                here = Load(stage.name, tuple(map(Index, stage.axes)))
                hit = Binary("eq", inner, here)
                # the ties counted as 0/1 flags: a sum of flags, not a masked sum of ones
                count = self.emit(f"ties_{stage.name}", stage.axes, Reduce("sum", body.axis, Cast(hit, "f32")))
                upstream = Where(hit, upstream / Load(count, tuple(map(Index, stage.axes))), Const(0.0))
            elif body.op != "sum":
                raise FusionError(PASS, stage.name, f"{body.op} over {body.axis}",
                                  "only sum, max and min reductions are differentiated")
        for load in _value_loads(inner):
            if load.buffer not in self.active or load.buffer in self.free:
                continue
            d = partial(inner, load)
            if d is None:
                continue
            if zero is None:
                contribution = simplify(_times(upstream, d))
            elif self.plain(d):  # guard the adjoint alone: the product stays a contraction (a dot)
                contribution = simplify(_times(_guard(zero, upstream), d))
            else:
                # the partial may hold what the forward discarded (0 / 0). The adjoint is exactly 0
                # where `zero` holds, so guarding the partial alone is the same as guarding the
                # product, and the guard keeps the partial's axes: the product stays a dot. A part
                # of the condition over axes the partial lacks (the positions a chunk never read)
                # guards the adjoint: 0 times the partial there, as torch's dense gradient computes
                parts = disjuncts(zero)
                own = [c for c in parts if free_axes(c) <= free_axes(d)]
                other = [c for c in parts if c not in own]
                contribution = simplify(_times(_guarded(other, upstream), _guarded(own, d)))
            self.contribute(stage, load, contribution, frame)

    def plain(self, expr: Expr) -> bool:
        """Whether `expr` is an input's value or a matrix product of such values (directly or
        through stages that only load, as a projection split into heads is): finite wherever the
        inputs are, so a zero adjoint times it is zero without a guard of its own."""
        if isinstance(expr, Const):
            return not isinstance(expr.value, float) or math.isfinite(expr.value)
        if not isinstance(expr, Load):
            return False
        if expr.buffer in self.inputs:
            return True
        stage = self.stages.get(expr.buffer)
        if stage is None:
            return False
        if isinstance(stage.body, Reduce):
            return stage.body.op == "sum" and all(self.plain(f) for f in product_factors(stage.body.body)[0])
        return self.plain(stage.body)

    def contribute(self, stage: Stage, load: Load, value: Expr, frame: tuple[str, ...]) -> None:
        """Add `value` (over `frame`) to the adjoint of the buffer `load` reads. The frame axes the
        buffer does not have are summed over, one stage each, innermost first, under the frame's
        names (so sums over the same loop from different stages agree on their axes); the last step
        renames the frame's axes to the buffer's."""
        target_axes = self.axes_of(load.buffer)
        rename: dict[str, Expr] = {}
        kept: list[str] = []  # per named position of the buffer: the frame axis (or its own, if computed)
        value, frame, digits = self.merged_view(load, value, frame, target_axes)
        index = list(load.index)  # the components, as the substitutions below leave them
        for pos, axis in enumerate(target_axes):
            component = index[pos]
            if axis is None:
                continue
            if pos in digits:
                kept.append(axis)
                continue
            if (isinstance(component, Index) and component.axis in frame and component.axis not in rename
                    and self.same_extent(component.axis, axis)):
                rename[component.axis] = Index(axis)
                kept.append(component.axis)
                sources = self.program.axis_sizes
                if load.buffer in self.inputs and component.axis != axis and sources.get(component.axis) != sources.get(axis):
                    self.narrowed.add((load.buffer, pos, component.axis))
            elif (shift := _affine_index(component, frame, rename, tuple(index), pos)) is not None:
                # x[..., s * step + start, ...] (a slice): the gradient at the buffer's position p
                # comes from s = (p - start) / step, where that lies on the slice
                var, step, start = shift
                # a frame axis of the buffer axis's name is summed over: it must not meet the position
                value, frame = self.renamed_apart(value, frame, {axis} - {var})
                offset = Binary("sub", Index(axis), Const(start)) if start else Index(axis)
                source = Binary("floordiv", offset, Const(step)) if step != 1 else offset
                on_slice = Binary("and", Binary("ge", offset, Const(0)), Binary("lt", source, Size(var)))
                if step != 1:
                    on_slice = Binary("and", on_slice, Binary("eq", Binary("mod", offset, Const(step)), Const(0)))
                # read at the source taken modulo the slice's length: the reads off the slice stay inside it
                inside = Binary("mod", source, Size(var))
                value = Where(on_slice, substitute_index(value, {var: inside}), Const(0.0))
                frame = tuple(a for a in frame if a != var)
                kept.append(axis)
            elif (radix := _mixed_radix(component, frame, rename, tuple(index), pos, self.const_sizes())) is not None:
                # x[..., h * c + d, ...] (a reshape that split the buffer's axis into the frame's h, d):
                # the buffer's position p is read once, at h = p // c, d = p % c
                value, frame = self.renamed_apart(value, frame, {axis} - {a for a, _ in radix})
                position, total, places = Index(axis), 1, {}
                for a, coefficient in sorted(radix, key=lambda item: item[1]):
                    digit: Expr = position if coefficient == 1 else Binary("floordiv", position, Const(coefficient))
                    places[a] = digit if a == max(radix, key=lambda item: item[1])[0] else Binary(
                        "mod", digit, Const(self.const_sizes()[a]))
                    total = coefficient * self.const_sizes()[a]
                value = substitute_index(value, places)
                if self.const_sizes().get(axis) != total:  # a buffer longer than the view
                    value = Where(Binary("lt", position, Const(total)), value, Const(0.0))
                frame = tuple(a for a in frame if a not in places)
                kept.append(axis)
            elif (group := _group_index(component, frame, rename)) is not None:
                # k[b, h // g]: the stage's axis h runs over g members of each of the buffer's
                # positions, h = axis * g + j, so the sum over h is one over j < g (no where)
                head, size = group
                member = self.fresh(f"{head}_of_{axis}")
                self.derived[member] = ("const", size, None)
                spread = {head: Binary("add", Binary("mul", Index(axis), Const(size)), Index(member))}
                value = substitute_index(value, spread)
                # the later components read the head axis as the buffer's axis and the member too
                # (`h % g` becomes the member)
                index[pos + 1:] = [simplify(whole_digits(substitute_index(c, spread), self.const_sizes()))
                                   for c in index[pos + 1:]]
                frame = tuple(member if a == head else a for a in frame)
                kept.append(axis)
            else:  # a computed index: the gradient lands where the index equals the buffer's position
                if axis in frame:
                    # the stage runs over the buffer's own axis too (a concatenation that meets the
                    # buffer it reads): that frame axis becomes a fresh one, summed over, where its
                    # size is fixed while tracing (a sum over an axis of run-time length per element
                    # would make the backward's work grow with that length squared)
                    if not self.fixed_size(axis) or axis in rename or any(
                            isinstance(r, Index) and r.axis == axis for r in rename.values()):
                        raise FusionError(PASS, stage.name, f"load of {load.buffer!r}",
                                          f"index {pos} is computed and its axis {axis!r} is also an axis of the stage")
                    source = self.fresh(f"{axis}_read")
                    self.derived[source] = ("mulc", axis, 1)  # the extent of `axis`
                    value = substitute_index(value, {axis: Index(source)})
                    component = substitute_index(component, {axis: Index(source)})
                    frame = tuple(source if a == axis else a for a in frame)
                value = Where(Binary("eq", component, Index(axis)), value, Const(0.0))
                kept.append(axis)
        reduced = [a for a in frame if a not in rename]
        clash = {r.axis for r in rename.values() if isinstance(r, Index)} & set(reduced)
        if clash:  # a summed axis that has the name of one the buffer is indexed by (x's in x @ x.T)
            value, frame = self.renamed_apart(value, frame, clash)
            reduced = [a for a in frame if a not in rename]
        axes = tuple(a for a in target_axes if a is not None)
        # a digit of a merged view's position read back whole (`(h * 128 + d) // 128` is h): a
        # condition keeps only the axes it depends on, so a guard can stay off a contraction's factor
        zero = _zero_condition(value)
        if zero is not None:
            zero = simplify(whole_digits(zero, self.const_sizes()))
        # the partial sums keep the frame's order (b, h, k, not k, b, h): their kernel then shares
        # the roles of the others over the same axes (dK's), where a leading key axis made it a held one
        current = (*[a for a in kept if a not in frame], *[a for a in frame if a in kept or a in reduced])
        for n, axis in enumerate(reversed(reduced)):
            current = tuple(a for a in current if a != axis)
            last = n == len(reduced) - 1
            body = Reduce("sum", axis, substitute_index(value, rename) if last else value)
            name = self.emit(f"grad_{load.buffer}_part", axes if last else current, body)
            zero = zero if zero is not None and axis not in free_axes(zero) else None
            value = Load(name, tuple(map(Index, axes if last else current)))
        if not reduced:
            value = substitute_index(value, rename)
        if zero is not None:
            zero = simplify(whole_digits(substitute_index(zero, rename), self.const_sizes()))
        self.contribs.setdefault(load.buffer, []).append(_Contribution(value, zero))

    # --- the two programs -------------------------------------------------------------
    def assemble(self, nonzero: tuple[str, ...], grads: dict[str, str]) -> Gradient:
        program = self.program
        output_of = {out.stage: i for i, out in enumerate(program.outputs)}
        read = _reads(self.new)
        exact = self.compared(read)
        recovered = self.recover(read, output_of, exact)
        recompute: list[Stage] = []
        saved: list[str] = []
        outputs_read: list[int] = []
        needed = read | _reads(list(recovered.values()))
        visited: set[str] = set()
        while True:
            pending = sorted(b for b in needed if b in self.stages and b not in visited)
            if not pending:
                break
            for name in pending:
                visited.add(name)
                stage = self.stages[name]
                if name in recovered:
                    continue
                if name in output_of and name not in exact:
                    outputs_read.append(output_of[name])
                elif self.saves(stage):
                    saved.append(name)
                else:
                    recompute.append(stage)
                    needed |= stage.reads()
        order = [st.name for st in program.all_stages()]
        recompute.sort(key=lambda st: order.index(st.name))
        stages = [*recompute, *(recovered[n] for n in order if n in recovered), *self.new]
        reads = _reads(stages)
        inputs = [b for b in program.inputs if b.name in reads or b.name in nonzero]
        inputs += [InputBuffer(n, self.stages[n].axes) for n in sorted(set(saved), key=order.index)]
        inputs += [InputBuffer(program.outputs[i].stage, self.stages[program.outputs[i].stage].axes)
                   for i in sorted(set(outputs_read))]
        seeds = [i for i in self.seeds if grad_name(i) in reads]
        inputs += [InputBuffer(grad_name(i), program.outputs[i].dims) for i in seeds]
        outputs = tuple(OutputSpec(grads[n], self.inputs[n].dims) for n in nonzero)
        held = {b.name for b in inputs}
        sources = {**{a: src for a, src in program.axis_sizes.items() if src[0] in held}, **axis_sources(inputs)}
        backward = Program(f"{program.name}_backward", tuple(inputs), program.params, tuple(stages), outputs,
                           sources, dict(program.param_kinds), {**program.derived_axes, **self.derived})
        backward.validate()
        saved_order = tuple(sorted(set(saved), key=order.index))
        extra = [Stage(self.fresh(f"saved_{n}"), self.stages[n].axes,
                       Cast(Load(n, tuple(map(Index, self.stages[n].axes))),
                            self.by_size_dtype if n in self.by_size and self.activation(n) else "f32"))
                 for n in saved_order]
        forward = Program(program.name, program.inputs, program.params, (*program.stages, *extra),
                          (*program.outputs, *(OutputSpec(st.name, st.axes) for st in extra)),
                          dict(program.axis_sizes), dict(program.param_kinds), dict(program.derived_axes))
        return Gradient(forward, backward, self.wrt, nonzero, saved_order, tuple(sorted(set(outputs_read))),
                        tuple(seeds), tuple(sorted(self.free)), tuple(recovered),
                        narrowed=tuple(sorted(self.narrowed)), held=_held_axes(program))

    def kept(self, buffer: str, exact: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether the backward reads `buffer` without recomputing it: an input, a saved statistic
        or an output. An output in `exact` (one the backward compares) is not read as returned:
        that may be narrower (fp16) than the value the forward compared, so a reduction is saved
        in fp32 (where `saveable`) and anything else recomputed."""
        if buffer in self.inputs:
            return True
        stage = self.stages[buffer]
        if self.saves(stage):
            return True
        return buffer not in exact and any(o.stage == buffer for o in self.program.outputs)

    def saves(self, stage: Stage) -> bool:
        """Whether the forward saves the value of `stage` for the backward: a reduction no larger
        than a tensor the program holds (a row statistic), or a value saved at the call's sizes,
        where the saved value is the one the backward would compute."""
        if stage.reduce_op is None:
            return stage.name in self.by_size
        return (self.program.holds_as_large(stage.axes) or stage.name in self.by_size) and self.saveable(stage)

    def activation(self, name: str) -> bool:
        """Whether the sum or element-wise value `name` is an activation torch's autograd keeps in
        the step's dtype (a projection, an MLP's hidden values), not a statistic: no reader divides by it or divides it
        (a normaliser, the unnormalised output of an attention, which can overflow 16 bits) or
        takes its log or root (a norm's mean square). A max is a statistic too: rounded, it would
        no longer match the scores the backward recomputes against it."""
        if self.stages[name].reduce_op not in ("sum", None):
            return False

        def scaled(expr: Expr) -> bool:  # reads `name` only through scale-keeping arithmetic
            if isinstance(expr, Binary) and expr.op in ("div", "pow") or isinstance(expr, Unary) and expr.op in (
                    "log", "log2", "sqrt", "rsqrt", "recip"):
                return not any(isinstance(n, Load) and n.buffer == name for n in walk(expr))
            return all(scaled(child) for child in expr.children())

        return all(scaled(st.body) for st in self.program.all_stages())

    def saveable(self, stage: Stage) -> bool:
        """Whether the value the forward saves for the reduction `stage` is the one the backward
        would compute. Not so for a max (min) with a tie test whose operand reads another reduction
        (a softmax's max, its sum): the fused forward keeps it against those reductions' running
        values and rescales it as they change (its repair), so the saved max is rounded, equal to
        none of the operand's values the backward recomputes, and the test would find no tie. The
        backward recomputes such a max from the reductions it reads, plainly."""
        if stage.name not in self.tied:
            return True
        todo, seen = sorted(stage.reads()), set()
        while todo:
            name = todo.pop()
            if name in seen or name not in self.stages:
                continue
            seen.add(name)
            if self.stages[name].reduce_op is not None:
                return False
            todo.extend(self.stages[name].reads())
        return True

    def recover(self, read: set[str], output_of: dict[str, int], exact: set[str]) -> dict[str, Stage]:
        """Reductions the backward reads that can be computed back from the one output reading
        them; the larger first, each from values that are not themselves recovered. A value the
        backward compares (`compared`) is not recovered: `max0 = (max0 + sum0) - sum0` is rounded,
        and the tie test `x == max0` of a max's gradient would then find no tie in some rows."""
        out: dict[str, Stage] = {}
        candidates = [self.stages[n] for n in read if n in self.stages and n not in output_of and n not in exact]
        candidates.sort(key=lambda st: (-len(st.axes), st.name))
        for stage in candidates:
            readers = [st for st in self.program.all_stages() if stage.name in st.reads()]
            if stage.reduce_op is None or len(readers) != 1:
                continue
            reader = readers[0]
            if reader.name not in output_of or reader.name in exact or reader.reduce_op is not None \
                    or set(reader.axes) != set(stage.axes):
                continue
            here = Load(stage.name, tuple(map(Index, stage.axes)))
            value = Load(reader.name, tuple(map(Index, reader.axes)))
            solution = symbolic.solve_for(_strip_guards(reader.body), here, value)
            if solution is not None and all(self.kept(n, exact) and n not in out for n in loads_of(solution)):
                out[stage.name] = Stage(stage.name, stage.axes, solution)
        return out

    def compared(self, read: set[str]) -> set[str]:
        """The forward stages whose exact value a condition of the backward tests: those a where's
        condition or a 0/1 flag reads (a max's tie test `x == max0`, `m == -inf`) in the backward's
        own stages or in the forward stages it recomputes (from `read` through stages not `kept`),
        and, through the recomputed ones, the values those are computed from. A condition flips
        where its operand is off by a rounding, so each of these must be the value the forward
        compared: saved or recomputed, never recovered through arithmetic nor read from a (maybe
        narrower) output. An output so excluded is recomputed in turn, so its own conditions count
        too: repeated until nothing is added."""
        exact: set[str] = set()
        while True:
            bodies = [st.body for st in self.new]
            seen: set[str] = set()
            todo = sorted(read)
            while todo:
                name = todo.pop()
                if name in seen or name not in self.stages or self.kept(name, exact):
                    continue
                seen.add(name)
                bodies.append(self.stages[name].body)
                todo.extend(self.stages[name].reads())
            found: set[str] = set()
            for body in bodies:
                found |= _condition_loads(body) & set(self.stages)
            found |= exact
            todo = sorted(found)
            while todo:
                name = todo.pop()
                if self.kept(name, found):
                    continue  # read as the forward made it: its own operands do not matter
                for dep in (self.stages[name].reads() & set(self.stages)) - found:
                    found.add(dep)
                    todo.append(dep)
            if found == exact:
                return exact
            exact = found


def _condition_loads(expr: Expr) -> set[str]:
    """Buffers read by the comparisons in `expr` (where() conditions, 0/1 flags, tie tests)."""
    out: set[str] = set()
    for node in walk(expr):
        if symbolic.is_condition(node):
            out |= loads_of(node)
    return out


def _held_axes(program: Program) -> frozenset[str]:
    """The axes the forward's kernel holds whole in its tiles (head dims): those its reductions
    outside the main chain contract (q . k over d) and those its chain's members have beyond the
    smallest member's rows (the value dim of `p @ v`)."""
    chains = find_chains(program)
    if not chains:
        return frozenset()
    chain = chains[0]
    members = [program.stage(m) for m in chain.members]
    rows = set(min(members, key=lambda st: len(st.axes)).axes)
    held = {st.reduce_axis for st in program.all_stages() if st.reduce_op and st.name not in chain.members}
    held |= {a for st in members for a in st.axes} - rows
    return frozenset(held - {chain.axis})


def _reads(stages: list[Stage]) -> set[str]:
    out: set[str] = set()
    for st in stages:
        out |= st.reads()
    return out


def _value_loads(expr: Expr) -> list[Load]:
    """Loads whose values `expr` computes with (not those only inside an index), each once."""
    out: dict[Load, None] = {}

    def visit(node: Expr) -> None:
        if isinstance(node, Load):
            out[node] = None
            return
        for child in node.children():
            visit(child)

    visit(expr)
    return list(out)


def _active(program: Program, wrt: set[str]) -> set[str]:
    """Buffers through which some `wrt` input reaches an output."""
    forward = set(wrt)
    for st in program.all_stages():
        if st.reads() & forward:
            forward.add(st.name)
    backward = {o.stage for o in program.outputs}
    for st in reversed(program.all_stages()):
        if st.name in backward:
            backward |= st.reads()
    return forward & backward


def _affine_index(component: Expr, frame: tuple[str, ...], taken: dict[str, Expr], index: tuple[Expr, ...],
                  pos: int) -> tuple[str, int, int] | None:
    """(s, step, start) where `component` is `s * step + start` (either part may be absent, not both)
    for a frame axis s not yet mapped and read by no other component of the load's `index`."""
    step, start, node = 1, 0, component
    if isinstance(node, Binary) and node.op == "add" and isinstance(node.b, Const) and type(node.b.value) is int:
        node, start = node.a, node.b.value
    if isinstance(node, Binary) and node.op == "mul" and isinstance(node.b, Const) and type(node.b.value) is int:
        node, step = node.a, node.b.value
    if not isinstance(node, Index) or node.axis not in frame or node.axis in taken or step < 1:
        return None
    if any(node.axis in free_axes(other) for i, other in enumerate(index) if i != pos):
        return None
    return node.axis, step, start


def whole_digits(expr: Expr, sizes: dict[str, int]) -> Expr:
    """`expr` with `(a * c + x) // c` read as `a` and `(a * c + x) % c` as `x` wherever the terms
    not divisible by c stay below c (x an axis of a fixed size under c): a reshape's digits of its
    own flat index are the axes they came from.

    Example:
        >>> from neptune_fusion.ir.expr import Binary, Const, Index
        >>> flat = Binary("add", Binary("mul", Index("a"), Const(8)), Index("x"))
        >>> whole_digits(Binary("floordiv", flat, Const(8)), {"x": 8}), whole_digits(Binary("mod", flat, Const(8)), {"x": 8})
        (Index(axis='a'), Index(axis='x'))
    """
    def rule(node: Expr) -> Expr | None:
        if not (isinstance(node, Binary) and node.op in ("floordiv", "mod") and isinstance(node.b, Const)
                and type(node.b.value) is int and node.b.value > 0):
            return None
        terms = _linear_terms(node.a)
        if terms is None:
            return None
        c = node.b.value
        whole = [(a, k // c) for a, k in terms if k % c == 0]
        rest = [(a, k) for a, k in terms if k % c != 0]
        if any(a not in sizes for a, _ in rest) or sum(k * (sizes[a] - 1) for a, k in rest) >= c:
            return None
        return _linear_sum(whole if node.op == "floordiv" else rest)

    return transform_bottom_up(expr, rule)


def _linear_terms(expr: Expr) -> list[tuple[str, int]] | None:
    """[(axis, coefficient)] where `expr` is a sum of axes times non-negative integer constants."""
    if isinstance(expr, Index):
        return [(expr.axis, 1)]
    if isinstance(expr, Binary) and expr.op == "add":
        a, b = _linear_terms(expr.a), _linear_terms(expr.b)
        return None if a is None or b is None else a + b
    if (isinstance(expr, Binary) and expr.op == "mul" and isinstance(expr.b, Const) and type(expr.b.value) is int
            and expr.b.value >= 0):
        inner = _linear_terms(expr.a)
        return None if inner is None else [(a, k * expr.b.value) for a, k in inner]  # type: ignore[operator]
    return None


def _linear_sum(terms: list[tuple[str, int]]) -> Expr:
    parts = [Index(a) if k == 1 else Binary("mul", Index(a), Const(k)) for a, k in terms if k != 0]
    if not parts:
        return Const(0)
    total = parts[0]
    for part in parts[1:]:
        total = Binary("add", total, part)
    return total


def _mixed_radix(component: Expr, frame: tuple[str, ...], taken: dict[str, Expr], index: tuple[Expr, ...],
                 pos: int, sizes: dict[str, int]) -> list[tuple[str, int]] | None:
    """[(axis, coefficient)] where `component` is `h * c + ... + d` over two or more frame axes of
    fixed sizes, not yet mapped nor read by another component, whose coefficients are the strides of
    a row-major order (the innermost 1, each the next one's times that one's size)."""
    terms: list[tuple[str, int]] = []
    todo = [component]
    while todo:
        node = todo.pop()
        if isinstance(node, Binary) and node.op == "add":
            todo += [node.a, node.b]
        elif isinstance(node, Index):
            terms.append((node.axis, 1))
        elif (isinstance(node, Binary) and node.op == "mul" and isinstance(node.a, Index) and isinstance(node.b, Const)
              and type(node.b.value) is int and node.b.value > 0):
            terms.append((node.a.axis, node.b.value))
        else:
            return None
    axes = [a for a, _ in terms]
    if len(terms) < 2 or len(set(axes)) != len(axes) or any(a not in frame or a in taken or a not in sizes for a in axes):
        return None
    if any(a in free_axes(other) for i, other in enumerate(index) if i != pos for a in axes):
        return None
    stride = 1
    for a, coefficient in sorted(terms, key=lambda t: t[1]):
        if coefficient != stride:
            return None
        stride *= sizes[a]
    return terms


def _digit(component: Expr, n: str) -> tuple[int, int | None] | None:
    """(c, s) where `component` is `(n // c) % s`, (c, None) where it is `n // c` (c = 1: `n`)."""
    size = None
    if isinstance(component, Binary) and component.op == "mod" and isinstance(component.b, Const):
        size, component = component.b.value, component.a  # type: ignore[assignment]
    coefficient = 1
    if isinstance(component, Binary) and component.op == "floordiv" and isinstance(component.b, Const):
        coefficient, component = component.b.value, component.a  # type: ignore[assignment]
    if not (isinstance(component, Index) and component.axis == n and type(coefficient) is int and coefficient > 0
            and (size is None or (type(size) is int and size > 0))):
        return None
    return coefficient, size


def _unravelled(index: tuple[Expr, ...], frame: tuple[str, ...], sizes: dict[str, int]
                ) -> tuple[str, dict[int, int]] | None:
    """(n, {position: c}) where two or more components of a load's `index` are the digits of a
    frame axis n of a fixed size in row-major order (`n // c0`, then `(n // c) % s`, the last
    `n % s`) and no other component reads n."""
    for n in frame:
        if n not in sizes:
            continue
        reading = [p for p, component in enumerate(index) if n in free_axes(component)]
        found = {p: _digit(index[p], n) for p in reading}
        if len(reading) < 2 or any(d is None for d in found.values()):
            continue
        order = sorted(found.items(), key=lambda item: -item[1][0])  # type: ignore[index]
        (_, (top, top_size)), rest = order[0], order[1:]
        ok = top_size is None and rest[-1][1][0] == 1  # type: ignore[index]
        above = top
        for _, (coefficient, size) in rest:  # type: ignore[misc]
            ok = ok and size is not None and coefficient * size == above
            above = coefficient
        if ok:
            return n, {p: d[0] for p, d in found.items()}  # type: ignore[index]
    return None


def _group_index(component: Expr, frame: tuple[str, ...], taken: dict[str, Expr]) -> tuple[str, int] | None:
    """(h, g) where `component` is `h // g` for a frame axis h not yet mapped and a constant g > 1."""
    if (isinstance(component, Binary) and component.op == "floordiv" and isinstance(component.a, Index)
            and component.a.axis in frame and component.a.axis not in taken and isinstance(component.b, Const)
            and isinstance(component.b.value, int) and not isinstance(component.b.value, bool) and component.b.value > 1):
        return component.a.axis, component.b.value
    return None


def _const_sizes(derived: dict[str, tuple[str, object, object]]) -> dict[str, int]:
    """The derived axes of a size fixed while tracing, with their sizes."""
    return {a: int(d[1]) for a, d in derived.items() if d[0] == "const"}  # type: ignore[call-overload]


def _times(a: Expr, b: Expr) -> Expr:
    return a if b == Const(1.0) else b if a == Const(1.0) else a * b


def _guard(zero: Expr, expr: Expr) -> Expr:
    """`where(zero, 0, expr)`, one where per disjunct of `zero`: a mask's condition and a row's
    (rows the forward left empty) stay apart, so the mask analysis sees the mask alone and the
    row's guard, which can skip no tile, stays arithmetic instead of making block maps per row."""
    return _guarded(disjuncts(zero), expr)


def _guarded(parts: list[Expr], expr: Expr) -> Expr:
    """`expr` set to 0 wherever one of the conditions `parts` holds, one where each."""
    for part in reversed(parts):
        expr = Where(part, Const(0.0), expr)
    return expr


def _and(a: Expr, b: Expr) -> Expr:
    return a if a == b else Binary("and", a, b)


def _zero_condition(expr: Expr) -> Expr | None:
    """A condition under which `expr` is exactly 0, read off its where()s and products."""
    if isinstance(expr, Where):
        if isinstance(expr.a, Const) and expr.a.value == 0:
            inner = _zero_condition(expr.b)
            return expr.cond if inner is None else Binary("or", expr.cond, inner)
        if isinstance(expr.b, Const) and expr.b.value == 0:
            inner = _zero_condition(expr.a)
            negated = Unary("not", expr.cond)
            return negated if inner is None else Binary("or", negated, inner)
    if isinstance(expr, Binary) and expr.op == "mul":
        a, b = _zero_condition(expr.a), _zero_condition(expr.b)
        if a is None or b is None:
            return a or b
        return Binary("or", a, b)
    return None


def _strip_guards(expr: Expr) -> Expr:
    """`where(c, constant, e)` -> e: the value where the output is not a constant."""
    while isinstance(expr, Where):
        if isinstance(expr.a, Const):
            expr = expr.b
        elif isinstance(expr.b, Const):
            expr = expr.a
        else:
            break
    return expr


# --- stabilisers ------------------------------------------------------------------------


def _free_stabilisers(program: Program) -> set[str]:
    """Max/min stages the outputs provably do not depend on (see `_stabiliser_is_free`)."""
    return {st.name for st in program.all_stages()
            if st.reduce_op in ("max", "min") and _stabiliser_is_free(program, st)}


def _stabiliser_is_free(program: Program, stabiliser: Stage) -> bool:
    """Move `stabiliser` by epsilon. Element-wise stages are inlined into their readers; a sum
    that reads a moving value moves by a factor of itself (the ratio of its body's derivative to
    its body, equal in every branch where the body is not 0 and free of the summed axis: the
    first-order form of its repair); anything else that moves fails the proof. It holds when
    every output has derivative 0 along the motion: never when the stabiliser is an output itself
    (nothing follows it to inspect, yet it moves at rate 1)."""
    stages = program.all_stages()
    elementwise = {st.name: st for st in stages if st.reduce_op is None}
    outputs = {o.stage for o in program.outputs}
    if stabiliser.name in outputs:
        return False  # the output is the max itself: it moves with it (derivative 1, not 0)
    values = symbolic.ValueSymbols()
    factors: dict[str, object] = {}  # moving sum -> d(value)/d(epsilon) / value
    # each position of the stabiliser moves by its own epsilon: the position of it whose motion a
    # moving value follows, over that value's own axes
    follows: dict[str, tuple[Expr, ...]] = {stabiliser.name: tuple(map(Index, stabiliser.axes))}
    sizes = _const_sizes(program.derived_axes)

    def rate(load: Load) -> object:
        if load.buffer == stabiliser.name:
            return symbolic.number(1)
        return factors[load.buffer] * values.symbol(load)  # type: ignore[operator]

    def followed(load: Load) -> tuple[Expr, ...]:
        at = dict(zip(program.stage(load.buffer).axes, load.index))
        return tuple(simplify(whole_digits(substitute_index(e, at), sizes)) for e in follows[load.buffer])

    def branches(expr: Expr) -> list[tuple[object, object]] | None:
        """(value, derivative along the motion) for each branch of the where()s in `expr`."""
        moving = {n for n in walk(expr) if isinstance(n, Load) and (n.buffer == stabiliser.name or n.buffer in factors)}
        if len({followed(n) for n in moving}) > 1:
            return None  # values that follow different positions of the stabiliser: they move apart
        if any(n.index != tuple(map(Index, program.stage(n.buffer).axes)) and n.buffer in factors
               and factors[n.buffer].free_symbols for n in moving):  # type: ignore[attr-defined]
            return None  # a rate that reads values at the sum's own position, read at another
        if any(isinstance(n, Cast) and symbolic.is_condition(n.x) and loads_of(n.x) & {m.buffer for m in moving}
               for n in walk(expr)):
            return None  # a flag of a moving value jumps as it moves: no derivative says it stays
        resolved = _branches(expr)
        if resolved is None:
            return None
        out = []
        for branch in resolved:
            try:
                value = values.convert(branch)
            except symbolic.NotAlgebraic:
                return None
            motion = {values.symbol(n): rate(n) for n in moving}
            out.append((value, symbolic.directional_derivative(value, motion)))
        return out

    for st in stages[stages.index(stabiliser) + 1:]:
        body = inline_elementwise_into(st.body.body if isinstance(st.body, Reduce) else st.body, elementwise)
        if not any(n.buffer == stabiliser.name or n.buffer in factors for n in walk(body) if isinstance(n, Load)):
            continue
        found = branches(body)
        if found is None:
            return False
        if st.reduce_op is None:
            if st.name in outputs and not all(symbolic.is_zero(d) for _, d in found):
                return False
            continue
        factor = _common_ratio(found)
        if factor is False:
            return False
        if factor is None:
            continue  # this reduction does not move (a projection of the normalised output)
        if st.reduce_op != "sum" or st.name in outputs:
            return False
        if any(st.reduce_axis in free_axes(values.exprs[s]) for s in factor.free_symbols):  # type: ignore[union-attr]
            return False
        position = next(followed(n) for n in walk(body) if isinstance(n, Load)
                        and (n.buffer == stabiliser.name or n.buffer in factors))
        if any(st.reduce_axis in free_axes(e) for e in position):
            return False  # a sum over positions of the stabiliser: they move by different epsilons
        factors[st.name] = factor
        follows[st.name] = position
    return True


def _common_ratio(branches: list[tuple[object, object]]) -> object:
    """The factor derivative / value shared by every branch whose value is not 0 (None: no branch
    moves; False: the branches disagree)."""
    found: list[object] = []
    for value, derivative in branches:
        if symbolic.is_zero(value):
            if not symbolic.is_zero(derivative):
                return False
            continue
        found.append(symbolic.ratio(derivative, value))
    if not found or all(symbolic.is_zero(f) for f in found):
        return None
    if any(not symbolic.is_zero(f - found[0]) for f in found[1:]):  # type: ignore[operator]
        return False
    return found[0]


def _branches(expr: Expr) -> list[Expr] | None:
    """`expr` with every combination of its where() conditions resolved; None past MAX_BRANCHES."""
    conditions = list(dict.fromkeys(n.cond for n in walk(expr) if isinstance(n, Where)))
    if len(conditions) > MAX_BRANCHES:
        return None
    out = []
    for choice in itertools.product((True, False), repeat=len(conditions)):
        chosen = dict(zip(conditions, choice))

        def resolve(node: Expr, chosen: dict[Expr, bool] = chosen) -> Expr:
            if isinstance(node, Where):
                return resolve(node.a if chosen[node.cond] else node.b)
            kids = node.children()
            if not kids or isinstance(node, Load):
                return node
            return rebuild(node, tuple(resolve(k) for k in kids))

        out.append(resolve(expr))
    return out
