"""nf.attention as a drop-in for FlexAttention inside PyTorch models: the exact call, torch.compile
(one registered op, no graph break), opcheck, the grad error, kernel_options and return_aux."""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

import neptune_fusion as nf
from neptune_fusion.integrations.attention import _flex_attention_op, _static_handle, attend

H = 4
SLOPES = torch.exp2(-torch.arange(1, H + 1.0))


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def make_alibi(slopes: torch.Tensor):
    def scaled_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return scaled_alibi


def dense(q, k, v, scale, score=None, keep=None):
    """Plain attention in float64 over explicit score / keep tensors."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if score is not None:
        s = score(s)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.double()).to(q.dtype)


def test_flex_signature_positional_and_keyword(attn_inputs):
    q, k, v = attn_inputs(1, H, 40, 40, 16)
    bm = create_block_mask(causal, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    want = flex_attention(q, k, v, alibi, bm, 0.3)
    torch.testing.assert_close(nf.attention(q, k, v, alibi, bm, 0.3), want, atol=2e-5, rtol=1e-4)
    got = nf.attention(query=q, key=k, value=v, score_mod=alibi, block_mask=bm, scale=0.3, enable_gqa=False,
                       return_lse=False, kernel_options=None, return_aux=None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_return_aux_and_lse(attn_inputs):
    q, k, v = attn_inputs(1, H, 24, 40, 16)
    out, aux = nf.attention(q, k, v, score_mod=alibi, return_aux=AuxRequest(lse=True, max_scores=True))
    want, want_lse = flex_attention(q, k, v, score_mod=alibi, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(aux.lse, want_lse.lse, atol=2e-5, rtol=1e-4)
    s = (q @ k.transpose(-1, -2)) / 4.0 + SLOPES[:, None, None] * (torch.arange(40) - torch.arange(24)[:, None])
    torch.testing.assert_close(aux.max_scores, s.amax(-1), atol=2e-5, rtol=1e-4)
    out2, only_lse = nf.attention(q, k, v, return_aux=AuxRequest(lse=True))
    assert only_lse.max_scores is None and only_lse.lse.dtype == torch.float32
    _, lse = nf.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(lse, only_lse.lse)
    with pytest.raises(ValueError, match="both return_lse and return_aux"):
        nf.attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))


def test_kernel_options_map_onto_the_schedule_and_warn_once_for_the_rest(attn_inputs):
    q, k, v = attn_inputs(1, H, 40, 40, 16)
    want = nf.attention(q, k, v, mask_mod=causal)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            got = nf.attention(q, k, v, mask_mod=causal, kernel_options={"BLOCK_M": 16, "BLOCK_N": 16,
                                                                         "PRESCALE_QK": True, "USE_TMA": False})
    ours = [str(w.message) for w in seen if "kernel_options" in str(w.message)]
    assert len(ours) == 1 and "PRESCALE_QK" in ours[0] and "USE_TMA" in ours[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        nf.attention(q, k, v, kernel_options=[("BLOCK_M", 16)])


def test_block_mask_arguments_are_checked(attn_inputs):
    q, k, v = attn_inputs(1, H, 40, 40, 16)
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="block_mask was created for"):
        nf.attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match="either block_mask= or mask_mod="):
        nf.attention(q, k, v, block_mask=create_block_mask(causal, None, None, 40, 40, device="cpu"), mask_mod=causal)
    with pytest.raises(TypeError, match="BlockMask"):
        nf.attention(q, k, v, block_mask=causal)


def test_from_kv_blocks_lists_are_honoured_inside_torch_compile(attn_inputs):
    q, k, v = attn_inputs(1, 2, 48, 48, 16)
    num = torch.tensor([[[1, 1, 1]]]).expand(1, 2, 3).contiguous().int()
    idx = torch.tensor([[[[0, 0, 0], [1, 0, 0], [2, 0, 0]]]]).expand(1, 2, 3, 3).contiguous().int()
    full_num = torch.tensor([[[1, 1, 1]]]).expand(1, 2, 3).contiguous().int()
    full_idx = torch.tensor([[[[2, 0, 0], [0, 0, 0], [1, 0, 0]]]]).expand(1, 2, 3, 3).contiguous().int()
    bm = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=16, mask_mod=causal, seq_lengths=(48, 48))
    block = torch.arange(48) // 16
    listed = block[:, None] == block[None, :]
    full = torch.tensor([[0, 0, 1], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)[block][:, block]
    keep = full | (listed & (torch.arange(48)[:, None] >= torch.arange(48)[None, :]))
    want = dense(q, k, v, 0.25, keep=keep)
    with torch.no_grad():
        torch.testing.assert_close(nf.attention(q, k, v, block_mask=bm), want, atol=2e-5, rtol=1e-4)
        compiled = torch.compile(lambda q, k, v: nf.attention(q, k, v, block_mask=bm), fullgraph=True,
                                 backend="aot_eager")
        torch.testing.assert_close(compiled(q, k, v), want, atol=2e-5, rtol=1e-4)


class Attn(torch.nn.Module):
    """A model calling nf.attention with mods that capture tensors (a closure from a factory, a global)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.slopes = torch.exp2(-torch.arange(1.0, H + 1))
        self.score_mod = make_alibi(self.slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        out = nf.attention(q, x, x, score_mod=self.score_mod, mask_mod=causal)
        return nf.attention(out, x, x, score_mod=alibi) + out


def test_torch_compile_fullgraph_no_graph_break_and_eager_result(randn):
    model = Attn(16)
    x = randn(1, H, 40, 16)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        ops = [n for g in explained.graphs for n in g.graph.nodes if "neptune_fusion" in str(n.target)]
        assert len(ops) == 2  # each attention is one node of the graph
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        before = model(x)
        model.slopes.mul_(4.0)  # captured tensors changing between calls: in place ...
        SLOPES.mul_(0.5)
        try:
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
            assert not torch.allclose(model(x), before)
            model.score_mod = make_alibi(torch.ones(H))  # ... and a new closure over a new tensor
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        finally:
            SLOPES.mul_(2.0)


def test_opcheck_on_the_registered_ops(attn_inputs):
    q, k, v = attn_inputs(1, H, 24, 24, 16)
    handle, paths, _ = _static_handle(alibi, None, causal, None, tuple(nf.integrations.attention.Builtins()),
                                      (True, False), False, None)
    captures = [SLOPES]
    assert len(paths) == len(captures)
    torch.library.opcheck(_flex_attention_op, (q, k, v, captures, handle, 0.25))

    @nf.program
    def rownorm(x):
        e = nf.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    fn = nf.compile(rownorm)
    x = q[0, 0]
    with torch.no_grad():
        explained = torch._dynamo.explain(lambda x: fn(x) + 1)(x)
        assert explained.graph_break_count == 0
        compiled = torch.compile(lambda x: fn(x) + 1, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x), torch.softmax(x, -1) + 1, atol=1e-6, rtol=1e-5)
    from neptune_fusion.integrations.ops import _handle, _program_op

    program_handle, _ = _handle(id(fn), 1, (), ("tensor",))
    torch.library.opcheck(_program_op, ([x], [], [], program_handle))
    from neptune_fusion.integrations.autograd import handle_for, train_backward, train_forward

    x = x.clone().requires_grad_()
    train = handle_for(fn, {"x": x})
    torch.library.opcheck(train_forward, ([x], [], [], train))
    results = [r.detach() for r in train_forward([x], [], [], train)]
    grads = [torch.randn_like(results[0]), *([None] * (len(results) - 1))]
    torch.library.opcheck(train_backward, ([x.detach()], results, grads, [], [], train))


