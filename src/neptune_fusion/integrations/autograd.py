"""Autograd for `nf.compile`d programs: the backward the compiler derives, as torch's backward.

A call whose float inputs require grad (in grad mode) runs as one registered op with a registered
backward (`call_with_grad`): its forward runs the program with the statistics its backward needs
as extra outputs (`transform/grad.py` decides which: never a query-by-key matrix), its backward
runs the derived backward program, compiled and fused by the same pipeline. Both are ordinary
`Compiled` functions, so inside torch.compile each is one registered op of the graph. A program
whose backward cannot be derived raises `FusionError` at the forward call.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.library import softmax
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> y = nf.compile(softmax)(x)                      # (CPU: under TRITON_INTERPRET=1)
    >>> (y * torch.randn(2, 8)).sum().backward()
    >>> x.grad.shape
    torch.Size([2, 8])
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from neptune_fusion.analysis.chains import chain_axis
from neptune_fusion.integrations.ops import argument_kinds, is_eager, run_kernels
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import Binary, Load, walk
from neptune_fusion.ir.program import InputBuffer, Program
from neptune_fusion.lang.tensor import input_dtype_name
from neptune_fusion.lang.trace import FixedProgram
from neptune_fusion.runtime import compiled as _compiled
from neptune_fusion.runtime.compiled import (
    Compiled,
    install_allocator,
    length_params_of,
    lengths_of,
    output_specs,
    result_dtypes,
)
from neptune_fusion.runtime.reference import axis_extents, run_reference
from neptune_fusion.runtime.state import in_cudagraph_tree, object_of, private_state, static_shape
from neptune_fusion.schedule.materialise import (
    Contraction,
    Materialised,
    OneHot,
    accumulates_in_fp32,
    call_params,
    chunk_arguments,
    chunk_budget,
    chunk_length,
    materialise,
)
from neptune_fusion.schedule.partition import Group, narrow_materialised, partition_loops, subprogram
from neptune_fusion.schedule.templates import Auto
from neptune_fusion.transform.grad import Gradient, differentiate, grad_name, saves_by_size

__all__ = ["Derived", "Kernels", "call_with_grad", "contract_into", "derived_for", "handle_for", "train_forward",
           "training_handle"]


class Unfused:
    """A program without a reduction (an element-wise backward), run by the reference executor:
    the fused kernels need a loop to fuse into, and torch's element-wise kernels are what an
    unfused program runs on anyway (inside torch.compile, inductor fuses them)."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def __call__(self, **named: Any) -> Any:
        dtype = next(named[b.name].dtype for b in self.program.inputs if named[b.name].is_floating_point())
        return run_reference(self.program, named, out_dtype=dtype)


def with_own_maxima(group: Program, whole: Program, earlier: set[str]) -> Program:
    """`group` (an element-wise part of `whole` that torch runs) computing again each max or min
    it compares values with (the tie test of a max's gradient), from `whole`'s inputs and the
    `earlier` groups' results: the test then compares values one executor computed. A kernel's
    max is rounded as its own arithmetic rounds (torch divides by a number as a product with its
    reciprocal), so values torch recomputes could miss every tie against it.

    Example:
        >>> from neptune_fusion.ir.expr import Const, Index, Reduce, Where
        >>> from neptune_fusion.ir.program import OutputSpec, Stage
        >>> x = Load("x", (Index("i"), Index("j")))
        >>> whole = Program("p", (InputBuffer("x", ("i", "j")),), (), (
        ...     Stage("m", ("i",), Reduce("max", "j", Binary("div", x, Const(3.0)))),
        ...     Stage("g", ("i", "j"), Where(Binary("eq", Binary("div", x, Const(3.0)), Load("m", (Index("i"),))), Const(1.0), Const(0.0)))),
        ...     (OutputSpec("g", ("i", "j")),), {"i": ("x", 0), "j": ("x", 1)})
        >>> group = subprogram(whole, "p_g", [whole.stage("g")], list(whole.outputs), [InputBuffer("m", ("i",))])
        >>> own = with_own_maxima(group, whole, {"m"})
        >>> [st.name for st in own.stages], [b.name for b in own.inputs]
        (['m', 'g'], ['x'])
    """
    compared = {n.buffer for st in group.all_stages() for c in walk(st.body) if isinstance(c, Binary) and c.op == "eq"
                for n in walk(c) if isinstance(n, Load)}
    stages = {st.name: st for st in whole.all_stages()}
    maxima = {b.name for b in group.inputs
              if b.name in compared and b.name in stages and stages[b.name].reduce_op in ("max", "min")}
    if not maxima:
        return group
    picked: set[str] = set()
    todo = sorted(maxima)
    while todo:
        name = todo.pop()
        if name in picked or name not in stages or (name in earlier and name not in maxima):
            continue
        picked.add(name)
        todo.extend(stages[name].reads())
    again = [st for st in whole.all_stages() if st.name in picked]
    own = [st for st in group.all_stages() if st.name not in picked]
    kept = {b.name for b in whole.inputs}
    reads = {r for st in again for r in st.reads()}
    extra = [b for b in group.inputs if b.name not in kept and b.name not in maxima]
    extra += [InputBuffer(n, stages[n].axes) for n in sorted(reads & earlier - picked - {b.name for b in extra})]
    part = subprogram(whole, group.name, again + own, list(group.outputs), extra)
    # the group's own stages may read lengths as parameters already (`partition.size_param`)
    return replace(part, params=tuple(dict.fromkeys((*part.params, *group.params))),
                   param_kinds={**group.param_kinds, **part.param_kinds})


