"""Saving a log-normaliser instead of a stabiliser and its sum (transform/normaliser.py): the
backward's gradients are the same before and after the rewrite, on random inputs, through the
reference executor (float64), and the rewrite declines what it cannot rescale."""

from __future__ import annotations

import torch

import neptune_fusion as nf
from neptune_fusion.lang.ops import cast, einsum, exp, index, inf, where
from neptune_fusion.library import attention, linear_cross_entropy, softmax_pooling
from neptune_fusion.transform.grad import _Reverse, grad_name
from neptune_fusion.transform.normaliser import save_log_normalisers


def _tuple(x):  # noqa: ANN001, ANN202
    return x if isinstance(x, tuple) else (x,)


def backward_values(g, program, args: dict, params: dict, seeds: list) -> tuple:  # noqa: ANN001
    """The gradients `g`'s backward computes from what `g`'s forward saves, in float64."""
    fwd = _tuple(nf.run_reference(g.forward, {**args, **params}, dtype=torch.float64))
    n = len(program.outputs)
    named = {b.name: args[b.name] for b in g.backward.inputs if b.name in args}
    named.update(zip(g.saved, fwd[n:]))
    for i in g.outputs_read:
        o = program.outputs[i]
        named[o.stage] = fwd[i].reshape([s for s, d in zip(fwd[i].shape, o.dims) if d is not None])
    named.update({grad_name(i): seeds[i] for i in g.grads_read})
    return _tuple(nf.run_reference(g.backward, {**named, **params}, dtype=torch.float64))


def before_and_after(program, args: dict, params: dict, wrt: tuple[str, ...]):  # noqa: ANN001, ANN201
    before = _Reverse(program, wrt).run()
    after = save_log_normalisers(before, program)
    outs = _tuple(nf.run_reference(program, {**args, **params}, dtype=torch.float64))
    seeds = [torch.randn_like(o) for o in outs]
    return before, after, backward_values(before, program, args, params, seeds), \
        backward_values(after, program, args, params, seeds)


def assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b, strict=True):
        assert not torch.isnan(x).any() and not torch.isnan(y).any()
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)  # saved values are fp32


@nf.program
def late_causal(q, k, v, scale):
    """Query i sees keys j <= i - 3: the first three rows see nothing (m = -inf, l = 0) and give 0,
    as `nf.attention` writes it."""
    s = einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = where(index(s, -2) >= index(s, -1) + 3, s, -inf)
    m = s.max(axis=-1, keepdims=True)
    p = exp(s - m)
    return where(m == -inf, 0.0, einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True))


@nf.program
def two_readers(x, v):
    """A softmax-weighted mean and the unnormalised sum it divides: the sum is read by two outputs,
    so it is saved, and it depends on the max."""
    p = exp(x - x.max(axis=-1, keepdims=True))
    u = einsum("ij,ij->i", p, v)
    return u / p.sum(axis=-1), u * 2.0


@nf.program
def weighted_normaliser(x, v, w):
    """The normaliser is a weighted sum of exponentials, not their plain sum."""
    p = exp(x - x.max(axis=-1, keepdims=True))
    return einsum("ij,ij->i", p, v) / einsum("ij,ij->i", p, w)


def test_attention_saves_one_log_normaliser_and_its_gradients_stay() -> None:
    torch.manual_seed(0)
    args = {n: torch.randn(1, 2, 9, 4, dtype=torch.float64) for n in "qkv"}
    program = attention.trace(*(t.float() for t in args.values()), scale=0.4)
    before, after, a, b = before_and_after(program, args, {"scale": 0.4}, ("q", "k", "v"))
    assert before.saved == ("max0", "sum0") and after.saved == ("lse_max0",)
    assert {b.name for b in after.backward.inputs} & {"max0", "sum0"} == set()
    assert_same(a, b)


def test_rows_that_see_nothing_keep_zero_gradients() -> None:
    torch.manual_seed(1)
    args = {n: torch.randn(1, 2, 8, 4, dtype=torch.float64) for n in "qkv"}
    program = late_causal.trace(*(t.float() for t in args.values()), scale=0.5)
    _, after, a, b = before_and_after(program, args, {"scale": 0.5}, ("q", "k", "v"))
    assert after.saved == ("lse_max0",)
    assert_same(a, b)
    assert torch.all(b[0][:, :, :3] == 0)  # dq of the rows that see no key


def test_linear_cross_entropy_and_pooling_fold() -> None:
    torch.manual_seed(2)
    h, w, t = torch.randn(6, 5, dtype=torch.float64), torch.randn(11, 5, dtype=torch.float64), torch.randint(0, 11, (6,))
    program = linear_cross_entropy.trace(h.float(), w.float(), t)
    _, after, a, b = before_and_after(program, {"h": h, "w": w, "target": t}, {}, ("h", "w"))
    assert after.saved == ("lse_max0",)
    assert_same(a, b)
    x, v = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    _, after, a, b = before_and_after(softmax_pooling.trace(x.float(), v.float()), {"x": x, "v": v}, {}, ("x", "v"))
    assert after.saved == ("lse_max0",)
    assert_same(a, b)


