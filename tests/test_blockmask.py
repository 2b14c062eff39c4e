"""FlexAttention BlockMask: dense block tables, validation, dynamo tracing and nf.attention end to end.

The references are built independently of the code under test: block tables by a Python loop
over the sparse lists, attention masks elementwise from those loops and the mask_mod. Eager
`flex_attention` applies only a BlockMask's mask_mod (it ignores the block lists; compiled
FlexAttention honours them), so it serves as the reference with a mask_mod reading the dense mask.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import warnings  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import flex_attention as flex  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.integrations.blockmask import (  # noqa: E402
    BlockTables,
    as_mask_mod,
    block_tables,
    implied_by_mask_mod,
    visible,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                               "ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def sliding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 48)


Q_DOC = torch.arange(200) // 70   # document ids of the queries and of the keys (lengths 200 / 136)
KV_DOC = torch.arange(136) // 50


def documents(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return Q_DOC[q_idx] == KV_DOC[kv_idx]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def loop_table(num: torch.Tensor, idx: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The lists read as the kernel reads them: the first num[b, h, r] entries of row r."""
    out = torch.zeros(*num.shape[:2], rows, cols, dtype=torch.bool)
    for b in range(num.shape[0]):
        for h in range(num.shape[1]):
            for r in range(rows):
                for j in range(int(num[b, h, r])):
                    out[b, h, r, int(idx[b, h, r, j])] = True
    return out