class Chunked:
    """Groups no kernel plan computes, run as `schedule/materialise.py` plans them: their shared
    intermediate materialised a chunk at a time by one fused kernel, each reduction a contraction
    of the chunk with an input (cuBLAS through `torch.einsum`)."""

    def __init__(self, plan: Materialised, allow_fallback: bool) -> None:
        self.plan = plan
        self.producer = Compiled(FixedProgram(plan.producer), Auto(), allow_fallback)
        names = {b.name for b in plan.producer.inputs} | {c.operand for c in plan.contractions}
        params = call_params(plan)
        if plan.one_hot is not None:
            names |= {b.name for b in plan.one_hot.values.inputs}
            params += [p for p in plan.one_hot.values.params if p not in params]
        self.inputs = tuple(sorted(names))
        self.params = tuple(params)

    def first_chunk(self, named: dict[str, Any]) -> dict[str, Any]:
        """The producer's arguments for the first chunk (to plan its kernel before any call)."""
        sizes = self._sizes(named)
        return chunk_arguments(self.plan, named, 0, self._length(named, sizes), sizes[self.plan.axis])

    def _sizes(self, named: dict[str, Any]) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for buf in self.plan.producer.inputs:
            sizes.update((a, int(n)) for a, n in zip(buf.dims, named[buf.name].shape) if a is not None)
        for c in self.plan.contractions:
            sizes.update(zip(c.operand_axes, named[c.operand].shape))
        return sizes

    def _length(self, named: dict[str, Any], sizes: dict[str, int]) -> int:
        return chunk_length(self.plan, sizes, named[self.plan.contractions[0].operand].element_size())

    def __call__(self, **named: Any) -> tuple[torch.Tensor, ...]:
        plan = self.plan
        sizes = self._sizes(named)
        length = self._length(named, sizes)
        dtype = named[plan.contractions[0].operand].dtype
        device = named[plan.contractions[0].operand].device
        itemsize = named[plan.contractions[0].operand].element_size()
        accumulator = torch.float32 if accumulates_in_fp32(plan, sizes, itemsize) else dtype
        outs: list[torch.Tensor] = []
        for c, axes in zip(plan.contractions, plan.result_axes):
            shape = [sizes[a] for a in axes]
            outs.append(torch.zeros(shape, dtype=accumulator, device=device) if c.over_chunk
                        else torch.empty(shape, dtype=dtype, device=device))
        hot = plan.one_hot
        term = None if hot is None else _one_hot_term(hot, named, sizes[hot.axis])
        # contractions summing over the one-hot axis read each chunk before its term is added in,
        # and get the term once after the chunks (a gather); the others read it in the chunk
        gathers = [j for j, c in enumerate(plan.contractions) if term is not None and c.summed == hot.axis]
        others = [j for j in range(len(outs)) if j not in gathers]

        def contract(j: int, shared: torch.Tensor, start: int, n: int) -> None:
            c, axes, out = plan.contractions[j], plan.result_axes[j], outs[j]
            operand = named[c.operand]
            if plan.axis in c.operand_axes:
                operand = operand.narrow(c.operand_axes.index(plan.axis), start, n)
            target = out if c.over_chunk else out.narrow(axes.index(plan.axis), start, n)
            contract_into(c.spec, shared, operand, target, accumulate=c.over_chunk, scale=c.scale)

        for start in range(0, sizes[plan.axis], length):
            n = min(length, sizes[plan.axis] - start)
            shared = run_kernels(self.producer, chunk_arguments(plan, named, start, n, sizes[plan.axis])).to(dtype)
            for j in gathers:
                contract(j, shared, start, n)
            if term is not None and others:
                _add_one_hot(shared, plan, term, start, n)
            for j in others:
                contract(j, shared, start, n)
            # released before the next chunk is made: one chunk alive at a time, not two
            del shared
        for j in gathers:
            assert term is not None
            _gather_one_hot(plan.contractions[j], plan.result_axes[j], outs[j], named[plan.contractions[j].operand],
                            term, chunk_budget(plan, sizes, itemsize))
        return tuple(out.to(dtype) for out in outs)


