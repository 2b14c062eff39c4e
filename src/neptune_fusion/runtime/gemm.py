"""The GEMM library's contraction with an fp32 result (a library plan's `widened` output).

cuBLAS accumulates a 16-bit GEMM in fp32; `torch.einsum` rounds the result to the operands' dtype.
A result a later kernel reads in fp32 (a backward's partial gradient) is taken unrounded from the
fp32 accumulator: `torch.bmm(..., out_dtype=torch.float32)` on CUDA, fp32 operands elsewhere (the
CPU has no 16-bit GEMM with a wider result).

Example:
    >>> import torch
    >>> a, b = torch.randn(3, 5).half(), torch.randn(4, 5).half()
    >>> out = einsum_fp32("ik,ek->ie", a, b)
    >>> out.dtype, torch.allclose(out, a.float() @ b.float().T)
    (torch.float32, True)
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def einsum_fp32(spec: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.einsum(spec, a, b)` in fp32, contiguous, from 16-bit operands; every axis of the
    output is an axis of `a` or `b`, and the summed axes are those of both that it lacks."""
    if a.device.type != "cuda":
        return torch.einsum(spec, a.float(), b.float()).contiguous()
    return as_batched_product(spec, a, b, lambda x, y: torch.bmm(x, y, out_dtype=torch.float32))


def as_batched_product(spec: str, a: torch.Tensor, b: torch.Tensor,
                       bmm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`spec` computed by one `bmm` of `a` and `b` viewed as (batch, rows, summed) and (batch,
    summed, columns), its result viewed back in the output's axis order (contiguous).

    Example:
        >>> a, b = torch.randn(2, 3, 5), torch.randn(5, 2, 4)
        >>> out = as_batched_product("bik,kbe->ieb", a, b, torch.bmm)
        >>> torch.allclose(out, torch.einsum("bik,kbe->ieb", a, b), atol=1e-6)
        True
    """
    sides, out = spec.split("->")
    sa, sb = sides.split(",")
    batch = [c for c in sa if c in sb and c in out]
    rows = [c for c in sa if c in out and c not in sb]
    cols = [c for c in sb if c in out and c not in sa]
    summed = [c for c in sa if c in sb and c not in out]
    size = {**dict(zip(sb, b.shape)), **dict(zip(sa, a.shape))}

    def grouped(t: torch.Tensor, axes: str, groups: list[list[str]]) -> torch.Tensor:
        order = [axes.index(c) for g in groups for c in g]
        return t.permute(order).reshape([math.prod(size[c] for c in g) for g in groups])

    product = bmm(grouped(a, sa, [batch, rows, summed]), grouped(b, sb, [batch, summed, cols]))
    held = batch + rows + cols
    return product.view([size[c] for c in held]).permute([held.index(c) for c in out]).contiguous()


__all__ = ["as_batched_product", "einsum_fp32"]
