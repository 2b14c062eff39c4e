"""Losses as torch defines them: reductions, class weights, ignore_index, label smoothing, legacy arguments."""

from __future__ import annotations

from typing import Any, Callable

from neptune_fusion.ir.expr import Const
from neptune_fusion.lang.tensor import (
    SymTensor,
    binary,
    index,
    mean,
    reduce_axes,
    size,
    unary,
    where,
)
from neptune_fusion.lang.torch_nn.common import floating, symbolic
from neptune_fusion.lang.torch_nn.statistics import log_softmax

__all__ = ["HANDLERS"]


def _reduction_arg(size_average: Any, reduce: Any, reduction: str) -> str:
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        return _reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return reduction


def _reduced(loss: SymTensor, reduction: str) -> SymTensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return reduce_axes("sum", loss, None, False)
    if reduction == "mean":
        return mean(loss, None, False)
    raise ValueError(f"{reduction!r} is not a valid value for reduction")


def _weighted(loss: SymTensor, weight: Any, reduction: str, weighted_mean: bool) -> SymTensor:
    """A pointwise loss times `weight`; its mean divides by the weights' sum where `weighted_mean`."""
    if weight is None:
        return _reduced(loss, reduction)
    loss = binary("mul", loss, weight)
    if reduction == "mean" and weighted_mean:
        return binary("div", _reduced(loss, "sum"), _reduced(symbolic(weight, loss), "sum"))
    return _reduced(loss, reduction)


def _mse_loss(input: Any, target: Any, size_average: Any = None, reduce: Any = None,  # noqa: A002
              reduction: str = "mean", weight: Any = None) -> SymTensor:
    d = binary("sub", input, target)
    return _weighted(binary("mul", d, d), weight, _reduction_arg(size_average, reduce, reduction), True)


def _l1_loss(input: Any, target: Any, size_average: Any = None, reduce: Any = None,  # noqa: A002
             reduction: str = "mean", weight: Any = None) -> SymTensor:
    loss = unary("abs", binary("sub", input, target))
    return _weighted(loss, weight, _reduction_arg(size_average, reduce, reduction), True)


def _huber(d: SymTensor, delta: float, scaled: bool) -> SymTensor:
    """|d| < delta: d^2 / 2 (/ delta where `scaled`: smooth L1), else |d| - delta / 2 (* delta: Huber)."""
    a = unary("abs", d)
    square = binary("mul", 0.5, binary("mul", d, d))
    if scaled:
        return where(binary("lt", a, delta), binary("div", square, delta), binary("sub", a, 0.5 * delta))
    return where(binary("lt", a, delta), square, binary("mul", delta, binary("sub", a, 0.5 * delta)))


def _smooth_l1_loss(input: Any, target: Any, size_average: Any = None, reduce: Any = None,  # noqa: A002
                    reduction: str = "mean", beta: float = 1.0) -> SymTensor:
    d = binary("sub", input, target)
    loss = unary("abs", d) if beta == 0 else _huber(d, beta, True)
    return _reduced(loss, _reduction_arg(size_average, reduce, reduction))


def _huber_loss(input: Any, target: Any, reduction: str = "mean", delta: float = 1.0,  # noqa: A002
                weight: Any = None) -> SymTensor:
    return _weighted(_huber(binary("sub", input, target), delta, False), weight, reduction, False)


def _kl_div(input: Any, target: Any, size_average: Any = None, reduce: Any = None,  # noqa: A002
            reduction: str = "mean", log_target: bool = False) -> SymTensor:
    if log_target:
        loss = binary("mul", unary("exp", target), binary("sub", target, input))
    else:  # xlogy(t, t) - t * input: 0 where t == 0
        safe = where(binary("eq", target, 0.0), 1.0, target)
        loss = binary("sub", binary("mul", target, unary("log", safe)), binary("mul", target, input))
    if size_average is not None or reduce is not None:
        return _reduced(loss, _reduction_arg(size_average, reduce, reduction))
    if reduction == "batchmean":
        total = _reduced(loss, "sum")
        x = symbolic(input, target)
        return binary("div", total, size(x, 0)) if x.ndim > 0 else total
    return _reduced(loss, reduction)


def _class_axis(x: SymTensor) -> int:
    return 0 if x.ndim == 1 else 1


def _class_weights(weight: Any, x: SymTensor) -> SymTensor:
    """`weight` (C,) shaped to broadcast along the class axis of `x` (N, C, d1, ...)."""
    w = symbolic(weight, x)
    return w[(slice(None),) + (None,) * (x.ndim - 2)] if x.ndim > 1 else w


def _picked(logp: SymTensor, target: SymTensor, weight: Any, ignore_index: int) -> tuple[SymTensor, SymTensor]:
    """Per target: (-weight[t] * logp[..., t, ...], weight[t]), both 0 where t is ignore_index."""
    axis = _class_axis(logp)
    if target.ndim != logp.ndim - 1:
        raise ValueError(f"expected a target of rank {logp.ndim - 1} for an input of shape {list(logp.shape)}, got "
                         f"shape {list(target.shape)}")
    kept = binary("ne", target, ignore_index)
    valid = binary("and", kept, binary("and", binary("ge", target, 0), binary("lt", target, size(logp, axis))))
    safe = where(valid, target, 0)
    # the target's other axes are the input's: an index tensor over the input's non-class axes
    rest = SymTensor(tuple(d for i, d in enumerate(logp.dims) if i != axis), Const(0), logp.tracer, "int")
    rows = [index(rest, i) for i in range(rest.ndim)]
    value = logp[tuple(rows[:axis]) + (safe,) + tuple(rows[axis:])]
    w = symbolic(weight, logp)[safe] if weight is not None else 1.0
    loss = where(kept, binary("mul", unary("neg", value), w), 0.0)
    return loss, where(kept, w, 0.0)