@dataclass(frozen=True)
class _OneHotTerm:
    """A plan's one-hot term for one call: where `index` (its indices outside the axis made 0)
    meets the one-hot axis, `coefficient` (0 there instead)."""

    hot: OneHot
    index: torch.Tensor
    coefficient: torch.Tensor


def _one_hot_term(hot: OneHot, named: dict[str, Any], size: int) -> _OneHotTerm:
    program = hot.values
    args = {b.name: named[b.name] for b in program.inputs} | {p: named[p] for p in program.params}
    index, coefficient = run_reference(program, args, dtype=torch.float64)  # float64: indices exact to 2**53
    index, coefficient = index.long(), coefficient.float()
    inside = (index >= 0) & (index < size)
    return _OneHotTerm(hot, torch.where(inside, index, 0), torch.where(inside, coefficient, 0.0))


def _add_one_hot(shared: torch.Tensor, plan: Materialised, term: _OneHotTerm, start: int, n: int) -> None:
    """The term added into a chunk of the shared stage (`start`, `n` along the chunked axis): one
    entry per index, so the sum is the same in any order."""
    hot, own = term.hot, term.hot.own
    axes = plan.producer.stage(plan.shared).axes
    if plan.axis == hot.axis:  # the chunk holds the columns start .. start + n of every row
        # every row adds its entry, 0 where its index lies in another chunk (no nonzero(): no sync)
        inside = (term.index >= start) & (term.index < start + n)
        at = {own: torch.arange(term.index.shape[0], device=shared.device),
              hot.axis: torch.where(inside, term.index - start, 0)}
        values = torch.where(inside, term.coefficient, 0.0)
    else:  # the chunk holds the rows start .. start + n
        at = {own: torch.arange(n, device=shared.device), hot.axis: term.index[start:start + n]}
        values = term.coefficient[start:start + n]
    shared.index_put_(tuple(at[a] for a in axes), values.to(shared.dtype), accumulate=True)


