"""Software pipelining of tile loops (tile/pipeline.py): the first dot issued one tile ahead.

The transform works on the tile IR, so it is checked the way the transforms are: kernels with and
without it against torch on random inputs (dense, masked, block-mapped, split-K; lengths that are
not multiples of the tiles), and on the tile IR itself (which loops it rewrites, which tiles run).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.library import attention, causal_attention, softmax  # noqa: E402
from neptune_fusion.tile.inspect import loop_ranges  # noqa: E402
from neptune_fusion.tile.ir import Assign, If, Loop, Op, TileKernel, TVal  # noqa: E402
from neptune_fusion.tile.pipeline import prefetch_first_dot  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _torch_attention(q, k, v, scale, visible=None):
    s = q.double() @ k.double().mT * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1) @ v.double()).nan_to_num(0.0)


def _executable(fn, *args, **kwargs):
    named = dict(fn.program_def.bind(*args, **kwargs))
    return fn.executable_for(fn.program_def.trace(**named), named)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("program, lq, lk", [(attention, 77, 200), (causal_attention, 130, 130), (attention, 16, 16)])
def test_prefetched_kernels_match_torch(dtype, program, lq, lk):
    g = torch.Generator().manual_seed(lq + lk)
    q = torch.randn(1, 2, lq, 32, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, lk, 32, generator=g).to(dtype) for _ in range(2))
    fn = nf.compile(program, schedule=nf.flash(block_q=32, block_k=32, prefetch_dot=True))
    out = fn(q, k, v, scale=0.2)
    visible = None
    if program is causal_attention:
        visible = torch.arange(lq)[:, None] >= torch.arange(lk)[None, :]
    expected = _torch_attention(q, k, v, 0.2, visible)
    assert ((out.double() - expected).norm() / expected.norm()).item() < TOL[dtype]
    source = _executable(fn, q, k, v, scale=0.2).main.source
    assert "issued one iteration ahead" in source and "if nonempty" in source


@pytest.mark.parametrize("mask", ["window", "document", "prefix"])
def test_prefetched_masked_and_block_mapped_attention(mask):
    n = 150
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    doc = torch.sort(torch.randint(0, 5, (n,), generator=g)).values

    def mask_mod(b, h, q_idx, kv_idx):
        if mask == "window":
            return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)
        if mask == "document":
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return (kv_idx < 20) | (q_idx >= kv_idx)

    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = mask_mod(0, 0, i, j)
    schedule = nf.flash(block_q=32, block_k=16, prefetch_dot=True)
    out = nf.attention(q, k, v, mask_mod=mask_mod, scale=0.3, schedule=schedule)
    expected = _torch_attention(q, k, v, 0.3, visible)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-5


def test_prefetched_split_k_decode():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = (torch.randn(1, 4, 333, 16, generator=g) for _ in range(2))
    fn = nf.compile(attention, schedule=nf.split_k(splits=5, block_k=16, prefetch_dot=True))
    expected = _torch_attention(q, k, v, 0.2)
    assert ((fn(q, k, v, scale=0.2).double() - expected).norm() / expected.norm()).item() < 1e-5


def test_prefetching_visits_the_same_tiles():
    """Prologue + pipelined loop + peeled last iteration cover exactly the original loop's tiles."""
    n = 200
    q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
    plain = _executable(nf.compile(causal_attention, schedule=nf.flash(block_q=32, block_k=16)), q, k, v, scale=0.1)
    piped = _executable(nf.compile(causal_attention, schedule=nf.flash(block_q=32, block_k=16, prefetch_dot=True)),
                        q, k, v, scale=0.1)
    for pid in range(math.ceil(n / 32)):
        sizes = {"q": n, "k": n, "b": 1, "h": 1}
        before = [(a, b) for a, b, _ in loop_ranges(plain.main.tile, (pid, 0, 0), sizes) if b > a]
        after = [(a, b) for a, b, _ in loop_ranges(piped.main.tile, (pid, 0, 0), sizes) if b > a]
        assert before == after


def test_softmax_has_no_dot_and_is_left_alone():
    x = torch.randn(4, 100)
    fn = nf.compile(softmax, schedule=nf.flash(block_q=16, block_k=32, prefetch_dot=True))
    torch.testing.assert_close(fn(x), torch.softmax(x, -1))
    assert "issued one iteration ahead" not in _executable(fn, x).main.source


