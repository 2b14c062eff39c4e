"""The derived backward (transform/grad.py, integrations/autograd.py).

Three levels: the backward Program run by the reference executor against torch autograd through
the forward program (float64, no kernels: many programs); finite differences on small float64
programs; and the compiled kernels under the Triton interpreter through `nf.attention` and
`nf.compile` against torch autograd on the dense formula in float64.
"""

from __future__ import annotations

import math
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.ir.errors import FusionError  # noqa: E402
from neptune_fusion.library import (  # noqa: E402
    attention,
    causal_attention,
    layernorm_matmul,
    linear_cross_entropy,
    logsumexp,
    rmsnorm_matmul,
    softmax,
    softmax_pooling,
)
from neptune_fusion.transform.grad import differentiate, grad_name  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


def _tuple(x):  # noqa: ANN001, ANN202
    return x if isinstance(x, tuple) else (x,)


def reference_backward(program, args: dict, params: dict, wrt: tuple[str, ...], seeds=None):  # noqa: ANN001, ANN201
    """(gradients from the derived backward program, gradients from torch autograd), both float64."""
    g = differentiate(program, wrt)
    leaves = {k: v.double().clone().requires_grad_(k in wrt) if v.is_floating_point() else v for k, v in args.items()}
    outs = _tuple(nf.run_reference(program, {**leaves, **params}, dtype=torch.float64))
    seeds = seeds or [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, [leaves[w] for w in wrt], seeds, allow_unused=True)
    fwd = _tuple(nf.run_reference(g.forward, {**leaves, **params}, dtype=torch.float64))
    n = len(program.outputs)
    named = {b.name: leaves[b.name].detach() for b in g.backward.inputs if b.name in leaves}
    named.update(zip(g.saved, (t.detach() for t in fwd[n:])))
    for i in g.outputs_read:
        o = program.outputs[i]
        named[o.stage] = fwd[i].detach().reshape([s for s, d in zip(fwd[i].shape, o.dims) if d is not None])
    named.update({grad_name(i): seeds[i] for i in g.grads_read})
    got = dict(zip(g.nonzero, _tuple(nf.run_reference(g.backward, {**named, **params}, dtype=torch.float64))))
    return [got.get(w) for w in wrt], list(want), g


def assert_grads(got, want, tol: float = 1e-6) -> None:  # noqa: ANN001
    for a, b in zip(got, want):
        if b is None:
            assert a is None or torch.all(a == 0)
            continue
        a = torch.zeros_like(b) if a is None else a.reshape(b.shape)
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a.double(), b.double(), atol=tol * max(1.0, b.abs().max().item()), rtol=tol)


# --------------------------------------------------------------------------- the backward program


LIBRARY = [
    (softmax, {"x": (6, 9)}, ()),
    (logsumexp, {"x": (6, 9)}, ()),
    (softmax_pooling, {"x": (5, 11), "v": (5, 11)}, ()),
    (rmsnorm_matmul, {"x": (7, 5), "w": (5, 6)}, ()),
    (layernorm_matmul, {"x": (7, 5), "w": (5, 6)}, ()),
    (attention, {"q": (1, 2, 7, 4), "k": (1, 2, 9, 4), "v": (1, 2, 9, 3)}, ("scale",)),
    (causal_attention, {"q": (1, 2, 9, 4), "k": (1, 2, 9, 4), "v": (1, 2, 9, 3)}, ("scale",)),
]


@pytest.mark.parametrize("program,shapes,params", LIBRARY, ids=lambda x: getattr(x, "name", None))
def test_backward_program_equals_autograd(program, shapes, params) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    args = {n: torch.randn(*s) for n, s in shapes.items()}
    values = {p: 0.37 for p in params}
    traced = program.trace(**args, **values)
    got, want, _ = reference_backward(traced, args, values, tuple(args))
    assert_grads(got, want)


def test_linear_cross_entropy_backward_gathers_the_target() -> None:
    torch.manual_seed(0)
    h, w, target = torch.randn(6, 4), torch.randn(10, 4), torch.randint(0, 10, (6,))
    traced = linear_cross_entropy.trace(h, w, target)
    got, want, g = reference_backward(traced, {"h": h, "w": w, "target": target}, {}, ("h", "w"))
    assert_grads(got, want)
    assert all(set(g.forward.stage(o.stage).axes) <= {"i"} for o in g.forward.outputs)  # no logits saved


def test_attention_saves_row_statistics_only_and_its_max_is_free() -> None:
    q = torch.randn(1, 2, 8, 4)
    g = differentiate(causal_attention.trace(q, q, q, scale=0.5), ("q", "k", "v"))
    assert g.free_stabilisers == ("max0",)
    assert g.saved == ("lse_max0",)  # max0 + log(sum0), one row statistic; never a query x key matrix
    assert g.recovered == ("dot1",)  # the unnormalised output, recovered from o = u / l
    assert g.held == frozenset({"d", "d2"})
    from neptune_fusion.schedule.partition import partition_loops

    kernels = partition_loops(g.backward, g.held)
    assert len(kernels) == 3  # D = rowsum(dO * O), then dK and dV over queries, then dQ over keys
    for group in kernels:  # what travels between kernels is linear in the sequence: never q x k
        for out in group.program.outputs:
            assert not {"q", "k"} <= set(out.dims), out


def test_a_max_that_is_the_output_gets_its_gradient_shared_among_ties() -> None:
    @nf.program
    def rowmax(x):
        return x.max(axis=-1) * 2.0

    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, -1.0, 0.5, 1.0]])
    seed = torch.tensor([1.5, -1.0], dtype=torch.float64)
    got, want, g = reference_backward(rowmax.trace(x), {"x": x}, {}, ("x",), [seed])
    assert g.free_stabilisers == ()
    assert got[0].tolist() == [[0.0, 1.5, 1.5, 0.0], [-2.0, 0.0, 0.0, 0.0]]  # torch.amax shares ties too
    assert_grads(got, want)


def test_a_max_read_outside_the_shift_is_not_free() -> None:
    @nf.program
    def shifted(x):
        m = x.max(axis=-1, keepdims=True)
        return nf.exp(x - m).sum(axis=-1) + m[..., 0]  # not shift invariant: the max itself is added

    x = torch.randn(4, 6)
    got, want, g = reference_backward(shifted.trace(x), {"x": x}, {}, ("x",))
    assert g.free_stabilisers == ()
    assert_grads(got, want)


def test_prod_reduction_has_no_derived_backward() -> None:
    from neptune_fusion.ir.expr import Index, Load, Reduce
    from neptune_fusion.ir.program import InputBuffer, OutputSpec, Program, Stage

    x = Load("x", (Index("i"), Index("j")))
    program = Program("rowprod", (InputBuffer("x", ("i", "j")),), (), (Stage("p", ("i",), Reduce("prod", "j", x)),),
                      (OutputSpec("p", ("i",)),), {"i": ("x", 0), "j": ("x", 1)})
    with pytest.raises(FusionError, match=r"\[differentiate\] stage 'p' \(prod over j\): only sum, max and min"):
        differentiate(program, ("x",))


