"""Distributing a contraction over an operand's terms that are constant along it
(transform/distribute.py): the rewrite against the reference executor, where it must not apply,
and the kernels it gives a centred matmul (a LayerNorm's) under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.ir.program import Stage  # noqa: E402
from neptune_fusion.library import layernorm_matmul  # noqa: E402
from neptune_fusion.schedule.partition import partition  # noqa: E402
from neptune_fusion.transform.distribute import distribute_constant_terms  # noqa: E402

NARROW = frozenset({"x", "w", "y"})


@nf.program
def centred_matmul(x, c, w):
    return nf.einsum("ik,ke->ie", x - c[:, None], w)


@nf.program
def shifted_scaled_matmul(x, c, b, s, w):
    """(b - x + c) / s @ w: the loaded term negated, two constant terms, a constant divisor."""
    return nf.einsum("ik,ke->ie", (b[:, None] - x + c[:, None]) / s[:, None], w)


@nf.program
def centred_triple(x, c, w, y):
    """sum_k (x - c) * w * y: the other factors are two loaded tiles."""
    return ((x - c[:, None]) * w * y).sum(axis=-1)


@nf.program
def centred_by_its_own_mean(x, w):
    """The constant term is a reduction of this program: left to the fusion's basis expansion."""
    return nf.einsum("ik,ke->ie", x - x.sum(axis=-1, keepdims=True) / x.shape[-1], w)


@nf.program
def computed_minus_constant(x, c, w):
    """The varying term is computed (exp(x)), not a loaded value: the dot's operand stays computed."""
    return nf.einsum("ik,ke->ie", nf.exp(x) - c[:, None], w)


def _sums(program) -> list[str]:
    return [st.name for st in program.stages if isinstance(st, Stage) and st.reduce_op is not None]


@pytest.mark.parametrize(("prog", "shapes"), [
    (centred_matmul, [(6, 20), (6,), (20, 5)]),
    (shifted_scaled_matmul, [(6, 20), (6,), (6,), (6,), (20, 5)]),
    (centred_triple, [(6, 20), (6,), (6, 20), (6, 20)]),
], ids=["centred", "shifted_scaled", "triple"])
def test_the_rewrite_keeps_the_reference_result(prog, shapes, randn):
    args = [randn(*s) for s in shapes]
    program = prog.trace(*args)
    rewritten = distribute_constant_terms(program, NARROW)
    assert rewritten is not program and len(_sums(rewritten)) == 2
    named = dict(prog.bind(*args))
    torch.testing.assert_close(nf.run_reference(rewritten, named), nf.run_reference(program, named),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("prog", "shapes", "narrow"), [
    (centred_matmul, [(6, 20), (6,), (20, 5)], frozenset()),  # fp32 inputs keep the centred operand
    (centred_matmul, [(6, 20), (6,), (20, 5)], frozenset({"x"})),  # w not 16-bit
    (centred_by_its_own_mean, [(6, 20), (20, 5)], NARROW),
    (computed_minus_constant, [(6, 20), (6,), (20, 5)], NARROW),
], ids=["fp32", "w_fp32", "own_mean", "computed"])
def test_the_rewrite_does_not_apply(prog, shapes, narrow, randn):
    program = prog.trace(*[randn(*s) for s in shapes])
    assert distribute_constant_terms(program, narrow) is program


def test_a_centred_matmul_runs_as_a_plain_matmul_beside_its_basis_sum(randn):
    """fp16 LayerNorm -> matmul with the rows and the output axis above 512: the statistics, the
    weight's column sums and a matmul whose operands are both loaded tiles, three kernels; the
    result is the reference's. With an input mean far from zero (|mean| 8x the spread) the
    cancellation stays below fp16's rounding."""
    x = randn(576, 64) + 8.0
    w = randn(64, 544, scale=0.1)
    program = layernorm_matmul.trace(x, w)
    groups = partition(program, frozenset({"i", "e"}), frozenset({"x", "w"}))
    assert [sorted(_sums(g.program)) for g in groups] == [["sum0", "sum1"], ["dot0_basis"], ["dot0_main"]]
    fn = nf.compile(layernorm_matmul)
    out = fn(x.half(), w.half())
    ref = nf.run_reference(program, {"x": x.half().float(), "w": w.half().float()})
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    exe = next(e for e in fn._cache.values() if e.groups)
    assert len(exe.groups) == 3
    # the same program in fp32 keeps its centred operand: two kernels
    assert len(partition(program, frozenset({"i", "e"}))) == 2


def test_a_short_centred_matmul_keeps_one_kernel_with_its_basis_sum_in_the_loop(randn):
    """Short axes: one kernel, the column sums accumulated in the matmul's own loop."""
    x, c, w = randn(24, 40), randn(24), randn(40, 32, scale=0.2)
    fn = nf.compile(centred_matmul)
    out = fn(x.half(), c.half(), w.half())
    ref = nf.run_reference(centred_matmul.trace(x, c, w), {"x": x.half().float(), "c": c.half().float(),
                                                          "w": w.half().float()})
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    assert not any(e.groups for e in fn._cache.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layernorm_statistics_far_from_zero_in_their_own_kernel(dtype, randn):
    """The statistics' kernel of a partitioned LayerNorm -> matmul (rows and output axis above 512)
    with a mean 300 times the spread: within the input's own rounding of fp64 (fp16 holds values
    near 300 to 0.25, so its rows carry that much noise, the same for torch)."""
    x = (randn(576, 64) + 300.0).to(dtype)
    w = randn(64, 544, scale=0.1).to(dtype)
    xd = x.double()
    ref = ((xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)) @ w.double()
    out = nf.compile(layernorm_matmul)(x, w)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=(2e-3 if dtype == torch.float32 else 3e-2) * ref.abs().max().item())