def _gather_one_hot(c: Contraction, axes: tuple[str, ...], out: torch.Tensor, operand: torch.Tensor,
                    term: _OneHotTerm, budget: int) -> None:
    """`out` += the term's part of contraction `c` (which sums over the one-hot axis): the
    operand's slices at the indices, times the coefficient, added in place; a block of indices at
    a time, its gathered slices within `budget` bytes."""
    hot, own = term.hot, term.hot.own
    gathered_axes = tuple(own if a == hot.axis else a for a in c.operand_axes)
    dim = c.operand_axes.index(hot.axis)
    step = max(1, budget // max(1, operand.numel() // max(1, operand.shape[dim]) * operand.element_size()))
    coefficient = term.coefficient * c.scale
    shape = [-1 if a == own else 1 for a in axes]
    for first in range(0, term.index.shape[0], step):
        gathered = operand.index_select(dim, term.index[first:first + step])
        gathered = gathered.permute([gathered_axes.index(a) for a in axes])  # the result's axes (a view)
        part = coefficient[first:first + step].reshape(shape)
        out.narrow(axes.index(own), first, part.numel()).addcmul_(gathered, part)


def contract_into(spec: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, accumulate: bool,
                  scale: float = 1.0) -> None:
    """`out` (+)= `scale` * einsum(`spec`, a, b). A contraction that is one matrix product of
    operands of out's dtype is written by cuBLAS into `out` itself (addmm_ / mm with out=), so a
    chunk's result takes no memory of its own beside the gradient it lands in.

    Example:
        >>> a, b, out = torch.ones(3, 2), torch.ones(3, 4), torch.ones(2, 4)
        >>> contract_into("iv,id->vd", a, b, out, accumulate=True, scale=0.5)
        >>> out[0, 0].item()
        2.5
    """
    inputs, result = spec.split("->")
    left, right = inputs.split(",")
    summed = (set(left) & set(right)) - set(result)
    matmul = (len(left) == len(right) == len(result) == 2 and len(summed) == 1 and a.dtype == b.dtype == out.dtype
              and len(set(left) | set(right)) == 3)
    if matmul and result[0] in right:
        a, b, left, right = b, a, right, left
    if not matmul:
        part = torch.einsum(spec, a, b)
        part = part * scale if scale != 1.0 else part
        if accumulate:
            out += part
        else:
            out.copy_(part)
        return
    (k,) = summed
    rows = a.permute(left.index(result[0]), left.index(k))
    cols = b.permute(right.index(k), right.index(result[1]))
    if accumulate:
        out.addmm_(rows, cols, alpha=scale)
    else:
        torch.mm(rows, cols, out=out)
        if scale != 1.0:
            out.mul_(scale)


NARROW_DTYPES = ("f16", "bf16")  # a step's dtypes whose dots take 16-bit operands


class Kernels:
    """A program of several loops (a backward pass) as the kernels `partition_loops` cuts it into,
    run in order; what one kernel materialises, the later ones read. Groups whose kernels cannot be
    planned run together as one `Chunked` step where `materialise` can plan them."""

    def __init__(self, program: Program, held: frozenset[str], allow_fallback: bool) -> None:
        self.program = program
        self.allow_fallback = allow_fallback
        self.steps: list[tuple[Group, InProgramDtype | Unfused | Chunked]] = []
        groups = partition_loops(program, held)
        # in a 16-bit step, what later kernels read only as a dot's operand is written in that dtype
        narrowed = {dtype: narrow_materialised(groups, dtype) for dtype in NARROW_DTYPES}
        for k, group in enumerate(groups):
            sub = group.program
            # an element-wise group written for later kernels (an operand several GEMMs read) is a
            # kernel of ours: what it writes is what they read, in the dtype they multiply in
            if chain_axis(sub) or not all(r.startswith("output:") for r in group.results):
                self.steps.append((group, InProgramDtype(sub, allow_fallback,
                                                         {d: narrowed[d][k].program for d in narrowed})))
            else:
                own = Group(with_own_maxima(sub, program, {r for g in groups[:k] for r in g.results}), group.results)
                self.steps.append((own, Unfused(own.program)))
        # lengths of axes a kernel reads none of its inputs along, passed to it as parameters
        self.length_params = length_params_of(program, [group.program for group, _ in self.steps])

    def _output_stage(self, result: str) -> str:
        """The stage name of the result `output:<j>`."""
        return self.program.outputs[int(result.split(":")[1])].stage

    def dtype(self, named: dict[str, Any]) -> str:
        """The dtype the program multiplies in: its first float input's (the forward's dtype), for
        every kernel, whatever fp32 pools of the earlier kernels it reads."""
        return next((input_dtype_name(named[b.name].dtype) for b in self.program.inputs
                     if isinstance(named.get(b.name), torch.Tensor) and named[b.name].is_floating_point()), "f32")

    def _with_lengths(self, named: dict[str, Any]) -> dict[str, Any]:
        return {**named, **lengths_of(self.program, self.length_params, named)} if self.length_params else named

    def prepare(self, **named: Any) -> None:
        """Plan and compile every kernel for arguments like `named` without running any, so a
        backward that cannot be planned raises at the forward call, before a training step."""
        named = self._with_lengths(named)
        sizes = axis_extents(self.program, named)
        pool = dict(named)
        failed: list[tuple[int, FusionError, dict[str, Any]]] = []  # (step, why, its arguments)
        dtype = self.dtype(named)
        for k, (group, fn) in enumerate(self.steps):
            args = _group_args(group, pool, named)
            if isinstance(fn, InProgramDtype):
                try:
                    fn.at(dtype).executable_for(fn.program_at(dtype), args)
                except FusionError as exc:
                    failed.append((k, exc, args))
            example = next(iter(named.values()))
            written = fn.result_dtypes(group, dtype) if isinstance(fn, InProgramDtype) else {}
            for name in group.results:
                # an output a later kernel reads (`partition._split`) goes by its stage's name there
                key = self._output_stage(name) if name.startswith("output:") else name
                shape = [sizes[a] for a in self.program.stage(key).axes]
                pool[key] = torch.empty(shape, dtype=written.get(name, torch.float32), device=example.device)
        if failed:
            self._chunk(failed, sizes, named, dtype)

    def _split_to_fit(self, failed: list[tuple[int, FusionError, dict[str, Any]]], dtype: str) -> bool:
        """Whether every group in `failed` compiles as several kernels where one kernel's tile is
        too large (`Compiled._apart_to_fit`): the plan after a chunked one."""
        for k, _, args in failed:
            fn = self.steps[k][1]
            assert isinstance(fn, InProgramDtype)
            fn.split_to_fit, fn.by_dtype = True, {}
            try:
                fn.at(dtype).executable_for(fn.program_at(dtype), args)
            except FusionError:
                return False
        return True

    def _chunk(self, unplanned: list[tuple[int, FusionError, dict[str, Any]]], sizes: dict[str, int],
               named: dict[str, Any], dtype: str) -> None:
        """Replace the groups that cannot be planned by one `Chunked` step, else compile them as
        several kernels each, or raise the first one's error."""
        failed, error = [k for k, _, _ in unplanned], unplanned[0][1]
        groups = [self.steps[k][0] for k in failed]
        later = {r for k, (g, _) in enumerate(self.steps) if k >= failed[0] for r in g.results}
        try:
            if any(b.name in later for g in groups for b in g.program.inputs):
                raise FusionError("materialise", groups[0].results[0], "inputs",
                                  "a group that cannot be planned reads what a later group computes")
            plan = materialise(groups, sizes)
            chunked = Chunked(plan, self.allow_fallback)
            chunked.producer.executable_for(plan.producer, chunked.first_chunk(named))
        except FusionError as why:
            if self.allow_fallback or self._split_to_fit(unplanned, dtype):
                return
            raise FusionError(error.pass_name, error.stage, error.reduction,
                              f"{error.condition}; materialising a chunk at a time fails too: {why}") from error
        merged = Group(groups[0].program, plan.results)
        steps = [step for k, step in enumerate(self.steps) if k not in failed]
        steps.insert(failed[0], (merged, chunked))
        self.steps = steps

    def __call__(self, **named: Any) -> tuple[torch.Tensor, ...]:
        install_allocator()  # Triton's allocator is per thread, and autograd runs backward passes in its own
        named = self._with_lengths(named)
        pool = dict(named)
        outs: list[torch.Tensor | None] = [None] * len(self.program.outputs)
        dtype = self.dtype(named)
        for group, fn in self.steps:
            if isinstance(fn, Chunked):
                result: Any = fn(**{n: pool[n] for n in (*fn.inputs, *fn.params)})
            else:
                args = _group_args(group, pool, named)
                result = run_kernels(fn.at(dtype), args) if isinstance(fn, InProgramDtype) else fn(**args)
            written = fn.result_dtypes(group, dtype) if isinstance(fn, InProgramDtype) else {}
            for name, value in zip(group.results, result if isinstance(result, tuple) else (result,)):
                if name.startswith("output:"):
                    outs[int(name.split(":")[1])] = value
                    pool[self._output_stage(name)] = value  # a later kernel may read it by that name
                elif value.dtype != written.get(name, torch.float32) or not value.is_contiguous():
                    # the later kernels were compiled for contiguous tensors of that dtype (`prepare`):
                    # their strides are fixed
                    raise RuntimeError(f"internal error: the backward's kernel {group.program.name} wrote {name!r} "
                                       f"as {value.dtype} with strides {value.stride()}, not contiguous "
                                       f"{written.get(name, torch.float32)}; please report it")
                else:
                    pool[name] = value
        return tuple(outs)  # type: ignore[arg-type]


class InProgramDtype:
    """One kernel of a larger program, compiled to multiply in that program's dtype (a backward's
    kernel reads fp32 pools of the earlier ones; its dots take fp16 operands in an fp16 step, as
    torch's own backward does): one `Compiled` per dtype."""

    def __init__(self, program: Program, allow_fallback: bool, narrowed: dict[str, Program] | None = None) -> None:
        self.program = program
        self.allow_fallback = allow_fallback
        self.narrowed = narrowed or {}  # by dtype: the program writing some results in it (`narrow_materialised`)
        self.by_dtype: dict[str, Compiled] = {}
        self.written: dict[str, dict[str, torch.dtype]] = {}  # by dtype: `result_dtypes`
        self.split_to_fit = False  # a tile too large to lower: a chunked plan first (`Kernels._chunk`)

    def at(self, dtype: str) -> Compiled:
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = Compiled(FixedProgram(self.program_at(dtype)), Auto(), self.allow_fallback,
                                            compute_dtype=dtype, split_to_fit=self.split_to_fit)
        return self.by_dtype[dtype]

    def program_at(self, dtype: str) -> Program:
        """The kernel's program in a step of `dtype` (what `at(dtype)` compiles and runs)."""
        return self.narrowed.get(dtype, self.program)

    def result_dtypes(self, group: Group, dtype: str) -> dict[str, torch.dtype]:
        """The dtype of each result the kernel writes for later ones, in a step of `dtype` (read
        once per dtype: each backward call checks what every kernel wrote against it)."""
        if dtype not in self.written:
            self.written[dtype] = result_dtypes(Group(self.program_at(dtype), group.results))
        return self.written[dtype]


def _group_args(group: Group, pool: dict[str, Any], named: dict[str, Any]) -> dict[str, Any]:
    """One kernel's arguments: its inputs from what the call and earlier kernels hold, and the
    call's scalar parameters."""
    return {**{b.name: pool[b.name] for b in group.program.inputs}, **{p: named[p] for p in group.program.params}}


@dataclass(frozen=True)
class Derived:
    """The forward (with its saved statistics) and the backward of one traced program, compiled."""

    gradient: Gradient
    forward: Compiled
    backward: Kernels

    @property
    def program(self) -> Program:
        return self.gradient.forward


def derived_for(fn: Compiled, program: Program, wrt: tuple[str, ...], sizes: dict[str, int] | None = None,
                dtype: str = "f32") -> Derived:
    """The derived backward of `program` (traced from `fn`) with respect to `wrt`, compiled once
    for each set of reductions the call's axis `sizes` make the forward save (in the call's
    `dtype`)."""
    by_size = saves_by_size(program, sizes)
    key = (program.fingerprint(), wrt, by_size, dtype if by_size else "f32")
    found = fn.training.get(key)
    if found is None:
        gradient = differentiate(program, wrt, sizes, dtype)
        found = Derived(gradient, Compiled(FixedProgram(gradient.forward, fn.program_def.promotes_outputs), fn.schedule,
                                           fn.allow_fallback),
                        Kernels(gradient.backward, gradient.held, fn.allow_fallback))
        fn.training[key] = found
    return found


@dataclass
class _Entry:
    """What the registered training op needs apart from tensors and numbers."""

    derived: Derived
    names: tuple[str, ...]  # the call's arguments, in order
    kinds: tuple[str, ...]  # "tensor" | "float" | "int" per argument
    prepared: bool = False  # the backward's kernels planned for these shapes

    def named(self, tensors: list[torch.Tensor], floats: list[float], ints: list[int]) -> dict[str, Any]:
        sources = {"tensor": iter(tensors), "float": iter(floats), "int": iter(ints)}
        return {n: next(sources[k]) for n, k in zip(self.names, self.kinds)}


_entries: list[_Entry] = []


@torch._dynamo.assume_constant_result
def training_handle(fn_id: int, names: tuple[str, ...], kinds: tuple[str, ...], wrt: tuple[str, ...],
                     shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...], numbers: tuple[Any, ...]) -> int:
    """The handle of (function, call layout, wrt) with its derived backward: traced and derived
    once, outside torch.compile's tracing (SymPy proves what it needs there). The compiled function
    comes as its id (runtime/state.py `object_of`). The handles of a function live on it, so a
    function made later (at the address of one collected) never gets another's backward, and a
    backward that fails to derive leaves no handle behind."""
    fn: Compiled = object_of(fn_id)
    key = (names, kinds, wrt, shapes, dtypes, numbers)
    if key not in fn.training_handles:
        examples = iter(torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
                        for shape, dtype in zip(shapes, dtypes))
        values = iter(numbers)
        named = {n: next(examples) if k == "tensor" else next(values) for n, k in zip(names, kinds)}
        program = fn.program_def.trace(**named)
        dtype = next((input_dtype_name(t.dtype) for t in named.values()
                      if isinstance(t, torch.Tensor) and t.is_floating_point()), "f32")
        _entries.append(_Entry(derived_for(fn, program, wrt, axis_extents(program, named), dtype), names, kinds))
        fn.training_handles[key] = len(_entries) - 1
    return fn.training_handles[key]


