"""Mask analysis promises, checked: skipped tiles are fully masked, unmasked tiles fully visible,
and block maps are built once per mask input."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
import neptune_fusion.runtime.blockmap as blockmap  # noqa: E402
from neptune_fusion.tile.inspect import loop_ranges  # noqa: E402

N, BQ, BK, WINDOW = 256, 32, 16, 40


@nf.program
def window_attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    i, j = nf.index(s, -2), nf.index(s, -1)
    s = nf.where((i >= j) & (i - j < WINDOW), s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def sink_window_attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    i, j = nf.index(s, -2), nf.index(s, -1)
    s = nf.where((j < 4) | ((i >= j) & (i - j < WINDOW)), s, -nf.inf)  # attention sink + window
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def window_attention_on_weights(q, k, v, scale):
    """The same window, written on the scores (-inf) for the max and on the weights (0) for the sums."""
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    i, j = nf.index(s, -2), nf.index(s, -1)
    visible = (i >= j) & (i - j < WINDOW)
    p = nf.where(visible, nf.exp(s - nf.where(visible, s, -nf.inf).max(axis=-1, keepdims=True)), 0.0)
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("program", [window_attention, sink_window_attention, window_attention_on_weights])
def test_masked_kernels_visit_exactly_the_tiles_they_need(program):
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    fn = nf.compile(program, schedule=nf.flash(block_q=BQ, block_k=BK))
    named = dict(fn.program_def.bind(q, k, v, 0.25))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    rows, cols = torch.arange(N)[:, None], torch.arange(N)[None, :]
    visible = (rows >= cols) & (rows - cols < WINDOW)
    if program is sink_window_attention:
        visible = visible | (cols < 4)
    n_tiles = math.ceil(N / BQ)
    total_visited = 0
    for pid in range(n_tiles):
        tile = n_tiles - 1 - pid  # programs take row tiles from the last one
        block = visible[tile * BQ:(tile + 1) * BQ]
        needed = {c // BK for c in range(N) if block[:, c].any()}
        full = {t for t in needed if block[:, t * BK:(t + 1) * BK].all()}
        visited, unmasked = set(), set()
        for start, stop, comment in loop_ranges(exe.main.tile, (pid, 0, 0), {"q": N, "k": N, "b": 1, "h": 2}):
            tiles = set(range(start // BK, math.ceil(stop / BK))) if stop > start else set()
            assert not (visited & tiles), "a tile visited twice"
            visited |= tiles
            if "no mask arithmetic" in comment:
                unmasked |= tiles
        assert visited == needed, f"row tile {tile}: visits {sorted(visited)}, window needs {sorted(needed)}"
        assert unmasked <= full, "a tile run without mask arithmetic is not fully visible"
        total_visited += len(visited)
    assert total_visited < n_tiles * math.ceil(N / BK) / 2  # most tiles are skipped
    out = fn(q, k, v, scale=0.25)
    s = (q @ k.mT * 0.25).masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_document_block_map_is_built_once_and_shared():
    g = torch.Generator().manual_seed(0)
    doc = torch.sort(torch.randint(0, 4, (96,), generator=g)).values

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    before = blockmap.builds
    for _ in range(3):
        nf.attention(q, k, v, mask_mod=same_document)
    assert blockmap.builds == before + 1
    q2, k2, v2 = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))  # another layer, same documents
    nf.attention(q2, k2, v2, mask_mod=same_document)
    assert blockmap.builds == before + 1
    doc[:10] = 7  # the documents change in place: the map is rebuilt
    out = nf.attention(q, k, v, mask_mod=same_document)
    assert blockmap.builds == before + 2
    mask = doc[:, None] == doc[None, :]
    s = (q @ k.mT / 4.0).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_block_map_is_built_on_every_call_while_a_cuda_graph_is_captured(monkeypatch):
    """A graph replay runs no host code: the map's build must be captured, not fetched from the cache."""
    g = torch.Generator().manual_seed(1)
    doc = torch.sort(torch.randint(0, 4, (96,), generator=g)).values

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    nf.attention(q, k, v, mask_mod=same_document)  # warm-up outside the capture fills the cache
    monkeypatch.setattr(blockmap, "_capturing", lambda: True)
    before = blockmap.builds
    for _ in range(2):
        out = nf.attention(q, k, v, mask_mod=same_document)
    assert blockmap.builds == before + 2
    monkeypatch.setattr(blockmap, "_capturing", lambda: False)
    nf.attention(q, k, v, mask_mod=same_document)
    assert blockmap.builds == before + 2  # after the capture the cache serves the map built before it
    mask = doc[:, None] == doc[None, :]
    torch.testing.assert_close(out, _table_attention(q, k, v, mask))


