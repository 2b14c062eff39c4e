"""Reference programs written the plain way, shared by the CLI, the benchmarks and the tests.

Nothing here is special to the compiler: each is an ordinary `@nf.program`.

Example:
    >>> import neptune_fusion as nf
    >>> from neptune_fusion.library import causal_attention
    >>> fn = nf.compile(causal_attention)   # then: out = fn(q, k, v, scale=0.088)
"""

from __future__ import annotations

from neptune_fusion.lang.ops import einsum, exp, index, inf, log, where
from neptune_fusion.lang.trace import program


@program
def attention(q, k, v, scale):
    """softmax(q k^T * scale) v over the last axis of the scores."""
    s = einsum("bhqd,bhkd->bhqk", q, k) * scale
    p = exp(s - s.max(axis=-1, keepdims=True))
    return einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@program
def causal_attention(q, k, v, scale):
    """Attention where query i sees keys j <= i, written as a where on positions."""
    s = einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = where(index(s, -2) >= index(s, -1), s, -inf)
    p = exp(s - s.max(axis=-1, keepdims=True))
    return einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@program
def softmax(x):
    """Softmax over the last axis."""
    e = exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@program
def logsumexp(x):
    """log(sum(exp(x))) over the last axis, computed stably."""
    m = x.max(axis=-1, keepdims=True)
    return (m + log(exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]