def test_training_inside_torch_compile(randn):
    """A Linear before attention and a learnable ALiBi slope, trained through torch.compile with
    fullgraph=True: the derived backward is one registered op's backward, no graph break, and the
    gradients equal the eager call's."""
    x = randn(1, H, 24, 16)
    lin = torch.nn.Linear(16, 16)
    slopes = torch.nn.Parameter(torch.rand(H))
    alibi = make_alibi(slopes)

    def step(x):
        return nf.attention(lin(x), x, x, score_mod=alibi, mask_mod=causal).square().sum()

    want = torch.autograd.grad(step(x), [lin.weight, slopes])
    assert torch._dynamo.explain(step)(x).graph_break_count == 0
    got = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(x), [lin.weight, slopes])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)



def test_two_programs_trained_in_one_compiled_graph(randn):
    """Two compiled programs, each first called inside one torch.compile'd function: the second's
    training handle is made while the graph is traced (its output count is read outside it)."""
    gated = nf.compile(lambda a, b: a * torch.sigmoid(a) * b)
    norm = nf.compile(lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6))
    positives = nf.compile(lambda x: (x > 0).sum(-1))

    def step(a, b):
        return (norm(gated(a, b)) * 2 + positives(a)[:, None]).square().sum()

    a, b = randn(8, 16).requires_grad_(), randn(8, 16)
    got = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(a, b), [a])
    want = torch.autograd.grad(step(a, b), [a])
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)


