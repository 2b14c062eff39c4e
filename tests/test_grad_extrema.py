"""Gradients through max and min reductions (transform/grad.py): a max that is an output, or that
an output reads outside an expression cancelling it, is not a free stabiliser and gets torch's
`amax` gradient, shared evenly among ties; the value its tie test compares with is the forward's
own (saved, or recomputed), never one recovered from the outputs by arithmetic.

Two levels, both against torch autograd in float64: the derived forward and backward Programs
run by the reference executor, and `nf.compile`d kernels under the Triton interpreter (rows longer
than one tile, so the forward's fused loop and split-K partial states are exercised). Both compute
in float32, as the kernels do: the forward saves its row statistics in fp32, so a float64 run
would compare its own float64 `exp(x)` with an fp32-rounded saved max and find no tie.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.library import attention, softmax  # noqa: E402
from neptune_fusion.transform.grad import Gradient, differentiate, grad_name  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


def _tuple(x):  # noqa: ANN001, ANN202
    return x if isinstance(x, tuple) else (x,)


def _softmax(x):  # noqa: ANN001, ANN202
    e = nf.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# (program, the same in torch): each reads its max (min) other than as a cancelled stabiliser
CASES: dict[str, tuple[Callable, Callable]] = {
    "max": (lambda x: x.max(axis=-1), lambda x: x.amax(-1)),
    "min_axis0": (lambda x: x.min(axis=0), lambda x: x.amin(0)),
    "max_keepdims": (lambda x: x.max(axis=-1, keepdims=True), lambda x: x.amax(-1, keepdim=True)),
    "max_of_scaled": (lambda x: (x * 2.0).max(axis=-1), lambda x: (x * 2.0).amax(-1)),
    "max_of_exp": (lambda x: nf.exp(x).max(axis=-1), lambda x: torch.exp(x).amax(-1)),
    "max_of_square": (lambda x: (x * x).max(axis=-1), lambda x: (x * x).amax(-1)),
    "max_plus_sum": (lambda x: x.max(axis=-1) + x.sum(axis=-1), lambda x: x.amax(-1) + x.sum(-1)),
    "range": (lambda x: x.max(axis=-1) - x.min(axis=-1), lambda x: x.amax(-1) - x.amin(-1)),
    "exp_of_max": (lambda x: nf.exp(x.max(axis=-1)), lambda x: torch.exp(x.amax(-1))),
    "softmax_and_max": (lambda x: (_softmax(x), x.max(axis=-1)), lambda x: (torch.softmax(x, -1), x.amax(-1))),
    # a max whose operand reads the softmax's max and sum: the fused forward rescales it
    "max_of_softmax_weighted": (lambda x: (_softmax(x) * x).max(axis=-1),
                                lambda x: (torch.softmax(x, -1) * x).amax(-1)),
}


def reference_grads(fn: Callable, x: torch.Tensor, seeds: list[torch.Tensor]) -> tuple[torch.Tensor, Gradient]:
    """The gradient of x the derived backward computes (reference executor, float32) from what its
    forward saves and returns, and the Gradient."""
    x = x.float()
    program = nf.program(fn).trace(x)
    g = differentiate(program, ("x",))
    fwd = _tuple(nf.run_reference(g.forward, {"x": x}))
    n = len(program.outputs)
    named: dict[str, torch.Tensor] = {"x": x}
    named.update(zip(g.saved, fwd[n:]))
    for i in g.outputs_read:
        o = program.outputs[i]
        named[o.stage] = fwd[i].reshape([s for s, d in zip(fwd[i].shape, o.dims) if d is not None])
    named.update({grad_name(i): seeds[i].float().reshape(fwd[i].shape) for i in g.grads_read})
    args = {b.name: named[b.name] for b in g.backward.inputs}
    (got,) = _tuple(nf.run_reference(g.backward, args))
    return got.double(), g


def torch_grad(dense: Callable, x: torch.Tensor, seeds: list[torch.Tensor]) -> torch.Tensor:
    leaf = x.double().clone().requires_grad_()
    outs = _tuple(dense(leaf))
    (want,) = torch.autograd.grad(outs, [leaf], [s.double().reshape(o.shape) for s, o in zip(seeds, outs)])
    return want


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 gradients against float64 ones: a lost tie is an error of the gradient's size."""
    torch.testing.assert_close(got, want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)


