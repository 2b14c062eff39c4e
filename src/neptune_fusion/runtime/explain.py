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

import torch

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import Cast
from neptune_fusion.ir.printer import format_expr, format_program
from neptune_fusion.ir.program import Program
from neptune_fusion.lang.dtypes import output_dtypes
from neptune_fusion.lang.tensor import input_dtype_name
from neptune_fusion.lang.trace import FixedProgram, ProgramDef
from neptune_fusion.runtime.compiled import (
    Compiled,
    Executable,
    arg_names,
    gemm_dtype,
    input_dtypes,
    long_axes,
    narrow_inputs,
    result_dtypes,
)
from neptune_fusion.runtime.reference import axis_extents, torch_dtype
from neptune_fusion.schedule.library import Declined, library_contraction
from neptune_fusion.schedule.partition import Group, why_apart
from neptune_fusion.schedule.templates import Schedule
from neptune_fusion.tile.ir import format_tile_kernel
from neptune_fusion.transform.grad import Gradient, grad_name


def explain(program: ProgramDef | Program | Compiled | Callable[..., Any], *args: Any,
            schedule: Schedule | None = None, backward: bool = False, compute_dtype: str | None = None,
            **kwargs: Any) -> str:
    """The input program, each fusion pass (with the derived repair terms), the tile program and Triton source.

    `program` is a `@nf.program`, a compiled function, or a traced `Program` (e.g. from
    `nf.attention_program`); arguments are passed as for a call (for a `Program`: its inputs,
    then its scalar parameters, in order, or by name). With `backward=True`, also the derived
    backward (with respect to the float tensor inputs that require grad, or all of them): what
    the forward saves, the backward program, and each of its kernels explained the same way, each
    multiplying in the forward's dtype as it runs. `compute_dtype` (a traced `Program`'s): the dtype
    its dots multiply in where not its first float input's.
    """
    if isinstance(program, Program):
        prog = program
        names = [b.name for b in prog.inputs] + list(prog.params)
        named = dict(zip(names, args))
        named.update(kwargs)
        compiled = Compiled(lambda: None, schedule, compute_dtype=compute_dtype)
    else:
        compiled = program if isinstance(program, Compiled) else Compiled(program, schedule)
        named = dict(compiled.program_def.bind(*args, **kwargs))
        prog = compiled.program_def.trace(**named)
    exe = compiled.executable_for(prog, named)
    out: list[str] = []
    if backward:
        forward = explain(program if isinstance(program, Program) else compiled, schedule=schedule, **named)
        return _explain_backward(prog, named, schedule, forward)

    def section(title: str, body: str) -> None:
        out.append(f"=== {title} ===")
        out.append(body)
        out.append("")

    if exe.library is not None:
        section("library contraction (schedule/library.py)", exe.library.plan.describe())
        for j, operand in enumerate(exe.library.plan.operands):
            if operand.program is not None:
                section(f"operand {j}: {operand.program.name}",
                        explain(operand.program, **{n: named[n] for n in arg_names(operand.program)}))
        return "\n".join(out)
    declined = library_contraction(prog, axis_extents(prog, named), compiled.compute_dtype or gemm_dtype(prog, named),
                                   input_dtypes(prog, named))
    if isinstance(declined, Declined) and declined.estimated:
        section("library contraction (schedule/library.py)", f"not used: {declined.reason}")
    if exe.groups:
        section(f"{len(exe.groups)} kernels",
                exe.apart or why_apart(prog, long_axes(prog, named), narrow_inputs(prog, named)) or "")
    for i, step in enumerate(exe.steps):
        section(f"{i}. {step.name}", format_program(step.program))
    plan = exe.plan
    if exe.groups and exe.groups[0][1].main is None:  # the first kernel is a GEMM of the library's
        group, first = exe.groups[0]
        for title, body in _part_sections(f"kernel 1 of {len(exe.groups)} ({group.program.name})", first):
            section(title, body)
        _later_kernels(exe, section)
        return "\n".join(out)
    assert plan is not None and exe.main is not None
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
    _later_kernels(exe, section)
    return "\n".join(out)