def test_training_inside_torch_compile_with_automatic_dynamic_shapes(randn):
    """torch.compile's default marks sizes dynamic when a second length arrives: a call that records
    gradients (attention, and an `nf.compile`d program) specialises its graph to each length instead
    of failing, and every length's gradients equal the eager call's."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(16, 16)
    pool = nf.compile(nf.program(lambda x, w: nf.einsum("ij,jk->ik", nf.exp(x - x.max(axis=-1, keepdims=True)), w)))

    def step(x, w):
        return nf.attention(lin(x), x, x, mask_mod=causal).square().sum() + pool(lin(x[0, 0]), w).square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for n in (24, 40, 33):
        x, w = randn(1, H, n, 16), randn(16, 8).requires_grad_()
        want = torch.autograd.grad(step(x, w), [lin.weight, w])
        got = torch.autograd.grad(compiled(x, w), [lin.weight, w])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_compiled_program_traces_once_for_all_lengths_under_dynamic_shapes(randn):
    """`dynamic=True`: an `nf.compile`d program's op keeps the sizes symbolic (its fake
    implementation traced the program at concrete sizes, a guard on each: a recompile per length)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    pool = nf.compile(nf.program(lambda x, w: nf.einsum("ij,jk->ik", nf.exp(x - x.max(axis=-1, keepdims=True)), w)))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, w: pool(x, w) * 2.0, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (20, 33, 48, 7):
            x, w = randn(n, 16), randn(16, 8)
            want = torch.exp(x - x.amax(-1, keepdim=True)) @ w * 2.0
            torch.testing.assert_close(compiled(x, w), want, atol=1e-5, rtol=1e-4)
    assert counter.frame_count == 1

@pytest.mark.parametrize("lq", [1, 7, 40])
def test_attend_describes_model_masks_by_value(attn_inputs, lq):
    q, k, v = attn_inputs(2, H, lq, 40, 16)
    pad = torch.ones(2, 40, dtype=torch.bool)
    pad[0, :5] = False  # left padding of the first sequence
    i = torch.arange(lq)[:, None] + 40 - lq
    j = torch.arange(40)[None]
    keep = ((j <= i) & (i - j < 10))[None, None] & pad[:, None, None, :]
    want = dense(q, k, v, 0.25, score=lambda s: 5.0 * torch.tanh(s / 5.0), keep=keep)
    got = attend(q, k, v, causal=True, window=10, softcap=5.0, key_padding=pad)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    compiled = torch.compile(lambda q, k, v, pad: attend(q, k, v, causal=True, window=10, softcap=5.0, key_padding=pad),
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, pad), want, atol=2e-5, rtol=1e-4)
    band = ((i - j).abs() < 4)[None, None] & pad[:, None, None, :]  # no causal: keys on both sides
    torch.testing.assert_close(attend(q, k, v, window=4, key_padding=pad), dense(q, k, v, 0.25, keep=band),
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="key_padding must have shape"):
        attend(q, k, v, key_padding=pad[:, :10])


BIAS = torch.zeros(H)


def global_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[h]