# training handles whose program depends on values torch.compile does not guard (a float a mod
# reads, fixed in the graph with the handle): the handle -> a function giving the handle of the
# current values, asked at every call of the op
_refreshers: dict[int, Callable[[], int]] = {}


def refresh_with(handle: int, refresh: Callable[[], int]) -> None:
    """Have the training op run `refresh()`'s handle where it is given `handle`."""
    _refreshers[handle] = refresh


def current_handle(handle: int) -> int:
    """`handle`, or the handle its refresher gives for the values of now (`refresh_with`)."""
    refresh = _refreshers.get(handle)
    return handle if refresh is None else refresh()


@torch.library.custom_op("neptune_fusion::train_forward", mutates_args=())
def train_forward(tensors: list[torch.Tensor], floats: list[float], ints: list[int], handle: int) -> list[torch.Tensor]:
    """The forward of a call that records gradients: its outputs, then the statistics its backward reads."""
    entry = _entries[current_handle(handle)]
    return _forward(entry, entry.named(tensors, floats, ints))


def _forward(entry: _Entry, named: dict[str, Any]) -> list[torch.Tensor]:
    if not entry.prepared:  # a backward that cannot be planned raises here, before any training step
        _prepare_backward(entry.derived, named)
        entry.prepared = True
    with private_state(in_cudagraph_tree()):  # in torch.compile's CUDA graphs no memory may outlive the call
        result = entry.derived.forward(**named)
    return list(result) if isinstance(result, tuple) else [result]


