"""Context parallelism (issue 14): 2 and 4 gloo processes on the CPU, kernels under the interpreter.

Each case shards full tensors (the same seeded ones on every rank), runs
`nf.context_parallel_attention`, gathers the output and compares it on rank 0 with
single-process `nf.attention` on the full tensors. The worker processes of a world start once
per module (imports and the process group are the slow part) and run the cases sent to them;
each rank reports what its case returned, or its traceback.
"""

from __future__ import annotations

import doctest
import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import neptune_fusion as nf
from neptune_fusion.integrations import context_parallel as cp
from neptune_fusion.integrations import context_parallel_comm, context_parallel_merge, context_parallel_plan
from neptune_fusion.integrations.context_parallel_merge import Merge, Partial
from neptune_fusion.integrations.context_parallel_plan import (
    Shapes,
    chunk_bounds,
    chunk_count,
    estimate,
    listed_pairs,
    machine_for,
    pair_work,
    shard_ranges,
)
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.schedule.pipeline import fuse

TOL = {"rtol": 1e-5, "atol": 1e-5}


# --------------------------------------------------------------------------- mods (global positions)


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def strictly_before(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx < q_idx  # query 0 sees no key at all


def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 9)


def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (kv_idx < 11) | (q_idx >= kv_idx)


def document_causal(doc: torch.Tensor) -> Callable[..., Any]:
    def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    return mask


