"""Split-K (FlashDecoding) and GQA packing: kernels under the interpreter and translation validation."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.library import causal_attention  # noqa: E402
from neptune_fusion.runtime.compiled import Compiled  # noqa: E402
from neptune_fusion.schedule.pipeline import combine_program, fuse  # noqa: E402
from neptune_fusion.transform.layout import group_divisor, pack_groups  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def decode_program(kind: str = "plain"):
    @nf.program
    def attention(q, k, v, slopes, scale):
        group = q.shape[1] // k.shape[1]
        k = nf.repeat_interleave(k, group, 1)
        v = nf.repeat_interleave(v, group, 1)
        s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
        if kind == "bias":
            s = s + slopes[:, None, None] * (nf.index(s, -1) - nf.index(s, -2))
        if kind == "softcap":
            s = 30 * nf.tanh(s / 30)
        p = nf.exp(s - s.max(axis=-1, keepdims=True))
        return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    return attention


def torch_decode(q, k, v, slopes, scale, kind):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k) * scale
    if kind == "bias":
        rel = torch.arange(k.shape[2])[None, :] - torch.arange(q.shape[2])[:, None]
        s = s + slopes.double()[:, None, None] * rel
    if kind == "softcap":
        s = 30 * torch.tanh(s / 30)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)


def _inputs(hq, hkv, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, lk, d, generator=g).to(dtype)
    slopes = torch.rand(hq, generator=g) * 0.1
    return q, k, v, slopes


def _rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ratio", [1, 2, 4, 8])
def test_decode_gqa_ratios(dtype, ratio):
    q, k, v, slopes = _inputs(8, 8 // ratio, 1, 300, 16, dtype, seed=ratio)
    fn = nf.compile(decode_program(), schedule=nf.split_k(splits=4))
    out = fn(q, k, v, slopes, 0.25)
    assert _rel(out, torch_decode(q, k, v, slopes, 0.25, "plain")) < TOL[dtype]


@pytest.mark.parametrize("lq", [2, 5, 8])
def test_speculative_decoding_query_lengths(lq):
    q, k, v, slopes = _inputs(4, 2, lq, 157, 16, torch.float32, seed=lq)
    fn = nf.compile(decode_program(), schedule=nf.split_k(splits=3))
    assert _rel(fn(q, k, v, slopes, 0.3), torch_decode(q, k, v, slopes, 0.3, "plain")) < 2e-5


@pytest.mark.parametrize("kind", ["bias", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_score_modifications(kind, dtype):
    q, k, v, slopes = _inputs(4, 2, 1, 211, 32, dtype, seed=7)
    if kind == "softcap":
        q = q * 4
    fn = nf.compile(decode_program(kind), schedule=nf.split_k(splits=5, block_k=32))
    assert _rel(fn(q, k, v, slopes, 0.2), torch_decode(q, k, v, slopes, 0.2, kind)) < TOL[dtype]


def test_auto_picks_split_k_for_decode_and_packs_groups():
    q, k, v, slopes = _inputs(8, 2, 1, 1024, 16, torch.float32)
    fn = nf.compile(decode_program())
    named = dict(fn.program_def.bind(q, k, v, slopes, 0.2))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    assert exe.plan.splits > 1
    assert exe.combine_tile is not None
    # the combine is its own launch
    assert exe.combine is not None and "tl.atomic_add" not in exe.main.source
    assert any("pack the 4 query heads" in s.name for s in exe.steps)
    # K and V are read with the kv-head index only: one program serves all heads of a group
    assert "h_kv, k, d]" in nf.explain(fn, q, k, v, slopes, 0.2)
    assert _rel(fn(q, k, v, slopes, 0.2), torch_decode(q, k, v, slopes, 0.2, "plain")) < 2e-5


def test_partial_state_scratch_is_reused_across_calls():
    q, k, v, slopes = _inputs(4, 4, 1, 200, 16, torch.float32)
    fn = nf.compile(decode_program(), schedule=nf.split_k(splits=4))
    fn(q, k, v, slopes, 0.2)
    scratch = [t.data_ptr() for d in fn._scratch.values() for t in d.values()]
    fn(q, k, v, slopes, 0.2)
    assert [t.data_ptr() for d in fn._scratch.values() for t in d.values()] == scratch
    assert len(fn._scratch) == 1


def test_pack_groups_translation_validation():
    q, k, v, slopes = _inputs(8, 2, 3, 40, 16, torch.float32)
    prog = decode_program("bias").trace(q, k, v, slopes, 0.2)
    fused = fuse(prog)[-1].program
    assert group_divisor(fused, "h", "k") == 4
    packed = pack_groups(fused, "h", "q", 4)
    args = {"q": q, "k": k, "v": v, "slopes": slopes, "scale": 0.2}
    torch.testing.assert_close(nf.run_reference(packed, args), nf.run_reference(prog, args), rtol=1e-5, atol=1e-6)


def test_combine_comes_from_the_algebra():
    """A program no code names: a 2-norm scaled by the running largest magnitude."""

    @nf.program
    def stable_norm(x):
        m = abs(x).max(axis=-1, keepdims=True)
        return (m * nf.sqrt(((x / m) ** 2).sum(axis=-1, keepdims=True)))[..., 0]

    x = torch.randn(6, 700, generator=torch.Generator().manual_seed(3)) * 1e3
    fused = fuse(stable_norm.trace(x), splits=5)[-1].program
    combine = combine_program(fused)
    args = {"x": x}
    torch.testing.assert_close(nf.run_reference(fused, args), x.norm(dim=-1), rtol=1e-5, atol=1e-3)
    out = nf.compile(stable_norm, schedule=nf.split_k(splits=5))(x)
    torch.testing.assert_close(out, x.norm(dim=-1), rtol=1e-5, atol=1e-3)
    assert combine.stages[0].reduce_op == "max"


@pytest.mark.parametrize("cols", [1000, 4099])
def test_split_k_softmax_and_logsumexp_over_a_long_row(cols):
    @nf.program
    def softmax(x):
        e = nf.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    @nf.program
    def logsumexp(x):
        m = x.max(axis=-1, keepdims=True)
        return (m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]

    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(cols)) * 5
    sm = nf.compile(softmax, schedule=nf.split_k(splits=6))
    lse = nf.compile(logsumexp, schedule=nf.split_k(splits=6))
    torch.testing.assert_close(sm(x), torch.softmax(x, -1), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(lse(x), torch.logsumexp(x, -1), rtol=1e-5, atol=1e-5)


def test_explain_shows_chunks_and_combine():
    q, k, v, slopes = _inputs(4, 4, 1, 128, 16, torch.float16)
    text = nf.explain(decode_program(), q, k, v, slopes, 0.2, schedule=nf.split_k(splits=4))
    for needle in ("split_k loop over k in 4 chunks", "combine program (generated from the repair functions)",
                   "max[split](part_max0", "exp(part_max0"):
        assert needle in text, needle


def test_bad_split_counts():
    with pytest.raises(ValueError, match="splits"):
        nf.split_k(splits=0)
    assert isinstance(nf.compile(decode_program()), Compiled)


def test_combine_tiles_that_loop_over_splits(monkeypatch):
    """A combine tile too small for all splits at once loops over them (row blocks of one row) and
    agrees with torch."""
    from neptune_fusion.runtime import compiled

    monkeypatch.setattr(compiled, "COMBINE_TILE_ELEMENTS", 64)
    q, k, v, slopes = _inputs(8, 2, 3, 300, 16, torch.float32, seed=7)
    fn = nf.compile(decode_program(), schedule=nf.split_k(splits=9, block_k=16))
    expected = torch_decode(q, k, v, slopes, 0.2, "plain")
    assert _rel(fn(q, k, v, slopes, 0.2), expected) < 2e-5
    named = dict(fn.program_def.bind(q, k, v, slopes, 0.2))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    assert exe.combine_tile.constexprs["BLOCK_C"] < 16  # fewer than all (16, rounded) splits per tile


def test_combine_tile_sizes():
    from neptune_fusion.runtime.compiled import _combine_tiles
    from neptune_fusion.schedule.auto import Plan

    # every split at once, rows shrunk to keep the tile in registers
    assert _combine_tiles(Plan(16, 64, 4, 2, 64), 8, {"e": 128}) == (1, 64, 1)
    assert _combine_tiles(Plan(16, 64, 4, 2, 17), 1, {"e": 128}) == (1, 32, 1)
    assert _combine_tiles(Plan(16, 64, 4, 2, 4), 16, {"e": 64}) == (16, 4, 1)


def test_separate_combine_uses_programmatic_dependent_launch_on_hopper(monkeypatch):
    """For a GPU target the main kernel lets the combine launch early, and the combine waits for the
    main kernel's writes before its first instruction; never under the interpreter."""
    from neptune_fusion.runtime import compiled

    q, k, v, slopes = _inputs(4, 2, 1, 4096, 64, torch.float16)
    fn = nf.compile(decode_program(), schedule=nf.split_k(splits=8))
    named = dict(fn.program_def.bind(q, k, v, slopes, 0.2))
    program = fn.program_def.trace(**named)
    interpreted = fn.executable_for(program, named)
    assert "gdc_" not in interpreted.main.source + interpreted.combine.source
    # the CUDA target, compiled on this machine without loading the kernels
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the switches the compile reads (runtime/options.py)
    monkeypatch.setattr(compiled, "_check_tensors", lambda p, a, i: torch.device("cuda"))
    monkeypatch.setattr(compiled, "_load_kernel", lambda source, name, directory: None)
    monkeypatch.setattr(compiled, "_num_sms", lambda device: 132)
    monkeypatch.setattr(compiled, "_tma_buffers", lambda *args: frozenset())
    monkeypatch.setattr(compiled, "_supports_dependent_launch", lambda device: True)
    exe = nf.compile(decode_program(), schedule=nf.split_k(splits=8)).executable_for(program, named)
    main_body = exe.main.source.split(f"def {exe.main.tile.name}(")[1]
    combine_body = exe.combine.source.split(f"def {exe.combine.tile.name}(")[1]
    assert "tl.extra.cuda.gdc_launch_dependents()" in main_body
    first_statement = next(line.strip() for line in combine_body.split("):", 1)[1].splitlines()
                           if line.strip() and not line.strip().startswith("#"))
    assert first_statement == "tl.extra.cuda.gdc_wait()"