def expected_keep(bm: BlockMask, batch: int, heads: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Elementwise (batch, heads, q_len, kv_len) visibility: full | (partial & mask_mod)."""
    qb, kb = bm.BLOCK_SIZE
    rows, cols = cdiv(q_len, qb), cdiv(kv_len, kb)

    def spread(table: torch.Tensor) -> torch.Tensor:
        t = table.repeat_interleave(qb, 2).repeat_interleave(kb, 3)[:, :, :q_len, :kv_len]
        return t.expand(batch, heads, q_len, kv_len)

    partial = spread(loop_table(bm.kv_num_blocks, bm.kv_indices, rows, cols))
    user = create_mask(bm.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    keep = partial & user
    if bm.full_kv_num_blocks is not None:
        keep = keep | spread(loop_table(bm.full_kv_num_blocks, bm.full_kv_indices, rows, cols))
    return keep


def random_lists(state: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists for the blocks where `state` is True, in a random order, junk (valid indices) past num."""
    num = state.sum(-1).to(torch.int32)
    keys = torch.rand(state.shape, generator=gen) + (~state).float()  # listed blocks first, shuffled
    return num, keys.argsort(-1).to(torch.int32)


def kv_blocks_mask(bm_b: int, bm_h: int, rows: int, cols: int, block: int | tuple[int, int],
                   seq_lengths: tuple[int, int] | None, mask_mod: Callable[..., Any] | None,
                   seed: int = 0) -> BlockMask:
    """A from_kv_blocks BlockMask with random disjoint partial / full blocks; block (0, 1) full."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.randint(0, 3, (bm_b, bm_h, rows, cols), generator=gen)  # 0: skipped, 1: partial, 2: full
    state[:, :, 0, 1] = 2  # above the diagonal: a full block where a causal mask_mod would say False
    state[0, 0, rows - 1] = 0  # a query block that sees nothing
    num, idx = random_lists(state == 1, gen)
    full_num, full_idx = random_lists(state == 2, gen)
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=seq_lengths)


# --------------------------------------------------------------------------- dense tables


@pytest.mark.parametrize("mask_mod", [causal, sliding, documents])
@pytest.mark.parametrize("bm_bh", [(None, None), (2, 3)])
@pytest.mark.parametrize("block", [64, 128, (128, 64)])
def test_tables_of_create_block_mask(mask_mod: Callable[..., Any], bm_bh: tuple[Any, Any],
                                     block: int | tuple[int, int]) -> None:
    q_len, kv_len = 200, 136  # not multiples of the block sizes
    bm = create_block_mask(mask_mod, *bm_bh, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
    t = block_tables(bm, 2, 3, q_len, kv_len)
    qb, kb = bm.BLOCK_SIZE
    rows, cols = cdiv(q_len, qb), cdiv(kv_len, kb)
    assert isinstance(t, BlockTables) and (t.q_block, t.kv_block) == (qb, kb) and t.mask_mod is mask_mod
    assert t.partial.dtype == torch.bool and t.full is not None
    assert t.partial.shape == t.full.shape == (bm.kv_indices.shape[0], bm.kv_indices.shape[1], rows, cols)
    assert torch.equal(t.partial, loop_table(bm.kv_num_blocks, bm.kv_indices, rows, cols))
    assert torch.equal(t.full, loop_table(bm.full_kv_num_blocks, bm.full_kv_indices, rows, cols))
    assert torch.equal(t.partial | t.full, bm.to_dense().bool())
    assert not (t.partial & t.full).any()
    # the tables with the mask_mod reproduce the mask exactly (full blocks all True, skipped all False)
    assert torch.equal(expected_keep(bm, 2, 3, q_len, kv_len),
                       create_mask(mask_mod, 2, 3, q_len, kv_len, device="cpu"))


@pytest.mark.parametrize("bm_bh", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_tables_of_from_kv_blocks(bm_bh: tuple[int, int]) -> None:
    q_len, kv_len, block = 200, 136, (64, 32)
    rows, cols = cdiv(q_len, 64), cdiv(kv_len, 32)
    bm = kv_blocks_mask(*bm_bh, rows, cols, block, (q_len, kv_len), None, seed=sum(bm_bh))
    t = block_tables(bm, 2, 3, q_len, kv_len)
    assert t.mask_mod is None  # from_kv_blocks' default is torch's noop_mask
    assert t.partial.shape == (*bm_bh, rows, cols)
    assert torch.equal(t.partial, loop_table(bm.kv_num_blocks, bm.kv_indices, rows, cols))
    assert torch.equal(t.full, loop_table(bm.full_kv_num_blocks, bm.full_kv_indices, rows, cols))
    assert torch.equal(t.partial | t.full, bm.to_dense().bool())


def test_tables_without_full_lists_and_default_seq_lengths() -> None:
    gen = torch.Generator().manual_seed(3)
    num, idx = random_lists(torch.rand(1, 2, 3, 4, generator=gen) < 0.5, gen)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=32)  # seq_lengths (96, 128)
    t = block_tables(bm, 4, 2, 96, 128)
    assert t.full is None and torch.equal(t.partial, loop_table(num, idx, 3, 4))


def test_out_of_range_indices_and_counts_are_dropped() -> None:
    num = torch.tensor([[[5, 1]]], dtype=torch.int32)  # more than the row holds
    idx = torch.tensor([[[[1, 7, -1, 0], [0, 1, 1, 1]]]], dtype=torch.int32)  # 7, -1: no such block
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64, seq_lengths=(128, 128), compute_q_blocks=False)
    assert block_tables(bm, 1, 1, 128, 128).partial[0, 0].tolist() == [[True, True], [True, False]]


def test_no_block_mask_sentinel_fits_any_length() -> None:
    # what flex_attention uses for block_mask=None: one huge block; torch skips the length check for it
    bm = BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                                  BLOCK_SIZE=1 << 30, seq_lengths=(1, 1))
    t = block_tables(bm, 2, 2, 100, 37)
    assert t.partial.tolist() == [[[[True]]]] and t.full is None


# --------------------------------------------------------------------------- validation


def test_seq_lengths_must_match_like_flex_attention() -> None:
    bm = create_block_mask(causal, None, None, 128, 128, device="cpu", BLOCK_SIZE=64)
    q = torch.zeros(1, 1, 192, 8)
    with pytest.raises(ValueError, match="smaller length"):  # torch's own check, same condition
        flex_attention(q, q, q, block_mask=bm)
    with pytest.raises(ValueError, match=r"block_mask.shape=\(1, 1, 128, 128\).*q_len=192.*smaller length"):
        block_tables(bm, 1, 1, 192, 128)
    with pytest.raises(ValueError, match="kv_len=200.*smaller length"):
        block_tables(bm, 1, 1, 64, 200)  # one shorter, one longer: "smaller" wins, as in torch
    with pytest.raises(ValueError, match="q_len=100 and kv_len=128.*larger length"):
        block_tables(bm, 1, 1, 100, 128)  # same number of blocks, still refused (as torch does)
    with pytest.raises(ValueError, match="larger length"):
        block_tables(bm, 1, 1, 128, 64)


def test_batch_heads_and_rows_must_fit() -> None:
    bm = create_block_mask(causal, 2, 3, 128, 128, device="cpu", BLOCK_SIZE=64)
    block_tables(bm, 2, 3, 128, 128)
    with pytest.raises(ValueError, match="batch size 2, which must be 1 or the inputs' batch size 4"):
        block_tables(bm, 4, 3, 128, 128)
    with pytest.raises(ValueError, match="3 heads, which must be 1 or the inputs' number of query heads 6"):
        block_tables(bm, 2, 6, 128, 128)
    with pytest.raises(ValueError, match="3 heads.*query heads 1"):
        block_tables(bm, 2, 1, 128, 128)
    short = BlockMask.from_kv_blocks(torch.ones(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 1, 2, dtype=torch.int32),
                                     BLOCK_SIZE=64, seq_lengths=(128, 128))
    with pytest.raises(ValueError, match="1 query-block rows, fewer than the 2"):
        block_tables(short, 1, 1, 128, 128)
    with pytest.raises(ValueError, match="shape \\(B, H, q_blocks, n\\)"):
        block_tables(BlockMask.from_kv_blocks(bm.kv_num_blocks[0], bm.kv_indices[0], BLOCK_SIZE=64), 2, 3, 128, 128)


def test_not_a_block_mask_and_sliced() -> None:
    with pytest.raises(TypeError, match="must be a torch.nn.attention.flex_attention.BlockMask, got function"):
        block_tables(causal, 1, 1, 128, 128)  # type: ignore[arg-type]
    if hasattr(flex, "_sliced_mask_mod_error"):
        bm = create_block_mask(causal, 2, 1, 128, 128, device="cpu", BLOCK_SIZE=64)
        with pytest.raises(RuntimeError, match="sliced BlockMask"):
            block_tables(bm[:1], 1, 1, 128, 128)


# --------------------------------------------------------------------------- dynamo


def test_tables_trace_with_fullgraph() -> None:
    torch._dynamo.reset()
    bm = create_block_mask(documents, 2, None, 200, 136, device="cpu", BLOCK_SIZE=64)
    kv = kv_blocks_mask(1, 3, 4, 5, (64, 32), (200, 136), causal, seed=5)

    def tables(block_mask: BlockMask, heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = block_tables(block_mask, 2, heads, 200, 136)
        return t.partial, t.full

    compiled = torch.compile(tables, fullgraph=True, backend="aot_eager")
    for block_mask, heads in ((bm, 1), (kv, 3)):
        eager = block_tables(block_mask, 2, heads, 200, 136)
        partial, full = compiled(block_mask, heads)
        assert torch.equal(partial, eager.partial) and torch.equal(full, eager.full)

    def from_lists(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # a BlockMask built inside the graph
        return block_tables(BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64, seq_lengths=(200, 136)),
                            2, 1, 200, 136).partial

    got = torch.compile(from_lists, fullgraph=True, backend="aot_eager")(bm.kv_num_blocks, bm.kv_indices)
    assert torch.equal(got, block_tables(bm, 2, 1, 200, 136).partial)


# --------------------------------------------------------------------------- attention end to end


def flex_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Eager flex_attention with a mask_mod reading the dense mask (eager applies exactly that)."""
    def dense(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return keep[b, h, q_idx, kv_idx]

    bm = create_block_mask(dense, keep.shape[0], keep.shape[1], keep.shape[2], keep.shape[3], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q.float(), k.float(), v.float(), block_mask=bm)


def qkv(b: int, h: int, lq: int, lk: int, d: int, dtype: torch.dtype = torch.float32,
        seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen).to(dtype) for n in (lq, lk, lk))


def test_closure_under_torch_vmap() -> None:
    # the same closure is an ordinary torch mask_mod: create_mask vmaps it over (b, h, q, kv)
    bm = kv_blocks_mask(2, 1, 4, 5, (64, 32), (200, 136), causal, seed=7)
    got = create_mask(as_mask_mod(block_tables(bm, 2, 3, 200, 136)), 2, 3, 200, 136, device="cpu")
    assert torch.equal(got, expected_keep(bm, 2, 3, 200, 136))


def test_attention_create_block_mask_matches_flex() -> None:
    bm = create_block_mask(documents, 2, None, 200, 136, device="cpu", BLOCK_SIZE=64)
    q, k, v = qkv(2, 2, 200, 136, 16)
    out = nf.attention(q, k, v, mask_mod=as_mask_mod(block_tables(bm, 2, 2, 200, 136)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = flex_attention(q, k, v, block_mask=bm)  # consistent lists: eager gives the compiled result
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_mod", [causal, None])
@pytest.mark.parametrize("bm_bh", [(1, 1), (2, 2)])
def test_attention_from_kv_blocks(mask_mod: Callable[..., Any] | None, bm_bh: tuple[int, int]) -> None:
    # full block (0, 1) lies above the diagonal: with causal applied there this test fails
    bm = kv_blocks_mask(*bm_bh, 4, 5, (64, 32), (200, 136), mask_mod, seed=11 + bm_bh[0])
    keep = expected_keep(bm, 2, 2, 200, 136)
    assert keep[:, :, :64, 32:64].all()
    q, k, v = qkv(2, 2, 200, 136, 16, seed=1)
    out = nf.attention(q, k, v, mask_mod=as_mask_mod(block_tables(bm, 2, 2, 200, 136)))
    expected = flex_reference(q, k, v, keep)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert (out[0, 0, 192:] == 0).all()  # the query block that sees nothing gives 0, as FlexAttention


def test_attention_float16_and_gqa() -> None:
    bm = kv_blocks_mask(1, 4, 2, 4, 64, None, sliding, seed=2)  # seq_lengths (128, 256)
    q, k, v = qkv(1, 4, 128, 256, 16, torch.float16, seed=2)
    k, v = k[:, :2], v[:, :2]  # two query heads per key/value head; the BlockMask is per query head
    tables = block_tables(bm, 1, 4, 128, 256)
    out = nf.attention(q, k, v, mask_mod=as_mask_mod(tables), enable_gqa=True)
    expected = flex_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                              expected_keep(bm, 1, 4, 128, 256))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=3e-3)


def test_visible_without_user_mask_or_full() -> None:
    partial = torch.tensor([[[[True, False], [False, True]]]])
    full = torch.tensor([[[[False, True], [False, False]]]])
    q_idx, kv_idx = torch.arange(4)[:, None], torch.arange(4)[None, :]
    b = h = torch.zeros((), dtype=torch.long)
    assert visible(partial, None, 2, 2, None, b, h, q_idx, kv_idx).int().tolist() == \
        [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    assert visible(partial, full, 2, 2, q_idx >= kv_idx, b, h, q_idx, kv_idx).int().tolist() == \
        [[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_matches_compiled_flex_attention() -> None:
    # the semantics' source: compiled FlexAttention (inductor's CPU kernel) honours the block lists
    bm = kv_blocks_mask(2, 1, 4, 5, (64, 32), (200, 136), causal, seed=13)
    q, k, v = qkv(2, 2, 200, 136, 16, seed=3)
    torch._dynamo.reset()
    try:
        expected = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    except Exception as e:  # no C++ toolchain for inductor here: the eager references above still apply
        pytest.skip(f"torch.compile(flex_attention) unavailable on CPU: {type(e).__name__}")
    out = nf.attention(q, k, v, mask_mod=as_mask_mod(block_tables(bm, 2, 2, 200, 136)))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(expected, flex_reference(q, k, v, expected_keep(bm, 2, 2, 200, 136)),
                               atol=1e-4, rtol=1e-4)


def test_a_block_mask_is_densified_once_and_again_when_its_lists_change() -> None:
    """The tables of one BlockMask are the same tensors on every call, so the block map built from
    them is found in its cache (not rebuilt per call, forward or backward); lists edited in place
    are densified again and honoured."""
    import neptune_fusion.runtime.blockmap as blockmap

    bm = kv_blocks_mask(1, 1, 4, 5, (64, 32), (200, 136), causal, seed=3)
    q, k, v = qkv(2, 2, 200, 136, 16, seed=2)
    before = blockmap.builds
    for _ in range(3):
        out = nf.attention(q, k, v, block_mask=bm)
    assert blockmap.builds == before + 1
    torch.testing.assert_close(out, flex_reference(q, k, v, expected_keep(bm, 2, 2, 200, 136)), atol=1e-4, rtol=1e-4)
    bm.kv_num_blocks[0, 0, 0] = 0  # the first query block now sees nothing
    out = nf.attention(q, k, v, block_mask=bm)
    assert blockmap.builds == before + 2
    torch.testing.assert_close(out, flex_reference(q, k, v, expected_keep(bm, 2, 2, 200, 136)), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- tables the mask_mod implies


def by_head(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) & ((h == 0) | (q_idx - kv_idx <= 48))  # head 0 causal, the others a window


def implied(bm: BlockMask, batch: int, heads: int) -> bool:
    q_len, kv_len = bm.seq_lengths
    return implied_by_mask_mod(block_tables(bm, batch, heads, q_len, kv_len), batch, heads, q_len, kv_len)


def with_full_block(bm: BlockMask, row: int, col: int) -> BlockMask:
    """`bm` with block (row, col) moved from wherever it was listed to the full lists."""
    partial = loop_table(bm.kv_num_blocks, bm.kv_indices, *bm.kv_num_blocks.shape[2:], bm.kv_indices.shape[3])
    full = loop_table(bm.full_kv_num_blocks, bm.full_kv_indices, *bm.kv_num_blocks.shape[2:], bm.kv_indices.shape[3])
    partial[..., row, col], full[..., row, col] = False, True
    gen = torch.Generator().manual_seed(0)
    return BlockMask.from_kv_blocks(*random_lists(partial, gen), *random_lists(full, gen), BLOCK_SIZE=bm.BLOCK_SIZE,
                                    mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)


@pytest.mark.parametrize("mask_mod", [causal, sliding, documents])
@pytest.mark.parametrize("block", [64, (128, 32)])
def test_create_block_mask_is_implied_by_its_mask_mod(mask_mod: Callable[..., Any],
                                                      block: int | tuple[int, int]) -> None:
    bm = create_block_mask(mask_mod, None, None, 200, 136, device="cpu", BLOCK_SIZE=block)
    assert implied(bm, 2, 3)
    assert not implied(with_full_block(bm, 0, 1), 2, 3)  # above every diagonal: a full block with masked positions
    skipped = BlockMask.from_kv_blocks(bm.kv_num_blocks.clamp(max=0), bm.kv_indices, BLOCK_SIZE=block,
                                       mask_mod=mask_mod, seq_lengths=(200, 136))
    assert not implied(skipped, 2, 3)  # no block listed, while mask_mod keeps some positions
    everywhere = torch.ones(1, 1, cdiv(200, skipped.BLOCK_SIZE[0]), cdiv(136, skipped.BLOCK_SIZE[1]), dtype=torch.bool)
    partial = BlockMask.from_kv_blocks(*random_lists(everywhere, torch.Generator().manual_seed(1)), BLOCK_SIZE=block,
                                       mask_mod=mask_mod, seq_lengths=(200, 136))
    assert implied(partial, 2, 3)  # partial blocks may hold anything


def test_implied_at_every_batch_entry_and_head_of_the_call() -> None:
    doc = torch.stack([torch.arange(200) // 70, torch.arange(200) // 40])  # per batch entry

    def per_entry(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc[b, q_idx] == doc[b, kv_idx]

    # a broadcast BlockMask holds the tables of b = 0 / h = 0: right for the call's other entries
    # and heads only where mask_mod does not depend on them
    assert not implied(create_block_mask(per_entry, None, None, 200, 200, device="cpu", BLOCK_SIZE=64), 2, 3)
    assert implied(create_block_mask(per_entry, None, None, 200, 200, device="cpu", BLOCK_SIZE=64), 1, 3)
    assert implied(create_block_mask(per_entry, 2, None, 200, 200, device="cpu", BLOCK_SIZE=64), 2, 3)
    assert not implied(create_block_mask(by_head, 1, 1, 200, 200, device="cpu", BLOCK_SIZE=64), 2, 3)
    assert implied(create_block_mask(by_head, 1, 1, 200, 200, device="cpu", BLOCK_SIZE=64), 2, 1)
    assert implied(create_block_mask(by_head, 1, 3, 200, 200, device="cpu", BLOCK_SIZE=64), 2, 3)


def test_implied_in_small_chunks_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    import neptune_fusion.integrations.blockmask as blockmask

    good = create_block_mask(by_head, 1, 3, 200, 136, device="cpu", BLOCK_SIZE=(64, 32))
    bad = with_full_block(create_block_mask(by_head, 1, 3, 200, 136, device="cpu", BLOCK_SIZE=(64, 32)), 3, 1)
    for chunk in (64 * 32 * 3, 64 * 32, 100):  # one block row of one head; one block; less than one block
        monkeypatch.setattr(blockmask, "_CHUNK_POSITIONS", chunk)
        assert implied(good, 2, 3) and not implied(bad, 2, 3)
    monkeypatch.setattr(blockmask, "_MAX_POSITIONS", 200 * 136 * 3 - 1)  # one position too many to evaluate
    assert not implied(good, 2, 3)
    noop = kv_blocks_mask(1, 1, 4, 5, (64, 32), (200, 136), None)
    assert not implied(noop, 2, 3)  # the no-op mask_mod keeps every position: skipped blocks say more
    everywhere = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    assert implied(BlockMask.from_kv_blocks(*random_lists(everywhere, torch.Generator()), BLOCK_SIZE=(64, 32),
                                            seq_lengths=(200, 136)), 2, 3)

    def fails(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        raise RuntimeError("not under vmap")

    bm = create_block_mask(causal, None, None, 200, 136, device="cpu", BLOCK_SIZE=64)
    bm.mask_mod = fails
    assert not implied(bm, 2, 3)


def test_the_check_evaluates_on_broadcast_indices_and_falls_back_to_vmap(monkeypatch: pytest.MonkeyPatch) -> None:
    """mask_mod is evaluated on broadcast index tensors (a few element-wise passes) where that
    agrees with create_mask's vmap on a corner of the grid; one whose ops need scalar indices
    (stacking them) or that is not point by point (a cumsum) goes through the vmap instead, with the
    same verdict."""
    import neptune_fusion.integrations.blockmask as blockmask

    doc = torch.tensor([0] * 70 + [1] * 90 + [2] * 40)

    def docs(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def stacked(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.stack([q_idx, kv_idx])[0] >= kv_idx  # q_idx >= kv_idx; no broadcasting stack

    def running(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx).cumsum(-1) >= 0  # q_idx >= kv_idx for scalars; a running sum when broadcast

    cpu = torch.device("cpu")
    for mod, broadcasts in ((docs, True), (by_head, True), (stacked, False), (running, False)):
        assert blockmask._varies(mod, 2, 3, 200, 136, cpu)[2] == broadcasts
        want = create_mask(lambda b, h, q, kv, mod=mod: mod(b, h, q + 8, kv), 2, 3, 192, 136, device="cpu")
        assert torch.equal(blockmask._evaluate(mod, (0, 2), (0, 3), (8, 200), (0, 136), cpu, broadcasts), want)
    vmapped: list[int] = []
    real = blockmask.create_mask
    monkeypatch.setattr(blockmask, "create_mask", lambda *a, **k: vmapped.append(1) or real(*a, **k))
    for mod, via_vmap in ((docs, False), (stacked, True), (running, True)):
        vmapped.clear()
        assert implied(create_block_mask(mod, None, None, 200, 136, device="cpu", BLOCK_SIZE=32), 2, 3)
        assert (len(vmapped) > 1) == via_vmap  # (the b / h probe is one create_mask call)


def block_mapped(q: torch.Tensor, k: torch.Tensor, bm: BlockMask) -> bool:
    """Whether nf.attention traces `bm` as its tables (else as its mask_mod alone)."""
    from neptune_fusion.integrations.attention import Outputs, _request

    request, extras = _request(q, k, None, bm, None, False, Outputs(), None)
    assert (request.builtins.block is None) == (extras == ())
    return request.builtins.block is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_with_an_implied_block_mask_traces_its_mask_mod(dtype: torch.dtype) -> None:
    bm = create_block_mask(causal, None, None, 200, 136, device="cpu", BLOCK_SIZE=64)
    q, k, v = qkv(1, 2, 200, 136, 16, dtype, seed=4)
    assert not block_mapped(q, k, bm)
    assert set(nf.attention_inputs(q, k, v, block_mask=bm)) == {"q", "k", "v", "scale"}  # no tables
    program = nf.attention_program(q, k, v, block_mask=bm)
    assert program.fingerprint() == nf.attention_program(q, k, v, mask_mod=causal).fingerprint()
    out = nf.attention(q, k, v, block_mask=bm)
    assert torch.equal(out, nf.attention(q, k, v, mask_mod=causal))
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), flex_reference(q, k, v, create_mask(causal, 1, 2, 200, 136)),
                               atol=tol, rtol=tol)


def test_attention_with_tables_the_mask_mod_does_not_imply_stays_block_mapped() -> None:
    q, k, v = qkv(2, 2, 200, 136, 16, seed=5)
    edited = with_full_block(create_block_mask(causal, None, None, 200, 136, device="cpu", BLOCK_SIZE=64), 0, 1)
    per_head = create_block_mask(by_head, None, None, 200, 136, device="cpu", BLOCK_SIZE=64)  # the tables of head 0
    noop = kv_blocks_mask(1, 1, 4, 5, (64, 32), (200, 136), None, seed=6)
    for bm in (edited, per_head, noop):
        assert block_mapped(q, k, bm)
        torch.testing.assert_close(nf.attention(q, k, v, block_mask=bm),
                                   flex_reference(q, k, v, expected_keep(bm, 2, 2, 200, 136)), atol=1e-4, rtol=1e-4)


def test_the_verdict_is_kept_per_block_mask_and_what_its_mask_mod_reads() -> None:
    import neptune_fusion.integrations.blockmask as blockmask

    doc = torch.arange(128) // 48

    def same_doc(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc[q_idx] == doc[kv_idx]

    bm = create_block_mask(same_doc, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    q, k, v = qkv(1, 2, 128, 128, 16, seed=7)
    calls = []
    check = blockmask.implied_by_mask_mod
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("neptune_fusion.integrations.attention.implied_by_mask_mod",
                   lambda *args: calls.append(1) or check(*args))
        assert not block_mapped(q, k, bm) and not block_mapped(q, k, bm) and len(calls) == 1
        doc[40:] = 0  # one document now: the lists (made for three) skip blocks mask_mod keeps
        assert block_mapped(q, k, bm) and len(calls) == 2
    torch.testing.assert_close(nf.attention(q, k, v, block_mask=bm),
                               flex_reference(q, k, v, expected_keep(bm, 1, 2, 128, 128)), atol=1e-4, rtol=1e-4)