def test_repeated_calls_see_rebound_closures_and_globals(attn_inputs):
    global BIAS
    q, k, v = attn_inputs(1, H, 24, 24, 16)
    scale = torch.ones(H)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale[h]

    def check(mod, want_score):
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=mod), dense(q, k, v, 0.25, score=want_score),
                                   atol=2e-5, rtol=1e-4)

    saved = BIAS
    try:
        for value in (1.0, 3.0):  # the same function object, its closure cell rebound between calls
            scale = torch.full((H,), value)
            for _ in range(2):
                check(scaled, lambda s, value=value: s * value)
        for value in (0.0, 2.0, -1.0):  # a global rebound to a new tensor between calls
            BIAS = torch.arange(H) * value
            check(global_bias, lambda s, value=value: s + (torch.arange(H) * value)[:, None, None])
    finally:
        BIAS = saved


def test_a_captured_tensor_relaid_in_place_is_seen(attn_inputs):
    """`t.data = ...` (what `module.half()` or `.to()` do to parameters) keeps the tensor object but
    changes its layout: the repeated call's fast path must not reuse the launcher built for the old one."""
    q, k, v = attn_inputs(1, H, 24, 24, 16)
    scale = torch.linspace(0.5, 2.0, H)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale[h]

    for _ in range(2):
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=scaled),
                                   dense(q, k, v, 0.25, score=lambda s: s * scale[:, None, None]), atol=2e-5, rtol=1e-4)
    scale.data = torch.linspace(3.0, -1.0, 2 * H)[::2]  # a strided view: every other element
    for _ in range(2):
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=scaled),
                                   dense(q, k, v, 0.25, score=lambda s: s * scale[:, None, None]), atol=2e-5, rtol=1e-4)


def test_repeated_calls_with_the_same_mods_and_other_tensors(attn_inputs, monkeypatch):
    """A repeated eager call is found by its mods and flags alone (`_lean`): calls alternating
    between shapes, flags or a dtype, new tensors each time, an input that requires grad, and a
    key-padding mask relaid as a view each give what a first call gives."""
    from neptune_fusion.integrations.attention import _FastCall

    hits = []
    again = _FastCall.again
    monkeypatch.setattr(_FastCall, "again", lambda *a: hits.append(again(*a)) or hits[-1])
    shapes = [(1, H, 24, 24, 16), (2, H, 1, 40, 16), (1, H, 24, 24, 16)]
    scale = torch.linspace(0.5, 2.0, H)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * scale[h]

    for _ in range(3):
        for shape in shapes:
            q, k, v = attn_inputs(*shape)
            want = dense(q, k, v, 0.25, score=lambda s: s * scale[:, None, None])
            torch.testing.assert_close(nf.attention(q, k, v, score_mod=scaled), want, atol=2e-5, rtol=1e-4)
            out, lse = nf.attention(q, k, v, score_mod=scaled, return_lse=True)
            torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
            assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
            got = nf.attention(q.half(), k.half(), v.half(), score_mod=scaled)
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert sum(h is not None for h in hits) >= 3 * len(shapes)  # the last round's calls took it
    q, k, v = attn_inputs(1, H, 24, 24, 16)
    q.requires_grad_(True)
    out = nf.attention(q, k, v, score_mod=scaled)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    q, k, v = attn_inputs(2, H, 8, 32, 16)
    padding = torch.rand(2, 64) > 0.3
    padding[:, 0] = True
    for pad in (padding[:, :32].contiguous(), padding[:, :32].contiguous(), padding[:, ::2], padding[:, ::2]):
        keep = pad[:, None, None, :] & (torch.arange(32) <= torch.arange(8)[:, None] + 24)
        torch.testing.assert_close(attend(q, k, v, causal=True, key_padding=pad), dense(q, k, v, 0.25, keep=keep),
                                   atol=2e-5, rtol=1e-4)
    for _ in range(2):
        attend(q, k, v, causal=True, window=1)
    with pytest.raises(ValueError, match="window"):
        attend(q, k, v, causal=True, window=True)


class _Biased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cap = 5.0
        self.register_buffer("slopes", torch.linspace(0.1, 0.8, H))

    def soft(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap) + self.slopes[h]

    def global_bias(self, score, b, h, q_idx, kv_idx):
        return score + BIAS[h]


