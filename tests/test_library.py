"""Contractions handed to cuBLAS (schedule/library.py): which programs take the route, that the
operand programs and the einsum compute the program (against the reference executor), and that
everything else keeps its fused kernels."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.library import layernorm_matmul, rmsnorm_matmul  # noqa: E402
from neptune_fusion.runtime.reference import axis_extents  # noqa: E402
from neptune_fusion.schedule.library import Declined, LibraryContraction, library_contraction  # noqa: E402

WIDE = 3000  # output columns past the estimate's break-even (about 2600 on the H200's figures)


@nf.program
def weighted_rmsnorm_matmul(x, g, w):
    r = nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return nf.einsum("ik,ke->ie", x / r * g, w)


@nf.program
def batched_norm_matmul(x, w):
    r = nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return nf.einsum("bik,bke->bie", x / r, w)


@nf.program
def plain_matmul(x, w):
    return nf.einsum("ik,ke->ie", x, w)


def _library_plan(fn: nf.Compiled) -> LibraryContraction | None:
    found = [exe.library.plan for exe in fn._cache.values() if exe.library is not None]
    return found[0] if found else None


def _reference(prog, args: tuple) -> torch.Tensor:
    floats = tuple(a.float() for a in args)
    return nf.run_reference(prog.trace(*floats), dict(prog.bind(*floats)))


@pytest.mark.parametrize("prog", [rmsnorm_matmul, layernorm_matmul], ids=["rmsnorm", "layernorm"])
def test_a_normalised_operand_is_written_once_for_cublas(prog, randn):
    x, w = randn(32, 96).half(), (randn(96, WIDE) * 0.1).half()
    fn = nf.compile(prog)
    out = fn(x, w)
    assert out.dtype == torch.float16 and out.shape == (32, WIDE)
    torch.testing.assert_close(out.float(), _reference(prog, (x, w)), rtol=2e-2, atol=2e-2)
    plan = _library_plan(fn)
    assert plan is not None and plan.spec == "ik,ke->ie"
    assert plan.operands[0].program is not None and plan.operands[1].input == "w"
    assert "torch.einsum" in nf.explain(prog, x, w)


def test_narrow_outputs_keep_the_fused_kernel(randn):
    """Each written element serves one product per output column: at 300 columns the traffic costs
    more than cuBLAS saves, and the estimate says so in `explain`."""
    x, w = randn(32, 96).half(), (randn(96, 300) * 0.1).half()
    fn = nf.compile(rmsnorm_matmul)
    torch.testing.assert_close(fn(x, w).float(), _reference(rmsnorm_matmul, (x, w)), rtol=2e-2, atol=2e-2)
    assert _library_plan(fn) is None
    assert "not used: the fused K-loop is estimated faster" in nf.explain(rmsnorm_matmul, x, w)


def test_an_explicit_schedule_keeps_the_fused_kernel(randn):
    x, w = randn(32, 96).half(), (randn(96, WIDE) * 0.1).half()
    fn = nf.compile(rmsnorm_matmul, schedule=nf.flash())
    torch.testing.assert_close(fn(x, w).float(), _reference(rmsnorm_matmul, (x, w)), rtol=2e-2, atol=2e-2)
    assert _library_plan(fn) is None


def test_a_factor_over_k_alone_joins_the_written_operand(randn):
    x, g, w = randn(16, 64).half(), randn(64).half(), (randn(64, WIDE) * 0.1).half()
    fn = nf.compile(weighted_rmsnorm_matmul)
    torch.testing.assert_close(fn(x, g, w).float(), _reference(weighted_rmsnorm_matmul, (x, g, w)),
                               rtol=2e-2, atol=2e-2)
    plan = _library_plan(fn)
    assert plan is not None and plan.operands[1].input == "w"
    assert {b.name for b in plan.operands[0].program.inputs} == {"x", "g"}


def test_batch_axes_both_operands_index(randn):
    x, w = randn(2, 16, 64).half(), (randn(2, 64, WIDE) * 0.1).half()
    fn = nf.compile(batched_norm_matmul)
    torch.testing.assert_close(fn(x, w).float(), _reference(batched_norm_matmul, (x, w)), rtol=2e-2, atol=2e-2)
    plan = _library_plan(fn)
    assert plan is not None and plan.spec == "bik,bke->bie"


def test_two_inputs_as_they_stand_need_no_kernel(randn):
    x, w = randn(16, 64).half(), randn(64, 48).half()
    fn = nf.compile(plain_matmul)
    torch.testing.assert_close(fn(x, w).float(), x.float() @ w.float(), rtol=2e-2, atol=2e-2)
    plan = _library_plan(fn)
    assert plan is not None and all(op.input is not None for op in plan.operands)


@pytest.mark.parametrize("prog", [rmsnorm_matmul, layernorm_matmul, weighted_rmsnorm_matmul, batched_norm_matmul],
                         ids=["rmsnorm", "layernorm", "weighted", "batched"])
def test_the_operand_programs_and_einsum_compute_the_program(prog, randn):
    """Program -> plan, checked by running each operand program through the reference executor
    and contracting the results: equal to the whole program's reference (the written operands
    are rounded to the GEMM's dtype, as the kernels writing them store them)."""
    shapes = {rmsnorm_matmul: [(8, 40), (40, 24)], layernorm_matmul: [(8, 40), (40, 24)],
              weighted_rmsnorm_matmul: [(8, 40), (40,), (40, 24)], batched_norm_matmul: [(2, 8, 40), (2, 40, 24)]}
    args = tuple(randn(*s) for s in shapes[prog])
    traced = prog.trace(*args)
    named = dict(prog.bind(*args))
    plan = library_contraction(traced, {**axis_extents(traced, named), **{a: 10**6 for a in ("e",)}}, "f16")
    assert isinstance(plan, LibraryContraction)
    operands = [named[op.input] if op.input is not None else
                nf.run_reference(op.program, {b.name: named[b.name] for b in op.program.inputs})
                for op in plan.operands]
    written = [spec.program for spec in plan.operands if spec.program is not None]
    assert written and all(p.stage(p.outputs[0].stage).body.dtype == "f16" for p in written)
    torch.testing.assert_close(torch.einsum(plan.spec, *(op.float() for op in operands)),
                               nf.run_reference(traced, named), rtol=1e-2, atol=1e-2)


