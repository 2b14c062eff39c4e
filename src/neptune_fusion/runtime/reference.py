"""The reference executor: runs any Program unfused with torch. The ground truth of every test.

Fused loops are executed as what they claim to be: a rolling loop walks its axis in
chunks of `block` elements and repairs accumulators with the derived repair terms; a
split-K loop computes private partial states per chunk and merges them. So running
the executor before and after a transform validates the transform.

Example:
    >>> import torch, neptune_fusion as nf
    >>> @nf.program
    ... def rowsum(x):
    ...     return x.sum(axis=-1)
    >>> x = torch.randn(3, 5)
    >>> out = run_reference(rowsum.trace(x), {"x": x})
    >>> bool(torch.allclose(out, x.sum(-1)))
    True
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from neptune_fusion.ir.expr import (
    NARROW_INT_DTYPES,
    REDUCER_IDENTITY,
    RUNNING_STAND_IN,
    Accumulator,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Running,
    Size,
    Unary,
    Where,
)
from neptune_fusion.ir.program import FusedLoop, Program, Stage
from neptune_fusion.lang.trace import set_eager_executor

_TORCH_DTYPES = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i32": torch.int32, "i64": torch.int64, "bool": torch.bool,
}


_NARROW_INTS = tuple(getattr(torch, name) for name in NARROW_INT_DTYPES.values())


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for our short name ('f16' -> torch.float16)."""
    return _TORCH_DTYPES[name]