def _backward_args(derived: Derived, named: dict[str, Any], results: Sequence[torch.Tensor],
                   grads: Sequence[torch.Tensor | None]) -> dict[str, Any]:
    """The backward program's arguments: the call's, the forward's saved statistics and outputs
    (with the stage's own axes: size-1 dims dropped), and the outputs' gradients."""
    gradient, outputs = derived.gradient, derived.program.outputs
    values: dict[str, Any] = {}
    for i in gradient.outputs_read:
        out = results[i]
        values[outputs[i].stage] = out.reshape([n for n, d in zip(out.shape, outputs[i].dims) if d is not None])
    values.update(zip(gradient.saved, results[len(outputs) - len(gradient.saved):]))
    for i in gradient.grads_read:
        g = grads[i]
        values[grad_name(i)] = torch.zeros_like(results[i]) if g is None else g.contiguous()
    args = {b.name: named[b.name] if b.name in named else values[b.name] for b in gradient.backward.inputs}
    args.update({p: named[p] for p in gradient.backward.params})
    return args


def _prepare_backward(derived: Derived, named: dict[str, Any]) -> None:
    device = next(v.device for v in named.values() if isinstance(v, torch.Tensor))
    results = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in output_specs(derived.forward, named)]
    derived.backward.prepare(**_backward_args(derived, named, results, [None] * len(results)))


