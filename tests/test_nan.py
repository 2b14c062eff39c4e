"""NaN and inf as torch computes them: max/min reductions, the running max of a rolling loop, the
split-K combine and element-wise maximum/minimum propagate NaN (torch.amax, torch.maximum), an
+inf score gives exp(inf - inf) = NaN in its row, and rows that see no key still give exactly 0
where the program says so (`where(m == -inf, 0, u / l)`).

Kernels run under the Triton interpreter against plain torch math in float32; the CUDA sources are
checked to compile, for sm_90, to NaN-propagating max instructions only (no GPU needed; the same
cases were run on an H200 with the CUDA kernels, Gluon and Triton, and agreed). Not checked:
a NaN in v at a key the mask hides. The plain program computes 0 * NaN = NaN there (eager
FlexAttention does too), but the kernels never visit fully masked key tiles (compiled FlexAttention
skips them too), so only the rows whose row tile reads that key tile see it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.codegen import triton_source  # noqa: E402
from neptune_fusion.runtime.compiled import Compiled  # noqa: E402

# the interpreter evaluates both sides of a where: 0 / 0 and inf - inf in rows the program discards
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")

NAN, INF = float("nan"), float("inf")
FLASH = nf.flash(block_q=32, block_k=32)
SPLIT = nf.split_k(splits=4)
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3)}


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True)


def qkv(lq: int, lk: int, dtype: torch.dtype = torch.float32, heads: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, d, generator=g).to(dtype) for n in (lq, lk, lk))


# --------------------------------------------------------------------------- plain programs


@nf.program
def causal_attention(q, k, v, scale):
    """Causal attention whose rows that see no key (the first 3) give 0, written with the row max."""
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1) + 3, s, -nf.inf)
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    u = nf.einsum("bhqk,bhkd->bhqd", p, v)
    return nf.where(m == -nf.inf, 0.0, u / p.sum(axis=-1, keepdims=True))


@nf.program
def padded_attention(q, k, v, scale, n):
    """Attention over the first `n` keys (a decode step's valid length), with its row max and LSE."""
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = nf.where(nf.index(s, -1) < n, s, -nf.inf)
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    u = nf.einsum("bhqk,bhkd->bhqd", p, v)
    empty = m == -nf.inf
    return nf.where(empty, 0.0, u / denom), m, nf.where(empty, -nf.inf, m + nf.log(denom))


def torch_attention(q, k, v, scale, keep, bump=None):
    """The same math in plain float32 torch: keep is the mask, bump (i, j, value) overrides one score."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    if bump is not None:
        i, j, value = bump
        s[:, :, i, j] = value
    s = torch.where(keep, s, -INF)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    u = torch.einsum("bhqk,bhkd->bhqd", p, v.float())
    empty = m == -INF
    return torch.where(empty, 0.0, u / denom), m, torch.where(empty, -INF, m + torch.log(denom))


def causal_keep(lq: int, lk: int) -> torch.Tensor:
    return torch.arange(lq)[:, None] >= torch.arange(lk)[None, :] + 3


def poison(q, k, v, where: str, head: int = 0, pos: int = 40, col: int = 5):
    q, k, v = q.clone(), k.clone(), v.clone()
    target = {"q": q, "k": k, "v": v}[where]
    target[0, head, pos, col] = NAN
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_flash_nan_in_inputs(where, dtype):
    """A NaN in one query row makes that row NaN, in one key every row that sees it, in one value the
    column of every row that sees it; rows that see no key stay exactly 0."""
    lq = lk = 100
    q, k, v = poison(*qkv(lq, lk, dtype), where)
    out = nf.compile(causal_attention, schedule=FLASH)(q, k, v, scale=0.25)
    ref = torch_attention(q, k, v, 0.25, causal_keep(lq, lk))[0]
    assert torch.equal(out[:, :, :3].float(), torch.zeros_like(out[:, :, :3].float()))
    # a NaN value at a key a row does not see reaches that row in plain torch (0 * NaN) only
    rows = slice(43, None) if where == "v" else slice(None)
    close(out[:, :, rows], ref[:, :, rows], dtype)
    # (rows 32..39 read key 40's tile, masked: 0 * NaN there as in plain torch)
    assert not out[0, 1].isnan().any() and not out[0, 0, :32 if where == "v" else 40].isnan().any()
    if where == "q":
        assert out[0, 0, 40].isnan().all() and not out[0, 0, 41:].isnan().any()
    else:  # rows 43.. see key 40
        assert out[0, 0, 43:, 5].isnan().all() and out[0, 0, 43:].isnan().all() == (where == "k")


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_flash_nan_without_mask(where):
    """With every key visible, a NaN value reaches every row: exactly plain torch, 0 * NaN included."""
    @nf.program
    def attention(q, k, v, scale):
        s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
        p = nf.exp(s - s.max(axis=-1, keepdims=True))
        return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    q, k, v = poison(*qkv(70, 90), where)
    out = nf.compile(attention, schedule=FLASH)(q, k, v, scale=0.25)
    close(out, torch_attention(q, k, v, 0.25, torch.ones(70, 90, dtype=torch.bool))[0])


@pytest.mark.parametrize("value", [INF, -INF, NAN])
@pytest.mark.parametrize("schedule", ["flash", "split_k"])
def test_one_score_inf_or_nan(value, schedule):
    """One score set to +inf gives its row exp(inf - inf) = NaN, to -inf drops that key, to NaN makes
    the row NaN, and so do the row max and the LSE; the other rows are unaffected."""
    lq, row, col = (40, 37, 11) if schedule == "flash" else (1, 0, 61)

    @nf.program
    def attention(q, k, v, scale, n):
        s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
        s = nf.where((nf.index(s, -2) == row) & (nf.index(s, -1) == col), value, s)
        s = nf.where(nf.index(s, -1) < n, s, -nf.inf)
        m = s.max(axis=-1, keepdims=True)
        p = nf.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        return nf.einsum("bhqk,bhkd->bhqd", p, v) / denom, m, m + nf.log(denom)

    q, k, v = qkv(lq, 150)
    fn = nf.compile(attention, schedule=FLASH if schedule == "flash" else SPLIT)
    outs = fn(q, k, v, scale=0.25, n=130)
    keep = (torch.arange(150) < 130).expand(lq, 150)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    s[:, :, row, col] = value
    s = torch.where(keep, s, -INF)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    refs = (p @ v / denom, m, m + torch.log(denom))
    for out, ref in zip(outs, refs):
        close(out.reshape(ref.shape), ref)
    assert outs[0][:, :, row].isnan().all() == (value != -INF)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_split_k_nan_in_inputs(where, dtype):
    """Decode (one query row, split-K): a NaN anywhere in the visible keys' inputs makes the row (the
    value: the column) NaN, in the output, the row max and the LSE; a NaN in a masked key's k is
    dropped with the key; a row that sees no key gives 0 and -inf."""
    q, k, v = poison(*qkv(1, 200, dtype), where, pos=0 if where == "q" else 77)
    fn = nf.compile(padded_attention, schedule=SPLIT)
    for n in (150, 0):
        outs = fn(q, k, v, scale=0.25, n=n)
        refs = torch_attention(q, k, v, 0.25, (torch.arange(200) < n).expand(1, 200))
        for out, ref in zip(outs, refs):
            close(out.reshape(ref.shape), ref, dtype)
        assert outs[0][0, 0].isnan().any() == (n > 0)
        assert not outs[0][0, 1].isnan().any()
    if where == "k":  # the NaN key is masked: nothing changes
        k2 = k.clone()
        k2[0, 0, 77] = 0.0
        k2[0, 0, 180, 3] = NAN
        outs = fn(q, k2, v, scale=0.25, n=150)
        close(outs[0], torch_attention(q, k2, v, 0.25, (torch.arange(200) < 150).expand(1, 200))[0], dtype)
        assert not outs[0].isnan().any()


@pytest.mark.parametrize("where", ["q", "k"])
def test_flash_row_max_and_lse_propagate_nan(where):
    """The row max itself is NaN where any visible score is: a NaN query row has no finite score, and
    a max that skipped NaN would stay -inf there (a row the epilogue then took for fully masked)."""
    q, k, v = poison(*qkv(64, 64), where, pos=20)
    outs = nf.compile(padded_attention, schedule=FLASH)(q, k, v, scale=0.25, n=64)
    refs = torch_attention(q, k, v, 0.25, torch.ones(64, 64, dtype=torch.bool))
    for out, ref in zip(outs, refs):
        close(out.reshape(ref.shape), ref)
    assert outs[1][0, 0, 20].isnan()


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("schedule", [None, "flash", "split_k"])
def test_row_reductions_propagate_nan(op, schedule):
    """max / min over a row (and an element-wise maximum / minimum inside the loop) give NaN where
    the row holds one, as torch.amax / torch.amin / torch.maximum do."""
    @nf.program
    def reductions(x):
        r = x.max(axis=-1) if op == "max" else x.min(axis=-1)
        clipped = nf.maximum(x, 0.5) if op == "max" else nf.minimum(x, -0.5)
        return r, clipped.sum(axis=-1)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=g)
    x[1, 7] = NAN
    x[2, 299] = NAN
    x[3, :] = NAN
    x[4, 100] = INF if op == "max" else -INF
    sched = {None: None, "flash": nf.flash(block_q=16, block_k=64), "split_k": nf.split_k(splits=4)}[schedule]
    r, total = nf.compile(reductions, schedule=sched)(x)
    ref = x.amax(-1) if op == "max" else x.amin(-1)
    clipped = torch.maximum(x, torch.tensor(0.5)) if op == "max" else torch.minimum(x, torch.tensor(-0.5))
    close(r, ref)
    close(total, clipped.sum(-1), torch.float16)
    assert r[1:4].isnan().all() and not r[0].isnan()


@pytest.mark.parametrize("schedule", ["flash", "split_k"])
def test_softmax_with_nan_and_inf(schedule):
    """A softmax (second pass over the row) and its logsumexp: NaN / +inf rows as in torch.softmax."""
    @nf.program
    def softmax(x):
        m = x.max(axis=-1, keepdims=True)
        p = nf.exp(x - m)
        return p / p.sum(axis=-1, keepdims=True)

    @nf.program
    def logsumexp(x):
        m = x.max(axis=-1, keepdims=True)
        return m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True))

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 200, generator=g)
    x[1, 150] = NAN
    x[2, 3] = INF
    x[3, :] = -INF
    sched = nf.flash(block_q=16, block_k=64) if schedule == "flash" else nf.split_k(splits=4)
    if schedule == "flash":
        close(nf.compile(softmax, schedule=sched)(x), torch.softmax(x, -1))
    m = x.amax(-1, keepdim=True)
    close(nf.compile(logsumexp, schedule=sched)(x), m + torch.log(torch.exp(x - m).sum(-1, keepdim=True)))


# --------------------------------------------------------------------------- FlexAttention


def flex(q, k, v, **kw):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:  # pragma: no cover - torch without FlexAttention
        pytest.skip(f"no FlexAttention: {exc}")
    mask_mod = kw.pop("mask_mod", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mask_mod is not None:
            kw["block_mask"] = create_block_mask(mask_mod, 1, q.shape[1], q.shape[2], k.shape[2], device="cpu")
        return flex_attention(q, k, v, **kw)


def shifted_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx + 3  # the first 3 rows see no key


@pytest.mark.parametrize("where", ["q", "k", "v", "score_inf", "score_nan"])
@pytest.mark.parametrize("decode", [False, True])
def test_flex_attention_nan_and_inf(where, decode):
    """nf.attention against eager FlexAttention on CPU with a NaN or inf at visible positions: out and
    LSE agree, NaN for NaN, fully masked rows 0 and -inf in both."""
    lq, lk, pos = (1, 200, 0) if decode else (100, 100, 40)
    key = 150 if decode else 30  # visible from the NaN query row (and every later row)
    q, k, v = qkv(lq, lk)
    if where in ("q", "k", "v"):
        q, k, v = poison(q, k, v, where, pos=pos if where == "q" else key)
    bump = {"score_inf": INF, "score_nan": NAN}.get(where)

    def score_mod(score, b, h, q_idx, kv_idx):
        if bump is None:
            return score
        return torch.where((h == 0) & (q_idx == pos) & (kv_idx == key), bump, score)

    mask_mod = (lambda b, h, q_idx, kv_idx: kv_idx < 180) if decode else shifted_causal
    out, lse = nf.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True,
                            schedule=SPLIT if decode else FLASH)
    ref_out, ref_lse = flex(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    if where == "v" and not decode:
        # eager FlexAttention computes 0 * NaN for the rows that do not see the NaN value
        rows = slice(key + 3, None)
        out, ref_out = out[:, :, rows], ref_out[:, :, rows]
    close(out, ref_out)
    if where == "score_inf":
        # a row whose max is +inf has LSE +inf, as FlexAttention's (m + log(l) there is inf + log(NaN))
        assert ref_lse[0, 0, pos] == INF and lse[0, 0, pos] == INF
    close(lse, ref_lse)
    assert out[0, 0].isnan().any() and not out[0, 1].isnan().any()
    if not decode:
        assert torch.equal(lse[:, :, :3], torch.full_like(lse[:, :, :3], -INF))


def test_flex_attention_fully_masked_rows_stay_zero():
    """Rows that see no key give out 0 and LSE -inf exactly, next to a row made NaN by its query."""
    q, k, v = poison(*qkv(64, 64), "q", pos=10)
    out, lse = nf.attention(q, k, v, mask_mod=shifted_causal, return_lse=True, schedule=FLASH)
    ref_out, ref_lse = flex(q, k, v, mask_mod=shifted_causal, return_lse=True)
    close(out, ref_out)
    close(lse, ref_lse)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert out[0, 0, 10].isnan().all() and not out[0, 0, 11].isnan().any()


# --------------------------------------------------------------------------- the CUDA sources


def _sources(monkeypatch) -> dict[str, tuple[str, dict]]:
    """CUDA-target sources (and compile specs) of a causal flash kernel, a split-K decode kernel and
    its combine, and a warp-specialised Gluon kernel, as the runtime lowers them for a GPU."""
    from neptune_fusion.codegen.gluon_source import generate_gluon
    from neptune_fusion.runtime import compiled

    def spec(tile, named, gluon=False):
        sig, aligned = {}, []
        for arg in tile.args:
            kind, buffer = arg.source.kind, arg.source.name
            if arg.kind == "pointer":
                sig[arg.name] = "*fp16" if kind == "input" and buffer in named else "*fp32"
                aligned.append(arg.name)
            else:
                sig[arg.name] = "fp32" if arg.kind == "float" else "i32"
        sig.update({c: "constexpr" for c in tile.constexprs})
        return {"name": tile.name, "signature": sig, "aligned": aligned, "constexprs": tile.constexprs,
                "num_warps": 4 if gluon else tile.num_warps, "num_stages": tile.num_stages, "gluon": gluon}

    out = {}
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 256, 64, generator=g, dtype=torch.float16) for _ in range(2))
    for name, args, schedule in (("flash", (q, k, k, 0.125), nf.flash(block_q=128, block_k=64)),
                                 ("split_k", (q[:, :, :1], k, k, 0.125, 200), SPLIT)):
        prog_def = causal_attention if name == "flash" else padded_attention
        c = Compiled(prog_def, schedule)
        named = dict(c.program_def.bind(*args))
        exe = c.executable_for(c.program_def.trace(**named), named)
        out[name] = (triton_source.generate(exe.main.tile, "cuda"), spec(exe.main.tile, named))
        if exe.combine_tile is not None:
            out[name + "_combine"] = (triton_source.generate(exe.combine_tile, "cuda"), spec(exe.combine_tile, {}))
    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    monkeypatch.setenv("NEPTUNE_FUSION_BACKEND", "gluon")
    monkeypatch.setattr(compiled, "_gluon_precondition", lambda device, options: None)
    q = torch.randn(1, 2, 256, 128, generator=g, dtype=torch.float16)
    kw = {"mask_mod": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, "return_lse": True}
    prog = nf.attention_program(q, q, q, **kw)
    named = nf.attention_inputs(q, q, q, **kw)
    exe = Compiled(lambda: None, nf.flash(128, 128, 8, 3)).executable_for(prog, named)
    assert exe.main.backend == "gluon", exe.main.tile.notes
    out["gluon"] = (generate_gluon(exe.main.tile), spec(exe.main.tile, named, gluon=True))
    return out


def test_cuda_sources_use_nan_propagating_max_only(monkeypatch):
    """Every float max/min of the printed CUDA kernels propagates NaN; integer ones (loop bounds)
    stay plain."""
    sources = _sources(monkeypatch)
    assert set(sources) == {"flash", "split_k", "split_k_combine", "gluon"}
    for name, (source, _) in sources.items():
        body = source.split("def nf_", 1)[1]  # the kernels, after the helpers
        assert "_max_nan(" in body or "gl.reduce(" in body, name
        assert "_maximum_nan(acc_" in body, name  # the running max
        assert not re.search(r"\b[tg]l\.(max|min)\(", body), name
        for line in body.splitlines():
            if re.search(r"[tg]l\.(maximum|minimum)\(", line):  # only on scalar integers
                assert "acc_" not in line and "red" not in line, (name, line)


_COMPILE = """
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
out = {}
for path, spec in json.loads(sys.argv[1]).items():
    loader = importlib.util.spec_from_file_location(spec["name"] + str(len(out)), path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    fn = getattr(module, spec["name"])
    index = {n: i for i, n in enumerate(fn.arg_names)}
    attrs = {(index[n],): [["tt.divisibility", 16]] for n in spec["aligned"]}
    constexprs = {(index[n],): v for n, v in spec["constexprs"].items()}
    source = (GluonASTSource if spec["gluon"] else ASTSource)(fn, spec["signature"], constexprs=constexprs, attrs=attrs)
    options = {"num_warps": spec["num_warps"]}
    if not spec["gluon"]:
        options["num_stages"] = spec["num_stages"]
    out[path] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
print(json.dumps(out))
"""


def test_cuda_kernels_compile_to_nan_max_instructions(monkeypatch, tmp_path):
    """For sm_90 (Triton's own ptxas, no GPU), every f32 max of the kernels is `max.NaN.f32` (one
    FMNMX.NAN for each FMNMX, the rest of the machine code as before), none the NaN-dropping `max.f32`."""
    specs = {}
    for name, (source, spec) in _sources(monkeypatch).items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        specs[str(path)] = spec
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(specs)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout.strip().splitlines()[-1])
    for path, text in ptx.items():
        assert re.search(r"\bmax\.NaN\.f32\b", text), path
        assert not re.search(r"\b(max|min)\.f32\b", text), path


def test_interpreter_reduction_helpers():
    """The interpreter's stand-ins for the CUDA target's NaN-propagating reductions (whose combine is
    inline PTX, which the interpreter cannot run) agree with torch.amax / amin, inf and NaN rows too."""
    module = tmp_module("nan_reduce_portable", "import triton\nimport triton.language as tl\n"
                        + triton_source._NAN_COMBINE_PORTABLE + triton_source._REDUCE_NAN_PORTABLE + _REDUCE_KERNEL)
    x = torch.randn(8, 16)
    x[1, 3] = NAN
    x[2, :] = NAN
    x[3, 0] = INF
    x[4, 5] = -INF
    x[5, :] = -INF
    out = torch.empty(2, 8)
    module.reduce_kernel[(1,)](x, out, R=8, C=16)
    close(out[0], x.amax(-1))
    close(out[1], x.amin(-1))


_REDUCE_KERNEL = '''

@triton.jit
def reduce_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)
    x = tl.load(x_ptr + rows[:, None] * C + tl.arange(0, C)[None, :])
    tl.store(out_ptr + rows, _max_nan(x, 1))
    tl.store(out_ptr + R + rows, _min_nan(x, 1))
'''


def tmp_module(name: str, text: str):
    """`text` as an importable module (Triton's JIT reads a kernel's source from its file)."""
    import importlib.util
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_executor_agrees():
    """The reference executor (the ground truth of the other tests) propagates NaN the same way."""
    q, k, v = poison(*qkv(50, 50), "k", pos=20)
    ref = torch_attention(q, k, v, 0.25, causal_keep(50, 50))[0]
    prog = causal_attention.trace(q=q, k=k, v=v, scale=0.25)
    close(nf.run_reference(prog, {"q": q, "k": k, "v": v, "scale": 0.25}), ref)
    assert math.isnan(float(ref[0, 0, 30, 0]))
