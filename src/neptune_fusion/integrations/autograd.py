"""Autograd for `nf.compile`d programs: the backward the compiler derives, as torch's backward.

A call whose float inputs require grad (in grad mode) runs through `ProgramFunction`, a
`torch.autograd.Function`: its forward runs the program with the statistics its backward needs
as extra outputs (`transform/grad.py` decides which: never a query-by-key matrix), its backward
runs the derived backward program, compiled and fused by the same pipeline. Both are ordinary
`Compiled` functions, so inside torch.compile each is one registered op of the graph. A program
whose backward cannot be derived raises `FusionError` at the forward call.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.library import softmax
    >>> x = torch.randn(2, 8, requires_grad=True)
    >>> y = nf.compile(softmax)(x)                      # doctest: +SKIP
    >>> (y * torch.randn(2, 8)).sum().backward()        # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from neptune_fusion.analysis.chains import chain_axis
from neptune_fusion.ir.program import Program
from neptune_fusion.lang.trace import FixedProgram
from neptune_fusion.runtime import compiled as _compiled
from neptune_fusion.runtime.compiled import Compiled, install_allocator
from neptune_fusion.runtime.reference import run_reference
from neptune_fusion.schedule.partition import Group, partition_loops
from neptune_fusion.schedule.templates import Auto
from neptune_fusion.transform.grad import Gradient, differentiate, grad_name

__all__ = ["Derived", "ProgramFunction", "derived_for"]


class Unfused:
    """A program without a reduction (an element-wise backward), run by the reference executor:
    the fused kernels need a loop to fuse into, and torch's element-wise kernels are what an
    unfused program runs on anyway (inside torch.compile, inductor fuses them)."""

    def __init__(self, program: Program) -> None:
        self.program = program

    def __call__(self, **named: Any) -> Any:
        dtype = next(named[b.name].dtype for b in self.program.inputs if named[b.name].is_floating_point())
        return run_reference(self.program, named, out_dtype=dtype)


class Kernels:
    """A program of several loops (a backward pass) as the kernels `partition_loops` cuts it into,
    run in order; what one kernel materialises, the later ones read."""

    def __init__(self, program: Program, held: frozenset[str], allow_fallback: bool) -> None:
        self.program = program
        self.steps: list[tuple[Group, Compiled | Unfused]] = []
        for group in partition_loops(program, held):
            sub = group.program
            self.steps.append((group, Compiled(FixedProgram(sub), Auto(), allow_fallback) if chain_axis(sub)
                               else Unfused(sub)))

    def __call__(self, **named: Any) -> tuple[torch.Tensor, ...]:
        pool = dict(named)
        outs: list[torch.Tensor | None] = [None] * len(self.program.outputs)
        for group, fn in self.steps:
            args = {b.name: pool[b.name] for b in group.program.inputs}
            args.update({p: named[p] for p in group.program.params})
            result = fn(**args)
            for name, value in zip(group.results, result if isinstance(result, tuple) else (result,)):
                if name.startswith("output:"):
                    outs[int(name.split(":")[1])] = value
                else:
                    pool[name] = value
        return tuple(outs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Derived:
    """The forward (with its saved statistics) and the backward of one traced program, compiled."""

    gradient: Gradient
    forward: Compiled
    backward: Kernels

    @property
    def program(self) -> Program:
        return self.gradient.forward


def derived_for(fn: Compiled, program: Program, wrt: tuple[str, ...]) -> Derived:
    """The derived backward of `program` (traced from `fn`) with respect to `wrt`, compiled once."""
    key = (program.fingerprint(), wrt)
    found = fn.training.get(key)
    if found is None:
        gradient = differentiate(program, wrt)
        found = Derived(gradient, Compiled(FixedProgram(gradient.forward), fn.schedule, fn.allow_fallback),
                        Kernels(gradient.backward, gradient.held, fn.allow_fallback))
        fn.training[key] = found
    return found


class ProgramFunction(torch.autograd.Function):
    """One call of a compiled program with its derived backward."""

    @staticmethod
    def forward(ctx: Any, derived: Derived, names: tuple[str, ...], scalars: dict[str, Any],
                *tensors: torch.Tensor) -> Any:
        named = {**dict(zip(names, tensors)), **scalars}
        result = derived.forward(**named)
        result = result if isinstance(result, tuple) else (result,)
        count = len(derived.program.outputs) - len(derived.gradient.saved)
        outs, saved = result[:count], result[count:]
        ctx.derived, ctx.names, ctx.scalars, ctx.count = derived, names, scalars, count
        ctx.save_for_backward(*tensors, *outs, *saved)
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        return outs[0] if count == 1 else outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        install_allocator()  # autograd's own thread: Triton's allocator is per thread
        derived: Derived = ctx.derived
        gradient = derived.gradient
        stored = ctx.saved_tensors
        tensors, outs, saved = stored[:len(ctx.names)], stored[len(ctx.names):][:ctx.count], stored[len(ctx.names) + ctx.count:]
        by_name = dict(zip(ctx.names, tensors))
        values: dict[str, Any] = {}
        outputs = derived.program.outputs
        for i in gradient.outputs_read:  # read with the stage's own axes: size-1 dims dropped
            out = outs[i]
            values[outputs[i].stage] = out.reshape([n for n, d in zip(out.shape, outputs[i].dims) if d is not None])
        values.update(zip(gradient.saved, saved))
        for i in gradient.grads_read:
            g = grads[i]
            values[grad_name(i)] = torch.zeros_like(outs[i]) if g is None else g.contiguous()
        args = {b.name: by_name[b.name] if b.name in by_name else values[b.name] for b in gradient.backward.inputs}
        result = derived.backward(**args, **ctx.scalars)
        result = result if isinstance(result, tuple) else (result,)
        found = dict(zip(gradient.nonzero, result))
        out: list[torch.Tensor | None] = []
        for name, tensor in zip(ctx.names, tensors):
            if name not in gradient.wrt:
                out.append(None)
            elif name in found:
                out.append(found[name].to(tensor.dtype).reshape(tensor.shape))
            else:
                out.append(torch.zeros_like(tensor))
        return (None, None, None, *out)


def call_with_grad(fn: Compiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`fn(*args, **kwargs)` recorded for autograd with the program's derived backward."""
    named = dict(fn.program_def.bind(*args, **kwargs))
    tensors = {n: v for n, v in named.items() if isinstance(v, torch.Tensor)}
    scalars = {n: v for n, v in named.items() if not isinstance(v, torch.Tensor)}
    program = fn.program_def.trace(**named)
    wrt = tuple(n for n, t in tensors.items() if t.requires_grad and t.is_floating_point())
    derived = derived_for(fn, program, wrt)
    return ProgramFunction.apply(derived, tuple(tensors), scalars, *tensors.values())


_compiled.WITH_GRAD = call_with_grad