@train_forward.register_fake
def _(tensors: list[torch.Tensor], floats: list[float], ints: list[int], handle: int) -> list[torch.Tensor]:
    entry = _entries[handle]
    device = tensors[0].device
    return [torch.empty(shape, dtype=dtype, device=device)
            for shape, dtype in output_specs(entry.derived.forward, entry.named(tensors, floats, ints))]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    tensors, floats, ints, handle = inputs
    ctx.handle, ctx.floats, ctx.ints, ctx.count = handle, floats, ints, len(tensors)
    ctx.save_for_backward(*tensors, *output)


def _gradients(entry: _Entry, tensors: list[torch.Tensor], results: Sequence[torch.Tensor],
               grads: Sequence[torch.Tensor | None], floats: list[float], ints: list[int]) -> list[torch.Tensor | None]:
    """Per tensor argument of the call: its gradient (None where it is not differentiated)."""
    derived, gradient = entry.derived, entry.derived.gradient
    named = entry.named(tensors, floats, ints)
    args = _backward_args(derived, named, results, grads)
    cuts = _cuts(gradient, named, derived.program)
    for name, dims in cuts.items():
        for dim, length in dims:
            args[name] = args[name].narrow(dim, 0, length)
    found = dict(zip(gradient.nonzero, derived.backward(**args)))
    for name, dims in cuts.items():
        if name in found:  # the entries past the cut were read by no position: no gradient
            full = found[name].new_zeros(named[name].shape)
            view = full
            for dim, length in dims:
                view = view.narrow(dim, 0, length)
            view.copy_(found[name].reshape(view.shape))
            found[name] = full
    out: list[torch.Tensor | None] = []
    # a gradient passed through unchanged (x + y: both are the upstream gradient) is copied, so
    # no two gradients, and no gradient and an argument, share memory (accumulating into one
    # .grad would change the other; torch.compile refuses outputs aliasing inputs)
    taken = {x.untyped_storage().data_ptr() for x in (*tensors, *results, *grads) if x is not None}
    for name, tensor in zip(_tensor_names(entry), tensors):
        if name not in gradient.wrt:
            out.append(None)
            continue
        g = found[name].to(tensor.dtype).reshape(tensor.shape) if name in found else torch.zeros_like(tensor)
        if g.untyped_storage().data_ptr() in taken:
            g = g.clone()
        taken.add(g.untyped_storage().data_ptr())
        out.append(g)
    return out


def _cuts(gradient: Any, named: dict[str, Any], program: Any) -> dict[str, list[tuple[int, int]]]:
    """Per input indexed by another input's axis and longer along it (`table[q_idx]`, the table
    longer than the queries): (dim, the axis's length) to cut it to for the backward. Shorter is
    an error: the forward read past its end."""
    if not gradient.narrowed:
        return {}
    sizes = axis_extents(program, named)
    cuts: dict[str, list[tuple[int, int]]] = {}
    for name, dim, axis in gradient.narrowed:
        have, used = named[name].shape[dim], sizes[axis]
        if have < used:
            raise ValueError(f"the tensor {name!r} has {have} entries along dim {dim}, but the axis {axis!r} that "
                             f"indexes it has {used} positions: the forward read past its end")
        if have > used:
            cuts.setdefault(name, []).append((dim, used))
    return cuts


def _tensor_names(entry: _Entry) -> list[str]:
    return [n for n, k in zip(entry.names, entry.kinds) if k == "tensor"]


@torch.library.custom_op("neptune_fusion::train_backward", mutates_args=())
def train_backward(tensors: list[torch.Tensor], results: list[torch.Tensor], grads: list[torch.Tensor | None],
                   floats: list[float], ints: list[int], handle: int) -> list[torch.Tensor]:
    """The backward of `train_forward` under torch.compile, one op: the gradients of the call's
    tensors that are differentiated, in order. Its handle is asked again at the call
    (`current_handle`), as the forward's is, so both follow values torch.compile does not guard."""
    entry = _entries[current_handle(handle)]
    return [g for g in _gradients(entry, tensors, results, grads, floats, ints) if g is not None]