def axis_extents(program: Program, args: Mapping[str, Any]) -> dict[str, int]:
    """Sizes of all axes, read from the input tensors; raises ValueError on inconsistent shapes."""
    sizes: dict[str, int] = {}
    for buf in program.inputs:
        if buf.name not in args:
            raise ValueError(f"missing input {buf.name!r}")
        t = args[buf.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"input {buf.name!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != len(buf.dims):
            raise ValueError(f"input {buf.name!r} must have rank {len(buf.dims)}, got shape {tuple(t.shape)}")
        for pos, axis in enumerate(buf.dims):
            if axis is None:
                continue
            size = t.shape[pos]  # (an int; under torch.compile's dynamic shapes a symbol, kept unguarded)
            if axis in sizes and sizes[axis] != size:
                src, dim = program.axis_sizes.get(axis, ("?", 0))
                raise ValueError(
                    f"input {buf.name!r} dim {pos} has size {size}, but it indexes axis {axis!r} "
                    f"of size {sizes[axis]} (from {src!r} dim {dim})"
                )
            sizes[axis] = size
    for axis, (buffer, dim) in program.axis_sizes.items():
        if axis not in sizes and buffer in args:  # an axis of an input's size that indexes no input (x @ x.T's)
            sizes[axis] = args[buffer].shape[dim]
    for axis, (op, a, b) in program.derived_axes.items():
        # derived axes come from layout transforms: ("div", axis, n), ("mul", axis, axis), ("const", n, _)
        if op == "div":
            sizes[axis] = sizes[a] // int(b)  # type: ignore[arg-type,index]
        elif op == "mul":
            sizes[axis] = sizes[a] * sizes[b]  # type: ignore[index]
        elif op == "mulc":
            sizes[axis] = sizes[a] * int(b)  # type: ignore[index,arg-type]
        elif op == "const":
            sizes[axis] = int(a)  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown derived axis rule {op!r}")
    return sizes


class _Evaluator:
    """Evaluates expressions over a frame of axes; results broadcast to the frame's rank."""

    def __init__(self, sizes: dict[str, int], buffers: dict[str, torch.Tensor],
                 params: Mapping[str, Any], dtype: torch.dtype, device: torch.device) -> None:
        self.sizes = sizes
        self.buffers = buffers
        self.params = params
        self.dtype = dtype
        self.device = device
        self.ranges: dict[str, torch.Tensor] = {}
        self.placeholders: dict[Expr, torch.Tensor] = {}

    def axis_range(self, axis: str) -> torch.Tensor:
        if axis in self.ranges:
            return self.ranges[axis]
        return torch.arange(self.sizes[axis], device=self.device)

    def eval(self, expr: Expr, frame: list[str]) -> torch.Tensor:
        if expr in self.placeholders:
            return self.placeholders[expr]
        if isinstance(expr, Const):
            v = expr.value
            if isinstance(v, bool):
                return torch.tensor(v, device=self.device)
            if isinstance(v, int):
                return torch.tensor(v, dtype=torch.int64, device=self.device)
            return torch.tensor(v, dtype=self.dtype, device=self.device)
        if isinstance(expr, Size):
            return torch.tensor(self.sizes[expr.axis], dtype=torch.int64, device=self.device)
        if isinstance(expr, Param):
            v = self.params[expr.name]
            if isinstance(v, int) and not isinstance(v, bool):
                return torch.tensor(v, dtype=torch.int64, device=self.device)
            return torch.tensor(float(v), dtype=self.dtype, device=self.device)
        if isinstance(expr, Index):
            r = self.axis_range(expr.axis)
            shape = [1] * len(frame)
            # the innermost binding of the axis (a nested Reduce may shadow an outer one)
            shape[len(frame) - 1 - frame[::-1].index(expr.axis)] = r.numel()
            return r.view(shape)
        if isinstance(expr, Load):
            buf = self.buffers[expr.buffer]
            if buf.dtype in _NARROW_INTS:
                buf = buf.to(torch.int32)  # as kernels widen them when loading
            idx = [self._index(i, frame) for i in expr.index]
            if not idx:
                return buf
            idx = list(torch.broadcast_tensors(*idx))
            out = buf[tuple(idx)]
            return out.to(self.dtype) if out.is_floating_point() else out
        if isinstance(expr, Unary):
            return _UNARY[expr.op](self.eval(expr.x, frame))
        if isinstance(expr, Binary):
            a, b = self.eval(expr.a, frame), self.eval(expr.b, frame)
            return _BINARY[expr.op](a, b)
        if isinstance(expr, Where):
            c = self.eval(expr.cond, frame)
            a, b = self.eval(expr.a, frame), self.eval(expr.b, frame)
            if a.is_floating_point() or b.is_floating_point():
                a, b = a.to(self.dtype), b.to(self.dtype)
            return torch.where(c.bool(), a, b)
        if isinstance(expr, Cast):
            x = self.eval(expr.x, frame)
            target = torch_dtype(expr.dtype)
            y = x.to(target)
            return y.to(self.dtype) if y.is_floating_point() else y
        if isinstance(expr, Reduce):
            return self._reduce(expr, frame)
        raise TypeError(f"reference executor cannot evaluate {expr!r}")

    def _index(self, expr: Expr, frame: list[str]) -> torch.Tensor:
        v = self.eval(expr, frame)
        return v.long() if v.dtype != torch.long else v

    def _reduce(self, expr: Reduce, frame: list[str]) -> torch.Tensor:
        inner = frame + [expr.axis]
        body = expr.body
        if expr.op == "sum" and isinstance(body, Binary) and body.op == "mul":
            return self._contract(body.a, body.b, inner)
        v = self._rank(self.eval(body, inner), len(inner))
        n = self.axis_range(expr.axis).numel()
        if v.shape[-1] != n:
            v = v.expand(*v.shape[:-1], n)
        if v.dtype == torch.bool:
            v = v.to(self.dtype)
        return _REDUCE[expr.op](v, -1)

    def _contract(self, a_expr: Expr, b_expr: Expr, frame: list[str]) -> torch.Tensor:
        # sum over the last frame axis of a*b, without materialising the broadcast product
        a, b = self.eval(a_expr, frame), self.eval(b_expr, frame)
        a, b = self._rank(a, len(frame)), self._rank(b, len(frame))
        if a.dtype == torch.bool or b.dtype == torch.bool or not (a.is_floating_point() and b.is_floating_point()):
            a, b = a.to(self.dtype), b.to(self.dtype)
        n = self.axis_range(frame[-1]).numel()
        letters = "abcdefghijklmnopqrstuvwxyz"[: len(frame)]

        def spec(t: torch.Tensor) -> tuple[torch.Tensor, str]:
            keep = [d for d in range(len(frame)) if t.shape[d] != 1]
            return t.squeeze([d for d in range(len(frame)) if t.shape[d] == 1]) if keep != list(range(len(frame))) else t, "".join(letters[d] for d in keep)

        ta, sa = spec(a)
        tb, sb = spec(b)
        red = letters[-1]
        if red not in sa and red not in sb:
            scale = float(n)
        else:
            scale = 1.0
        out_letters = "".join(ch for ch in letters[:-1] if ch in sa or ch in sb)
        res = torch.einsum(f"{sa},{sb}->{out_letters}", ta, tb) * scale
        shape = [self.axis_range(frame[d]).numel() if letters[d] in out_letters else 1 for d in range(len(frame) - 1)]
        return res.reshape(shape)


    @staticmethod
    def _rank(t: torch.Tensor, rank: int) -> torch.Tensor:
        return t.view([1] * (rank - t.dim()) + list(t.shape)) if t.dim() < rank else t



def _safe(value: torch.Tensor, op: str | None) -> torch.Tensor:
    """The running value that terms are computed with: a producer still at its identity is used
    as a finite stand-in (max/min: 0, so no inf - inf; sum: 1, so no division by zero).

    Any stand-in is exact as long as the accumulators computed with it are later repaired *from
    the same value* (replacement condition), which `_rolling` and `_split_k` do.
    """
    if op in RUNNING_STAND_IN:
        return torch.where(value == REDUCER_IDENTITY[op], torch.full_like(value, RUNNING_STAND_IN[op]), value)
    return value


_UNARY = {
    "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "abs": torch.abs, "not": torch.logical_not, "sin": torch.sin, "cos": torch.cos,
    "recip": torch.reciprocal, "erf": torch.erf, "detach": torch.Tensor.detach,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "max": torch.maximum, "min": torch.minimum, "pow": torch.pow,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": lambda a, b: torch.logical_and(a, b) if a.dtype == torch.bool and b.dtype == torch.bool else a & b,
    "or": lambda a, b: torch.logical_or(a, b) if a.dtype == torch.bool and b.dtype == torch.bool else a | b,
    "floordiv": torch.floor_divide, "mod": torch.remainder,
}
_REDUCE = {
    "sum": lambda v, d: v.sum(d), "max": lambda v, d: v.amax(d), "min": lambda v, d: v.amin(d),
    "prod": lambda v, d: v.prod(d),
}
_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}


