"""Lengths are run-time values: calls that differ only in a sequence length (a decode loop over a
growing KV cache) share the traced program's fingerprint, the fusion passes, the plan and the
kernel, and stay correct at every length."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.integrations import attention as attention_module  # noqa: E402
from neptune_fusion.integrations.attention import attend  # noqa: E402
from neptune_fusion.ir.expr import Const, Size, walk  # noqa: E402
from neptune_fusion.runtime import compiled as compiled_module  # noqa: E402
from neptune_fusion.schedule.pipeline import fuse, with_split_k  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")

H, HKV, D = 4, 2, 16
SLOPES = torch.exp2(-8.0 * torch.arange(1, H + 1) / H)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def expected(q, k, v, *, causal=False, window=None, bias=None):
    """float64 attention with the queries aligned to the end of the keys."""
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lq, lk = q.shape[2], k.shape[2]
    qi, ki = torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :]
    if bias is not None:
        s = s + bias(qi - (lk - lq), ki).double()
    if causal:
        keep = ki <= qi
        if window is not None:
            keep = keep & (qi - ki < window)
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v


def qkv(lq, lk, hkv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, lq, D, generator=gen), torch.randn(1, hkv, lk, D, generator=gen),
            torch.randn(1, hkv, lk, D, generator=gen))


def _compiled_for_latest() -> nf.Compiled:
    return next(reversed(attention_module._compiled.values()))


@pytest.mark.parametrize("lq,window", [(1, None), (1, 5), (3, None), (3, 5)])
def test_decode_lengths_share_one_program_and_kernel(lq, window):
    attention_module.clear_cache()
    fused_before = None
    fingerprints, sources = set(), set()
    lengths = (37, 38, 48, 64, 65)
    for i, lk in enumerate(lengths):
        q, k, v = qkv(lq, lk, HKV, seed=lk)
        out = attend(q, k, v, causal=True, window=window, enable_gqa=True)
        torch.testing.assert_close(out.double(), expected(q, k, v, causal=True, window=window), atol=2e-5, rtol=2e-5)
        compiled = _compiled_for_latest()
        fingerprints |= {exe.steps[0].program.fingerprint() for exe in compiled._cache.values()}
        sources |= {exe.main.source for exe in compiled._cache.values()}
        if i == 0:
            fused_before = len(compiled_module._FUSED)
    # the query's key position is |k| - |q| + q (sizes, read at run time), never a constant baked in per length
    program = next(iter(_compiled_for_latest()._cache.values())).steps[0].program
    sizes = {n.axis for st in program.all_stages() for n in walk(st.body) if isinstance(n, Size)}
    assert len(sizes) == (0 if lq == 1 and window is None else 1 if lq == 1 else 2)
    baked = {lk - d for lk in lengths for d in (1, lq)}
    assert not any(isinstance(n, Const) and n.value in baked for st in program.all_stages() for n in walk(st.body))
    assert len(fingerprints) == 1 and len(sources) == 1
    assert len(_compiled_for_latest()._cache) == 1
    assert len(compiled_module._FUSED) == fused_before  # no fusion pass ran again


def test_prefill_then_decode_with_a_score_mod():
    attention_module.clear_cache()
    for lq, lk in ((6, 6), (1, 7), (1, 8), (1, 9)):
        q, k, v = qkv(lq, lk, H, seed=lk)
        out = nf.attention(q, k, v, score_mod=alibi)
        bias = lambda qi, ki: SLOPES[None, :, None, None] * (ki - qi)  # noqa: E731
        torch.testing.assert_close(out.double(), expected(q, k, v, bias=bias), atol=2e-5, rtol=2e-5)
    decode = [c for c in attention_module._compiled.values()]
    assert len(decode) == 1
    exes = list(decode[0]._cache.values())  # prefill (6 rows) and decode (1 row): at most one kernel each
    assert len({exe.main.source for exe in exes}) == len({exe.plan for exe in exes}) <= len(exes) <= 2


@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_over_lengths(splits):
    attention_module.clear_cache()
    for lk in (70, 71, 90, 97, 128):
        q, k, v = qkv(1, lk, HKV, seed=lk)
        out = attend(q, k, v, causal=True, enable_gqa=True, schedule=nf.split_k(splits=splits))
        torch.testing.assert_close(out.double(), expected(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
    compiled = _compiled_for_latest()
    exes = list(compiled._cache.values())
    # one executable per plan (a split count that would leave a split without a whole tile changes
    # it), and one main kernel for all of them: the split count is a run-time argument
    assert len(exes) == len({exe.plan for exe in exes}) <= 2
    assert len({(exe.main.source, tuple(sorted(exe.main.tile.constexprs.items()))) for exe in exes}) == 1
    assert all("SPLITS" not in exe.main.tile.constexprs and "size_split" in exe.main.tile.do_not_specialize
               for exe in exes)
    # the partial states do not depend on the key length: one set per split count
    assert len(compiled._scratch) == len({exe.plan.splits for exe in exes})


def test_split_counts_reuse_the_rolling_passes():
    q, k, v = qkv(1, 40, HKV)
    program = attention_module.attention_program(q, k, v, enable_gqa=True)
    for splits in (2, 5):
        direct = fuse(program, splits)
        reused = with_split_k(fuse(program), splits)
        assert [s.name for s in direct] == [s.name for s in reused]
        assert direct[-1].program.fingerprint() == reused[-1].program.fingerprint()


def test_size_in_a_program():
    @nf.program
    def end_aligned(q, k, v, scale):
        s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
        offset = nf.size(k, -2) - nf.size(q, -2)
        s = nf.where(nf.index(s, -2) + offset >= nf.index(s, -1), s, -nf.inf)
        p = nf.exp(s - s.max(axis=-1, keepdims=True))
        return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    fn = nf.compile(end_aligned)
    prints = set()
    for lq, lk in ((3, 20), (3, 21), (3, 33)):
        q, k, v = qkv(lq, lk, H, seed=lk)
        out = fn(q, k, v, scale=1 / math.sqrt(D))
        torch.testing.assert_close(out.double(), expected(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
        ref = nf.run_reference(end_aligned.trace(q, k, v, 0.25), {"q": q, "k": k, "v": v, "scale": 1 / math.sqrt(D)})
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        prints.add(end_aligned.trace(q, k, v, 0.25).fingerprint())
    assert len(prints) == 1 and len(fn._cache) == 1


def test_key_length_is_not_specialised_on():
    attention_module.clear_cache()
    q, k, v = qkv(1, 40, HKV)
    attend(q, k, v, causal=True, enable_gqa=True)
    exe = next(iter(_compiled_for_latest()._cache.values()))
    assert exe.main.tile.do_not_specialize == ["size_k"]
    assert "@triton.jit(do_not_specialize=['size_k'])" in exe.main.source


def test_launchers_per_length_are_bounded(monkeypatch):
    monkeypatch.setattr(compiled_module, "MAX_LAUNCHERS", 3)
    attention_module.clear_cache()
    for lk in (30, 31, 32, 33, 34, 30):
        q, k, v = qkv(1, lk, HKV, seed=lk)
        out = attend(q, k, v, causal=True, enable_gqa=True)
        torch.testing.assert_close(out.double(), expected(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
    compiled = _compiled_for_latest()
    assert len(compiled._launchers) == 3 and len(compiled._cache) == 1


def test_one_trace_serves_every_length(monkeypatch):
    """The traced program is kept per length class (1, or more): a decode loop traces once."""
    attention_module.clear_cache()
    traces = []
    real = attention_module._trace_entry
    monkeypatch.setattr(attention_module, "_trace_entry", lambda *a: traces.append(a[1].shape[2]) or real(*a))
    for lk in (1, 2, 3, 9, 40):
        q, k, v = qkv(1, lk, HKV, seed=lk)
        out = nf.attention(q, k, v, score_mod=alibi, enable_gqa=True)
        bias = lambda qi, ki: SLOPES[None, :, None, None] * (ki - qi)  # noqa: E731
        torch.testing.assert_close(out.double(), expected(q, k, v, bias=bias), atol=2e-5, rtol=2e-5)
    assert traces == [1, 2]  # a length-1 key axis is a broadcast dimension to the tracer: its own class


def test_new_lengths_reuse_the_compiled_kernel_and_its_binder():
    attention_module.clear_cache()
    for lk in (20, 21, 22):
        q, k, v = qkv(1, lk, HKV, seed=lk)
        torch.testing.assert_close(attend(q, k, v, causal=True, enable_gqa=True).double(),
                                   expected(q, k, v, causal=True), atol=2e-5, rtol=2e-5)
    compiled = _compiled_for_latest()
    assert len(compiled._launchers) == 3 and len(compiled._cache) == 1
    assert compiled_module._binder.cache_info().hits >= 2