def test_attention_variants_backward_equals_autograd() -> None:
    """Masks, a learnable ALiBi slope, a relative-position table, softcap, GQA, rows with no
    visible key, decode: the programs `nf.attention` compiles, differentiated and run unfused."""
    torch.manual_seed(0)
    lq, lk, hq, hkv = 9, 13, 4, 2
    table = torch.randn(hq, lq + lk)

    def mods(slopes, table):  # noqa: ANN001, ANN202
        def alibi(s, b, h, i, j):
            return s + slopes[h] * (j - i)

        def relative(s, b, h, i, j):
            return s + table[h, i - j + lk]

        def softcap(s, b, h, i, j):
            return 5.0 * torch.tanh(s / 5.0)

        return {"alibi": alibi, "relative": relative, "softcap": softcap}

    def window(b, h, i, j):
        return (i + lk - lq >= j) & (i + lk - lq - j < 5)  # (rows that see no key: the kernel tests)

    for name in ("alibi", "relative", "softcap"):
        for shape_q in ((1, hq, lq, 8), (1, hq, 1, 8)):
            q, k, v = torch.randn(*shape_q), torch.randn(1, hkv, lk, 8), torch.randn(1, hkv, lk, 8)
            slopes = torch.rand(hq)
            score = mods(slopes, table)[name]
            prog = nf.attention_program(q, k, v, score_mod=score, mask_mod=window, enable_gqa=True)
            args = nf.attention_inputs(q, k, v, score_mod=score, mask_mod=window, enable_gqa=True)
            params = {"scale": args.pop("scale")}
            wrt = tuple(n for n, t in args.items() if t.is_floating_point())
            got, want, _ = reference_backward(prog, args, params, wrt)
            assert_grads(got, want)


# --------------------------------------------------------------------------- finite differences


class _ReferenceFunction(torch.autograd.Function):
    """The derived forward and backward programs, run by the reference executor (for gradcheck)."""

    @staticmethod
    def forward(ctx, program, names, *tensors):  # noqa: ANN001, ANN205
        g = differentiate(program, names)
        named = dict(zip(names, tensors))
        outs = _tuple(nf.run_reference(g.forward, named, dtype=torch.float64))
        ctx.g, ctx.names, ctx.program = g, names, program
        ctx.save_for_backward(*tensors, *outs)
        return outs[: len(program.outputs)][0]

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        g, names = ctx.g, ctx.names
        tensors, outs = ctx.saved_tensors[: len(names)], ctx.saved_tensors[len(names):]
        named = dict(zip(names, tensors))
        named.update(zip(g.saved, outs[len(ctx.program.outputs):]))
        for i in g.outputs_read:
            o = ctx.program.outputs[i]
            named[o.stage] = outs[i].reshape([s for s, d in zip(outs[i].shape, o.dims) if d is not None])
        named[grad_name(0)] = grad
        args = {b.name: named[b.name] for b in g.backward.inputs}
        got = dict(zip(g.nonzero, _tuple(nf.run_reference(g.backward, args, dtype=torch.float64))))
        return (None, None, *(got.get(n, torch.zeros_like(t)) for n, t in zip(names, tensors)))


@pytest.mark.parametrize("program,shapes", [
    (softmax_pooling, {"x": (3, 5), "v": (3, 5)}),
    (logsumexp, {"x": (3, 6)}),
    (layernorm_matmul, {"x": (3, 4), "w": (4, 2)}),
], ids=["softmax_pooling", "logsumexp", "layernorm_matmul"])
def test_finite_differences(program, shapes) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    args = {n: torch.randn(*s, dtype=torch.float64, requires_grad=True) for n, s in shapes.items()}
    traced = program.trace(**{n: t.detach().float() for n, t in args.items()})
    assert torch.autograd.gradcheck(lambda *t: _ReferenceFunction.apply(traced, tuple(args), *t),
                                    tuple(args.values()), eps=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- compiled kernels


def dense_attention(q, k, v, score=None, keep=None):  # noqa: ANN001, ANN201
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lq, lk = q.shape[2], k.shape[2]
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None]
    h = torch.arange(q.shape[1])[:, None, None]
    if score is not None:
        s = score(s, 0, h, i, j)
    if keep is not None:
        s = s.masked_fill(~keep(0, h, i, j), -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def _check_attention(lq: int, lk: int, hq: int, hkv: int, score_maker=None, mask=None, block: bool = False,
                     tol: float = 2e-4) -> None:  # noqa: ANN001
    torch.manual_seed(lq * 100 + lk)
    q = torch.randn(1, hq, lq, 16, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, lk, 16, dtype=torch.float64) for _ in range(2))
    extra = [torch.rand(hq, dtype=torch.float64)] if score_maker is not None else []
    leaves = [t.float().requires_grad_() for t in (q, k, v, *extra)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, *extra)]
    score = score_maker(leaves[3]) if score_maker else None
    mask_arg: dict = {}
    if mask is not None:
        if block:
            from torch.nn.attention.flex_attention import create_block_mask

            mask_arg["block_mask"] = create_block_mask(mask, None, None, lq, lk, device="cpu", BLOCK_SIZE=16)
        else:
            mask_arg["mask_mod"] = mask
    out = nf.attention(*leaves[:3], score_mod=score, enable_gqa=hq != hkv, **mask_arg)
    assert out.grad_fn is not None
    seed = torch.randn(1, hq, lq, 16, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, seed.float())
    want = torch.autograd.grad(dense_attention(*ref_leaves[:3], score_maker(ref_leaves[3]) if score_maker else None,
                                               mask), ref_leaves, seed)
    for a, b in zip(got, want):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a.double(), b, atol=tol * max(1.0, b.abs().max().item()), rtol=tol)


def test_causal_attention_gradients_in_kernels() -> None:
    _check_attention(40, 40, 2, 2, mask=lambda b, h, i, j: i >= j)


def test_alibi_learnable_slopes_gqa_window_and_empty_rows_in_kernels() -> None:
    def alibi(slopes):  # noqa: ANN001, ANN202
        return lambda s, b, h, i, j: s + slopes[h] * (j - i)

    _check_attention(37, 45, 4, 2, alibi, mask=lambda b, h, i, j: (i + 8 >= j) & (i + 8 - j < 12) & (i >= 3))


def test_document_block_mask_and_decode_in_kernels() -> None:
    doc = torch.tensor([0] * 13 + [1] * 20 + [2] * 15)
    _check_attention(48, 48, 2, 2, mask=lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), block=True)
    _check_attention(1, 45, 4, 1, lambda slopes: lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0) + 0 * slopes[h])


@pytest.mark.parametrize("program,shapes", [
    (softmax_pooling, {"x": (16, 40), "v": (16, 40)}),
    (logsumexp, {"x": (16, 40)}),
], ids=["softmax_pooling", "logsumexp"])
def test_compiled_programs_backward(program, shapes) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    args = {n: torch.randn(*s, dtype=torch.float64) for n, s in shapes.items()}
    leaves = {n: t.float().requires_grad_() for n, t in args.items()}
    out = nf.compile(program)(**leaves)
    seed = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, list(leaves.values()), seed.float())
    ref = {n: t.clone().requires_grad_() for n, t in args.items()}
    dense = nf.run_reference(program.trace(**leaves), ref, dtype=torch.float64)
    want = torch.autograd.grad(dense, list(ref.values()), seed)
    assert_grads(got, want, tol=1e-4)