def _nll(logp: SymTensor, target: SymTensor, weight: Any, ignore_index: int, reduction: str,
         smoothing: float = 0.0) -> SymTensor:
    """The negative log-likelihood of integer targets, with torch's label smoothing and reductions."""
    loss, weights = _picked(logp, target, weight, ignore_index)
    if smoothing:
        axis = _class_axis(logp)
        weighted = logp if weight is None else binary("mul", logp, _class_weights(weight, logp))
        uniform = where(binary("ne", target, ignore_index), unary("neg", reduce_axes("sum", weighted, axis, False)), 0.0)
        loss = binary("add", binary("mul", 1.0 - smoothing, loss),
                      binary("mul", smoothing, binary("div", uniform, size(logp, axis))))
    if reduction == "mean":  # over the targets kept, weighted: NaN where none is
        return binary("div", _reduced(loss, "sum"), _reduced(weights, "sum"))
    return _reduced(loss, reduction)


def _nll_loss(input: Any, target: Any, weight: Any = None, size_average: Any = None,  # noqa: A002
              ignore_index: int = -100, reduce: Any = None, reduction: str = "mean") -> SymTensor:
    logp, t = symbolic(input, target), symbolic(target, input)
    if t.kind != "int":
        raise TypeError(f"nll_loss needs integer class targets, got a {t.kind} tensor")
    return _nll(logp, t, weight, ignore_index, _reduction_arg(size_average, reduce, reduction))


def _cross_entropy(input: Any, target: Any, weight: Any = None, size_average: Any = None,  # noqa: A002
                   ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> SymTensor:
    x, t = floating(symbolic(input, target)), symbolic(target, input)
    reduction = _reduction_arg(size_average, reduce, reduction)
    axis = _class_axis(x)
    logp = log_softmax(x, axis)
    if t.kind == "int":
        return _nll(logp, t, weight, ignore_index, reduction, label_smoothing)
    if t.kind != "float" or t.shape != x.shape:
        raise ValueError(f"cross_entropy: a target of shape {list(t.shape)} ({t.kind}) is neither class indices nor "
                         f"probabilities for an input of shape {list(x.shape)}")
    if label_smoothing:  # probabilities: mixed with the uniform distribution
        t = binary("add", binary("mul", t, 1.0 - label_smoothing), binary("div", label_smoothing, size(x, axis)))
    terms = binary("mul", logp, t)
    if weight is not None:
        terms = binary("mul", terms, _class_weights(weight, x))
    return _reduced(unary("neg", reduce_axes("sum", terms, axis, False)), reduction)


def _binary_cross_entropy(input: Any, target: Any, weight: Any = None, size_average: Any = None,  # noqa: A002
                          reduce: Any = None, reduction: str = "mean") -> SymTensor:
    """-(t log p + (1 - t) log(1 - p)), each log clamped at -100, as torch."""
    log_p = binary("max", unary("log", input), -100.0)
    log_q = binary("max", unary("log", binary("sub", 1.0, input)), -100.0)
    loss = unary("neg", binary("add", binary("mul", target, log_p), binary("mul", binary("sub", 1.0, target), log_q)))
    return _weighted(loss, weight, _reduction_arg(size_average, reduce, reduction), False)


def _binary_cross_entropy_with_logits(input: Any, target: Any, weight: Any = None, size_average: Any = None,  # noqa: A002
                                      reduce: Any = None, reduction: str = "mean",
                                      pos_weight: Any = None) -> SymTensor:
    """(1 - t) x - (1 + (pw - 1) t) log(sigmoid(x)), log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|))."""
    x = symbolic(input, target)
    log_sigmoid = binary("sub", binary("min", x, 0.0),
                         unary("log", binary("add", 1.0, unary("exp", unary("neg", unary("abs", x))))))
    scale: Any = 1.0
    if pos_weight is not None:
        scale = binary("add", 1.0, binary("mul", binary("sub", pos_weight, 1.0), target))
    loss = binary("sub", binary("mul", binary("sub", 1.0, target), x), binary("mul", scale, log_sigmoid))
    return _weighted(loss, weight, _reduction_arg(size_average, reduce, reduction), False)


HANDLERS: dict[str, Callable[..., Any]] = {
    "mse_loss": _mse_loss, "l1_loss": _l1_loss, "smooth_l1_loss": _smooth_l1_loss, "huber_loss": _huber_loss,
    "kl_div": _kl_div, "nll_loss": _nll_loss, "cross_entropy": _cross_entropy,
    "binary_cross_entropy": _binary_cross_entropy,
    "binary_cross_entropy_with_logits": _binary_cross_entropy_with_logits,
}
