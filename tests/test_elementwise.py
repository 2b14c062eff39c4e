"""Programs with no reduction (schedule/pipeline.py `_elementwise_steps`): their outputs are the
second pass of a loop with no members, over the last axis of the output of the most axes.

Checked as every transform is: the reference executor on the program before and after the
fusion steps, and the compiled kernels against torch, on random inputs of shapes that are not
multiples of any tile (1, 2 and 3 axes, broadcasts, transposed reads, several outputs, rows longer
than a tile), their gradients against torch autograd, and as the written operand of a contraction
handed to cuBLAS (schedule/library.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.ir.errors import FusionError  # noqa: E402
from neptune_fusion.ir.program import FusedLoop  # noqa: E402
from neptune_fusion.runtime.reference import run_reference  # noqa: E402
from neptune_fusion.schedule.library import Declined, LibraryContraction, library_contraction  # noqa: E402
from neptune_fusion.schedule.pipeline import fuse  # noqa: E402

CASES = {
    "gated": (lambda a, b: a * torch.sigmoid(a) * b, [(33, 70), (33, 70)]),
    "one axis": (lambda x: torch.tanh(x) + 1.0, [(77,)]),
    "three axes": (lambda x: torch.exp(x * 0.5) * 2.0, [(3, 5, 40)]),
    "row broadcast": (lambda a, b: a * b, [(20, 30), (30,)]),
    "column broadcast": (lambda a, b: a - b, [(20, 30), (20, 1)]),
    "transposed read": (lambda a: a.T * 2.0, [(20, 30)]),
    "two outputs": (lambda a: (a * 2.0, torch.where(a > 0, a, 0.1 * a)), [(20, 30)]),
    "narrower output first": (lambda a, b: (b + 1.0, a * b), [(20, 30), (30,)]),
    "row longer than a tile": (lambda a: a * 3.0 - 1.0, [(4, 200)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fused_program_computes_what_the_program_does(name, randn):
    fn, shapes = CASES[name]
    args = [randn(*s) for s in shapes]
    program = nf.program(fn).trace(*args)
    named = {b.name: a for b, a in zip(program.inputs, args)}
    steps = fuse(program)
    loops = [n for n in steps[-1].program.stages if isinstance(n, FusedLoop)]
    assert len(loops) == 1 and not loops[0].members
    before = run_reference(program, named)
    after = run_reference(steps[-1].program, named)
    for x, y in zip(before if isinstance(before, tuple) else (before,), after if isinstance(after, tuple) else (after,)):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_elementwise_programs_match_torch(name, dtype, randn):
    fn, shapes = CASES[name]
    args = [randn(*s, dtype=dtype) for s in shapes]
    out, ref = nf.compile(fn)(*args), fn(*args)
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for x, y in zip(outs, refs, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol)


def test_nan_and_inf_pass_through(randn):
    x = randn(3, 40)
    x[0, 3], x[1, 7], x[2, 0] = float("nan"), float("inf"), float("-inf")
    out = nf.compile(lambda x: x * 2.0 + 1.0)(x)
    torch.testing.assert_close(out, x * 2.0 + 1.0, equal_nan=True)


def test_gradients_of_an_elementwise_program(randn):
    a, b = randn(20, 30).requires_grad_(), randn(20, 30).requires_grad_()

    def gated(a, b):
        return a * torch.sigmoid(a) * b

    out = nf.compile(gated)(a, b)
    weight = randn(20, 30)
    grads = torch.autograd.grad((out * weight).sum(), (a, b))
    expected = torch.autograd.grad((gated(a, b) * weight).sum(), (a, b))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_program_of_0d_values_names_the_condition():
    with pytest.raises(FusionError, match="no reduction and no output with an axis"):
        nf.compile(lambda s: s * 2.0)(torch.tensor(3.0))


WIDE = 4096


def test_a_gated_operand_is_written_by_its_own_kernel_for_cublas(randn):
    """A gated down-projection `(silu(a) * b) @ w`: the operand is element-wise, written by an
    element-wise kernel, then multiplied by cuBLAS; its memory is what a and b already take."""

    def gated_down(a, b, w):
        return (a * torch.sigmoid(a) * b) @ w

    a, b = randn(16, 64, dtype=torch.float16), randn(16, 64, dtype=torch.float16)
    w = randn(64, WIDE, scale=0.1, dtype=torch.float16)
    program = nf.program(gated_down).trace(a, b, w)
    plan = library_contraction(program, {"x": 16, "y": 64, "z": WIDE}, "f16")
    assert isinstance(plan, LibraryContraction) and plan.operands[1].input == "w"
    writer = plan.operands[0].program
    assert writer is not None and {b.name for b in writer.inputs} == {"a", "b"}
    out = nf.compile(gated_down)(a, b, w)
    ref = (a.float() * torch.sigmoid(a.float()) * b.float()) @ w.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_an_operand_larger_than_its_inputs_and_the_output_stays_fused(randn):
    """exp(u[i] + v[k]) is an outer product of two vectors: writing it would hold i x k elements
    where the inputs hold i + k and the output i x e."""

    @nf.program
    def outer_operand(u, v, w):
        return nf.einsum("ik,ke->ie", nf.exp(u[:, None] + v[None, :]), w)

    u, v, w = randn(4096).half(), randn(4096).half(), randn(4096, 8).half()
    decision = library_contraction(outer_operand.trace(u, v, w), {"i": 4096, "k": 4096, "e": 8}, "f16")
    assert isinstance(decision, Declined) and "more memory" in decision.reason


WIDE_OUTPUTS = {
    "a total times a matrix": lambda x, y: x.sum() * y,
    "centred by the global mean": lambda x, y: x - x.mean(),
    "row-centred over the global rms": lambda x, y: (x - x.mean(-1, keepdim=True)) / (x * x).mean().sqrt(),
    "row sums broadcast to three axes": lambda x, y: x.sum(-1)[:, None, None] * y[None],
    "beside a softmax": lambda x, y: (x.softmax(-1), x.sum() * y),
}


@pytest.mark.parametrize("name", list(WIDE_OUTPUTS))
def test_outputs_wider_than_their_reductions_run_in_a_later_elementwise_kernel(name, randn):
    """An output with two axes beyond the reductions' (schedule/partition.py `_wide_outputs`):
    a second kernel reads the reductions materialised and writes it."""
    fn = WIDE_OUTPUTS[name]
    x, y = randn(8, 24), randn(8, 24)
    got, want = nf.compile(fn)(x, y), fn(x, y)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_long_row_is_cut_across_programs_with_nothing_to_merge(randn):
    """Few rows, long columns: the loop axis is split across programs as split-K cuts a reduction
    (schedule/auto.py), each program writing its chunk; with no members there is no combine."""

    def shifted(x):
        return x * 2.0 - 1.0

    fn = nf.compile(shifted)
    x = randn(3, 1000)
    torch.testing.assert_close(fn(x), shifted(x))
    exe = fn.executable_for(fn.program_def.trace(x), {"x": x})
    assert exe.plan.splits > 1 and exe.combine is None
