"""Reference programs written the plain way, shared by the CLI, the benchmarks and the tests.

Nothing here is special to the compiler: each is an ordinary `@nf.program`.

Example:
    >>> import neptune_fusion as nf
    >>> from neptune_fusion.library import causal_attention
    >>> fn = nf.compile(causal_attention)   # then: out = fn(q, k, v, scale=0.088)
"""

from __future__ import annotations

from neptune_fusion.lang.ops import cast, einsum, exp, index, inf, log, size, sqrt, where
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


@program
def rmsnorm(x, g):
    """RMSNorm over the last axis of `x`, with a weight `g`."""
    return x / sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6) * g


@program
def layernorm(x):
    """LayerNorm (no affine) over the last axis of `x`."""
    mean = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    var = ((x - mean) * (x - mean)).sum(axis=-1, keepdims=True) / x.shape[-1]
    return (x - mean) / sqrt(var + 1e-5)


@program
def rmsnorm_matmul(x, w):
    """RMSNorm over the last axis of `x`, then `@ w`."""
    r = sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return einsum("ik,ke->ie", x / r, w)


@program
def layernorm_matmul(x, w):
    """LayerNorm (no affine) over the last axis of `x`, then `@ w`."""
    mean = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    var = ((x - mean) * (x - mean)).sum(axis=-1, keepdims=True) / x.shape[-1]
    return einsum("ik,ke->ie", (x - mean) / sqrt(var + 1e-5), w)


@program
def linear_logsumexp(h, w):
    """logsumexp over the vocabulary of `h @ w^T` (the normaliser of a linear cross-entropy)."""
    s = einsum("id,vd->iv", h, w)
    m = s.max(axis=-1, keepdims=True)
    return (m + log(exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]


@program
def linear_cross_entropy(h, w, target):
    """Cross-entropy of `h @ w^T` against integer targets, per row, without the logits in memory.
    A target outside [0, vocabulary) (torch's ignore_index -100, padding) gives 0 and no gradient."""
    s = einsum("id,vd->iv", h, w)
    m = s.max(axis=-1, keepdims=True)
    lse = (m + log(exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]
    kept = (target >= 0) & (target < size(s, -1))
    return (lse - s[index(lse, 0), where(kept, target, 0)]) * cast(kept, "f32")


@program
def softmax_pooling(x, v):
    """Per row, the softmax of `x` as weights of a mean of `v`."""
    p = exp(x - x.max(axis=-1, keepdims=True))
    return einsum("ij,ij->i", p, v) / p.sum(axis=-1)