def _table_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    s = (q @ k.mT / 4.0).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def test_block_map_of_a_transposed_view_is_not_the_original_map():
    """A transposed view has the address, version and (square) shape of its base: strides tell them apart."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 16, generator=g) for _ in range(3))
    table = torch.zeros(32, 32, dtype=torch.bool)
    table[:, :8] = True
    for visible in (table, table.T):
        out = nf.attention(q, k, v, mask_mod=lambda b, h, qi, ki, t=visible: t[qi, ki],
                           schedule=nf.flash(block_q=16, block_k=16))
        torch.testing.assert_close(out, _table_attention(q, k, v, visible))


def test_block_map_of_a_new_tensor_at_an_old_address_is_rebuilt():
    """A new tensor over the same memory (like one allocated where a freed one was) starts at version 0."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=g) for _ in range(3))
    memory = np.zeros(64, dtype=np.int64)
    first = torch.from_numpy(memory)
    nf.attention(q, k, v, mask_mod=lambda b, h, qi, ki: first[qi] == first[ki],
                 schedule=nf.flash(block_q=16, block_k=16))
    memory[:] = np.arange(64) * 4 // 64  # four documents, written where torch does not count versions
    second = torch.from_numpy(memory)
    assert (second.data_ptr(), second._version) == (first.data_ptr(), first._version)
    out = nf.attention(q, k, v, mask_mod=lambda b, h, qi, ki: second[qi] == second[ki],
                       schedule=nf.flash(block_q=16, block_k=16))
    torch.testing.assert_close(out, _table_attention(q, k, v, second[:, None] == second[None, :]))


