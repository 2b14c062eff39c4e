"""The grouped program order: row tiles of GROUP_B heads interleaved, heaviest first.

The order only changes which program computes which (head, row tile), so every kernel must give the
same result with any group size, including a last group with fewer heads than the others.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.integrations.attention import clear_cache  # noqa: E402
from neptune_fusion.library import causal_attention  # noqa: E402
from neptune_fusion.runtime import compiled as compiled_module  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")


def _qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(hq * 1000 + lq)
    q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    return q, k, v


def _softmax_attention(q, k, v, bias=None, mask=None):
    q, k, v = q.double(), k.double(), v.double()
    ratio = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return torch.nan_to_num(torch.softmax(s, -1)) @ v


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("group", [1, 2, 3, 64])  # 1: the one-axis grid in the plain order
def test_grouped_order_keeps_causal_alibi_exact(monkeypatch, group):
    monkeypatch.setenv("NEPTUNE_FUSION_GRID_GROUP", str(group))
    clear_cache()
    b, h, n = 2, 5, 77  # 10 batch entries: groups of 3 leave a last group of 1
    q, k, v = _qkv(b, h, h, n, n, 16)
    slopes = torch.linspace(0.1, 0.9, h)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    out = nf.attention(q, k, v, score_mod=alibi, mask_mod=causal)
    pos = torch.arange(n)
    bias = slopes[:, None, None].double() * (pos[None, None, :] - pos[None, :, None])
    ref = _softmax_attention(q, k, v, bias=bias, mask=pos[:, None] >= pos[None, :])
    assert _rel(out, ref) < 2e-5


@pytest.mark.parametrize("group", [2, 4])
def test_grouped_order_with_gqa_and_document_block_map(monkeypatch, group):
    monkeypatch.setenv("NEPTUNE_FUSION_GRID_GROUP", str(group))
    clear_cache()
    q, k, v = _qkv(1, 6, 2, 70, 70, 16, torch.float16)
    doc = torch.tensor([0] * 20 + [1] * 35 + [2] * 15)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    out = nf.attention(q, k, v, mask_mod=same_doc, enable_gqa=True)
    ref = _softmax_attention(q, k, v, mask=doc[:, None] == doc[None, :])
    assert _rel(out, ref) < 3e-3


def test_grouped_order_plain_compile(monkeypatch):
    monkeypatch.setenv("NEPTUNE_FUSION_GRID_GROUP", "3")
    q, k, v = _qkv(1, 4, 4, 100, 100, 32)
    out = nf.compile(causal_attention)(q, k, v, scale=1 / math.sqrt(32))
    ref = _softmax_attention(q, k, v, mask=torch.ones(100, 100, dtype=torch.bool).tril())
    assert _rel(out, ref) < 2e-5


def test_group_is_the_largest_divisor_of_the_batch_that_fits_one_wave(monkeypatch):
    monkeypatch.delenv("NEPTUNE_FUSION_GRID_GROUP", raising=False)
    cuda = torch.device("cuda")

    def group(row_tiles: int, batch: int, splits: int = 1, block_mapped: bool = False) -> int | None:
        return compiled_module._grid_group(row_tiles, batch, splits, 132, block_mapped, cuda)

    assert group(32, 32) == 4  # 4 heads x 32 row tiles: one wave of 128 programs on 132 SMs
    assert group(8, 32) == 16
    assert group(128, 32) is None  # one head at a time: the plain two-axis grid
    assert group(32, 30) == 3  # 4 does not divide 30 heads
    assert group(8, 4) == 4  # never more than the batch
    assert group(32, 32, splits=8) is None  # split-K keeps the plain order
    assert group(32, 32, block_mapped=True) == 32  # 1024 programs: at most eight waves
    assert group(128, 32, block_mapped=True) is None
    assert compiled_module._grid_group(32, 32, 1, 132, False, torch.device("cpu")) is None
    # more batch entries than a grid axis holds: the one-axis grid, one entry at a time
    assert group(300, 70000) == 1
    assert compiled_module._grid_group(300, 70000, 1, 132, False, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="split_k runs at most 65535"):
        group(1, 70000, splits=4)


def test_options_given_to_a_function_override_the_environment(monkeypatch):
    """`nf.compile(..., options=)` carries every switch; the environment is read only without it,
    once per compile, and an invalid value is an error naming the variable."""
    from neptune_fusion.runtime.options import Options

    monkeypatch.setenv("NEPTUNE_FUSION_GRID_GROUP", "3")
    q, k, v = _qkv(1, 4, 4, 100, 100, 32)
    args = dict(q=q, k=k, v=v, scale=1 / math.sqrt(32))
    fn = nf.compile(causal_attention, options=Options(interpreter=True, grid_group=2))
    exe = fn.executable_for(fn.program_def.trace(**args), args)
    assert exe.record.grid_group == 2
    from_env = nf.compile(causal_attention)
    assert from_env.executable_for(from_env.program_def.trace(**args), args).record.grid_group == 3
    monkeypatch.setenv("NEPTUNE_FUSION_GRID_GROUP", "two")
    with pytest.raises(ValueError, match="NEPTUNE_FUSION_GRID_GROUP"):
        nf.compile(causal_attention)(q, k, v, scale=0.1)


@pytest.mark.parametrize("rows_are_keys", [False, True])
def test_programs_start_with_the_row_tiles_that_visit_the_most_loop_tiles(rows_are_keys):
    """Causal rows over queries see more keys the later they are; rows over keys (a backward's
    loop over the queries that see them) see fewer: either way program 0 runs the heaviest tile."""
    from neptune_fusion.tile.inspect import loop_ranges

    @nf.program
    def causal_lse(a, b):
        s = nf.einsum("id,jd->ij", a, b)
        visible = nf.index(s, -1) >= nf.index(s, -2) if rows_are_keys else nf.index(s, -2) >= nf.index(s, -1)
        s = nf.where(visible, s, -nf.inf)
        return nf.log(nf.exp(s - s.max(axis=-1, keepdims=True)).sum(axis=-1)) + s.max(axis=-1)

    a, b = torch.randn(64, 16), torch.randn(64, 16)
    fn = nf.compile(causal_lse, nf.flash(block_q=16, block_k=16))
    out = fn(a, b)
    i = torch.arange(64)
    visible = (i[None, :] >= i[:, None]) if rows_are_keys else (i[:, None] >= i[None, :])
    ref = torch.logsumexp((a.double() @ b.double().T).masked_fill(~visible, -math.inf), -1)
    assert torch.allclose(out.double(), ref, atol=1e-4)
    exe = fn.executable_for(fn.program_def.trace(a=a, b=b), {"a": a, "b": b})
    visited = [sum(hi - lo for lo, hi, _ in loop_ranges(exe.main.tile, (pid, 0, 0), {"i": 64, "j": 64}))
               for pid in range(4)]
    assert visited == sorted(visited, reverse=True) and visited[0] > visited[-1], visited