def _stage_shape(stage: Stage, sizes: dict[str, int]) -> list[int]:
    return [sizes[a] for a in stage.axes]


def _run_stage(ev: _Evaluator, stage: Stage, sizes: dict[str, int]) -> torch.Tensor:
    value = ev.eval(stage.body, list(stage.axes))
    shape = _stage_shape(stage, sizes)
    if value.dim() < len(shape):
        value = value.view([1] * (len(shape) - value.dim()) + list(value.shape))
    value = value.expand(shape)
    return value.to(ev.dtype).contiguous() if value.dtype != torch.bool else value.contiguous()


def _rolling(ev: _Evaluator, loop: FusedLoop, sizes: dict[str, int], start: int, stop: int,
             block: int) -> dict[str, torch.Tensor]:
    """Partial states of the loop's members over [start, stop), walked in chunks with repairs."""
    state: dict[str, torch.Tensor] = {}
    for m in loop.members:
        state[m.name] = torch.full(_stage_shape(m, sizes), REDUCER_IDENTITY[m.reduce_op], dtype=ev.dtype, device=ev.device)
    ops = {m.name: m.reduce_op for m in loop.members}
    for lo in range(start, stop, block):
        hi = min(stop, lo + block)
        ev.ranges[loop.axis] = torch.arange(lo, hi, device=ev.device)
        # the values the accumulators were last computed with (see `_safe`)
        old = {name: _safe(value, ops[name]) for name, value in state.items()}
        for m in loop.members:
            producers = loop.producers.get(m.name, ())
            for p in producers:
                ev.buffers[p] = _safe(state[p], ops[p])
            contribution = _run_stage(ev, m, sizes)
            acc = state[m.name]
            if producers:
                acc = _apply_repair(ev, loop, m, acc, {p: old[p] for p in producers},
                                    {p: _safe(state[p], ops[p]) for p in producers})
            state[m.name] = _COMBINE[m.reduce_op](acc, contribution)
        del ev.ranges[loop.axis]
    return state


def _apply_repair(ev: _Evaluator, loop: FusedLoop, member: Stage, acc: torch.Tensor,
                  old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], guard: bool = True) -> torch.Tensor:
    repair = loop.repairs[member.name]
    if repair is None:
        raise ValueError(f"fused loop {loop.name!r}: member {member.name!r} has producers but no repair")
    ev.placeholders = {Accumulator(): acc}
    for p in old:
        ev.placeholders[Running(p, "old")] = _align(old[p], loop.member(p), member)
        ev.placeholders[Running(p, "new")] = _align(new[p], loop.member(p), member)
    out = ev.eval(repair, list(member.axes))
    ev.placeholders = {}
    if not guard:
        return out.expand(acc.shape)
    # 0 * inf from a stale accumulator that never saw a value stays 0 (it contributed nothing)
    return torch.where(acc == REDUCER_IDENTITY[member.reduce_op], acc, out).expand(acc.shape)