@nf.program
def min_normalised_by_a_clamped_square_of_the_max(x):
    m = x.max(axis=-1, keepdims=True)
    return (x / nf.maximum(m * m, m * 0 + 1.0)).min(axis=-1)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=4, block_k=16)])
def test_split_k_merge_whose_finiteness_sympy_cannot_decide(schedule):
    """The merge asks whether the repair stays finite from a chunk's -inf max: SymPy cannot take that
    limit of a Max (a regression: NotImplementedError); the merge stands in a finite value instead."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    out = nf.compile(min_normalised_by_a_clamped_square_of_the_max, schedule=schedule)(x)
    torch.testing.assert_close(out, (x / torch.clamp(x.amax(-1, keepdim=True) ** 2, min=1.0)).amin(-1))


def test_split_k_choice_fills_the_device_and_deepens_the_pipeline_when_it_fits():
    """The plan rules measured on the H200 (bench/results/run33, run34): few programs get short
    chunks until every multiprocessor has one; at most two programs per multiprocessor get a third
    stage unless three stages of two programs would not fit in shared memory."""
    from neptune_fusion.schedule.auto import choose
    from neptune_fusion.schedule.templates import Auto

    def plan(hq: int, hkv: int, seq: int, d: int = 128):
        return choose(Auto(), rows=hq // hkv, cols=seq, batch=hkv,
                      full_sizes={"d": d, "e": d}, dtype="f16", num_sms=132, interpreter=False)

    gqa_1k = plan(64, 8, 1024)
    assert (gqa_1k.splits, gqa_1k.num_stages, gqa_1k.block_col) == (16, 3, 64)  # 8 programs x 16 splits
    mha_16k = plan(32, 32, 16384)
    assert (mha_16k.splits, mha_16k.num_stages) == (16, 2)  # 512 programs: four per multiprocessor
    head_256 = plan(16, 16, 9001, d=256)
    assert head_256.num_stages == 2  # 3 stages x 64 KB x 2 programs do not fit
    assert plan(64, 8, 32768).num_stages == 3


@pytest.mark.parametrize("failure", ["shared memory", "assembler"])
def test_a_kernel_too_large_for_shared_memory_is_planned_again_smaller(monkeypatch, failure):
    """Triton compiles at the first launch; a kernel that needs more shared memory than the device
    has, or that ptxas fails on, gets the same program with fewer pipeline stages (a warning says
    so), and the right result."""
    from triton.runtime.errors import OutOfResources, PTXASError

    from neptune_fusion.runtime import compiled as compiled_module

    real = compiled_module._FastLaunch._first
    tried = []

    def first(self, slots):
        tried.append(self.stages)
        if self.stages > 1:
            if failure == "assembler":
                raise PTXASError("PTXAS error: `ptxas` failed with error code -11")
            raise OutOfResources(262144, 232448, "shared memory")
        return real(self, slots)

    monkeypatch.setattr(compiled_module._FastLaunch, "_first", first)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    fn = nf.compile(causal_attention, schedule=nf.flash(block_q=16, block_k=16, num_stages=3))
    match = "does not fit the device" if failure == "shared memory" else "fails in the device's assembler"
    with pytest.warns(UserWarning, match=match):
        out = fn(q, k, v, 0.25)
    want = torch.softmax((q @ k.transpose(-1, -2) * 0.25).masked_fill(
        torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert tried[:3] == [3, 2, 1]
    torch.testing.assert_close(fn(q, k, v, 0.25), want, atol=2e-5, rtol=2e-5)  # the smaller plan is kept