def seeds_for(dense: Callable, x: torch.Tensor) -> list[torch.Tensor]:
    return [torch.randn(o.shape, dtype=torch.float64) for o in _tuple(dense(x.double()))]


def random_rows(shape: tuple[int, ...], ties: bool) -> torch.Tensor:
    """float32-representable values in float64 (both sides see the same inputs); with `ties`, few
    distinct values (half-integers in [-2, 2]) so that most rows hold their max and min more than
    once."""
    x = torch.randn(*shape)
    if ties:
        x = torch.randint(-4, 5, shape).float() / 2.0
    return x.double()


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name", list(CASES))
def test_backward_program_equals_torch(name: str, ties: bool) -> None:
    torch.manual_seed(0)
    fn, dense = CASES[name]
    x = random_rows((5, 7), ties)
    seeds = seeds_for(dense, x)
    got, g = reference_grads(fn, x, seeds)
    want = torch_grad(dense, x, seeds)
    assert not torch.isnan(got).any()
    close(got.reshape(want.shape), want)
    # only a softmax's own max cancels (not where it is an output too); a max read as a value never does
    assert len(g.free_stabilisers) == (name == "max_of_softmax_weighted")


def test_a_max_that_is_the_output_is_not_a_free_stabiliser() -> None:
    """Nothing follows the max: no output's derivative is 0 along its motion; it is the output."""
    x = torch.randn(3, 5)
    for fn in (lambda x: x.max(axis=-1), lambda x: x.min(axis=0), lambda x: nf.exp(x).max(axis=-1)):
        assert differentiate(nf.program(fn).trace(x), ("x",)).free_stabilisers == ()


def test_ties_share_the_gradient_evenly_as_amax_does() -> None:
    """Row 0 has its max three times, row 1 its min twice. torch.amax and amin share evenly
    (torch.max(dim) would give all to one index); the shares here are exact."""
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, -1.0, 0.5, -1.0, 1.0]], dtype=torch.float64)
    seed = torch.tensor([1.5, -1.0], dtype=torch.float64)
    got, _ = reference_grads(lambda x: x.max(axis=-1), x, [seed])
    assert got.tolist() == [[0.0, 0.5, 0.5, 0.0, 0.5], [-1.0, 0.0, 0.0, 0.0, 0.0]]
    got, _ = reference_grads(lambda x: x.max(axis=-1) - x.min(axis=-1), x, [seed])
    assert got.tolist() == [[0.0, 0.5, 0.5, -1.5, 0.5], [-1.0, 0.5, 0.0, 0.5, 0.0]]
    assert torch.equal(got, torch_grad(lambda x: x.amax(-1) - x.amin(-1), x, [seed]))


def test_a_compared_max_is_saved_not_recovered_nor_read_from_the_output() -> None:
    """`max0 = ew0 - sum0` is rounded (the tie test then finds no tie in some rows), and an output
    may be narrower than the value the forward compared: a max with a tie test is saved (fp32)."""
    x = torch.randn(3, 5)
    for fn in (lambda x: x.max(axis=-1) + x.sum(axis=-1), lambda x: nf.exp(x.max(axis=-1)),
               lambda x: x.max(axis=-1) * 2.0, lambda x: nf.exp(x).max(axis=-1)):
        g = differentiate(nf.program(fn).trace(x), ("x",))
        assert "max0" in g.saved and "max0" not in g.recovered, g.backward
    g = differentiate(nf.program(lambda x: nf.exp(x).max(axis=-1)).trace(x), ("x",))
    assert g.outputs_read == ()  # the max is the output, but the backward reads the saved fp32 copy


def test_a_rescaled_max_is_recomputed_by_the_backward() -> None:
    """max(softmax(x) * x) is kept against the running max and sum of its row in the forward's
    fused loop and rescaled as they change: saved, it is no entry's value. The backward recomputes
    it from the saved log-normaliser (the softmax's max is free: the output does not move with it)."""
    g = differentiate(nf.program(CASES["max_of_softmax_weighted"][0]).trace(torch.randn(3, 5)), ("x",))
    assert g.saved == ("lse_max0",) and g.free_stabilisers == ("max0",)
    assert "max1" in {st.name for st in g.backward.stages}