@pytest.mark.parametrize("kind", ["prefix", "window_or_sink"])
def test_unions_of_affine_regions_skip_tiles(kind):
    """prefix-LM (kv < P | q >= kv) and attention sinks (kv < 4 | window) are unions of affine boxes."""
    q, k, v = (torch.randn(1, 1, 128, 16) for _ in range(3))
    masks = {
        "prefix": lambda b, h, qi, ki: (ki < 20) | (qi >= ki),
        "window_or_sink": lambda b, h, qi, ki: (ki < 4) | ((qi >= ki) & (qi - ki < 24)),
    }
    out = nf.attention(q, k, v, mask_mod=masks[kind], schedule=nf.flash(block_q=16, block_k=16))
    qi, ki = torch.arange(128)[:, None], torch.arange(128)[None, :]
    s = (q @ k.mT / 4.0).masked_fill(~masks[kind](None, None, qi, ki), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_block_map_takes_one_axis_conjuncts_apart_and_keeps_the_mask_cached(monkeypatch):
    """A mask of documents and of keys per head (a padding mask): the per-head key condition is
    evaluated over (head, key) alone, never over (head, query, key), and changing it leaves the
    documents' part of the map cached. Tiles are still skipped and the results exact."""
    g = torch.Generator().manual_seed(2)
    doc = torch.sort(torch.randint(0, 3, (96,), generator=g)).values
    keep = torch.rand(2, 96, generator=g) > 0.3
    keep[1, 40:] = False  # a whole stretch of keys of head 1 masked: its tiles are skipped

    def mask(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & keep[h, kv_idx]

    shapes = []
    evaluate = blockmap._Evaluator.eval

    def recording(self, expr, frame):  # noqa: ANN001, ANN202
        out = evaluate(self, expr, frame)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(blockmap._Evaluator, "eval", recording)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    schedule = nf.flash(block_q=16, block_k=16)
    out = nf.attention(q, k, v, mask_mod=mask, schedule=schedule)
    visible = (doc[:, None] == doc[None, :]) & keep[:, None, :]
    torch.testing.assert_close(out, _table_attention(q, k, v, visible[None]))
    assert shapes and max(math.prod(s) for s in shapes) < 2 * 96 * 96
    dense_builds = [s for s in shapes if s[-2:] == (96, 96)]
    assert dense_builds, shapes
    shapes.clear()
    keep[0, :10] = False  # the per-head keys change: only their part is evaluated again
    out = nf.attention(q, k, v, mask_mod=mask, schedule=schedule)
    assert shapes and all(s[-2:] != (96, 96) for s in shapes), shapes
    visible = (doc[:, None] == doc[None, :]) & keep[:, None, :]
    torch.testing.assert_close(out, _table_attention(q, k, v, visible[None]))


@pytest.mark.parametrize("lengths", [(1, 1), (3, 1), (1, 2), (5, 37)])
@pytest.mark.parametrize("by_block_mask", [False, True], ids=["mask_mod", "block_mask"])
def test_a_tile_past_the_last_key_is_never_full(lengths, by_block_mask):
    """A full tile is read without bounds checks, so the key tile that runs past the end is at
    most partial: also at one key, where the visibility has extent 1 along the keys (read as a
    broadcast, it made that tile full and the kernel read past the keys)."""
    from torch.nn.attention.flex_attention import create_block_mask

    lq, lk = lengths
    torch.manual_seed(lq * 100 + lk)
    q, k, v = torch.randn(1, 2, lq, 16), torch.randn(1, 2, lk, 16), torch.randn(1, 2, lk, 16)
    kv_doc = torch.randint(0, 2, (lk,))
    q_doc = kv_doc[torch.arange(lq).clamp(max=lk - 1)]

    def document(b, h, q_idx, kv_idx):
        return q_doc[q_idx] == kv_doc[kv_idx]

    mask = create_block_mask(document, None, None, lq, lk, device="cpu") if by_block_mask else None
    out = nf.attention(q, k, v, block_mask=mask, mask_mod=None if by_block_mask else document)
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(q_doc[:, None] != kv_doc[None, :], -math.inf)
    torch.testing.assert_close(out, torch.softmax(s, -1).nan_to_num(0.0) @ v, atol=2e-5, rtol=1e-4)


@nf.program
def lower_triangle_matmul(a, b):
    """tril(a * a) @ (b * b): both operands are computed, so the tile's rows are b's columns and the
    masked axis (a's rows) is held in the tile across the dot, not tiled per program."""
    i, k = nf.index(a, 0), nf.index(a, 1)
    return (nf.where(i >= k, a * a, 0.0)[:, :, None] * (b * b)[None, :, :]).sum(axis=1)


def test_a_mask_on_an_axis_held_in_the_tile_stays_element_wise():
    """A condition on the loop axis and an axis the tile holds beside the rows bounds the loop
    differently for each of its positions: no tile is skipped for it, it is applied element-wise
    (its loop bounds were once computed from the whole tile, and the kernel failed)."""
    a, b = torch.randn(64, 96), torch.randn(96, 80)
    fn = nf.compile(lower_triangle_matmul)
    torch.testing.assert_close(fn(a, b), torch.tril(a * a) @ (b * b), rtol=1e-4, atol=1e-3)
    text = nf.explain(lower_triangle_matmul, a, b)
    assert "tile axes ('a2', 'a1', 'a0')" in text and "no mask: tiles [0, size_a1) visited" in text