def test_compiled_linear_cross_entropy_backward() -> None:
    torch.manual_seed(0)
    h, w = torch.randn(24, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    target = torch.randint(0, 40, (24,))
    hl, wl = h.float().requires_grad_(), w.float().requires_grad_()
    loss = nf.compile(linear_cross_entropy)(hl, wl, target).mean()
    loss.backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.cross_entropy(hr @ wr.T, target).backward()
    assert_grads([hl.grad, wl.grad], [hr.grad, wr.grad], tol=1e-4)


def test_relative_position_table_gradient_in_kernels() -> None:
    """A learnable bias table read at i - j: its gradient lands where the index equals the table's
    position (a where over the table's axis, summed over queries, keys and batch)."""
    torch.manual_seed(0)
    heads, n = 2, 24
    q, k, v = (torch.randn(1, heads, n, 16, dtype=torch.float64) for _ in range(3))
    table = torch.randn(heads, 2 * n, dtype=torch.float64)
    leaves = [t.float().requires_grad_() for t in (q, k, v, table)]

    def relative(s, b, h, i, j):
        return s + leaves[3][h, i - j + n]

    out = nf.attention(*leaves[:3], score_mod=relative, mask_mod=lambda b, h, i, j: i >= j)
    seed = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, seed.float())
    ref = [t.clone().requires_grad_() for t in (q, k, v, table)]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    s = (ref[0] @ ref[1].transpose(-1, -2) / 4.0 + ref[3][:, i - j + n]).masked_fill(~(i >= j), -math.inf)
    want = torch.autograd.grad(torch.softmax(s, -1) @ ref[2], ref, seed)
    assert_grads(got, want, tol=2e-4)



@pytest.mark.parametrize("shape,index", [((65,), lambda t, b, h, i, j: t[j]), ((20, 30), lambda t, b, h, i, j: t[i, j]),
                                         ((2, 30), lambda t, b, h, i, j: t[b, j])], ids=["key", "query_key", "batch_key"])
def test_learnable_biases_over_the_keys_in_kernels(shape, index) -> None:
    """A bias read at the key index (per key, per query and key, per batch and key): its gradient
    sums over the other axes in the frame's order (b, h, k), so its kernel shares dK's roles; the
    key axis led its partial sums before, was held whole, and the tile outgrew Triton's limit."""
    torch.manual_seed(0)
    batch = shape[0] if len(shape) == 2 and shape[0] == 2 else 1
    lq, lk = (20, 30) if len(shape) == 2 else (16, 65)
    q = torch.randn(batch, 2, lq, 16, dtype=torch.float64)
    k, v = (torch.randn(batch, 2, lk, 16, dtype=torch.float64) for _ in range(2))
    table = torch.randn(*shape, dtype=torch.float64)
    leaves = [x.float().requires_grad_() for x in (q, k, v, table)]
    out = nf.attention(*leaves[:3], score_mod=lambda s, b, h, i, j: s + index(leaves[3], b, h, i, j))
    seed = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, seed.float())
    ref = [x.clone().requires_grad_() for x in (q, k, v, table)]
    b, i, j = torch.arange(batch)[:, None, None, None], torch.arange(lq)[:, None], torch.arange(lk)[None]
    s = ref[0] @ ref[1].transpose(-1, -2) / 4.0 + index(ref[3], b, None, i, j)
    want = torch.autograd.grad(torch.softmax(s, -1) @ ref[2], ref, seed)
    assert_grads(got, want, tol=2e-4)

def test_linear_cross_entropy_backward_over_a_long_hidden_axis_is_materialised_a_chunk_at_a_time(monkeypatch) -> None:
    """Hidden size 600, over what a tile holds whole: dW's and dh's kernels would both contract the
    hidden axis (the logits) and accumulate over it. The logits' gradient is materialised for a
    chunk of the vocabulary at a time instead (here 128, 128 and 44 entries) and contracted with w
    and h: dh sums over the chunks, dW is written a slice at a time. Gradients as torch's."""
    from neptune_fusion.integrations.autograd import Chunked
    from neptune_fusion.schedule import materialise

    monkeypatch.setattr(materialise, "MIN_CHUNK_BYTES", 0)  # chunks of one tile (128 entries)
    monkeypatch.setattr(materialise, "CHUNK_SHARE", 0.0)
    torch.manual_seed(0)
    h = torch.randn(8, 600, dtype=torch.float64)
    w = torch.randn(300, 600, dtype=torch.float64) * 0.05
    target = torch.randint(0, 300, (8,))
    hl, wl = h.float().requires_grad_(), w.float().requires_grad_()
    fn = nf.compile(linear_cross_entropy)
    seed = torch.randn(8, dtype=torch.float64)
    fn(hl, wl, target).backward(seed.float())
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.cross_entropy(hr @ wr.T, target, reduction="none").backward(seed)
    assert_grads([hl.grad, wl.grad], [hr.grad, wr.grad], tol=1e-5)
    (derived,) = fn.training.values()
    (step,) = [f for _, f in derived.backward.steps]
    assert isinstance(step, Chunked) and step.plan.axis == "v" and step.plan.shared == "grad_dot0"
    # one chunk of the logits' gradient is alive at a time: each is released before the next is made
    import weakref

    from neptune_fusion.integrations import autograd

    made: list = []
    real = autograd.run_kernels

    def producing(fn, args):
        assert all(ref() is None for ref in made), "an earlier chunk is still alive"
        out = real(fn, args)
        if fn is step.producer:
            made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(autograd, "run_kernels", producing)
    hl.grad = wl.grad = None
    fn(hl, wl, target).backward(seed.float())
    assert len(made) == 3
    assert_grads([hl.grad, wl.grad], [hr.grad, wr.grad], tol=1e-5)
    assert materialise.chunk_length(step.plan, {"i": 8, "v": 300, "d": 600}, 4) == 128
    # dh (summed over the vocabulary's chunks) is held in fp32 unless that outgrows the chunk's budget
    assert materialise.accumulates_in_fp32(step.plan, {"i": 8, "v": 300, "d": 600}, 4)
    assert not materialise.accumulates_in_fp32(step.plan, {"i": 8192, "v": 128256, "d": 4096}, 2)