@train_backward.register_fake
def _(tensors: list[torch.Tensor], results: list[torch.Tensor], grads: list[torch.Tensor | None],
      floats: list[float], ints: list[int], handle: int) -> list[torch.Tensor]:
    entry = _entries[handle]
    wrt = entry.derived.gradient.wrt
    return [torch.empty_like(t) for name, t in zip(_tensor_names(entry), tensors) if name in wrt]


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, ...]:
    entry = _entries[ctx.handle]
    stored = ctx.saved_tensors
    tensors, results = list(stored[:ctx.count]), stored[ctx.count:]
    if is_eager(tensors):
        out = _gradients(entry, tensors, results, grads, ctx.floats, ctx.ints)
    else:  # traced: one op, which runs the backward of the handle current when it is called
        found = iter(train_backward(tensors, list(results), list(grads), ctx.floats, ctx.ints, ctx.handle))
        wrt = entry.derived.gradient.wrt
        out = [next(found) if name in wrt else None for name in _tensor_names(entry)]
    # the structure of the op's inputs, as torch flattens them: a list of numbers is one leaf, unless empty
    return out, None if ctx.floats else [], None if ctx.ints else [], None


train_forward.register_autograd(_backward, setup_context=_setup)


class _EagerTraining(torch.autograd.Function):
    """The training op's forward and backward for an eager call, without the op: a registered
    op's Python dispatch costs more host time per call than launching its kernels."""

    @staticmethod
    def forward(ctx: Any, handle: int, floats: list[float], ints: list[int], *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        entry = _entries[handle]
        output = _forward(entry, entry.named(list(tensors), floats, ints))
        _setup(ctx, (list(tensors), floats, ints, handle), output)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*output[len(output) - len(entry.derived.gradient.saved):])
        return tuple(output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if torch.is_grad_enabled():  # create_graph=True: gradients that would silently have none
            raise RuntimeError(f"{_entries[ctx.handle].derived.gradient.backward.name}: second derivatives are "
                               "not derived (create_graph=True); differentiate a plain torch version instead")
        return (None, None, None, *_gradients(_entries[ctx.handle], list(ctx.saved_tensors[:ctx.count]),
                                              ctx.saved_tensors[ctx.count:], list(grads), ctx.floats, ctx.ints))


def handle_for(fn: Compiled, named: dict[str, Any]) -> int:
    """The training op's handle of the call `fn(**named)`: gradients for the float tensors that
    require grad."""
    tensors = [v for v in named.values() if isinstance(v, torch.Tensor)]
    wrt = tuple(n for n, v in named.items() if isinstance(v, torch.Tensor) and v.requires_grad and v.is_floating_point())
    return training_handle(id(fn), tuple(named), argument_kinds(tuple(named.values())), wrt,
                           tuple(static_shape(t) for t in tensors), tuple(str(t.dtype).split(".")[-1] for t in tensors),
                           tuple(v for v in named.values() if not isinstance(v, torch.Tensor)))


def call_with_grad(fn: Compiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`fn(*args, **kwargs)` recorded for autograd with the program's derived backward: traced
    (torch.compile), one registered op (`neptune_fusion::train_forward`, whose backward runs the
    backward's kernels, each one `neptune_fusion::program` op); eager, the same forward and backward
    as a `torch.autograd.Function` that launches the kernels directly."""
    named = dict(fn.program_def.bind(*args, **kwargs))
    handle = handle_for(fn, named)
    tensors = [v for v in named.values() if isinstance(v, torch.Tensor)]
    numbers = [v for v in named.values() if not isinstance(v, torch.Tensor)]
    floats, ints = [v for v in numbers if isinstance(v, float)], [v for v in numbers if not isinstance(v, float)]
    if is_eager(tensors):
        result = _EagerTraining.apply(handle, floats, ints, *tensors)
    else:
        result = train_forward(tensors, floats, ints, handle)
    count = output_count(handle)
    return result[0] if count == 1 else tuple(result[:count])


@torch._dynamo.assume_constant_result
def output_count(handle: int) -> int:
    """How many of the training op's results are the call's outputs (the rest are saved for the
    backward). Read outside torch.compile's tracing: a handle made while tracing (a second
    function's, in the same graph) is an entry its snapshot of `_entries` lacks."""
    derived = _entries[handle].derived
    return len(derived.program.outputs) - len(derived.gradient.saved)


_compiled.WITH_GRAD = call_with_grad