def _finish(ev: _Evaluator, loop: FusedLoop, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Repair accumulators from the stand-in running values (`_safe`) to the true final ones.

    Only where a producer ended at its identity (nothing seen: a fully masked row) do the two
    differ; there the unfused program computes with that identity (e.g. exp(-inf - -inf) = nan),
    and so does this, so a fused loop agrees with the unfused program element for element.
    """
    ops = {m.name: m.reduce_op for m in loop.members}
    used = {name: _safe(value, ops[name]) for name, value in state.items()}
    final = dict(state)
    for m in loop.members:
        producers = loop.producers.get(m.name, ())
        if not producers:
            continue
        changed = torch.zeros((), dtype=torch.bool, device=ev.device)
        for p in producers:
            differs = (used[p] != final[p]) | torch.isnan(final[p])
            changed = changed | _align(differs, loop.member(p), m)
        if not bool(changed.any()):
            continue
        fixed = _apply_repair(ev, loop, m, state[m.name], {p: used[p] for p in producers},
                              {p: final[p] for p in producers}, guard=False)
        final[m.name] = torch.where(changed, fixed, state[m.name])
    return final


def _align(value: torch.Tensor, producer: Stage, member: Stage) -> torch.Tensor:
    """View a producer's value in the member's axes (producer axes must be a subset)."""
    shape = [value.shape[producer.axes.index(a)] if a in producer.axes else 1 for a in member.axes]
    perm = [producer.axes.index(a) for a in member.axes if a in producer.axes]
    return value.permute(perm).reshape(shape)


def _split_k(ev: _Evaluator, loop: FusedLoop, sizes: dict[str, int], block: int) -> dict[str, torch.Tensor]:
    n = sizes[loop.axis]
    chunk = max(1, math.ceil(n / loop.splits))
    partials = [_rolling(ev, loop, sizes, lo, min(n, lo + chunk), block) for lo in range(0, n, chunk)]
    ops = {m.name: m.reduce_op for m in loop.members}
    final: dict[str, torch.Tensor] = {}
    for m in loop.members:
        producers = loop.producers.get(m.name, ())
        total = None
        for part in partials:
            value = part[m.name]
            if producers:
                value = _apply_repair(ev, loop, m, value, {p: _safe(part[p], ops[p]) for p in producers},
                                      {p: _safe(final[p], ops[p]) for p in producers})
            total = value if total is None else _COMBINE[m.reduce_op](total, value)
        assert total is not None
        final[m.name] = total
    return final


def run_reference(program: Program, args: Mapping[str, Any], *, dtype: torch.dtype = torch.float32,
                  block: int = 16, out_dtype: torch.dtype | None = None) -> Any:
    """Run `program` on `args` (input name -> tensor, param name -> number), unfused.

    Returns one tensor or a tuple, shaped as the program's outputs. Computation is in
    `dtype`; outputs are cast to `out_dtype` if given. `block` is the chunk size used
    to walk fused loops.
    """
    sizes = axis_extents(program, args)
    device = next((args[b.name].device for b in program.inputs), torch.device("cpu"))
    for p in program.params:
        if p not in args:
            raise ValueError(f"missing scalar parameter {p!r}")
    params = {p: args[p] for p in program.params}
    buffers: dict[str, torch.Tensor] = {b.name: args[b.name] for b in program.inputs}
    ev = _Evaluator(sizes, buffers, params, dtype, device)
    for node in program.stages:
        if isinstance(node, Stage):
            buffers[node.name] = _run_stage(ev, node, sizes)
        elif node.mode == "rolling":
            buffers.update(_finish(ev, node, _rolling(ev, node, sizes, 0, sizes[node.axis], block)))
        else:
            buffers.update(_finish(ev, node, _split_k(ev, node, sizes, block)))
    outs = []
    for spec in program.outputs:
        value = buffers[spec.stage]
        stage_axes = program.stage(spec.stage).axes
        value = value.permute([stage_axes.index(d) for d in spec.dims if d is not None])
        value = value.reshape([sizes[d] if d else 1 for d in (spec.view or spec.dims)])
        outs.append(value.to(out_dtype) if out_dtype is not None and value.is_floating_point() else value)
    return outs[0] if len(outs) == 1 else tuple(outs)


set_eager_executor(lambda program, args: run_reference(program, args))