class _MethodLayer(_Biased):
    def forward(self, q, k, v):
        return nf.attention(q, k, v, score_mod=self.soft, mask_mod=causal)


def test_torch_compile_of_a_module_whose_score_mod_is_its_own_method(attn_inputs):
    """`score_mod=self.soft` inside the compiled forward: one graph, no break, the eager result; a
    buffer the method reads written in place and a float attribute changed are both seen."""
    q, k, v = attn_inputs(1, H, 24, 24, 16)
    m = _MethodLayer()
    with torch.no_grad():
        explained = torch._dynamo.explain(m)(q, k, v)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q, k, v), m(q, k, v), atol=1e-5, rtol=1e-5)
        m.slopes.mul_(3.0)
        torch.testing.assert_close(compiled(q, k, v), m(q, k, v), atol=1e-5, rtol=1e-5)
        m.cap = 1.0
        keep = torch.arange(24)[:, None] >= torch.arange(24)
        want = dense(q, k, v, 0.25, score=lambda s: torch.tanh(s) + m.slopes[:, None, None], keep=keep)
        torch.testing.assert_close(compiled(q, k, v), want, atol=2e-5, rtol=1e-4)
        other = _MethodLayer()  # another object of the class: its own attributes, not the first one's
        other.cap = 0.5
        torch.testing.assert_close(torch.compile(other, fullgraph=True, backend="aot_eager")(q, k, v), other(q, k, v),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled(q, k, v), want, atol=2e-5, rtol=1e-4)
        holder = types.SimpleNamespace(layer=m)

        class Plain:  # a method of an object that is not a module
            scale = 2.0

            def bias(self, score, b, h, q_idx, kv_idx):
                return score * self.scale + holder.layer.slopes[h]

        plain = Plain()
        call = torch.compile(lambda q, k, v: nf.attention(q, k, v, score_mod=plain.bias), fullgraph=True,
                             backend="aot_eager")
        torch.testing.assert_close(call(q, k, v), nf.attention(q, k, v, score_mod=plain.bias), atol=1e-5, rtol=1e-5)


def test_a_bound_method_as_score_mod_is_one_cache_entry_and_sees_its_object(attn_inputs):
    """`score_mod=module.method` is a new bound method at every access: the call caches key it by
    its function and object, so repeated calls reuse one entry; what it reads through its object
    (a float attribute changed, a buffer written in place or rebound) is seen: the attributes its
    code names are part of its key (they were fixed at the first trace: a stale softcap)."""
    from neptune_fusion.integrations import attention as front

    q, k, v = attn_inputs(1, H, 8, 24, 16)
    m = _Biased()
    front.clear_cache()
    for _ in range(4):
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=m.global_bias),
                                   dense(q, k, v, 0.25, score=lambda s: s + BIAS[:, None, None]), atol=2e-5, rtol=1e-4)
    assert len(front._fast) == 1 and len(front._lean) == 1

    def want():
        return dense(q, k, v, 0.25, score=lambda s: m.cap * torch.tanh(s / m.cap) + m.slopes[:, None, None])

    for cap in (5.0, 5.0, 1.0, 20.0):
        m.cap = cap
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=m.soft), want(), atol=2e-5, rtol=1e-4)
    m.slopes.mul_(3)
    torch.testing.assert_close(nf.attention(q, k, v, score_mod=m.soft), want(), atol=2e-5, rtol=1e-4)
    m.slopes = m.slopes * 2
    torch.testing.assert_close(nf.attention(q, k, v, score_mod=m.soft), want(), atol=2e-5, rtol=1e-4)
    cfg = types.SimpleNamespace(inner=types.SimpleNamespace(cap=5.0))

    def nested(score, b, h, q_idx, kv_idx):  # an attribute of an object a closure holds
        return cfg.inner.cap * torch.tanh(score / cfg.inner.cap)

    for cap in (5.0, 1.0):
        cfg.inner.cap = cap
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=nested),
                                   dense(q, k, v, 0.25, score=lambda s, c=cap: c * torch.tanh(s / c)), atol=2e-5, rtol=1e-4)