def test_declines_what_it_cannot_rescale() -> None:
    torch.manual_seed(3)
    x, v, w = (torch.randn(5, 7, dtype=torch.float64) for _ in range(3))
    for program, args in ((two_readers, {"x": x, "v": v}), (weighted_normaliser, {"x": x, "v": v, "w": w})):
        traced = program.trace(**{n: t.float() for n, t in args.items()})
        before, after, a, b = before_and_after(traced, args, {}, tuple(args))
        assert after == before, program.name
        assert "max0" in after.saved or "max0" in {i.name for i in after.backward.inputs}
        assert_same(a, b)


def rows(seed: int) -> dict[str, torch.Tensor]:
    """x and v of 6 rows of 7, c one value per row (float64)."""
    torch.manual_seed(seed)
    return {"x": torch.randn(6, 7, dtype=torch.float64), "v": torch.randn(6, 7, dtype=torch.float64),
            "c": torch.randn(6, dtype=torch.float64)}


def against_torch(program, args: dict, dense):  # noqa: ANN001, ANN201
    """(before, after, their gradients) of `program` on `args`, after's gradients checked against
    torch's autograd of `dense(**leaves)` (the outputs, as torch writes them) with the same seeds."""
    traced = program.trace(**{n: t.float() for n, t in args.items()})
    before, after, a, b = before_and_after(traced, args, {}, tuple(args))
    seeds = [torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)]
    got = backward_values(after, traced, args, {}, seeds)
    leaves = {n: t.clone().requires_grad_() for n, t in args.items()}
    assert_same(got, torch.autograd.grad(dense(**leaves), list(leaves.values()), seeds))
    return before, after, a, b


@nf.program
def flagged_by_its_max(x, v, c):
    """A softmax-weighted mean, and `c` where the row's max is positive (else 0): the second output
    reads the max through a 0/1 flag, so shifting the max to m + log(l) would flip the flag where
    m < 0 < m + log(l); the max is not free."""
    m = x.max(axis=-1, keepdims=True)
    p = exp(x - m)
    return einsum("ij,ij->i", p, v) / p.sum(axis=-1), c * cast(m[..., 0] > 0.0, "f32")


def test_a_flag_of_the_max_keeps_it_saved() -> None:
    args = rows(4)
    # rows whose max is negative but m + log(l) positive: the flag is 0 there (and 1 at m + log(l))
    args["x"][:3] = -0.1 - 0.4 * torch.rand(3, 7, dtype=torch.float64)

    def dense(x, v, c):  # noqa: ANN001, ANN202
        return (torch.softmax(x, -1) * v).sum(-1), c * (x.max(-1).values > 0).double()

    _, after, a, b = against_torch(flagged_by_its_max, args, dense)
    assert "max0" not in after.free_stabilisers and "lse_max0" not in after.saved
    assert_same(a, b)


@nf.program
def chosen_by_its_max(x, v, c):
    """A softmax-weighted mean, and `c` where the row's max is positive (else 0): each branch is
    free of the max, the choice is not (it would flip at m + log(l) where m < 0 < m + log(l))."""
    m = x.max(axis=-1, keepdims=True)
    p = exp(x - m)
    return einsum("ij,ij->i", p, v) / p.sum(axis=-1), where(m[..., 0] > 0.0, c, 0.0)


def test_a_condition_on_the_max_declines_the_fold() -> None:
    args = rows(5)
    args["x"][:3] = -0.1 - 0.4 * torch.rand(3, 7, dtype=torch.float64)

    def dense(x, v, c):  # noqa: ANN001, ANN202
        return (torch.softmax(x, -1) * v).sum(-1), torch.where(x.max(-1).values > 0, c, 0.0)

    before, after, _, _ = against_torch(chosen_by_its_max, args, dense)
    assert after == before and "max0" in before.free_stabilisers  # free, but its condition stays


@nf.program
def chosen_by_its_sum(x, v, c):
    """A softmax-weighted mean, and `c` where the row's sum of exponentials exceeds 2 (else 0): the
    sum becomes 1 in the folded backward, so the choice stays with (m, l)."""
    p = exp(x - x.max(axis=-1, keepdims=True))
    total = p.sum(axis=-1)
    return einsum("ij,ij->i", p, v) / total, where(total > 2.0, c, 0.0)


def test_a_condition_on_the_sum_declines_the_fold() -> None:
    args = rows(6)
    args["x"][:3, 0] += 5.0  # rows dominated by one entry: their sum is below 2

    def dense(x, v, c):  # noqa: ANN001, ANN202
        e = torch.exp(x - x.max(-1, keepdim=True).values)
        return (e * v).sum(-1) / e.sum(-1), torch.where(e.sum(-1) > 2.0, c, 0.0)

    before, after, _, _ = against_torch(chosen_by_its_sum, args, dense)
    assert after == before and "max0" in before.free_stabilisers