def _later_kernels(exe: Executable, section: Callable[[str, str], None]) -> None:
    """The tile programs and sources of a grouped program's kernels after the first."""
    for k, (group, part) in enumerate(exe.groups[1:], start=2):
        for title, body in _part_sections(f"kernel {k} of {len(exe.groups)} ({group.program.name})", part):
            section(title, body)


def _part_sections(title: str, part: Executable) -> list[tuple[str, str]]:
    """(title, body) of one kernel of a grouped program: its tile programs and sources, or the
    GEMM the library runs and its operand writers' (themselves possibly grouped)."""
    if part.library is not None:
        found = [(f"{title}: library contraction", part.library.plan.describe())]
        for j, writer in enumerate(part.library.operands):
            if writer is not None:
                found += _part_sections(f"{title}: operand {j}", writer)
        return found
    found = []
    for kernel in (part.main, part.combine):
        if kernel is not None:
            found += [(f"{title}: tile program", format_tile_kernel(kernel.tile)),
                      (f"{title}: {'Gluon' if kernel.backend == 'gluon' else 'Triton'} source", kernel.source)]
    for k, (group, inner) in enumerate(part.groups[1:], start=2):
        found += _part_sections(f"{title}, part {k} ({group.program.name})", inner)
    return found


def _explain_backward(program: Program, named: dict[str, Any], schedule: Schedule | None, forward: str) -> str:
    """The forward's explanation, then the derived backward: its record, program and kernels."""

    from neptune_fusion.analysis.chains import chain_axis
    from neptune_fusion.schedule.partition import narrow_materialised, partition_loops
    from neptune_fusion.transform.grad import differentiate

    floats = [b.name for b in program.inputs if b.kind == "float" and named[b.name].is_floating_point()]
    wrt = tuple(n for n in floats if named[n].requires_grad) or tuple(floats)
    # every kernel multiplies in the forward's dtype (integrations/autograd.py `Kernels.dtype`)
    dtype = next((input_dtype_name(named[b.name].dtype) for b in program.inputs
                  if isinstance(named.get(b.name), torch.Tensor) and named[b.name].is_floating_point()), "f32")
    gradient = differentiate(program, wrt, axis_extents(program, named), dtype)
    out = [forward, "=== derived backward ===",
           f"with respect to {list(wrt)}; zero by structure: {sorted(set(wrt) - set(gradient.nonzero))}",
           f"saved by the forward: {list(gradient.saved)}; recovered from outputs: {list(gradient.recovered)}",
           f"stabilisers proved gradient-free: {list(gradient.free_stabilisers)}; held axes: {sorted(gradient.held)}",
           "", format_program(gradient.backward), ""]
    stand_ins = _stand_ins(gradient, named, sizes_of=program)
    sizes = axis_extents(gradient.backward, {**named, **stand_ins})
    unplanned: list[tuple[Group, FusionError]] = []
    groups = partition_loops(gradient.backward, gradient.held)
    if dtype in ("f16", "bf16"):  # what later kernels read only as a dot's operand is written in the step's dtype
        groups = narrow_materialised(groups, dtype)
    written: dict[str, torch.dtype] = {}
    for i, group in enumerate(groups):
        args: dict[str, Any] = {p: named[p] for p in group.program.params}
        for b in group.program.inputs:  # an earlier kernel's result (the row statistic D) stands in too
            if b.name not in named and b.name not in stand_ins:
                stand_ins[b.name] = torch.randn([sizes[a] if a else 1 for a in b.dims],
                                                dtype=written.get(b.name, torch.float32),
                                                device=next(iter(stand_ins.values())).device)
        written.update(result_dtypes(group))
        args.update({b.name: named[b.name] if b.name in named else stand_ins[b.name] for b in group.program.inputs})
        out.append(f"=== backward kernel {i}: {group.program.name} (results {list(group.results)}) ===")
        if chain_axis(group.program) is None and all(r.startswith("output:") for r in group.results):
            # what integrations/autograd.py runs unfused
            out.append("(no reduction: torch's element-wise kernels run it)\n" + format_program(group.program))
            continue
        try:  # as the training call plans it: a chunked plan before one kernel split in several
            out.append(explain(Compiled(FixedProgram(group.program), compute_dtype=dtype, split_to_fit=False), **args))
        except FusionError as exc:
            out.append(f"(no kernel plan computes it: {exc})")
            unplanned.append((group, exc, args))
    if unplanned:
        chunked, planned = _explain_chunked([g for g, _, _ in unplanned], sizes, {**named, **stand_ins})
        out.append(chunked)
        if not planned:
            for group, _, args in unplanned:
                out.append(f"=== {group.program.name}, one kernel's tile split in several ===")
                out.append(explain(group.program, **args, schedule=None, compute_dtype=dtype))
    return "\n".join(out)