SOFTCAP = 5.0
CONFIG = types.SimpleNamespace(cap=5.0)


def global_softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def config_softcap(score, b, h, q_idx, kv_idx):
    return CONFIG.cap * torch.tanh(score / CONFIG.cap)


def test_compiled_calls_see_changed_constants_their_mods_read(attn_inputs):
    """Under torch.compile the mods are constants of the graph and nothing guards the values their
    key read (a global float, an object's attribute): the op checks them on every call and keys
    its kernels again when they changed (they kept the first trace's value: a stale softcap)."""
    global SOFTCAP
    q, k, v = attn_inputs(1, H, 8, 24, 16)
    saved = SOFTCAP
    try:
        for mod, set_cap in ((global_softcap, lambda c: globals().__setitem__("SOFTCAP", c)),
                             (config_softcap, lambda c: setattr(CONFIG, "cap", c))):
            set_cap(5.0)
            compiled = torch.compile(lambda q, k, v, mod=mod: nf.attention(q, k, v, score_mod=mod), fullgraph=True,
                                     backend="aot_eager")
            for cap in (5.0, 1.0, 1.0, 20.0):
                set_cap(cap)
                torch.testing.assert_close(compiled(q, k, v),
                                           dense(q, k, v, 0.25, score=lambda s, c=cap: c * torch.tanh(s / c)),
                                           atol=2e-5, rtol=1e-4)
    finally:
        SOFTCAP = saved
        CONFIG.cap = 5.0