def _kernel(body: list) -> TileKernel:
    return TileKernel("k", [], ("r", "c"), {"r": "BR", "c": "BC"}, ["1"], body, 4, 1, {"BR": 16, "BC": 16})


def test_a_dot_reading_carried_state_is_not_moved():
    i32, tile = (lambda n: TVal(n, (), "i32")), (lambda n: TVal(n, ("r", "c"), "f32"))
    var, acc = i32("j"), tile("acc")
    body = [Op(tile("x"), "load", (var,), {"buffer": "x"}), Op(tile("d"), "dot", (acc, tile("x")), {"k": "c"}),
            Assign(acc, tile("d"))]
    kernel = _kernel([Loop(var, i32("lo"), i32("hi"), "BC", body)])
    assert prefetch_first_dot(kernel) is kernel


def test_a_loop_whose_rest_rereads_the_tile_is_not_moved():
    i32, tile = (lambda n: TVal(n, (), "i32")), (lambda n: TVal(n, ("r", "c"), "f32"))
    var, acc = i32("j"), tile("acc")
    body = [Op(tile("x"), "load", (var,), {"buffer": "x"}), Op(tile("d"), "dot", (tile("q"), tile("x")), {"k": "c"}),
            Op(tile("e"), "binary", (tile("d"), tile("x")), {"op": "add"}), Assign(acc, tile("e"))]
    kernel = _kernel([Loop(var, i32("lo"), i32("hi"), "BC", body)])
    assert prefetch_first_dot(kernel) is kernel
    moved = prefetch_first_dot(_kernel([Loop(var, i32("lo"), i32("hi"), "BC", body[:2] + [Assign(acc, tile("d"))])]))
    assert isinstance(moved.body[1], If) and any(isinstance(s, Loop) and s.peeled for s in moved.body[1].body)


def test_prefetched_loads_are_kept_a_stage_longer():
    from neptune_fusion.tile.resources import shared_memory_estimate

    i32, tile = (lambda n: TVal(n, (), "i32")), (lambda n: TVal(n, ("r", "c"), "f16"))
    var, acc = i32("j"), TVal("acc", ("r", "c"), "f32")
    body = [Op(tile("x"), "load", (var,), {"buffer": "x"}), Op(tile("y"), "load", (var,), {"buffer": "y"}),
            Op(TVal("s", ("r", "c"), "f32"), "dot", (tile("q"), tile("x")), {"k": "c"}),
            Op(TVal("e", ("r", "c"), "f32"), "dot", (TVal("s", ("r", "c"), "f32"), tile("y"), acc), {"k": "c"}),
            Assign(acc, TVal("e", ("r", "c"), "f32"))]
    kernel = _kernel([Loop(var, i32("lo"), i32("hi"), "BC", body)])
    kernel.num_stages = 3
    tile_bytes = 16 * 16 * 2
    assert shared_memory_estimate(prefetch_first_dot(kernel)) - shared_memory_estimate(kernel) == tile_bytes


@pytest.mark.parametrize("n", [150, 40])
def test_block_map_loops_read_the_next_tile_index_ahead(n):
    """Block-mapped kernels with each listed tile's index read one iteration early (no peeled
    iteration: the last one re-reads its own index) agree with torch, also for rows with no tile."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    doc = torch.sort(torch.randint(0, 6, (n,), generator=g)).values
    doc[: n // 3] = -1  # padding: rows that see nothing

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (doc[q_idx] >= 0)

    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    expected = _torch_attention(q, k, v, 0.3, document(0, 0, i, j))
    schedule = nf.flash(block_q=16, block_k=16)
    out = nf.attention(q, k, v, mask_mod=document, scale=0.3, schedule=schedule)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-5
    source = nf.explain_attention(q, k, v, mask_mod=document, scale=0.3, schedule=schedule)
    assert "next tile's index) is read ahead" in source and "# last iteration" not in source



def test_explain_shows_every_kernel_of_the_derived_backward(randn):
    """A later backward kernel reads an earlier one's result (the row statistic D): explain stands
    in for it too, and each kernel is explained."""
    q, k, v = (randn(1, 2, 48, 16) for _ in range(3))
    text = nf.explain(attention, q, k, v, 0.25, backward=True)
    assert text.count("=== backward kernel") == 3 and "grad_sum0_part" in text