def _stand_ins(gradient: Gradient, named: dict[str, Any], sizes_of: Program) -> dict[str, Any]:
    """Random tensors for the backward's inputs the call does not have, shaped by the forward's
    axis sizes: the outputs and their gradients in the outputs' dtypes, the saved values in the
    dtypes the forward writes them (other kernels' results in fp32), as the training call passes them."""

    sizes = axis_extents(sizes_of, named)
    example = next(v for v in named.values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    out_dtypes = output_dtypes(sizes_of, named)
    forward = gradient.forward
    saved = forward.outputs[len(forward.outputs) - len(gradient.saved):]
    dtypes = {**{grad_name(i): out_dtypes[i] for i in gradient.grads_read},
              **{sizes_of.outputs[i].stage: out_dtypes[i] for i in gradient.outputs_read},
              **{name: torch_dtype(body.dtype) for name, o in zip(gradient.saved, saved)
                 if isinstance(body := forward.stage(o.stage).body, Cast)}}
    return {b.name: torch.randn([sizes.get(a, 1) if a else 1 for a in b.dims], device=example.device,
                                dtype=dtypes.get(b.name, torch.float32))
            for b in gradient.backward.inputs if b.name not in named}


def _explain_chunked(groups: list[Group], sizes: dict[str, int], args: dict[str, Any]) -> tuple[str, bool]:
    """How the kernels no plan computes run instead (schedule/materialise.py), or why they cannot;
    and whether a chunked plan exists."""
    from neptune_fusion.schedule.materialise import chunk_arguments, chunk_length, materialise

    try:
        plan = materialise(groups, sizes)
    except FusionError as exc:
        return f"=== no chunked plan either: {exc} ===", False
    example = args[plan.contractions[0].operand]
    length = chunk_length(plan, sizes, example.element_size())
    lines = [f"=== materialised a chunk at a time: {plan.shared}{list(plan.producer.stage(plan.shared).axes)} "
             f"over {plan.axis!r}, {length} of {sizes[plan.axis]} a chunk ===",
             *(f"{c.result}: einsum({c.spec!r}, {plan.shared} chunk, {c.operand})"
               f"{' summed over the chunks' if c.over_chunk else ' a slice per chunk'}" for c in plan.contractions)]
    if plan.one_hot is not None:
        hot = plan.one_hot
        index, coefficient = (format_expr(hot.values.stage(o.stage).body) for o in hot.values.outputs)
        lines.append(f"kept out of the chunks: where({index} == {hot.axis}, {coefficient}, 0), gathered by the "
                     f"contractions over {hot.axis!r}, added into each chunk for the others")
    lines.append(explain(plan.producer, **chunk_arguments(plan, args, 0, length, sizes[plan.axis]), schedule=None))
    return "\n".join(lines), True
