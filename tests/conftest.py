"""Shared random-input helpers: small float32 tensors from a fixed seed, never exactly zero."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def _make_randn(seed: int) -> Callable[..., torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, dtype=torch.float32)
        x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)  # random and non-zero
        return (x * scale).to(dtype)

    return randn


@pytest.fixture
def randn() -> Callable[..., torch.Tensor]:
    """`randn(*shape, scale=1.0, dtype=torch.float32)`: a seeded random tensor with no zeros."""
    return _make_randn(1234)


@pytest.fixture
def randint() -> Callable[..., torch.Tensor]:
    """`randint(low, high, *shape, dtype=torch.int64)`: seeded random integers in [low, high)."""
    gen = torch.Generator().manual_seed(4321)

    def make(low: int, high: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, dtype=dtype)

    return make


@pytest.fixture
def attn_inputs(randn: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`attn_inputs(b, h, lq, lk, d, dv=None, scale=1.0)`: random q, k, v of attention shapes."""

    def make(b: int, h: int, lq: int, lk: int, d: int, dv: int | None = None,
             scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (randn(b, h, lq, d, scale=scale), randn(b, h, lk, d, scale=scale),
                randn(b, h, lk, dv or d))

    return make
