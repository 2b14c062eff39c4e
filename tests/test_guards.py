"""A `where` whose condition bounds a modulo (a slice's or a concatenation's read, kept in bounds by
`% n`) reads its taken branch at the plain index with the loads masked by the bounds
(`tile/guards.py`): no run-time modulo there, and no load for the lanes the where discards.
Results equal torch's on random inputs; a value read both under the mask and outside it is
two loads, not one shared."""

from __future__ import annotations

import os
import re
from typing import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402


def _kernel_body(explained: str) -> str:
    source = explained[explained.rindex("=== Triton source ==="):]
    return source[source.index("def nf_"):]


def _concatenate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, b], 1) * 2


def _halves_and_whole(a: torch.Tensor) -> torch.Tensor:
    return torch.cat([a[:, :8], a[:, :8]], 1) + a


def _gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_the_first_part_of_a_concatenation_is_read_without_a_modulo(randn: Callable[..., torch.Tensor]) -> None:
    a, b = randn(24, 40), randn(24, 24)
    fn = nf.compile(_concatenate)
    assert torch.equal(fn(a, b), _concatenate(a, b))
    body = _kernel_body(nf.explain(fn, a, b))
    # one modulo in each of the two loops (whole tiles, the partial last one): the second part's,
    # whose upper bound is the concatenation's length, not a condition of the where
    assert body.count("_mod(") == 2, body


def test_a_load_under_a_guard_is_not_shared_with_the_same_load_outside_it(randn: Callable[..., torch.Tensor]) -> None:
    a = randn(24, 16)
    assert torch.equal(nf.compile(_halves_and_whole)(a), _halves_and_whole(a))


def test_a_chunks_gradient_reads_each_half_under_its_own_mask(randn: Callable[..., torch.Tensor]) -> None:
    """The backward of `chunk`: two wheres, each reading the output's gradient and the projection
    at the position minus its half's offset, modulo the half's length; the kernels that sum it
    into x's and w's gradients read each half under its own bounds instead."""
    x, w = randn(16, 32).requires_grad_(), randn(32, 96).requires_grad_()
    seed = randn(16, 48)
    fn = nf.compile(_gated)
    got = torch.autograd.grad(fn(x, w), (x, w), seed)
    want = torch.autograd.grad(_gated(x, w), (x, w), seed)
    for g, t in zip(got, want):
        torch.testing.assert_close(g, t, rtol=1e-4, atol=1e-5)
    explained = nf.explain(fn, x, w, backward=True)
    program = explained[explained.index("=== derived backward ==="):explained.index("=== backward kernel 0")]
    kernels = explained[explained.index("=== backward kernel 0"):]
    assert "% |" in program  # the program reads modulo the half's length ...
    assert re.search(r"_mod\(v|% size", kernels) is None  # ... its kernels do not
    assert kernels.count("=== Triton source ===") >= 2