def lengths_mask_mod(lengths: torch.Tensor):
    def by_length(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return by_length


def test_private_state_keeps_no_device_memory_between_calls(attn_inputs):
    """What torch.compile's CUDA graphs need of the op: scratch and block maps per call, none cached."""
    from neptune_fusion.runtime import blockmap
    from neptune_fusion.runtime.state import private_state

    q, k, v = attn_inputs(2, H, 1, 200, 16)
    mask_mod = lengths_mask_mod(torch.tensor([200, 77]))
    keep = torch.arange(200)[None, :] < torch.tensor([200, 77])[:, None]
    want = dense(q, k, v, 0.25, keep=keep[:, None, None, :])
    nf.integrations.attention.clear_cache()
    with private_state():
        for _ in range(3):
            builds = blockmap.builds
            got = nf.attention(q, k, v, mask_mod=mask_mod, schedule=nf.split_k(splits=4))
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert blockmap.builds == builds + 1  # built for the call, never fetched
    compiled = next(iter(nf.integrations.attention._compiled.values()))
    assert not compiled._scratch  # split-K partials and counters were the calls' own
    torch.testing.assert_close(nf.attention(q, k, v, mask_mod=mask_mod, schedule=nf.split_k(splits=4)), want,
                               atol=2e-5, rtol=1e-4)
    assert compiled._scratch  # outside private_state they are kept for the next call


def test_torch_compile_with_dynamic_shapes(randn):
    """A decode loop's key length grows every step: dynamic=True traces once for all lengths."""
    compiled = torch.compile(lambda q, k, v: nf.attention(q, k, v, score_mod=alibi, enable_gqa=True), dynamic=True,
                             fullgraph=True, backend="aot_eager")
    compiled_attend = torch.compile(lambda q, k, v: attend(q, k, v, causal=True, enable_gqa=True), dynamic=True,
                                    fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for length in (40, 41, 57):
            q, k, v = randn(1, H, 1, 16), randn(1, 2, length, 16), randn(1, 2, length, 16)
            torch.testing.assert_close(compiled(q, k, v), nf.attention(q, k, v, score_mod=alibi, enable_gqa=True))
            torch.testing.assert_close(compiled_attend(q, k, v), attend(q, k, v, causal=True, enable_gqa=True))


class _TableBias(torch.nn.Module):
    """A score_mod that is a Module: a learnable relative-position table, read in `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 48))

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[q_idx - kv_idx + 24]


class _Softcap:
    """A score_mod that is a plain callable object."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)


def test_callable_objects_dicts_and_numpy_values_a_mod_reads_are_keyed(attn_inputs):
    """A Module or callable object as score_mod is keyed like a bound method of its forward /
    __call__ (its parameters are captured tensors, so their gradients flow; its attributes are read
    again); a dict entry and a numpy array a mod reads are keyed by value and read again (each kept
    the first trace's constant: a silently stale result)."""
    import numpy as np

    q, k, v = attn_inputs(1, H, 24, 24, 16)
    table = _TableBias()
    out = nf.attention(q, k, v, score_mod=table)
    assert out.requires_grad
    out.square().sum().backward()
    ref_table = table.table.detach().clone().requires_grad_()
    rel = torch.arange(24)[:, None] - torch.arange(24) + 24
    dense(q, k, v, 0.25, score=lambda s: s + ref_table[rel]).square().sum().backward()
    torch.testing.assert_close(table.table.grad, ref_table.grad, atol=1e-4, rtol=1e-4)

    cap = _Softcap(30.0)
    cfg = {"cap": 30.0}
    arr = np.array([30.0])

    def by_dict(score, b, h, q_idx, kv_idx):
        return cfg["cap"] * torch.tanh(score / cfg["cap"])

    def by_numpy(score, b, h, q_idx, kv_idx):
        return float(arr[0]) * torch.tanh(score / float(arr[0]))

    with torch.no_grad():
        for mod in (cap, by_dict, by_numpy):
            for value in (30.0, 0.5, 0.5, 2.0):
                cap.cap, cfg["cap"], arr[0] = value, value, value
                want = dense(q, k, v, 0.25, score=lambda s, c=value: c * torch.tanh(s / c))
                torch.testing.assert_close(nf.attention(q, k, v, score_mod=mod), want, atol=2e-5, rtol=1e-4)


CAP = 2.0


def _global_softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def test_torch_compile_of_a_training_call_sees_a_changed_float_the_mod_reads(attn_inputs):
    """The training op's handle is fixed in the graph: a float the mod reads (a global) changed
    between calls is seen there too (the op asks for the handle of the current values), forward
    and gradients, and a function compiled after a no-grad call saw another value starts right."""
    global CAP
    q, k, v = attn_inputs(1, H, 24, 24, 16)
    f = torch.compile(lambda q, k, v: nf.attention(q, k, v, score_mod=_global_softcap), fullgraph=True,
                      backend="aot_eager")
    try:
        for cap in (2.0, 0.5, 0.5, 3.0):
            CAP = cap
            qq = q.clone().requires_grad_()
            out = f(qq, k, v)
            q64 = q.double().requires_grad_()
            want = dense(q64, k.double(), v.double(), 0.25, score=lambda s, c=cap: c * torch.tanh(s / c))
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
            out.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(qq.grad.double(), q64.grad, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            CAP = 1.0
            f(q, k, v)
        CAP = 2.0
        g = torch.compile(lambda q, k, v: nf.attention(q, k, v, score_mod=_global_softcap) * 1.0, fullgraph=True,
                          backend="aot_eager")
        want = dense(q, k, v, 0.25, score=lambda s: 2.0 * torch.tanh(s / 2.0))
        torch.testing.assert_close(g(q.clone().requires_grad_(), k, v).detach(), want, atol=2e-5, rtol=1e-4)
    finally:
        CAP = 2.0


def test_a_table_longer_than_the_axis_that_indexes_it_gets_its_gradient(attn_inputs):
    """`table[q_idx]` with a table longer than the queries: its entries past the queries get a zero
    gradient (the backward runs on the table cut to the queries' length; uncut, it read past its
    upstream gradient); a table shorter than the queries is an error, as the forward read past it."""
    q, k, v = attn_inputs(1, H, 16, 16, 16)
    g = torch.Generator().manual_seed(5)
    for length in (40, 16):
        table = torch.randn(length, generator=g).requires_grad_()
        nf.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[q_idx]).square().sum().backward()  # noqa: B023 - used at once
        t64 = table.detach().double().requires_grad_()
        dense(q, k, v, 0.25, score=lambda s: s + t64[:16, None]).square().sum().backward()  # noqa: B023
        torch.testing.assert_close(table.grad.double(), t64.grad, atol=1e-4, rtol=1e-4)
    short = torch.randn(8, generator=g).requires_grad_()
    with pytest.raises(ValueError, match="read past its end"):
        nf.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + short[q_idx]).sum().backward()


def test_a_learnable_bias_broadcast_over_batch_or_heads_gets_its_gradient(attn_inputs):
    """`attend(bias=b)` with b (1, H, L, L) or (B, 1, L, L) requiring grad, and a score_mod reading
    a (H, L, L) parameter: the backward's sums over the broadcast axis have a mask condition that
    varies along an axis the tile holds, which the block map now leaves partial (it raised
    ValueError 'aN' is not in list). A full (B, H, L, L) bias, whose gradient is as wide as the
    scores, gets it from a later element-wise kernel (it was refused at the forward call)."""
    q, k, v = attn_inputs(2, H, 16, 16, 16)
    g = torch.Generator().manual_seed(3)
    for shape in ((1, H, 16, 16), (2, 1, 16, 16), (2, H, 16, 16)):
        b = torch.randn(shape, generator=g).requires_grad_()
        attend(q, k, v, bias=b).square().sum().backward()
        b64 = b.detach().double().requires_grad_()
        dense(q, k, v, 0.25, score=lambda s, b64=b64: s + b64).square().sum().backward()
        torch.testing.assert_close(b.grad.double(), b64.grad, atol=1e-4, rtol=1e-4)
    table = torch.nn.Parameter(torch.randn(H, 16, 16, generator=g))
    nf.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx, kv_idx]).sum().backward()
    t64 = table.detach().double().requires_grad_()
    dense(q, k, v, 0.25, score=lambda s: s + t64).sum().backward()
    torch.testing.assert_close(table.grad.double(), t64.grad, atol=1e-4, rtol=1e-4)


