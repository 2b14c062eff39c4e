"""Random affine masks (and/or/not of comparisons between positions) against the reference.

Tile skipping is where a compiler can be silently wrong: every mask here is compiled with small
random blocks so that tiles are skipped, partly masked and fully visible in many combinations.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.integrations.attention import clear_cache  # noqa: E402


def _maybe_grouped_order(rng: random.Random, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sometimes run on the one-axis grid with row tiles of several heads interleaved."""
    if rng.random() < 0.4:
        monkeypatch.setenv("NEPTUNE_FUSION_GRID_GROUP", str(rng.choice([1, 2, 3])))
        clear_cache()


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention (head dim 16, scale 1/4); rows with no visible key give 0."""
    s = (q.double() @ k.double().mT) / 4.0
    return torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0) @ v.double()


def _random_comparison(rng: random.Random):
    a, b = rng.choice([-2, -1, 0, 1, 2]), rng.choice([-1, 1])
    c = rng.randint(-40, 40)
    op = rng.choice(["ge", "gt", "le", "lt"])

    def cmp(q, k):
        lhs = a * q + b * k + c
        return {"ge": lhs >= 0, "gt": lhs > 0, "le": lhs <= 0, "lt": lhs < 0}[op]

    return cmp, f"{a}*q + {b}*k + {c} {op} 0"


def _random_mask(rng: random.Random):
    terms = [_random_comparison(rng) for _ in range(rng.randint(1, 3))]
    combine = rng.choice(["and", "or", "mixed", "not"])

    def mask(b, h, q, k):
        values = [t[0](q, k) for t in terms]
        if combine == "and":
            out = values[0]
            for v in values[1:]:
                out = out & v
        elif combine == "or":
            out = values[0]
            for v in values[1:]:
                out = out | v
        elif combine == "not":
            out = ~values[0]
            for v in values[1:]:
                out = out & v
        else:
            out = values[0] | (values[-1] & (q >= k))
        return out

    return mask, f"{combine}: " + "; ".join(t[1] for t in terms)


@pytest.mark.parametrize("seed", range(int(os.environ.get("NF_FUZZ_SEEDS", "16"))))
def test_random_affine_masks(seed, monkeypatch):
    rng = random.Random(seed)
    _maybe_grouped_order(rng, monkeypatch)
    mask, text = _random_mask(rng)
    lq, lk = rng.choice([(64, 64), (70, 45), (33, 100)])
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (lq, lk, lk))
    if rng.random() < 0.3:
        schedule = nf.split_k(splits=rng.randint(2, 5), block_k=16)
    else:
        schedule = nf.flash(block_q=rng.choice([16, 32]), block_k=rng.choice([16, 32]))
    out = nf.attention(q, k, v, mask_mod=mask, schedule=schedule)
    qi, ki = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    visible = mask(None, None, qi, ki)
    torch.testing.assert_close(out.double(), _masked_attention(q, k, v, visible), rtol=1e-5, atol=1e-5, msg=text)


@pytest.mark.parametrize("seed", range(int(os.environ.get("NF_FUZZ_SEEDS", "16")) // 2))
def test_random_data_dependent_masks(seed, monkeypatch):
    """Masks read from tensors (documents, tables, lengths): tiles come from a run-time block map."""
    rng = random.Random(1000 + seed)
    _maybe_grouped_order(rng, monkeypatch)
    g = torch.Generator().manual_seed(seed)
    b, lq, lk = rng.choice([1, 2]), rng.choice([40, 64, 90]), rng.choice([40, 64, 77])
    q, k, v = (torch.randn(b, 2, n, 16, generator=g) for n in (lq, lk, lk))
    doc_q = torch.sort(torch.randint(0, rng.randint(1, 6), (lq,), generator=g)).values
    doc_k = torch.sort(torch.randint(0, rng.randint(1, 6), (lk,), generator=g)).values
    table = torch.rand(lq, lk, generator=g) > rng.random()
    lengths = torch.randint(0, lk + 1, (b,), generator=g)
    affine, _ = _random_comparison(rng)
    kind = rng.choice(["doc", "table", "lengths", "doc_affine"])

    def mask(bi, h, qi, ki):
        if kind == "doc":
            return doc_q[qi] == doc_k[ki]
        if kind == "table":
            return table[qi, ki] | (qi == ki)
        if kind == "lengths":
            return ki < lengths[bi]
        return (doc_q[qi] == doc_k[ki]) & affine(qi, ki)

    if rng.random() < 0.3:
        schedule = nf.split_k(splits=rng.randint(2, 5), block_k=16)  # each split takes a share of the lists
    else:
        schedule = nf.flash(block_q=rng.choice([16, 32]), block_k=rng.choice([16, 32]))
    out = nf.attention(q, k, v, mask_mod=mask, schedule=schedule)
    bi = torch.arange(b)[:, None, None, None]
    qi, ki = torch.arange(lq)[None, None, :, None], torch.arange(lk)[None, None, None, :]
    visible = mask(bi, None, qi, ki)
    torch.testing.assert_close(out.double(), _masked_attention(q, k, v, visible), rtol=1e-5, atol=1e-5, msg=kind)


@pytest.mark.parametrize("seed", range(int(os.environ.get("NF_FUZZ_SEEDS", "16")) // 2))
def test_random_score_mods_shapes_and_groups(seed, monkeypatch):
    """Score modifications, GQA ratios, decode-like and odd shapes, both templates, fp32/fp16."""
    rng = random.Random(5000 + seed)
    _maybe_grouped_order(rng, monkeypatch)
    g = torch.Generator().manual_seed(seed)
    hk = rng.choice([1, 2])
    hq = hk * rng.choice([1, 2, 4])
    lq, lk, d = rng.choice([1, 3, 17, 64]), rng.choice([23, 64, 130]), rng.choice([16, 24, 32])
    dtype = rng.choice([torch.float32, torch.float16])
    q = torch.randn(1, hq, lq, d, generator=g).to(dtype)
    k, v = (torch.randn(1, hk, lk, d, generator=g).to(dtype) for _ in range(2))
    slopes = torch.rand(hq, generator=g)
    table = torch.randn(lq + lk, generator=g)
    cap = rng.choice([5.0, 20.0])
    kind = rng.choice(["alibi", "softcap", "table", "alibi_softcap", "none", "soft_penalty", "where_scale"])
    penalty = rng.choice([-4.0, 0.0, 2.0, -1e4])  # finite: moves scores, never a mask

    def score_mod(s, b, h, qi, ki):
        if kind in ("alibi", "alibi_softcap"):
            s = s + slopes[h] * (ki - qi)
        if kind in ("softcap", "alibi_softcap"):
            s = cap * torch.tanh(s / cap)
        if kind == "table":
            s = s + table[qi - ki + lk]
        if kind == "soft_penalty":
            s = s + torch.where(qi >= ki, 0.0, penalty)
        if kind == "where_scale":
            s = torch.where((ki - qi) % 3 == 0, s, s * 0.5)
        return s

    mask, _ = _random_mask(rng) if rng.random() < 0.5 else (None, "")
    schedule = nf.split_k(splits=rng.randint(2, 4), block_k=16) if rng.random() < 0.4 else None
    out = nf.attention(q, k, v, score_mod=score_mod, mask_mod=mask, enable_gqa=hq != hk, schedule=schedule)
    kk, vv = k.double().repeat_interleave(hq // hk, 1), v.double().repeat_interleave(hq // hk, 1)
    s = (q.double() @ kk.mT) / math.sqrt(d)
    hi = torch.arange(hq)[None, :, None, None]
    qi, ki = torch.arange(lq)[None, None, :, None], torch.arange(lk)[None, None, None, :]
    s = score_mod(s, None, hi, qi, ki)
    if mask is not None:
        s = s.masked_fill(~mask(None, None, qi, ki), float("-inf"))
    expected = torch.softmax(s, -1).nan_to_num(0.0) @ vv
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol, msg=f"{kind} {hq}/{hk} {lq}x{lk}x{d}")