def test_what_is_not_a_contraction_of_two_sides_is_declined(randn):
    x, w = randn(8, 40), randn(40, 24)
    traced = rmsnorm_matmul.trace(x, w)
    sizes = {"i": 8, "k": 40, "e": 10**6}
    assert "16-bit" in library_contraction(traced, sizes, "f32").reason

    @nf.program
    def scaled_after(x, w):
        return nf.einsum("ik,ke->ie", x, w) * 0.5

    @nf.program
    def two_outputs(x, w):
        return nf.einsum("ik,ke->ie", x, w), x.sum(axis=-1)

    for prog in (scaled_after, two_outputs):
        decision = library_contraction(prog.trace(x, w), sizes, "f16")
        assert isinstance(decision, Declined) and not decision.estimated


@nf.program
def position_softmax_matmul(c, w):
    a = c * nf.index(w, 1) * 0.01
    e = nf.exp(a - a.max(axis=-1, keepdims=True))
    return nf.einsum("ik,ek->ie", e / e.sum(axis=-1, keepdims=True), w)


def test_an_operand_axis_sized_by_an_input_it_does_not_read(randn):
    """The softmax over positions k reads only c; k's size comes from w, which its program takes
    along for that (so does an element-wise operand, `c * k` alone)."""
    c, w = randn(16, 1).half(), (randn(WIDE, 64) * 0.1).half()
    fn = nf.compile(position_softmax_matmul)
    a = c.float() * torch.arange(64).float() * 0.01
    torch.testing.assert_close(fn(c, w).float(), torch.softmax(a, -1) @ w.float().T, rtol=2e-2, atol=2e-2)
    plan = _library_plan(fn)
    assert plan is not None and plan.operands[1].input == "w"
    assert {b.name for b in plan.operands[0].program.inputs} == {"c", "w"}

    @nf.program
    def position_weighted(c, w):
        return nf.einsum("ik,ek->ie", c * nf.index(w, 1), w)

    decision = library_contraction(position_weighted.trace(c, w), {"i": 16, "a1": 1, "k": 64, "e": 10**6}, "f16")
    assert isinstance(decision, LibraryContraction)
    assert {b.name for b in decision.operands[0].program.inputs} == {"c", "w"}