SCALE = 0.3


def test_dynamic_torch_compile_of_prefill_and_of_a_float_scale_variable(attn_inputs):
    """`dynamic=True`: the default scale of a symbolic head dim and a global float scale are
    symbolic while tracing (their finiteness is checked at launch); results equal eager's."""
    torch._dynamo.reset()
    for fn, scale in ((lambda q, k, v: nf.attention(q, k, v, mask_mod=causal), 0.25),
                      (lambda q, k, v: nf.attention(q, k, v, scale=SCALE), SCALE)):
        f = torch.compile(fn, dynamic=True, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            for n in (40, 41):
                q, k, v = attn_inputs(1, H, n, n, 16)
                keep = (torch.arange(n)[:, None] >= torch.arange(n)) if scale == 0.25 else None
                torch.testing.assert_close(f(q, k, v), dense(q, k, v, scale, keep=keep), atol=2e-5, rtol=1e-4)


def test_attend_edge_cases_found_by_fuzzing(attn_inputs):
    """A bias that requires grad after a call with one that did not (same layout) records the
    backward (the fast path looked only at q, k, v and captured tensors); an infinite softcap is
    refused; a large softcap is the uncapped score (the interpreter's tanh cancelled for small
    arguments); an explained Program's backward; no queries against many keys."""
    q, k, v = attn_inputs(1, H, 4, 16, 16)
    g = torch.Generator().manual_seed(4)
    attend(q, k, v, bias=torch.randn(1, H, 4, 16, generator=g))
    b = torch.randn(1, H, 4, 16, generator=g).requires_grad_()
    out = attend(q, k, v, bias=b)
    assert out.requires_grad
    out.sum().backward()
    assert b.grad is not None and b.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="finite"):
        attend(q, k, v, softcap=math.inf)
    torch.testing.assert_close(attend(q, k, v, softcap=1e6), dense(q, k, v, 0.25), atol=2e-5, rtol=1e-4)
    prog = nf.attention_program(q, k, v)
    assert "derived backward" in nf.explain(prog, **nf.attention_inputs(q, k, v), backward=True)
    from neptune_fusion.library import attention as plain_attention

    keys = torch.randn(1, H, 256, 16, generator=g)
    assert nf.compile(plain_attention)(torch.randn(1, H, 0, 16), keys, keys, scale=0.25).shape == (1, H, 0, 16)
