"""Tracing torch.nn.functional and friends: activations, normalisations, norms, einsum and losses.

A model's code calls `F.silu`, `F.layer_norm`, `F.cross_entropy`, `torch.var`, ... on what are,
inside `nf.compile`, symbolic tensors. `torch_function.py` routes those calls here (the table
`HANDLERS`, keyed by the torch function's `__name__`; a Tensor method of the same name, such as
`x.var(...)` or `x.norm(...)`, uses the same entry). Every handler is a composition of the front
end's ops (elementwise ops, `where`, reductions, `einsum`, gathers), so the reference executor,
the Triton code generator and the derived backward need nothing new; the one IR op added for
them is `erf` (the exact GELU).

Semantics follow torch's own definitions (checked against torch 2.13): `softplus` returns `x`
where `beta * x > threshold`; `rms_norm`'s default eps is `torch.finfo(torch.float32).eps`;
`cosine_similarity` clamps each norm at `eps` separately; `cross_entropy` and `nll_loss` with
`reduction='mean'` divide by the (weighted) count of targets that are not `ignore_index`, NaN
where every target is ignored. Targets outside `[0, C)` other than `ignore_index` read class 0
(no bounds check in a kernel; torch raises). `log1p`, `expm1` (short series near 0) and `erfc` (a
Chebyshev fit, not 1 - erf) keep float32's relative accuracy in the tails. Not supported (a
TypeError says why): in-place variants (`inplace=True`), matrix norms, `prod`, `argmax` / `argmin`,
scans and sorts, dropout while training.

Example:
    >>> import torch, torch.nn.functional as F, neptune_fusion as nf
    >>> def block(x, w, b):
    ...     return F.gelu(F.linear(F.layer_norm(x, (8,)), w, b))
    >>> x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
    >>> torch.allclose(nf.compile(block)(x, w, b), block(x, w, b), atol=1e-5)
    True
"""


from __future__ import annotations

from typing import Any, Callable

from neptune_fusion.lang.torch_nn import activations, attention, factories, linear, losses, statistics
from neptune_fusion.lang.torch_nn.common import CONTEXT, no_out

__all__ = ["CONTEXT", "HANDLERS", "UNSUPPORTED", "no_out"]

# why torch operations without a handler are refused (torch_function adds it to its TypeError)
UNSUPPORTED: dict[str, str] = {
    "prod": "kernels reduce with sum, max and min only; for positive values write torch.exp(torch.log(x).sum(dim))",
    "argmax": "reductions give values, not positions; torch.amax gives the maximum",
    "argmin": "reductions give values, not positions; torch.amin gives the minimum",
    "cumsum": "scans (prefix sums) are not supported; only whole-axis reductions are",
    "cumprod": "scans (prefix products) are not supported; only whole-axis reductions are",
    "sort": "sorting is not supported; only elementwise ops and reductions are",
    "topk": "selecting elements by rank is not supported",
}

HANDLERS: dict[str, Callable[..., Any]] = {
    **activations.HANDLERS, **statistics.HANDLERS, **linear.HANDLERS, **losses.HANDLERS, **attention.HANDLERS,
    **factories.HANDLERS,
}