def test_a_library_contraction_inside_torch_compile(randn):
    """The registered op runs the route as it does eagerly: no graph break, the eager result."""
    fn = nf.compile(rmsnorm_matmul)
    x, w = randn(16, 64).half(), (randn(64, WIDE) * 0.1).half()

    def layer(x, w):
        return fn(x, w) * 2

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w), layer(x, w))
    assert torch._dynamo.explain(layer)(x, w).graph_break_count == 0
    assert _library_plan(fn) is not None


@pytest.mark.parametrize("seed", range(6))
def test_random_prologues_through_cublas_match_the_reference(seed, randn):
    """Random row statistics and factors on either side of a wide contraction: whatever the
    route (cuBLAS or the fused kernel), the result is the reference executor's."""
    import random

    rng = random.Random(seed)
    stat = rng.choice(["rms", "maxabs", "softmax", "none"])
    col_scale, transposed, row_bias = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5

    @nf.program
    def prog(x, g, c, w):
        a = x
        if stat == "rms":
            a = x / nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
        elif stat == "maxabs":
            a = x / (nf.abs_(x).max(axis=-1, keepdims=True) + 1.0)
        elif stat == "softmax":
            e = nf.exp(x - x.max(axis=-1, keepdims=True))
            a = e / e.sum(axis=-1, keepdims=True)
        a = a * g
        if row_bias:
            a = a + 0.5
        b = w * c if col_scale else w
        return nf.einsum("ik,ek->ie" if transposed else "ik,ke->ie", a, b)

    m, k, n = rng.randint(1, 40), rng.randint(8, 96), rng.choice([300, WIDE])
    x, g = randn(m, k).half(), randn(k).half()
    c = randn(n).half() if not transposed else randn(k, 1).half()[:, 0]
    w = (randn(n, k) if transposed else randn(k, n)).mul(0.1).half()
    if col_scale and not transposed:
        c = randn(n).half()
    elif col_scale:
        c = randn(k).half()
    fn = nf.compile(prog)
    out = fn(x, g, c, w)
    torch.testing.assert_close(out.float(), _reference(prog, (x, g, c, w)), rtol=3e-2, atol=3e-2)


def test_autotune_leaves_a_library_contraction_to_cublas(randn):
    x, w = randn(16, 64).half(), (randn(64, WIDE) * 0.1).half()
    fn = nf.compile(rmsnorm_matmul, schedule=nf.autotune())
    torch.testing.assert_close(fn(x, w).float(), _reference(rmsnorm_matmul, (x, w)), rtol=2e-2, atol=2e-2)
    assert _library_plan(fn) is not None


def test_a_down_projection_operand_may_take_what_its_input_takes(randn):
    """A down-projection (the normalised side wider than the output) holds the operand as long as
    the input it normalises: no more memory than the call already holds (an operand larger than
    both the output and its inputs stays fused: tests/test_elementwise.py)."""
    x, w = randn(8, 40), randn(40, 24)
    plan = library_contraction(rmsnorm_matmul.trace(x, w), {"i": 64, "k": 20000, "e": 4096}, "f16")
    assert isinstance(plan, LibraryContraction)


def test_a_written_operand_has_rows_cublas_multiplies_at_full_rate(randn, monkeypatch):
    """An operand of 61 columns is written at a row pitch of 64 (16 bytes a row start): cuBLAS
    takes unaligned 16-bit rows on a slow path."""
    seen = []
    einsum = torch.einsum

    def spy(equation, *operands):
        seen.append([op.stride() for op in operands])
        return einsum(equation, *operands)

    monkeypatch.setattr(torch, "einsum", spy)
    x, w = randn(16, 61).half(), (randn(61, WIDE) * 0.1).half()
    fn = nf.compile(rmsnorm_matmul)
    out = fn(x, w)
    assert _library_plan(fn) is not None and seen[0][0] == (64, 1)
    torch.testing.assert_close(out.float(), _reference(rmsnorm_matmul, (x, w)), rtol=2e-2, atol=2e-2)