def test_a_backward_no_chunked_plan_computes_runs_in_several_kernels() -> None:
    """The logits of h * h: dW's sum over tokens multiplies the logits' gradient by h twice, which
    neither one kernel's plan nor a chunked contraction computes; the kernel is split in several
    instead (`partition.split_to_fit`: the reductions that read others in later kernels), and
    the gradients are torch's. `nf.explain` shows the same order of attempts."""
    @nf.program
    def squared_logsumexp(h, w):
        s = nf.einsum("id,vd->iv", h * h, w)
        m = s.max(axis=-1, keepdims=True)
        return (m + nf.log(nf.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]

    torch.manual_seed(0)
    h, w = torch.randn(8, 600, requires_grad=True), torch.randn(16, 600, requires_grad=True)
    got = torch.autograd.grad(nf.compile(squared_logsumexp)(h, w).sum(), (h, w))
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.autograd.grad(torch.logsumexp((hd * hd) @ wd.T, -1).sum(), (hd, wd))
    assert_grads(list(got), list(want), tol=1e-4)
    text = nf.explain(squared_logsumexp, h, w, backward=True)
    assert "no chunked plan either" in text and "one kernel's tile split in several" in text


def test_a_training_step_with_a_block_mask_builds_no_block_map_again() -> None:
    """The backward kernels' block maps come from the BlockMask alone: the guard of rows the forward
    left empty (which reads the saved max, new every step) stays arithmetic, so the second step
    finds every map in its cache. The BlockMask's tables say more than its mask_mod (a full block
    above the diagonal), so the call stays block-mapped. Gradients as the dense formula's."""
    from torch.nn.attention.flex_attention import BlockMask

    import neptune_fusion.runtime.blockmap as blockmap

    def lists(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # listed blocks first
        return table.sum(-1).int()[None, None], (~table).int().argsort(dim=-1, stable=True).int()[None, None]

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(3))
    rows, cols = torch.arange(4)[:, None], torch.arange(4)[None]
    full = (rows >= cols + 2) | ((rows == 0) & (cols == 3))
    partial = (rows == cols) | (rows == cols + 1)
    block = BlockMask.from_kv_blocks(*lists(partial), *lists(full), BLOCK_SIZE=16, seq_lengths=(64, 64),
                                     mask_mod=lambda b, h, i, j: i >= j + 3)
    seed = torch.randn(1, 2, 64, 16, dtype=torch.float64)
    for step in range(2):
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        before = blockmap.builds
        got = torch.autograd.grad(nf.attention(*leaves, block_mask=block), leaves, seed.float())
        assert (blockmap.builds > before) == (step == 0)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    i, j = torch.arange(64)[:, None], torch.arange(64)[None]
    keep = full[i // 16, j // 16] | (partial[i // 16, j // 16] & (i >= j + 3))
    s = (ref[0] @ ref[1].transpose(-1, -2) / 4.0).masked_fill(~keep, -math.inf)
    want = torch.autograd.grad(torch.softmax(s, -1).nan_to_num(0.0) @ ref[2], ref, seed)
    assert_grads(got, want, tol=1e-4)


def test_contraction_letters_never_collide() -> None:
    """Axes named by one letter keep it in the einsum; longer names take letters no axis uses."""
    from neptune_fusion.ir.expr import Binary, Index, Load, Reduce
    from neptune_fusion.ir.program import Stage
    from neptune_fusion.schedule.materialise import _contraction

    body = Reduce("sum", "d", Binary("mul", Load("G", (Index("d"), Index("v"))), Load("x", (Index("d"), Index("hd")))))
    contraction = _contraction("output:0", Stage("g", ("v", "hd"), body), "v", frozenset({"x"}))
    assert contraction.spec == "dv,da->va" and contraction.operand_axes == ("d", "hd")


def test_explain_shows_the_chunked_backward() -> None:
    """nf.explain(..., backward=True) says which kernels no plan computes, and how they run instead."""
    h = torch.randn(8, 600, requires_grad=True)
    w = torch.randn(300, 600, requires_grad=True)
    text = nf.explain(linear_cross_entropy, h, w, torch.randint(0, 300, (8,)), backward=True)
    assert "(no kernel plan computes it: [tile planning] stage 'grad_w_part'" in text
    assert "=== materialised a chunk at a time: grad_dot0['i', 'v'] over 'v'" in text
    assert "einsum('iv,vd->id', grad_dot0 chunk, w) summed over the chunks" in text


@pytest.mark.parametrize("spec", ["iv,id->vd", "iv,vd->id", "vi,dv->di", "ij,jk->ik", "bij,bjk->bik"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_a_chunk_contracts_into_its_gradient_as_einsum_does(spec, accumulate) -> None:
    """A chunk's contraction lands in the gradient itself (cuBLAS writing into a slice, or adding
    to the accumulator), whichever operand holds the result's first axis; other contractions
    (a batch axis) go through einsum. Scaled, into a column slice too."""
    from neptune_fusion.integrations.autograd import contract_into

    torch.manual_seed(0)
    inputs, result = spec.split("->")
    size = dict(zip("bijkvd", (2, 5, 6, 7, 3, 4)))
    a, b = (torch.randn(*(size[x] for x in part), dtype=torch.float64) for part in inputs.split(","))
    want = torch.einsum(spec, a, b) * 0.5
    whole = torch.randn(*(size[x] for x in result[:-1]), size[result[-1]] + 3, dtype=torch.float64)
    out = whole.narrow(-1, 2, size[result[-1]])  # a slice of a wider gradient: not contiguous
    before = out.clone()
    contract_into(spec, a, b, out, accumulate=accumulate, scale=0.5)
    torch.testing.assert_close(out, want + before if accumulate else want)


def test_backward_kernels_sum_in_a_fixed_order(monkeypatch) -> None:
    """Gradients are deterministic, with no option to ask for it: no kernel of attention's backward
    (causal, a learnable ALiBi slope summed over queries and heads) accumulates through atomics;
    every reduction is a loop of one program or a combine in a fixed order. Two steps give the
    same bits."""
    from neptune_fusion.integrations import autograd
    from neptune_fusion.integrations.autograd import InProgramDtype

    made: list = []
    init = autograd.Kernels.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(autograd.Kernels, "__init__", recording)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 16) for _ in range(3))
    seed = torch.randn(1, 2, 48, 16)

    def step():
        slopes = torch.tensor([0.5, 0.25], requires_grad=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = nf.attention(*leaves, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i),
                           mask_mod=lambda b, h, i, j: i >= j)
        return torch.autograd.grad(out, [*leaves, slopes], seed)

    first, second = step(), step()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    sources = [launch.source for kernels in made for _, step in kernels.steps if isinstance(step, InProgramDtype)
               for fn in step.by_dtype.values()
               for exe in fn._cache.values() for launch in (exe.main, exe.combine) if launch is not None]
    assert len(sources) >= 3 and not any("atomic" in s for s in sources)


def test_a_backward_that_fails_to_derive_fails_again_and_leaves_no_handle(monkeypatch) -> None:
    """A backward that cannot be derived is refused; a second call says so again rather than
    reaching for a handle the first left half made (which pointed at no backward, or at another
    function's)."""
    from neptune_fusion.integrations import autograd

    def refused(program, wrt, *sizes_and_dtype):  # noqa: ANN001, ANN002, ANN202
        raise FusionError("differentiate", "dot0", "load of 'x'", "refused for the test")

    monkeypatch.setattr(autograd, "differentiate", refused)

    @nf.program
    def gram(x):
        return nf.einsum("id,jd->ij", x, x)

    fn = nf.compile(gram)
    x = torch.randn(8, 4, requires_grad=True)
    for _ in range(2):
        with pytest.raises(FusionError, match=r"\[differentiate\] stage 'dot0'"):
            fn(x)
    assert fn.training_handles == {}
    with torch.no_grad():
        torch.testing.assert_close(fn(x), x @ x.T)


def test_gram_matrix_and_self_attention_of_one_tensor() -> None:
    """x read under two axes of one stage (x @ x.T): the sum over one of them is renamed apart from
    the axis the gradient lands on."""
    torch.manual_seed(0)
    for fn in (lambda x: torch.einsum("id,jd->ij", x, x), lambda x: torch.softmax(x @ x.T, -1) @ x):
        x = torch.randn(16, 8, requires_grad=True)
        got = torch.autograd.grad((nf.compile(fn)(x) * torch.arange(16.0)[:, None]).sum(), x)[0]
        want = torch.autograd.grad((fn(x) * torch.arange(16.0)[:, None]).sum(), x)[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_eager_training_step_launches_without_the_registered_ops(monkeypatch) -> None:
    """Eager, the forward and the backward's kernels launch directly (a registered op's Python
    dispatch costs more host time than the launches); torch.compile traces the ops
    (tests/test_torch_integration.py)."""
    from neptune_fusion.integrations import autograd, ops

    def refused(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("an eager call went through a registered op")

    monkeypatch.setattr(autograd, "train_forward", refused)
    monkeypatch.setattr(ops, "call_in_graph", refused)
    _check_attention(24, 24, 2, 2, mask=lambda b, h, i, j: i >= j)


def test_second_derivatives_are_refused_not_dropped() -> None:
    """create_graph=True would give gradients without a graph of their own (a gradient penalty
    would silently lose its term): refused with a clear error instead."""
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="second derivatives are not derived"):
        torch.autograd.grad(nf.attention(q, k, v).sum(), [q], create_graph=True)
    (g,) = torch.autograd.grad(nf.attention(q, k, v).sum(), [q])
    assert g.shape == q.shape and not g.requires_grad


@pytest.mark.parametrize("tokens,vocab", [(16, 2048), (300, 40)])  # chunked along the vocabulary / the tokens
def test_the_target_term_of_linear_cross_entropy_is_gathered_not_chunked(monkeypatch, tokens, vocab) -> None:
    """The logits' gradient is softmax - one_hot(target): the one-hot term is kept out of the
    chunks (the producer computes the softmax part only) and dh gets it once, as w's rows at the
    targets; dW sees it added into each chunk. Summed in 16-bit over 16 chunks, dh is then as
    accurate as torch's own fp16 cross-entropy (with the term in one chunk, each token's sum was
    dominated by it and the other chunks' parts were rounded against it: 3x the error)."""
    from neptune_fusion.integrations import autograd
    from neptune_fusion.integrations.autograd import Chunked
    from neptune_fusion.ir.expr import Where, walk
    from neptune_fusion.schedule import materialise

    monkeypatch.setattr(materialise, "MIN_CHUNK_BYTES", 0)  # chunks of one tile (128 entries)
    monkeypatch.setattr(materialise, "CHUNK_SHARE", 0.0)
    monkeypatch.setattr(autograd, "accumulates_in_fp32", lambda *args: False)  # as at Llama-3 sizes
    torch.manual_seed(0)
    h = torch.randn(tokens, 600, dtype=torch.float64)
    w = torch.randn(vocab, 600, dtype=torch.float64) * 0.05
    target = torch.randint(0, vocab, (tokens,))
    seed = torch.rand(tokens, dtype=torch.float64) + 0.5
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.cross_entropy(hr @ wr.T, target, reduction="none").backward(seed)
    fn = nf.compile(linear_cross_entropy)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, None)):
        hl, wl = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        fn(hl, wl, target).backward(seed.to(dtype))
        if tol is not None:
            assert_grads([hl.grad, wl.grad], [hr.grad, wr.grad], tol=tol)
            continue
        hp, wp = h.half().requires_grad_(), w.half().requires_grad_()
        torch.nn.functional.cross_entropy((hp @ wp.T).float(), target, reduction="none").backward(seed.float())
        for got, plain, want in ((hl.grad, hp.grad, hr.grad), (wl.grad, wp.grad, wr.grad)):
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < 1.35 * ((plain.double() - want).norm() / want.norm()).item(), err  # 1.94x with the term chunked
    steps = [f for _, f in next(iter(fn.training.values())).backward.steps]
    (step,) = [s for s in steps if isinstance(s, Chunked)]
    assert step.plan.axis == ("v" if tokens < vocab else "i") and step.plan.one_hot is not None
    assert not any(isinstance(n, Where) for st in step.plan.producer.stages for n in walk(st.body))


@pytest.mark.parametrize("hidden", [32, 600])  # one kernel each way / the chunked backward
def test_linear_cross_entropy_ignores_targets_outside_the_vocabulary(monkeypatch, hidden) -> None:
    """torch's ignore_index (-100, padding) and any target outside [0, vocabulary): loss 0 and no
    gradient, never a read outside the logits; the other rows as torch's cross-entropy."""
    from neptune_fusion.schedule import materialise

    monkeypatch.setattr(materialise, "MIN_CHUNK_BYTES", 0)
    monkeypatch.setattr(materialise, "CHUNK_SHARE", 0.0)
    torch.manual_seed(1)
    h, w = torch.randn(12, hidden, dtype=torch.float64), torch.randn(300, hidden, dtype=torch.float64) * 0.05
    target = torch.randint(0, 300, (12,))
    target[[2, 7]] = -100
    target[9] = 300
    seed = torch.rand(12, dtype=torch.float64) + 0.5
    hl, wl = h.float().requires_grad_(), w.float().requires_grad_()
    loss = nf.compile(linear_cross_entropy)(hl, wl, target)
    loss.backward(seed.float())
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    kept = target.clone()
    kept[9] = -100
    want = torch.nn.functional.cross_entropy(hr @ wr.T, kept, reduction="none", ignore_index=-100)
    want.backward(seed)
    torch.testing.assert_close(loss.double(), want.detach(), atol=1e-5, rtol=1e-5)
    assert torch.all(loss[[2, 7, 9]] == 0) and torch.all(hl.grad[[2, 7, 9]] == 0)
    assert_grads([hl.grad, wl.grad], [hr.grad, wr.grad], tol=1e-5)


def test_a_backward_kernel_reading_no_input_along_an_axis_gets_its_length() -> None:
    """`x - mean(x)`: a kernel of the backward sums the gradient along an axis none of its inputs
    has whole (the length became a parameter of that kernel, which the backward did not pass:
    a KeyError at the forward call)."""
    g = torch.Generator().manual_seed(3)
    def centred(axis: int) -> nf.ProgramDef:
        return nf.program(lambda x: x - x.mean(axis, keepdims=True))

    for axis in (-1, 0):
        x = torch.randn(27, 5, generator=g)
        weights = torch.randn(27, 5, generator=g)
        xg = x.clone().requires_grad_()
        (nf.compile(centred(axis))(xg) * weights).sum().backward()
        x64 = x.double().requires_grad_()
        ((x64 - x64.mean(axis, keepdim=True)) * weights.double()).sum().backward()
        torch.testing.assert_close(xg.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)


def test_gradients_passed_through_unchanged_share_no_memory() -> None:
    """`x + y`: both gradients are the upstream one. Each is its own tensor, so accumulating into
    one `.grad` leaves the other alone (they were one tensor: a second backward after zeroing in
    place doubled), also inside torch.compile, which refuses outputs aliasing inputs."""
    fn = nf.compile(nf.program(lambda x, y: (x + y).sum(axis=-1)))
    x, y = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    fn(x, y).sum().backward()
    assert x.grad.data_ptr() != y.grad.data_ptr()
    x.grad.zero_()
    assert torch.equal(y.grad, torch.ones(16, 32))
    fn(x, y).sum().backward()
    assert torch.equal(x.grad, torch.ones(16, 32)) and torch.equal(y.grad, 2 * torch.ones(16, 32))
    torch._dynamo.reset()
    gx, gy = torch.autograd.grad(torch.compile(fn, backend="aot_eager", fullgraph=True)(x, y).sum(), [x, y])
    assert torch.equal(gx, torch.ones(16, 32)) and torch.equal(gy, torch.ones(16, 32))


def _swiglu_mlp(x, norm_weight, gate_up, down):  # noqa: ANN001, ANN202
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],), norm_weight, eps=1e-6)
    gate, up = torch.nn.functional.linear(h, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


def test_swiglu_mlp_backward_computes_dh_once() -> None:
    """The MLP's backward: dh = dgate_up @ W (no larger than x) is computed by one kernel, not
    again by each of its readers (dx, the norm weight's gradient). Gradients as torch's."""
    from neptune_fusion.schedule.partition import partition_loops

    torch.manual_seed(0)
    args = [torch.randn(16, 32), 1 + 0.1 * torch.randn(32), torch.randn(96, 32) / 32**0.5, torch.randn(32, 48) / 48**0.5]
    leaves = [a.clone().requires_grad_() for a in args]
    seed = torch.randn(16, 32)
    nf.compile(_swiglu_mlp)(*leaves).backward(seed)
    want = [a.clone().requires_grad_() for a in args]
    _swiglu_mlp(*want).backward(seed)
    assert_grads([a.grad for a in leaves], [a.grad for a in want], tol=1e-4)

    grad = differentiate(nf.program(_swiglu_mlp).trace(*args), ("x", "norm_weight", "gate_up", "down"))
    groups = partition_loops(grad.backward, grad.held)
    by_result = {r: g for g in groups for r in g.results}
    dh = by_result["grad_ew1_part"]  # sum over the hidden axis z, axes (a, y) as x's
    assert [g for g in groups if "grad_ew1_part" in {st.name for st in g.program.all_stages()}] == [dh]


def test_swiglu_mlp_weight_gradient_is_a_matmul_over_the_hidden_axis() -> None:
    """dW_gate_up sums over tokens a product of three factors: the gate's derivative (tokens x
    hidden), the normalised input's x and its row statistic rsqrt(mean(x^2)). They group into the
    two operands of a dot, so the hidden axis is held in the tile, not a program per hidden index;
    the chunk's guard (positions neither half reads) is on the adjoint, off the product."""
    from neptune_fusion.schedule.partition import partition_loops
    from neptune_fusion.schedule.pipeline import fuse
    from neptune_fusion.tile.lower import assign_roles

    torch.manual_seed(0)
    args = [torch.randn(16, 32), 1 + 0.1 * torch.randn(32), torch.randn(96, 32) / 32**0.5, torch.randn(32, 48) / 48**0.5]
    grad = differentiate(nf.program(_swiglu_mlp).trace(*args), ("x", "norm_weight", "gate_up", "down"))
    group = next(g for g in partition_loops(grad.backward, grad.held)
                 if "grad_gate_up_part" in {st.name for st in g.program.all_stages()})
    hidden = grad.backward.input("gate_up").dims[0]
    roles = assign_roles(fuse(group.program)[-1].program)
    assert hidden in roles.tile_axes and hidden not in roles.batch, roles
    assert roles.k_loop  # every member sums loaded products: the loop is a dot's K-loop


def _causal_self_attention(x, wq, wk, wv):  # noqa: ANN001, ANN202 - heads of 8 by view, as model code writes it
    t, d = x.shape
    q, k, v = (torch.nn.functional.linear(x, w).view(t, d // 8, 8).transpose(0, 1) for w in (wq, wk, wv))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(0, 1).reshape(t, d)


def test_self_attention_from_model_code_backward_keeps_no_token_by_token_matrix() -> None:
    """Queries and keys of one projection: the backward reads the scores S[q, k] at (k_sum, k) for
    dK and dV, an axis renamed apart from the keys. S and dP are still recomputed inside the
    kernels that sum them (none writes a token x token matrix), and dK's and dV's sums over the
    renamed queries share one kernel and its loop; the forward's max and the sums reading it are
    recomputed by one loop. Gradients as torch's."""
    from neptune_fusion.schedule.partition import partition_loops

    torch.manual_seed(0)
    args = [torch.randn(24, 16)] + [torch.randn(16, 16) / 4 for _ in range(3)]
    leaves = [a.clone().requires_grad_() for a in args]
    seed = torch.randn(24, 16)
    nf.compile(_causal_self_attention)(*leaves).backward(seed)
    want = [a.double().requires_grad_() for a in args]
    _causal_self_attention(*want).backward(seed.double())
    assert_grads([a.grad for a in leaves], [a.grad.float() for a in want], tol=1e-4)

    grad = differentiate(nf.program(_causal_self_attention).trace(*args), ("x", "wq", "wk", "wv"))
    backward = grad.backward
    tokens = {a for a, source in backward.axis_sizes.items() if source == ("x", 0)}
    copies = {a for a, how in backward.derived_axes.items() if how[0] == "mulc" and how[1] in tokens}
    groups = partition_loops(backward, grad.held)
    written = [backward.stage(r).axes for g in groups for r in g.results if not r.startswith("output:")]
    assert all(len(set(axes) & (tokens | copies)) < 2 for axes in written), written
    over_copies = [g for g in groups if g.program.loop_axis in copies]
    assert len(over_copies) == 1 and len(over_copies[0].results) == 2, [g.results for g in over_copies]
    # the forward's statistics, recomputed, in one loop as the forward computes them: the max,
    # then the weighted sum and the normaliser that read it
    statistics = [g for g in groups if any(backward.stage(r).reduce_op == "max" for r in g.results if ":" not in r)]
    assert [len(g.results) for g in statistics] == [3], [g.results for g in statistics]


def test_a_backward_multiplies_in_the_forward_dtype() -> None:
    """Every kernel of an fp16 backward takes fp16 dot operands, also one whose first inputs are
    fp32 pools of earlier kernels (the projections the attention's scores recompute): fp32 dots there
    ran without tensor cores. Gradients within fp16 error of torch's fp32 ones."""
    from neptune_fusion.integrations.autograd import InProgramDtype

    torch.manual_seed(0)
    args = [torch.randn(24, 16)] + [torch.randn(16, 16) / 4 for _ in range(3)]
    fn = nf.compile(_causal_self_attention)
    leaves = [a.half().requires_grad_() for a in args]
    seed = torch.randn(24, 16)
    fn(*leaves).backward(seed.half())
    want = [a.clone().requires_grad_() for a in args]
    _causal_self_attention(*want).backward(seed)
    assert_grads([a.grad.float() for a in leaves], [a.grad for a in want], tol=2e-2)
    (derived,) = fn.training.values()
    steps = [step for _, step in derived.backward.steps if isinstance(step, InProgramDtype)]
    pools_first = [s for s in steps if s.program.inputs[0].name not in {"x", "wq", "wk", "wv", "grad_0"}]
    assert pools_first and all(set(s.by_dtype) == {"f16"} for s in steps)
    for step in steps:
        (compiled,) = step.by_dtype.values()
        records = {exe.record.compute_dtype for exe in compiled._cache.values() if exe.record is not None}
        # (a product of two fp16 tensors as they stand is cuBLAS's alone: no kernel of ours)
        assert records == {"f16"} or not records and all(exe.library for exe in compiled._cache.values())


def _library_runs(compiled: nf.Compiled) -> list:
    """The library contractions among a compiled kernel's executables, through its groups."""
    found, todo = [], list(compiled._cache.values())
    while todo:
        exe = todo.pop()
        if exe.library is not None:
            found.append(exe.library.plan)
        todo += [part for _, part in exe.groups]
    return found


def _swiglu_mlp_step_in_fp16(tokens: int, width: int, hidden: int):  # noqa: ANN202
    """A training step of `_swiglu_mlp` in fp16, its gradients checked against torch's fp32 ones
    (within fp16 error); returns the step's derived forward and backward."""
    torch.manual_seed(0)
    args = [torch.randn(tokens, width), 1 + 0.1 * torch.randn(width), torch.randn(2 * hidden, width) / width**0.5,
            torch.randn(width, hidden) / hidden**0.5]
    seed = torch.randn(tokens, width)
    fn = nf.compile(_swiglu_mlp)
    leaves = [a.half().requires_grad_() for a in args]
    fn(*leaves).backward(seed.half())
    want = [a.clone().requires_grad_() for a in args]
    _swiglu_mlp(*want).backward(seed)
    assert_grads([a.grad.float() for a in leaves], [a.grad for a in want], tol=2e-2)
    (derived,) = fn.training.values()
    return derived


def test_a_backwards_matmuls_through_gathered_fp32_results_run_through_cublas() -> None:
    """The SwiGLU MLP's backward at a width past one K-loop column tile: dh sums the chunk's
    gradient, computed from fp32 results of earlier kernels read at two offsets, against gate_up.
    A fused kernel would load those again for every tile of dh's columns, so the operand is
    written once (fp16, in its sources' order) and cuBLAS multiplies; so is gate_up's gradient,
    split from the norm weight's beside it, and a partial result later kernels read comes back
    from the GEMM in fp32. Gradients within fp16 error of torch's fp32 ones."""
    from neptune_fusion.integrations.autograd import InProgramDtype

    derived = _swiglu_mlp_step_in_fp16(tokens=16, width=300, hidden=128)
    plans = [plan for _, step in derived.backward.steps if isinstance(step, InProgramDtype)
             for plan in _library_runs(step.at("f16"))]
    stages = {plan.stage for plan in plans}
    assert {"grad_ew1_part", "grad_gate_up_part"} <= stages, stages
    dh = next(plan for plan in plans if plan.stage == "grad_ew1_part")
    assert dh.widened and dh.operands[0].program is not None and dh.operands[1].input == "gate_up"
    # the recomputed projection, a matrix product, is kept in fp16 as torch's own backward keeps it
    halves = {name for group, step in derived.backward.steps if isinstance(step, InProgramDtype)
              for name, dtype in step.result_dtypes(group, "f16").items() if dtype == torch.float16}
    assert "dot0" in halves and "grad_ew1_part" not in halves, halves
    # written as their sources hold them, tokens first, also where the GEMM sums over tokens
    tokens = derived.gradient.backward.input("x").dims[0]
    weight = next(plan for plan in plans if plan.stage == "grad_gate_up_part")
    assert all(op.axes[0] == tokens for op in (*dh.operands, *weight.operands) if op.program is not None)


def test_an_operand_two_gemms_read_is_written_once_and_read_as_it_stands() -> None:
    """The SwiGLU MLP at a width whose projection the forward saves: the chunk's gradient, which
    dh's GEMM and gate_up's gradient both read, is written once (fp16) by a kernel of its own
    instead of being computed again for each, and dh's GEMM takes it as it stands (the guard
    where it is zero anyway is dropped). The forward computes the projection it saves once: the
    part computing the output reads it. Gradients within fp16 error of torch's fp32 ones."""
    from neptune_fusion.integrations.autograd import InProgramDtype

    derived = _swiglu_mlp_step_in_fp16(tokens=16, width=640, hidden=48)
    assert "dot0" in derived.gradient.saved
    steps = [(group, step) for group, step in derived.backward.steps if isinstance(step, InProgramDtype)]
    (written,) = [(group, step) for group, step in steps if group.results == ("grad_dot0",)]
    assert written[1].result_dtypes(written[0], "f16") == {"grad_dot0": torch.float16}
    readers = [group for group, _ in steps if any(b.name == "grad_dot0" for b in group.program.inputs)]
    assert len(readers) == 2 and all("grad_dot0" not in {st.name for st in g.program.stages} for g in readers)
    dh = next(plan for _, step in steps for plan in _library_runs(step.at("f16")) if plan.stage == "grad_ew1_part")
    assert dh.operands[0].input == "grad_dot0" and dh.operands[1].input == "gate_up"
    # the forward's output part reads the projection its saving part returns, not computed twice
    parts = [group.program for exe in derived.forward._cache.values() for group, _ in exe.groups]
    assert any("saved_dot0" in {b.name for b in p.inputs} and "gate_up" not in {b.name for b in p.inputs}
               for p in parts), [[b.name for b in p.inputs] for p in parts]
    # the rewrite is exact: the backward program gives the same gradients with the guard dropped
    from neptune_fusion.schedule.partition import _unguarded_reads

    backward = derived.gradient.backward
    named = {b.name: torch.rand([{"a": 16, "y": 640, "z": 96, "y2": 48, "z2": 640}[a] for a in b.dims],
                                dtype=torch.float64) + 0.5 for b in backward.inputs}  # sum0, a mean square, > 0
    unguarded = _unguarded_reads(backward, {"grad_dot0"})
    assert unguarded != backward
    for before, after in zip(nf.run_reference(backward, named), nf.run_reference(unguarded, named)):
        torch.testing.assert_close(after, before, rtol=1e-12, atol=0)


def test_the_operand_of_a_long_down_projection_is_saved_and_written_once() -> None:
    """The SwiGLU MLP with 640 hidden units (past `SAVED_MIN_SUMMED`): `silu(gate) * up`, the
    operand the down projection sums over them, is saved in fp16 as torch's autograd keeps it.
    The forward writes it once (the part computing the output, apart from the saved values since
    the GEMM library computes it, reads the saved value as it stands, an input of cuBLAS, not the
    projection it came from) and the backward reads it for down's gradient instead of computing
    it again. Gradients within fp16 error of torch's fp32 ones."""
    derived = _swiglu_mlp_step_in_fp16(tokens=16, width=640, hidden=640)
    gradient = derived.gradient
    gated = next(n for n in gradient.saved if gradient.forward.stage(n).reduce_op is None)
    assert {"sum0", gated} <= set(gradient.saved), gradient.saved
    assert gated in {b.name for b in gradient.backward.inputs}
    assert gated not in {st.name for st in gradient.backward.all_stages()}
    args = [torch.randn(16, 640, dtype=torch.float16), torch.randn(640, dtype=torch.float16),
            torch.randn(1280, 640, dtype=torch.float16), torch.randn(640, 640, dtype=torch.float16)]
    explained = nf.explain(derived.forward, *args)
    # the down projection reads the saved value as it stands: cuBLAS on two inputs, no operand written
    down = re.search(r"=== kernel \d of \d \(\w+_out0\): library contraction ===\n.*\n(.*)\n(.*)\n", explained)
    assert down is not None and {down.group(1), down.group(2)} == {
        f"operand 0: input 'saved_{gated}'", "operand 1: input 'down'"}, explained[:3000]
    # and the part computing the gated value reads the projection the forward saves, not a copy
    assert "__mat_dot0" not in explained and re.search(r"program \w+\(saved_dot0\[a, z\]\):", explained)


def test_a_softmaxs_probabilities_are_not_saved_even_where_small() -> None:
    """Decode-shaped attention over 1024 keys: the probabilities `exp(s - max)` are an element-wise
    value the long sum over keys multiplies, and small (one query), but computed from a reduction
    along that same axis: the fused loop keeps them against running statistics and never writes
    them, so the forward saves nothing and the backward recomputes them tile by tile."""
    from neptune_fusion.library import attention
    from neptune_fusion.transform.grad import saves_by_size

    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 1024, 64)
    program = attention.trace(q, k, k, 0.125)
    sizes = {a: n for b, t in zip(program.inputs, (q, k, k)) for a, n in zip(b.dims, t.shape) if a is not None}
    assert sizes["k"] == 1024 and saves_by_size(program, sizes) == frozenset()


def _gradient_and_reference(program, shape):  # noqa: ANN001, ANN202
    """x's gradient through `nf.compile(program)` for a random x of `shape` and a random seed, and
    autograd's through the reference executor in float64."""
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    out = nf.compile(program)(x)
    seed = torch.randn(out.shape)
    (got,) = torch.autograd.grad(out, x, seed)
    exact = x.detach().clone().requires_grad_()
    ref = nf.run_reference(program.trace(exact), dict(program.bind(exact)), dtype=torch.float64)
    (want,) = torch.autograd.grad(ref, exact, seed.double())
    return got, want


@nf.program
def _max_of_standardised_odd_columns(x):  # noqa: ANN001, ANN202
    x = x[:, 1::2]
    m = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    return (x / nf.sqrt(((x - m) * (x - m)).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-5)).max(axis=-1)


def test_a_max_gradient_computed_by_torch_tests_ties_against_its_own_max() -> None:
    """The gradient of a max over a strided slice: the element-wise part writing x's gradient runs
    on torch, and tests `x / std == max` against the max. An earlier kernel's max is rounded as
    its arithmetic rounds (torch divides by a number as a product with its reciprocal), and the
    test found no tie in some rows (their gradient was lost); torch computes the max again
    there. Gradients as autograd's of the reference executor in float64."""
    got, want = _gradient_and_reference(_max_of_standardised_odd_columns, (17, 12))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    assert (got != 0).sum(-1).min() > 1  # every row's gradient reaches its max and, through std, the rest


def _projected_attention(x, wq, wk, wv, wo):  # noqa: ANN001, ANN202 - heads of 128, an output projection
    t, d = x.shape
    q, k, v = (torch.nn.functional.linear(x, w).view(t, d // 128, 128).transpose(0, 1) for w in (wq, wk, wv))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.nn.functional.linear(o.transpose(0, 1).reshape(t, d), wo)


def test_a_later_part_reads_the_statistics_the_forward_returns_not_copies_of_them() -> None:
    """Model-code attention over 640 tokens with an output projection of width 640: the training
    forward saves the attention's statistics (sums over 640 keys, fp32) and the normalised output
    the projection multiplies (fp16). That output needs the statistics finished, so a later kernel
    computes it, reading the saved statistics as the earlier kernel returned them: nothing is
    written twice, and nothing it divides is rounded to 16 bits. The forward's output as torch's."""
    torch.manual_seed(0)
    args = [torch.randn(640, 640)] + [torch.randn(640, 640) / 640**0.5 for _ in range(4)]
    fn = nf.compile(_projected_attention)
    leaves = [a.half().requires_grad_() for a in args]
    out = fn(*leaves)
    torch.testing.assert_close(out.float(), _projected_attention(*args), rtol=2e-2, atol=2e-2)
    (derived,) = fn.training.values()
    assert {"max0", "sum0"} <= set(derived.gradient.saved), derived.gradient.saved
    explained = nf.explain(derived.forward, *[a.detach() for a in leaves])
    later = set(re.findall(r"program \w+_part2\((.*)\):", explained))
    assert later and all(re.fullmatch(r"(saved_\w+\[[\w, ]+\](, )?)+", inputs) for inputs in later), later
    assert "__mat_" not in explained


@nf.program
def _scaled_by_the_mean_of_all(x):  # noqa: ANN001, ANN202
    return (nf.exp(x * 0.1) * (x.sum() / (x.shape[0] * x.shape[1]))).sum(axis=0)


def test_the_gradient_of_a_mean_of_everything_spreads_over_x_in_a_kernel_of_its_own() -> None:
    """x's gradient reads a sum over all of x (a value of no axes) and is wider than it by both of
    x's axes: the backward kernel that sums it cannot also write that output (at most one axis
    beyond the loop's reductions), so the output follows in a later element-wise kernel. It was
    refused at the forward call. Gradients as autograd's of the reference executor in float64."""
    got, want = _gradient_and_reference(_scaled_by_the_mean_of_all, (39, 65))
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-6)


def test_the_forward_saves_long_projections_in_the_calls_dtype_and_statistics_in_fp32() -> None:
    """Model-code attention over 1024 tokens of width 1024: the projections (sums over 1024 > 600
    elements, no larger than x) are saved by the forward in fp16 as torch keeps them; the
    attention's max, normaliser and unnormalised output, also sums over 1024 keys, stay fp32:
    rounded, they would not match the scores the backward recomputes against them (and the
    unnormalised output could overflow fp16)."""
    from neptune_fusion.ir.expr import Cast

    args = [torch.randn(1024, 1024)] + [torch.randn(1024, 1024) for _ in range(3)]
    program = nf.program(_causal_self_attention).trace(*args)
    sizes = {a: 1024 for a in ("a", "y", "z", "z2", "z3")} | {"a2": 128, "e": 8, "f": 8, "s": 1024}
    g = differentiate(program, ("x", "wq", "wk", "wv"), sizes, "f16")
    saved = {st.body.x.buffer: st.body.dtype for st in g.forward.stages
             if st.name.startswith("saved_") and isinstance(st.body, Cast)}
    projections = {n for n, st in ((n, program.stage(n)) for n in saved) if st.reduce_axis == "y"}
    assert len(projections) == 3 and {saved[n] for n in projections} == {"f16"}, saved
    assert {dtype for n, dtype in saved.items() if n not in projections} == {"f32"} and len(saved) > 3, saved
    # the SwiGLU MLP: its gate/up projection of the normed input is an activation (fp16), the
    # norm's mean square, read under a root, a statistic (fp32)
    args = [torch.randn(16, 640), torch.randn(640), torch.randn(96, 640), torch.randn(640, 48)]
    program = nf.program(_swiglu_mlp).trace(*args)
    g = differentiate(program, ("x", "norm_weight", "gate_up", "down"),
                      {"a": 16, "y": 640, "z": 96, "y2": 48, "z2": 640}, "f16")
    dtypes = {st.body.x.buffer: st.body.dtype for st in g.forward.stages if st.name.startswith("saved_")}
    assert dtypes == {"dot0": "f16", "sum0": "f32"}, dtypes
