"""`F.scaled_dot_product_attention` inside traced code, written out as the plain attention it
computes (scores, mask, softmax, weighted sum), so the fusion passes derive its flash kernel as they
do for any program: model code that calls sdpa compiles unchanged. Semantics as torch 2.13: causal
masks aligned top-left (query i sees keys j <= i), a bool mask True where attended, a float mask
added to the scores, `enable_gqa` repeating each key / value head over its group of query heads,
and rows with no visible key giving 0. A mask is an argument of the compiled function (a tensor
the function captures is refused, as in any program)."""

from __future__ import annotations

import math
from typing import Any, Callable

from neptune_fusion.lang.ops import exp, repeat_interleave
from neptune_fusion.lang.tensor import SymTensor, einsum, index, where
from neptune_fusion.lang.torch_nn.common import CONTEXT, symbolic

__all__ = ["HANDLERS"]


def _sdpa(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False) -> SymTensor:
    if dropout_p:
        raise TypeError(f"scaled_dot_product_attention with dropout_p > 0 is not supported {CONTEXT}: kernels draw "
                        "no random numbers")
    q, k, v = symbolic(query, key, value), symbolic(key, query), symbolic(value, query)
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"scaled_dot_product_attention: query, key and value must have one rank (>= 2), got shapes "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(f"enable_gqa: {q.shape[-3]} query heads are not a multiple of {k.shape[-3]} key heads")
        group = q.shape[-3] // k.shape[-3]
        k, v = repeat_interleave(k, group, q.ndim - 3), repeat_interleave(v, group, q.ndim - 3)
    batch = "abcdefghij"[:q.ndim - 2]
    s = einsum(f"{batch}le,{batch}se->{batch}ls", q, k) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        if attn_mask is not None:
            raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal, not both (as torch)")
        s = where(index(s, -2) >= index(s, -1), s, -math.inf)
    if attn_mask is not None:
        mask = symbolic(attn_mask, s)
        s = where(mask, s, -math.inf) if mask.kind == "bool" else s + mask
    m = s.max(axis=-1, keepdims=True)
    p = exp(s - m)
    out = einsum(f"{batch}ls,{batch}sf->{batch}lf", p, v) / p.sum(axis=-1, keepdims=True)
    return where(m == -math.inf, 0.0, out)  # a row with no visible key: 0, as torch's sdpa


HANDLERS: dict[str, Callable[..., Any]] = {"scaled_dot_product_attention": _sdpa}
