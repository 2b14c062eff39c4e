"""`explain`: every stage of compilation as text — the best debugging tool.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.library import softmax
    >>> text = nf.explain(softmax, torch.randn(4, 64))   # compiles, launches nothing
    >>> for line in text.splitlines():
    ...     if line.startswith("==="):
    ...         print(line)
    === 0. input ===
    === 1. inline elementwise stages ===
    === 2. commute normalisations past linear reductions ===
    === 3. inline stages indexed by the loop axis 'a1' (recomputed per tile, never stored) ===
    === 4. inline everything else into the loop and the outputs ===
    === 5. rolling update along 'a1' (derived repair terms) ===
    === schedule ===
    === kernel plan (every decision, the cache key) ===
    === tile program ===
    === Triton source ===
"""

from __future__ import annotations

from typing import Any, Callable

from neptune_fusion.ir.printer import format_program
from neptune_fusion.ir.program import Program
from neptune_fusion.lang.trace import ProgramDef
from neptune_fusion.runtime.compiled import Compiled
from neptune_fusion.schedule.templates import Schedule
from neptune_fusion.tile.ir import format_tile_kernel


def explain(program: ProgramDef | Program | Compiled | Callable[..., Any], *args: Any,
            schedule: Schedule | None = None, backward: bool = False, **kwargs: Any) -> str:
    """The input program, each fusion pass (with the derived repair terms), the tile program and Triton source.

    `program` is a `@nf.program`, a compiled function, or a traced `Program` (e.g. from
    `nf.attention_program`); arguments are passed as for a call (for a `Program`: its inputs,
    then its scalar parameters, in order, or by name). With `backward=True`, also the derived
    backward (with respect to the float tensor inputs that require grad, or all of them): what
    the forward saves, the backward program, and each of its kernels explained the same way.
    """
    if isinstance(program, Program):
        prog = program
        names = [b.name for b in prog.inputs] + list(prog.params)
        named = dict(zip(names, args))
        named.update(kwargs)
        compiled = Compiled(lambda: None, schedule)
    else:
        compiled = program if isinstance(program, Compiled) else Compiled(program, schedule)
        named = dict(compiled.program_def.bind(*args, **kwargs))
        prog = compiled.program_def.trace(**named)
    exe = compiled.executable_for(prog, named)
    out: list[str] = []
    if backward:
        return _explain_backward(prog, named, schedule, explain(compiled, **named))

    def section(title: str, body: str) -> None:
        out.append(f"=== {title} ===")
        out.append(body)
        out.append("")

    for i, step in enumerate(exe.steps):
        section(f"{i}. {step.name}", format_program(step.program))
    plan = exe.plan
    section("schedule", f"template {plan.template}: block_row={plan.block_row} block_col={plan.block_col} "
                        f"num_warps={plan.num_warps} num_stages={plan.num_stages} splits={plan.splits} "
                        f"prefetch_dot={plan.prefetch_dot}")
    if exe.record is not None:
        section("kernel plan (every decision, the cache key)", exe.record.describe() + f"\nbackend used: {exe.main.backend}")
    section("tile program", format_tile_kernel(exe.main.tile))
    section("Gluon source" if exe.main.backend == "gluon" else "Triton source", exe.main.source)
    if exe.combine_tile is not None:
        section("combine program (generated from the repair functions)", format_program(exe.combine_steps[0].program))
        section("combine after fusion", format_program(exe.combine_steps[-1].program))
        section("combine tile program", format_tile_kernel(exe.combine_tile))
        if exe.combine is not None:
            section("combine Triton source", exe.combine.source)
        else:
            section("combine", "called by the main kernel's last program per row tile (see the Triton source above)")
    for k, (group, part) in enumerate(exe.groups[1:], start=2):
        title = f"kernel {k} of {len(exe.groups)} ({group.program.name})"
        for kernel in (part.main, part.combine):
            if kernel is not None:
                section(f"{title}: tile program", format_tile_kernel(kernel.tile))
                section(f"{title}: Triton source", kernel.source)
    return "\n".join(out)


def _explain_backward(program: Program, named: dict[str, Any], schedule: Schedule | None, forward: str) -> str:
    """The forward's explanation, then the derived backward: its record, program and kernels."""
    import torch

    from neptune_fusion.analysis.chains import chain_axis
    from neptune_fusion.runtime.reference import axis_extents
    from neptune_fusion.schedule.partition import partition_loops
    from neptune_fusion.transform.grad import differentiate

    floats = [b.name for b in program.inputs if b.kind == "float" and named[b.name].is_floating_point()]
    wrt = tuple(n for n in floats if named[n].requires_grad) or tuple(floats)
    gradient = differentiate(program, wrt)
    out = [forward, "=== derived backward ===",
           f"with respect to {list(wrt)}; zero by structure: {sorted(set(wrt) - set(gradient.nonzero))}",
           f"saved by the forward: {list(gradient.saved)}; recovered from outputs: {list(gradient.recovered)}",
           f"stabilisers proved gradient-free: {list(gradient.free_stabilisers)}; held axes: {sorted(gradient.held)}",
           "", format_program(gradient.backward), ""]
    sizes = axis_extents(program, named)
    example = next(named[n] for n in floats)
    for i, group in enumerate(partition_loops(gradient.backward, gradient.held)):
        args: dict[str, Any] = {p: named[p] for p in group.program.params}
        for buf in group.program.inputs:
            if buf.name in named:
                args[buf.name] = named[buf.name]
            else:  # saved statistics, output gradients and other kernels' results: random stand-ins
                shape = [sizes.get(a, 1) if a else 1 for a in buf.dims]
                args[buf.name] = torch.randn(shape, device=example.device, dtype=torch.float32)
        out.append(f"=== backward kernel {i}: {group.program.name} (results {list(group.results)}) ===")
        if chain_axis(group.program) is None:  # what integrations/autograd.py runs unfused
            out.append("(no reduction: torch's element-wise kernels run it)\n" + format_program(group.program))
        else:
            out.append(explain(group.program, **args, schedule=None))
    return "\n".join(out)