def alibi(slopes: torch.Tensor) -> Callable[..., Any]:
    def score(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return s + slopes[h] * (kv_idx - q_idx)

    return score


def documents(length: int) -> torch.Tensor:
    sizes = [length // 3, length // 5, length // 4]
    sizes.append(length - sum(sizes))
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def full_inputs(lq: int, lk: int, hq: int, hkv: int, d: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, lq, d, generator=gen), torch.randn(1, hkv, lk, d, generator=gen),
            torch.randn(1, hkv, lk, d, generator=gen))


def mods(mask: str, score: str | None, lq: int, lk: int, hq: int) -> dict[str, Any]:
    """The keyword arguments of a case's mask and score (the same on every rank)."""
    kw: dict[str, Any] = {}
    if mask in ("causal", "strict", "window", "prefix"):
        kw["mask_mod"] = {"causal": causal, "strict": strictly_before, "window": window, "prefix": prefix_lm}[mask]
    elif mask in ("document", "block_document"):
        fn = document_causal(documents(max(lq, lk)))
        if mask == "document":
            kw["mask_mod"] = fn
        else:
            from torch.nn.attention.flex_attention import create_block_mask

            kw["block_mask"] = create_block_mask(fn, None, None, lq, lk, device="cpu", BLOCK_SIZE=16)
    if score == "alibi":
        kw["score_mod"] = alibi(torch.exp2(-torch.arange(1.0, hq + 1)))
    return kw


# --------------------------------------------------------------------------- cases (run on every rank)


def case_compare(rank: int, world: int, *, mask: str = "causal", score: str | None = None, lq: int = 64,
                 lk: int | None = None, hq: int = 2, hkv: int = 2, load_balance: str | None = "zigzag",
                 strategy: str | None = "ring", nan_at: int | None = None) -> dict[str, Any]:
    lk = lq if lk is None else lk
    q, k, v = full_inputs(lq, lk, hq, hkv)
    if nan_at is not None:
        k[0, 0, nan_at, 3] = float("nan")
    kw = mods(mask, score, lq, lk, hq)
    gqa = hq != hkv
    shards = [nf.context_parallel_shard(t, load_balance=load_balance) for t in (q, k, v)]
    before = cp.kernel_calls
    out = nf.context_parallel_attention(*shards, enable_gqa=gqa, load_balance=load_balance, strategy=strategy, **kw)
    calls = cp.kernel_calls - before
    assert out.shape == (*shards[0].shape[:3], v.shape[3]) and out.dtype == q.dtype
    full = nf.context_parallel_gather(out, load_balance=load_balance)
    err = None
    if rank == 0:
        ref = nf.attention(q, k, v, enable_gqa=gqa, **kw)
        torch.testing.assert_close(full, ref, equal_nan=True, **TOL)
        err = (full - ref).abs().nan_to_num(0.0).max().item()
        if nan_at is not None:
            assert bool(ref.isnan().any()), "the case meant to check NaN rows has none"
    return {"calls": calls, "strategy": cp.last_strategy, "err": err}


def case_grad(rank: int, world: int, *, mask: str = "causal", score: str | None = None, lq: int = 48,
              lk: int | None = None, hq: int = 2, hkv: int = 2, load_balance: str | None = "zigzag",
              strategy: str | None = "ring") -> float | None:
    """Gradients of q, k and v through the ring: each rank's shards get what single-process
    `nf.attention` gives the same positions (its own derived backward, checked in test_grad.py)."""
    lk = lq if lk is None else lk
    q, k, v = full_inputs(lq, lk, hq, hkv)
    seed = torch.randn(1, hq, lq, v.shape[3], generator=torch.Generator().manual_seed(7))
    kw = mods(mask, score, lq, lk, hq)
    gqa = hq != hkv
    shards = [nf.context_parallel_shard(t, load_balance=load_balance).requires_grad_() for t in (q, k, v)]
    out = nf.context_parallel_attention(*shards, enable_gqa=gqa, load_balance=load_balance, strategy=strategy, **kw)
    out.backward(nf.context_parallel_shard(seed, load_balance=load_balance))
    grads = [nf.context_parallel_gather(t.grad, load_balance=load_balance) for t in shards]
    if rank != 0:
        return None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(nf.attention(*leaves, enable_gqa=gqa, **kw), leaves, seed)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    return max((g - w).abs().max().item() for g, w in zip(grads, want))


def case_round_trip(rank: int, world: int) -> int:
    checked = 0
    for shape, dim in (((2, 3, 17, 4), 2), ((5, 7), 0), ((3, 2 * world - 1, 2), -2), ((1, 1, 2, 3), 2)):
        x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
        for lb in ("zigzag", None):
            local = nf.context_parallel_shard(x, seq_dim=dim, load_balance=lb)
            ranges = shard_ranges(x.shape[dim], world, rank, lb)
            expected = torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
            assert torch.equal(local, expected) and local.is_contiguous()
            assert torch.equal(nf.context_parallel_gather(local, seq_dim=dim, load_balance=lb), x)
            checked += 1
    return checked


def _raised(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the case reports what was raised
        return type(exc).__name__, str(exc)
    return "nothing", ""


def case_errors(rank: int, world: int) -> dict[str, tuple[str, str]]:
    q, k, v = full_inputs(8 * world, 8 * world, 2, 2)
    ql, kl, vl = (nf.context_parallel_shard(t) for t in (q, k, v))
    attn = nf.context_parallel_attention
    out = {
        "heads": _raised(lambda: attn(ql, kl[:, :1], vl[:, :1])),
        "load_balance": _raised(lambda: attn(ql, kl, vl, load_balance="striped")),
        "strategy": _raised(lambda: attn(ql, kl, vl, strategy="fast")),
        "group": _raised(lambda: attn(ql, kl, vl, group="world")),
        "seq_dim": _raised(lambda: nf.context_parallel_shard(q, seq_dim=4)),
        "seq_dim_type": _raised(lambda: nf.context_parallel_gather(ql, seq_dim="2")),
        "both_masks": _raised(lambda: attn(ql, kl, vl, block_mask=object(), mask_mod=causal)),
        "grad_captured": _raised(lambda: attn(ql, kl, vl, score_mod=alibi(torch.ones(2, requires_grad=True)))),
        # the ranks pass shapes that do not fit together: every rank raises, none hangs
        "head_dim": _raised(lambda: attn(ql[..., :16 - 8 * rank], kl[..., :16 - 8 * rank], vl)),
        "lengths": _raised(lambda: attn(q[:, :, :3 + 6 * rank], k[:, :, :3 + 6 * rank], v[:, :, :3 + 6 * rank])),
        "load_balance_ranks": _raised(lambda: attn(ql, kl, vl, load_balance=None if rank else "zigzag")),
        "gather_shapes": _raised(lambda: nf.context_parallel_gather(ql[:, :2 - rank])),
    }
    from torch.nn.attention.flex_attention import create_block_mask

    local_mask = create_block_mask(causal, None, None, ql.shape[2], kl.shape[2], device="cpu", BLOCK_SIZE=8)
    out["block_mask_lengths"] = _raised(lambda: attn(ql, kl, vl, block_mask=local_mask))
    with torch.no_grad():  # forward-only use of tensors that require grad is fine
        ok = attn(ql.clone().requires_grad_(), kl, vl, mask_mod=causal, strategy="all_gather")
    out["no_grad"] = ("nothing", str(tuple(ok.shape)))
    return out


def case_subgroup(rank: int, world: int) -> float | None:
    """Ranks 1 and 3 of 4 form the group: its ring neighbours are found by their global ranks."""
    group = dist.new_group([1, 3])  # collective over the world: every rank makes it
    if rank not in (1, 3):
        return None
    q, k, v = full_inputs(50, 50, 2, 2)
    shards = [nf.context_parallel_shard(t, group=group) for t in (q, k, v)]
    out = nf.context_parallel_attention(*shards, mask_mod=causal, group=group, strategy="ring")
    full = nf.context_parallel_gather(out, group=group)
    ref = nf.attention(q, k, v, mask_mod=causal)
    torch.testing.assert_close(full, ref, **TOL)
    return (full - ref).abs().max().item()


CASES: dict[str, Callable[..., Any]] = {"compare": case_compare, "grad": case_grad, "round_trip": case_round_trip,
                                        "errors": case_errors, "subgroup": case_subgroup}


# --------------------------------------------------------------------------- the worker processes


def _worker(rank: int, size: int, store: str, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)  # 2 or 4 processes share CI's 2 cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=90))
    while (task := tasks.get()) is not None:
        name, kwargs = task
        try:
            results.put((rank, "ok", CASES[name](rank, size, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class World:
    """`size` gloo processes that run cases on request."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.broken = False
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        store = os.path.join(tempfile.mkdtemp(prefix="nf_cp_"), "store")
        self.procs = [ctx.Process(target=_worker, args=(r, size, store, self.tasks[r], self.results), daemon=True)
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def run(self, case: str, **kwargs: Any) -> list[Any]:
        for queue in self.tasks:
            queue.put((case, kwargs))
        got: dict[int, tuple[str, Any]] = {}
        try:
            while len(got) < self.size:
                rank, status, value = self.results.get(timeout=240)
                got[rank] = (status, value)
        except Exception:
            self.broken = True
            raise
        errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
        if errors:
            self.broken = True  # a rank may still wait in a collective: the next test gets a fresh world
            pytest.fail("\n".join(errors))
        return [got[r][1] for r in range(self.size)]

    def close(self) -> None:
        for queue in self.tasks:
            queue.put(None)
        for p in self.procs:
            p.join(timeout=20 if not self.broken else 1)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def worlds() -> Any:
    live: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in live or live[size].broken:
            if size in live:
                live[size].close()
            live[size] = World(size)
        return live[size]

    yield get
    for w in live.values():
        w.close()


# --------------------------------------------------------------------------- against nf.attention, 2 ranks


@pytest.mark.parametrize("kw", [
    {"mask": "causal"},
    {"mask": "causal", "lq": 61, "load_balance": None},
    {"mask": "document", "lq": 77},
    {"mask": "causal", "score": "alibi", "lq": 66},
    {"mask": "causal", "hq": 2, "hkv": 1, "lq": 57},
    {"mask": "block_document", "lq": 70},
    {"mask": "strict", "lq": 45},
    {"mask": "window", "lq": 64, "load_balance": None},
    {"mask": "none", "lq": 40, "lk": 53},
    {"mask": "causal", "lq": 48, "nan_at": 30},
], ids=["causal", "causal-contiguous-odd", "document-odd", "alibi", "gqa-odd", "blockmask-document",
        "row-without-keys", "window-contiguous", "cross-lengths", "nan"])
def test_ring_matches_single_process(worlds: Any, kw: dict[str, Any]) -> None:
    results = worlds(2).run("compare", strategy="ring", **kw)
    assert all(r["strategy"] == "ring" for r in results)
    assert results[0]["err"] is not None


@pytest.mark.parametrize("kw", [
    {"mask": "document", "lq": 75},
    {"mask": "causal", "score": "alibi", "hq": 2, "hkv": 1, "lq": 50, "load_balance": None},
    {"mask": "causal", "lq": 48, "nan_at": 7},
], ids=["document-odd", "alibi-gqa-contiguous", "nan"])
def test_all_gather_matches_single_process(worlds: Any, kw: dict[str, Any]) -> None:
    results = worlds(2).run("compare", strategy="all_gather", **kw)
    assert all(r["strategy"] == "all_gather" for r in results)
    per_rank = 2 if kw.get("load_balance", "zigzag") else 1  # one call per local query chunk
    assert [r["calls"] for r in results] == [per_rank, per_rank]


@pytest.mark.parametrize("kw", [
    {"mask": "causal"},
    {"mask": "document", "lq": 45, "strategy": "all_gather"},
    {"mask": "causal", "score": "alibi", "hq": 2, "hkv": 1, "lq": 37, "load_balance": None},
    {"mask": "strict", "lq": 32},
    {"mask": "none", "lq": 24, "lk": 35},
], ids=["causal", "document-all-gather", "alibi-gqa-contiguous-odd", "row-without-keys", "cross-lengths"])
def test_gradients_through_the_ring_match_single_process(worlds: Any, kw: dict[str, Any]) -> None:
    assert worlds(2).run("grad", **kw)[0] is not None


def test_gradients_through_a_ring_of_four(worlds: Any) -> None:
    assert worlds(4).run("grad", mask="causal", lq=50)[0] is not None


def test_fully_masked_pairs_are_skipped(worlds: Any) -> None:
    # zigzag, 2 ranks, causal: of each rank's 8 (query chunk, key chunk) pairs 3 are above the diagonal
    assert [r["calls"] for r in worlds(2).run("compare", mask="causal", lq=64)] == [5, 5]
    # contiguous: rank 0 only sees its own shard, rank 1 both
    assert [r["calls"] for r in worlds(2).run("compare", mask="causal", lq=61, load_balance=None)] == [1, 2]
    # no mask: nothing to skip
    assert [r["calls"] for r in worlds(2).run("compare", mask="none", lq=32)] == [8, 8]


def test_strategy_chosen_from_the_shapes_is_the_same_on_every_rank(worlds: Any) -> None:
    results = worlds(2).run("compare", mask="causal", lq=40, strategy=None)
    # tiny shards: a transfer per step and a merge per pair cost more than gathering K/V once
    assert [r["strategy"] for r in results] == ["all_gather", "all_gather"]


def test_shard_and_gather_round_trip(worlds: Any) -> None:
    assert worlds(2).run("round_trip") == [8, 8]


def test_errors_before_and_across_ranks(worlds: Any) -> None:
    for r in worlds(2).run("errors"):
        assert r["heads"][0] == "ValueError" and "enable_gqa" in r["heads"][1]
        assert r["load_balance"][0] == "ValueError" and "'striped'" in r["load_balance"][1]
        assert r["strategy"][0] == "ValueError" and "'fast'" in r["strategy"][1]
        assert r["group"][0] == "TypeError" and "ProcessGroup" in r["group"][1]
        assert r["seq_dim"][0] == "ValueError" and "seq_dim=4" in r["seq_dim"][1]
        assert r["seq_dim_type"][0] == "TypeError"
        assert r["both_masks"][0] == "ValueError" and "not both" in r["both_masks"][1]
        assert r["grad_captured"][0] == "RuntimeError" and "captures requires grad" in r["grad_captured"][1]
        assert r["head_dim"][0] == "ValueError" and "head dim" in r["head_dim"][1]
        assert r["lengths"][0] == "ValueError" and "rank 0 holds 3 positions" in r["lengths"][1]
        assert r["load_balance_ranks"][0] == "ValueError" and "load_balance" in r["load_balance_ranks"][1]
        assert r["gather_shapes"][0] == "ValueError" and "size of dim 1: [2, 1]" in r["gather_shapes"][1]
        assert r["block_mask_lengths"][0] == "ValueError" and "block_mask" in r["block_mask_lengths"][1]
        assert r["no_grad"][0] == "nothing"


# --------------------------------------------------------------------------- 4 ranks


@pytest.mark.parametrize("kw", [
    {"mask": "causal", "lq": 101, "strategy": "ring"},
    {"mask": "document", "score": "alibi", "hq": 2, "hkv": 1, "lq": 90, "load_balance": None, "strategy": "ring"},
    {"mask": "causal", "lq": 83, "strategy": "all_gather"},
], ids=["causal-odd", "document-alibi-gqa-contiguous", "all-gather"])
def test_four_ranks(worlds: Any, kw: dict[str, Any]) -> None:
    results = worlds(4).run("compare", **kw)
    if kw == {"mask": "causal", "lq": 101, "strategy": "ring"}:
        assert [r["calls"] for r in results] == [9, 9, 9, 9]  # zigzag balances the causal work exactly


def test_subgroup(worlds: Any) -> None:
    results = worlds(4).run("subgroup")
    assert results[0] is None and results[2] is None and results[1] is not None and results[3] is not None


# --------------------------------------------------------------------------- no process group


def test_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()
    x = torch.randn(1, 1, 8, 16)
    for call in (lambda: nf.context_parallel_attention(x, x, x), lambda: nf.context_parallel_shard(x),
                 lambda: nf.context_parallel_gather(x)):
        with pytest.raises(ValueError, match="not initialised"):
            call()


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 31])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("load_balance", ["zigzag", None])
def test_layout_covers_the_sequence_once(length: int, world: int, load_balance: str | None) -> None:
    seen = sorted(i for r in range(world) for a, b in shard_ranges(length, world, r, load_balance) for i in range(a, b))
    assert seen == list(range(length))
    sizes = [b - a for a, b in chunk_bounds(length, chunk_count(world, load_balance))]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _fused(mask_mod: Any, score_mod: Any = None) -> Any:
    q = k = v = torch.zeros(1, 2, 2, 16)
    return fuse(nf.attention_program(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True))[-1].program


def _brute_counts(mask_mod: Any, q_bounds: Any, kv_bounds: Any) -> torch.Tensor:
    qi = torch.arange(q_bounds[-1][1])[:, None]
    ki = torch.arange(kv_bounds[-1][1])[None, :]
    vis = mask_mod(0, 0, qi, ki).expand(len(qi), ki.shape[1])
    return torch.tensor([[int(vis[a:b, c:d].sum()) for c, d in kv_bounds] for a, b in q_bounds])


@pytest.mark.parametrize("mask_mod", [causal, strictly_before, window, prefix_lm], ids=lambda f: f.__name__)
def test_pair_counts_are_exact_for_affine_masks(mask_mod: Any) -> None:
    q_bounds, kv_bounds = chunk_bounds(45, 6), chunk_bounds(38, 6)
    fused = _fused(mask_mod)
    work = pair_work(fused, q_bounds, kv_bounds, {"q": 45, "k": 38})
    brute = _brute_counts(mask_mod, q_bounds, kv_bounds)
    if mask_mod is prefix_lm:  # a union of two boxes: an upper bound, zero exactly where nothing is visible
        assert bool((work.counts >= brute).all()) and torch.equal(work.counts == 0, brute == 0)
    else:
        assert work.exact and torch.equal(work.counts, brute)


def test_pair_counts_bound_data_dependent_masks() -> None:
    doc = documents(40)
    mask = document_causal(doc)
    bounds = chunk_bounds(40, 4)
    work = pair_work(_fused(mask), bounds, bounds, {"q": 40, "k": 40})
    assert not work.exact
    assert bool((work.counts >= _brute_counts(mask, bounds, bounds)).all())
    assert torch.equal(work.counts, _brute_counts(causal, bounds, bounds))  # the causal conjunct alone


def test_block_lists_rule_out_pairs() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    from neptune_fusion.integrations.blockmask import block_tables

    mask = document_causal(documents(64))
    bm = create_block_mask(mask, None, None, 64, 64, device="cpu", BLOCK_SIZE=8)
    t = block_tables(bm, 1, 1, 64, 64)
    bounds = chunk_bounds(64, 8)
    listed = listed_pairs(t.partial, t.full, t.q_block, t.kv_block, bounds, bounds)
    visible = _brute_counts(mask, bounds, bounds) > 0
    assert bool((listed | ~visible).all())  # every visible pair is listed
    assert int(listed.sum()) < int(_brute_counts(causal, bounds, bounds).gt(0).sum())  # and some causal ones are not


def _shapes(length: int, world: int, heads: int, kv_heads: int, dim: int, itemsize: int) -> Shapes:
    n = chunk_count(world, "zigzag")
    return Shapes(1, heads, kv_heads, dim, dim, itemsize, world, "zigzag", chunk_bounds(length, n),
                  chunk_bounds(length, n))


def test_strategy_estimate() -> None:
    def counts(length: int, world: int) -> torch.Tensor:
        bounds = chunk_bounds(length, 2 * world)
        return pair_work(_fused(causal), bounds, bounds, {"q": length, "k": length}).counts

    small = estimate(counts(64, 2), _shapes(64, 2, 2, 2, 16, 4), machine_for("cpu", torch.float32), 1 << 62)
    assert small.choice == "all_gather"
    big = _shapes(1 << 17, 4, 32, 32, 128, 2)
    gpu = machine_for("cuda", torch.float16)
    large = estimate(counts(1 << 17, 4), big, gpu, 1 << 40)
    # 128k causal tokens on 4 GPUs: each step's compute hides the next shard's transfer; gathering
    # the whole K/V first exposes three transfers
    assert large.choice == "ring" and large.ring < large.all_gather
    assert estimate(counts(1 << 17, 4), big, gpu, 1 << 20).choice == "ring"  # a gathered K/V would not fit
    # with 8 key/value heads the shards are 4x smaller: one gather costs less than the merges
    gqa = estimate(counts(1 << 17, 4), _shapes(1 << 17, 4, 32, 8, 128, 2), gpu, 1 << 40)
    assert gqa.all_gather < large.all_gather and gqa.ring <= large.ring


# --------------------------------------------------------------------------- the merge, one process


def test_merge_of_partials_equals_attention_over_all_keys(attn_inputs: Any) -> None:
    q, k, v = attn_inputs(1, 2, 24, 40, 16)
    merge = Merge(_fused(causal))

    def shifted(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx + 16 >= kv_idx + 17

    first = Partial(*nf.attention(q, k[:, :, :17], v[:, :, :17], mask_mod=lambda b, h, qi, ki: qi + 16 >= ki,
                                  return_lse=True))
    second = Partial(*nf.attention(q, k[:, :, 17:], v[:, :, 17:], mask_mod=shifted, return_lse=True))
    merged = merge(first, second, scale=0.25)
    ref, ref_lse = nf.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi + 16 >= ki, return_lse=True)
    torch.testing.assert_close(merged.out, ref, **TOL)
    torch.testing.assert_close(merged.lse, ref_lse, **TOL)
    empty = Partial(torch.zeros_like(first.out), torch.full_like(first.lse, -torch.inf))
    again = merge(empty, first, scale=0.25)
    assert torch.equal(again.out, first.out) and torch.equal(again.lse, first.lse)
    nothing = merge(empty, empty, scale=0.25)
    assert torch.equal(nothing.out, empty.out) and bool((nothing.lse == -torch.inf).all())


def test_merge_refuses_a_wrong_reading_of_the_kernel_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    right = Merge.state

    def doubled(self: Merge, p: Partial) -> dict[str, torch.Tensor]:
        state = right(self, p)
        state[self.norm.name] = state[self.norm.name] * 2.0  # not the state the outputs stand for
        return state

    monkeypatch.setattr(Merge, "state", doubled)
    with pytest.raises(FusionError, match="reading"):
        Merge(_fused(window))


def test_docstring_examples() -> None:
    for module in (cp, context_parallel_comm, context_parallel_merge, context_parallel_plan):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_block_mask_conversion_is_kept_per_block_mask() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    tables, mask = cp._block_mask_mod(bm, 1, 2, 64, 64)
    assert cp._block_mask_mod(bm, 1, 2, 64, 64)[1] is mask  # the same mask_mod: the shifted mods are found again
    assert bool(tables.partial.any())
    bm.kv_num_blocks.add_(0)  # written in place: its lists may have changed
    assert cp._block_mask_mod(bm, 1, 2, 64, 64)[1] is not mask