def test_the_attention_softmax_max_stays_free() -> None:
    """A softmax's max, which the outputs do not depend on, stays a free stabiliser and is saved
    with its sum as one log-normaliser; its gradient stays torch's."""
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 3)
    g = differentiate(attention.trace(q, k, v, scale=0.5), ("q", "k", "v"))
    assert g.free_stabilisers == ("max0",) and g.saved == ("lse_max0",)
    g = differentiate(softmax.trace(torch.randn(4, 6)), ("x",))
    assert g.free_stabilisers == ("max0",)
    torch.manual_seed(1)
    x = random_rows((5, 7), ties=False)
    seeds = seeds_for(lambda x: torch.softmax(x, -1), x)
    got, g = reference_grads(_softmax, x, seeds)
    assert g.free_stabilisers == ("max0",)
    close(got, torch_grad(lambda x: torch.softmax(x, -1), x, seeds))


# --------------------------------------------------------------------------- compiled kernels


def compiled_grad(fn: Callable, x: torch.Tensor, seeds: list[torch.Tensor]) -> torch.Tensor:
    leaf = x.float().requires_grad_()
    outs = _tuple(nf.compile(nf.program(fn))(leaf))
    (got,) = torch.autograd.grad(outs, [leaf], [s.float().reshape(o.shape) for s, o in zip(seeds, outs)])
    return got


COMPILED = ["max", "min_axis0", "max_keepdims", "max_of_exp", "max_plus_sum", "range", "exp_of_max",
            "softmax_and_max", "max_of_softmax_weighted"]


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_gradient_equals_torch(name: str, ties: bool) -> None:
    """130 columns: several column tiles and split-K partial maxima, where a recovered max (or a
    saved rescaled one) missed its tie in some rows."""
    torch.manual_seed(2)
    fn, dense = CASES[name]
    x = random_rows((4, 130), ties)
    seeds = seeds_for(dense, x)
    got = compiled_grad(fn, x, seeds)
    want = torch_grad(dense, x, seeds)
    assert not torch.isnan(got).any()
    close(got.double(), want)


def test_compiled_attention_style_softmax_keeps_its_free_max() -> None:
    """softmax_pooling through nf.compile: the max stays free, the gradients torch's."""
    from neptune_fusion.library import softmax_pooling

    torch.manual_seed(3)
    x, v = torch.randn(4, 70, dtype=torch.float64), torch.randn(4, 70, dtype=torch.float64)
    leaves = [t.float().requires_grad_() for t in (x, v)]
    fn = nf.compile(softmax_pooling)
    out = fn(*leaves)
    seed = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, seed.float())
    ref = [t.clone().requires_grad_() for t in (x, v)]
    want = torch.autograd.grad((torch.softmax(ref[0], -1) * ref[1]).sum(-1), ref, seed)
    for a, b in zip(got, want):
        close(a.double(), b)
    (derived,) = fn.training.values()
    assert derived.gradient.free_stabilisers == ("max0",) and derived.gradient.saved == ("lse_max0",)


def test_a_tie_test_on_computed_values_is_no_mask() -> None:
    """The gradient of a weight broadcast along the rows of a max, `exp(x * w).max(-1)`: its sum
    over rows holds the tie test `exp(x * w) == max` inside a where, which must not be read as a
    mask whose tiles are skipped by a host-built map (the host's `exp` is not the kernel's
    `exp2(x * log2e)`: the tile holding the max was skipped and dw was off by ~30)."""
    from neptune_fusion.analysis.masks import exact_anywhere
    from neptune_fusion.ir.expr import Binary, Index, Load, Unary

    x_load = Load("x", (Index("a0"), Index("a1")))
    assert not exact_anywhere(Unary("not", Binary("eq", Unary("exp", x_load), x_load)), set(), frozenset())
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 130, generator=g), torch.randn(130, generator=g)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    nf.compile(nf.program(lambda x, w: nf.exp(x * w).max(axis=-1)))(xl, wl).sum().backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    torch.exp(x64 * w64).amax(-1).sum().backward()
    torch.testing.assert_close(wl.grad.double(), w64.grad, atol=1e-2, rtol=1e-4)
    torch.testing.assert_close(xl.grad.double(), x64.grad, atol=1e-2, rtol=1e-4)
