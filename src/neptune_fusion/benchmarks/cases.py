# ruff: noqa: B023 - every closure is built and called for one case only
"""The benchmark's cases: the attention operators of DESIGN.md section 5 (and a few more), the
reduction chains that are not attention, and host time per call.

Each case builds, when it runs, its random inputs, our call, every baseline that computes the same
thing, and a check of an output against an fp32 reference on those inputs. Shapes follow DESIGN.md;
`quick` shrinks them to what Triton's interpreter runs in seconds.

Example:
    >>> from neptune_fusion.benchmarks.cases import select
    >>> [f"{c.op}@{c.seq}" for c in select(["decode"], ops=["dc_gqa"], seqs=[4096, 16384])]
    ['dc_gqa@4096', 'dc_gqa@16384']
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

SOFTCAP = 50.0
WINDOW = 4096
DIM = 128
# (query heads, key/value heads) of the operators called through nf.attention (FlexAttention's call)
FLEX_HEADS = {"pf_global": (32, 32), "pf_causal": (32, 32), "pf_alibi": (32, 32), "pf_softcap": (32, 16),
              "pf_window": (32, 8), "pf_gqa": (64, 8), "pf_document": (32, 32), "pf_prefix_lm": (32, 32),
              "dc_lengths": (32, 8)}
# decode: (query heads, key/value heads, score kind) of the plain programs
DECODE_OPS = {"dc_causal": (32, 32, "plain"), "dc_alibi": (32, 32, "alibi"), "dc_gqa": (64, 8, "plain"),
              "dc_softcap": (32, 16, "softcap")}
PREFILL_SEQS = (1024, 4096, 16384)
DECODE_SEQS = (1024, 4096, 16384, 32768)
FLEX_SEQS = (4096, 16384)
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


# --- what every case is made of ----------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """Where and how the cases run, and which baselines can run there."""

    device: str
    quick: bool
    fa4: ModuleType | None = None  # flash_attn.cute.interface, where importable
    unavailable: dict[str, str] = field(default_factory=dict)  # baseline -> why it does not run here
    before: ModuleType | None = None  # an earlier neptune_fusion package (--before)

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"


@dataclass
class System:
    """One implementation of a case: `call` is timed as it is; `output` reads its result for the check."""

    call: Callable[[], Any]
    output: Callable[[Any], torch.Tensor] = lambda result: result
    plans: Callable[[], list[str]] | None = None  # the kernel plans our call ran, read after it ran


@dataclass
class Built:
    """A case with its inputs allocated: our call first, then the baselines."""

    systems: dict[str, System]
    check: Callable[[torch.Tensor], float]  # relative error against the fp32 reference
    tolerance: float
    skipped: dict[str, str] = field(default_factory=dict)  # baseline -> why it was not run
    work: dict[str, float] = field(default_factory=dict)  # flops / bytes of one call, for throughput
    info: dict[str, Any] = field(default_factory=dict)  # shapes and whatever else the JSON should hold


@dataclass(frozen=True)
class Case:
    suite: str
    op: str
    seq: int | None  # the key length; None for the general suite, whose sizes are its own
    build: Callable[[Setup], Built]
    timer: str = "device"  # "host": host time per call while the GPU keeps up


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error in float64 (NaN anywhere in `out` gives NaN)."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _builder(setup: Setup) -> tuple[dict[str, System], dict[str, str], Callable[[str, Callable[[], System]], None]]:
    """Systems, skip notes, and `add(name, make)`: a baseline unavailable here is noted, not made."""
    systems: dict[str, System] = {}
    skipped: dict[str, str] = {}

    def add(name: str, make: Callable[[], System]) -> None:
        if name in setup.unavailable:
            skipped[name] = setup.unavailable[name]
            return
        try:
            systems[name] = make()
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot be set up is recorded, not fatal
            skipped[name] = f"setup failed: {type(exc).__name__}: {str(exc)[:200]}"

    return systems, skipped, add


def _plans(fn: Any) -> list[str]:
    """The plans a compiled function has built so far (empty where the runtime keeps none to read)."""
    return [str(exe.plan) for exe in getattr(fn, "_cache", {}).values() if hasattr(exe, "plan")]


def _fronts(setup: Setup) -> dict[str, ModuleType]:
    """The packages whose calls are timed: this one ("ours") and the earlier one ("before")."""
    import neptune_fusion

    fronts = {"ours": neptune_fusion}
    if setup.before is not None:
        fronts["before"] = setup.before
    return fronts


# --- attention: inputs, programs and references ------------------------------------------------
def make_case(op: str, seq: int, device: str = "cuda", *, dim: int = DIM, heads: tuple[int, int] | None = None,
              window: int = WINDOW, dtype: torch.dtype = torch.float16):
    """(q, k, v, score_mod, mask_mod, gqa) exactly as a FlexAttention user writes them.

    `dc_lengths`: decode (one query token) for a batch of 4 sequences of different lengths in one
    padded KV cache of `seq` slots, the mask reading a per-sequence length tensor."""
    hq, hkv = heads or FLEX_HEADS[op]
    batch, q_len = (4, 1) if op.startswith("dc_") else (1, seq)
    q = torch.randn(batch, hq, q_len, dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, hkv, seq, dim, device=device, dtype=dtype) for _ in range(2))
    kv_lengths = torch.tensor([seq, seq // 2 + 3, seq // 4 - 5, seq - 77], device=device)
    slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device=device, dtype=torch.float32) / hq)
    g = torch.Generator(device="cpu").manual_seed(seq)
    lengths = torch.randint(max(1, seq // 16), max(2, seq // 2), (64,), generator=g)
    doc_id = torch.repeat_interleave(torch.arange(64), lengths)[:seq]
    doc_id = torch.cat([doc_id, torch.full((seq - doc_id.numel(),), 64)]).to(device)
    prefix = seq // 4

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def document(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def by_length(b, h, q_idx, kv_idx):
        return kv_idx < kv_lengths[b]

    table = {
        "pf_global": (None, None), "pf_causal": (None, causal), "pf_alibi": (alibi, causal),
        "pf_softcap": (softcap, causal), "pf_window": (softcap, sliding), "pf_gqa": (None, causal),
        "pf_document": (None, document), "pf_prefix_lm": (None, prefix_lm), "dc_lengths": (None, by_length),
    }
    score_mod, mask_mod = table[op]
    return q, k, v, score_mod, mask_mod, hq != hkv


def reference_rows(q, k, v, score_mod, mask_mod, rows, scale):
    """fp32 attention for a subset of query rows, applying the mods elementwise with torch (rows
    that see no key give 0)."""
    hq, hkv = q.shape[1], k.shape[1]
    kf, vf = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), kf) * scale
    b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    h = torch.arange(hq, device=q.device)[None, :, None, None]
    qi = rows[None, None, :, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1).nan_to_num(0.0), vf)


def plain(kind: str, front: Any = None):
    """The plain decode program for a score kind ("plain", "alibi", "softcap"): what a user writes
    (and what torch.compile gets), with `front`'s ops (another neptune_fusion package for
    before/after comparisons; this one by default)."""
    if front is None:
        import neptune_fusion as front

    def attention(q, k, v, slopes, scale):
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = front.repeat_interleave(k, group, 1)
            v = front.repeat_interleave(v, group, 1)
        s = front.einsum("bhqd,bhkd->bhqk", q, k) * scale
        if kind == "alibi":
            s = s + slopes[:, None, None] * (front.index(s, -1) - front.index(s, -2) - (k.shape[2] - q.shape[2]))
        if kind == "softcap":
            s = SOFTCAP * front.tanh(s / SOFTCAP)
        p = front.exp(s - s.max(axis=-1, keepdims=True))
        return front.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    return front.program(attention)


def torch_plain(q, k, v, slopes, scale, kind):
    """The same decode program in torch (float32 inside), the torch.compile baseline and the reference."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    if kind == "alibi":
        rel = torch.arange(k.shape[2], device=q.device)[None, :] - torch.arange(q.shape[2], device=q.device)[:, None]
        s = s + slopes[:, None, None] * (rel - (k.shape[2] - q.shape[2]))
    if kind == "softcap":
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v.float()).to(q.dtype)


# --- baselines ---------------------------------------------------------------------------------
def _sdpa(setup: Setup, add: Callable, q, k, v, scale: float, causal: bool = False, bias=None,
          gqa: bool = False) -> None:
    """torch's scaled_dot_product_attention through each of its GPU backends (on the CPU: its default)."""
    def call(backend=None):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scale, enable_gqa=gqa)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal, scale=scale, enable_gqa=gqa)

    if not setup.on_gpu:
        add("sdpa", lambda: System(call))
        return
    from torch.nn.attention import SDPBackend

    for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        add(label, lambda backend=backend: System(lambda: call(backend)))


def _flex(setup: Setup, add: Callable, q, k, v, score_mod, mask_mod, gqa: bool, scale: float) -> None:
    """FlexAttention (compiled), with its default Triton backend and its FLASH (CuTeDSL) backend."""
    def make(options: dict[str, str] | None) -> System:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if mask_mod is not None:
            batch = q.shape[0] if q.shape[0] > 1 else None  # masks may read the batch index
            block_mask = create_block_mask(mask_mod, batch, None, q.shape[2], k.shape[2], device=q.device)
        return System(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                   enable_gqa=gqa, kernel_options=options))

    add("flex", lambda: make(None))
    add("flex_flash", lambda: make({"BACKEND": "FLASH"}))


def _fa4(setup: Setup, add: Callable, q, k, v, scale: float, causal: bool = False, softcap: float = 0.0,
         window: int | None = None) -> None:
    """FlashAttention-4 (CuTeDSL, its Hopper path), on (batch, seq, heads, dim) copies of the inputs."""
    def make() -> System:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        kw: dict[str, Any] = {"softmax_scale": scale, "causal": causal, "softcap": softcap}
        if window is not None:
            kw["window_size"] = (window - 1, 0)
        return System(lambda: setup.fa4.flash_attn_func(qt, kt, vt, **kw),
                      output=lambda r: (r[0] if isinstance(r, tuple) else r).transpose(1, 2))

    add("fa4", make)


def _compiled_torch(setup: Setup, add: Callable, name: str, fn: Callable, *args: Any) -> None:
    """torch.compile of the same plain torch code."""
    def make() -> System:
        compiled = torch.compile(fn, dynamic=False)
        return System(lambda: compiled(*args))

    add(name, make)


# --- the attention suites ----------------------------------------------------------------------
def _shrunk(setup: Setup, heads: tuple[int, int]) -> tuple[tuple[int, int], int]:
    """Heads and head dim: DESIGN.md's, or a quarter of them (at least 2 query heads per KV head
    where there was grouping) for the interpreter."""
    if not setup.quick:
        return heads, DIM
    hq, hkv = heads
    group = hq // hkv
    kv = 2 if group > 1 else 4
    return (kv * min(group, 2), kv), 32


def _prefill(op: str, seq: int) -> Callable[[Setup], Built]:
    def build(setup: Setup) -> Built:
        torch.manual_seed(0)
        (hq, hkv), dim = _shrunk(setup, FLEX_HEADS[op])
        window = WINDOW if not setup.quick else max(16, seq // 4)
        q, k, v, score_mod, mask_mod, gqa = make_case(op, seq, setup.device, dim=dim, heads=(hq, hkv), window=window)
        scale = 1.0 / math.sqrt(dim)
        rows = torch.randperm(seq, device=setup.device)[:128].sort().values
        ref = reference_rows(q, k, v, score_mod, mask_mod, rows, scale)
        systems, skipped, add = _builder(setup)
        causal = mask_mod is not None
        for name, front in _fronts(setup).items():
            if op in ("pf_global", "pf_causal"):  # the plain program, as nf.compile gets it
                lib = importlib.import_module(f"{front.__name__}.library")
                fn = front.compile(lib.causal_attention if causal else lib.attention)
                add(name, lambda fn=fn: System(lambda: fn(q, k, v, scale), plans=lambda: _plans(fn)))
            else:  # FlexAttention's call
                add(name, lambda front=front: System(lambda: front.attention(
                    q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, enable_gqa=gqa)))
        if op in ("pf_global", "pf_causal", "pf_gqa"):
            _sdpa(setup, add, q, k, v, scale, causal=causal, gqa=gqa)
        _flex(setup, add, q, k, v, score_mod, mask_mod, gqa, scale)
        if op in ("pf_global", "pf_causal", "pf_gqa", "pf_softcap", "pf_window"):
            _fa4(setup, add, q, k, v, scale, causal=causal, softcap=SOFTCAP if op in ("pf_softcap", "pf_window") else 0.0,
                 window=window if op == "pf_window" else None)
        work = {}
        if op in ("pf_global", "pf_causal", "pf_alibi", "pf_gqa", "pf_softcap"):  # causal ones: half the scores
            work["flops"] = 4 * hq * seq * seq * dim * (1.0 if op == "pf_global" else 0.5)
        return Built(systems, lambda out: rel_err(out[:, :, rows], ref), TOLERANCE[q.dtype], skipped, work,
                     {"heads_q": hq, "heads_kv": hkv, "dim": dim, "dtype": "float16", "checked_rows": len(rows)})

    return build


def _decode(op: str, seq: int) -> Callable[[Setup], Built]:
    def build(setup: Setup) -> Built:
        hq0, hkv0, kind = DECODE_OPS[op]
        (hq, hkv), dim = _shrunk(setup, (hq0, hkv0))
        torch.manual_seed(0)
        q = torch.randn(1, hq, 1, dim, device=setup.device, dtype=torch.float16)
        k, v = (torch.randn(1, hkv, seq, dim, device=setup.device, dtype=torch.float16) for _ in range(2))
        slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device=setup.device, dtype=torch.float32) / hq)
        scale = 1.0 / math.sqrt(dim)
        ref = torch_plain(q.float(), k.float(), v.float(), slopes, scale, kind).float()
        systems, skipped, add = _builder(setup)
        for name, front in _fronts(setup).items():
            fn = front.compile(plain(kind, front))
            add(name, lambda fn=fn: System(lambda: fn(q, k, v, slopes, scale), plans=lambda: _plans(fn)))
        gqa = hq != hkv
        if kind != "softcap":
            bias = None
            if kind == "alibi":
                rel = torch.arange(seq, device=setup.device)[None, :] - torch.arange(1, device=setup.device)[:, None]
                bias = (slopes[:, None, None] * (rel - (seq - 1))).to(q.dtype)[None]
            _sdpa(setup, add, q, k, v, scale, bias=bias, gqa=gqa)
        score_mod = None
        if kind == "alibi":
            def score_mod(score, b, h, qi, ki):
                return score + slopes[h] * (ki - qi - (seq - 1))
        elif kind == "softcap":
            def score_mod(score, b, h, qi, ki):
                return SOFTCAP * torch.tanh(score / SOFTCAP)
        _flex(setup, add, q, k, v, score_mod, None, gqa, scale)
        _compiled_torch(setup, add, "torch_compile", lambda q, k, v: torch_plain(q, k, v, slopes, scale, kind), q, k, v)
        if kind != "alibi":
            _fa4(setup, add, q, k, v, scale, softcap=SOFTCAP if kind == "softcap" else 0.0)
        return Built(systems, lambda out: rel_err(out, ref), TOLERANCE[q.dtype], skipped,
                     {"bytes": 2 * hkv * seq * dim * 2},
                     {"heads_q": hq, "heads_kv": hkv, "dim": dim, "dtype": "float16", "kind": kind})

    return build


def _lengths(op: str, seq: int) -> Callable[[Setup], Built]:
    """dc_lengths: decode of 4 sequences of different lengths in one padded cache (a data-dependent mask)."""
    def build(setup: Setup) -> Built:
        torch.manual_seed(0)
        (hq, hkv), dim = _shrunk(setup, FLEX_HEADS[op])
        q, k, v, score_mod, mask_mod, gqa = make_case(op, seq, setup.device, dim=dim, heads=(hq, hkv))
        scale = 1.0 / math.sqrt(dim)
        ref = reference_rows(q, k, v, score_mod, mask_mod, torch.arange(1, device=setup.device), scale)
        systems, skipped, add = _builder(setup)
        for name, front in _fronts(setup).items():
            add(name, lambda front=front: System(lambda: front.attention(
                q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, enable_gqa=gqa)))
        visible = mask_mod(torch.arange(4, device=q.device)[:, None, None, None], 0, 0, torch.arange(seq, device=q.device))
        _sdpa(setup, add, q, k, v, scale, bias=visible, gqa=gqa)
        _flex(setup, add, q, k, v, score_mod, mask_mod, gqa, scale)
        return Built(systems, lambda out: rel_err(out, ref), TOLERANCE[q.dtype], skipped, {},
                     {"heads_q": hq, "heads_kv": hkv, "dim": dim, "batch": 4, "dtype": "float16"})

    return build


# --- reduction chains that are not attention ---------------------------------------------------
def _torch_rmsnorm_matmul(x, w):
    return (x.float() / torch.sqrt((x.float() ** 2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) @ w


def _torch_layernorm_matmul(x, w):
    xf = x.float()
    normed = (xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return normed.to(x.dtype) @ w


def _torch_linear_cross_entropy(h, w, target):
    return F.cross_entropy((h @ w.T).float(), target, reduction="none")


def _torch_softmax_pooling(x, v):
    return (torch.softmax(x.float(), -1) * v.float()).sum(-1)


# name: (program in neptune_fusion.library, torch code, sizes (full, quick))
GENERAL = {
    "rmsnorm_matmul": ("rmsnorm_matmul", _torch_rmsnorm_matmul, ((8192, 4096, 4096), (64, 128, 64))),
    "layernorm_matmul": ("layernorm_matmul", _torch_layernorm_matmul, ((8192, 4096, 4096), (64, 128, 64))),
    "linear_cross_entropy": ("linear_cross_entropy", _torch_linear_cross_entropy,
                             ((8192, 4096, 128256), (32, 64, 512))),
    "softmax_pooling": ("softmax_pooling", _torch_softmax_pooling, ((16384, 8192), (16, 256))),
}


def _general(op: str, seq: int | None) -> Callable[[Setup], Built]:
    def build(setup: Setup) -> Built:
        program_name, plain_torch, sizes = GENERAL[op]
        g = torch.Generator(device=setup.device).manual_seed(0)

        def randn(*shape: int, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=setup.device).mul_(scale).to(dtype)

        shape = sizes[1] if setup.quick else sizes[0]
        if op == "linear_cross_entropy":
            n, d, vocab = shape
            args: tuple[torch.Tensor, ...] = (randn(n, d, dtype=torch.bfloat16), randn(vocab, d, dtype=torch.bfloat16,
                                                                                      scale=0.02),
                                              torch.randint(0, vocab, (n,), device=setup.device, generator=g))
        elif op == "softmax_pooling":
            args = (randn(*shape), randn(*shape))
        else:
            n, d, e = shape
            args = (randn(n, d), randn(d, e, scale=d ** -0.5))
        ref = plain_torch(*(a.float() if a.is_floating_point() else a for a in args)).float()
        systems, skipped, add = _builder(setup)
        for name, front in _fronts(setup).items():
            lib = importlib.import_module(f"{front.__name__}.library")
            fn = front.compile(getattr(lib, program_name))
            add(name, lambda fn=fn: System(lambda: fn(*args), plans=lambda: _plans(fn)))
        add("torch", lambda: System(lambda: plain_torch(*args)))
        _compiled_torch(setup, add, "torch_compile", plain_torch, *args)
        out_dtype = torch.bfloat16 if op == "linear_cross_entropy" else torch.float16
        info: dict[str, Any] = {"shapes": [list(a.shape) for a in args],
                                "dtypes": [str(a.dtype).removeprefix("torch.") for a in args]}
        if op == "linear_cross_entropy":  # what a fused kernel does not hold: the bf16 logits
            info["logits_bytes"] = args[0].shape[0] * args[1].shape[0] * 2
        return Built(systems, lambda out: rel_err(out.float(), ref), TOLERANCE[out_dtype], skipped, {}, info)

    return build


# --- host time per call ------------------------------------------------------------------------
HOST_CASES = ("host_decode_plain", "host_decode_alibi", "host_decode_compiled", "host_prefill_alibi")


def _host(op: str, seq: int) -> Callable[[Setup], Built]:
    """Decode-sized calls (batch 4, 32/8 heads, `seq` keys; the prefill case 16 queries and keys), whose
    kernels are short: what a decode loop pays per layer in Python and launches."""
    def build(setup: Setup) -> Built:
        hq, hkv, d, b = 32, 8, DIM, 4
        dev = setup.device
        torch.manual_seed(0)
        slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, dtype=torch.float32, device=dev) / hq)
        prefill = op == "host_prefill_alibi"
        if prefill:
            b, hkv = 1, hq
        q = torch.randn(b, hq, seq if prefill else 1, d, device=dev, dtype=torch.float16)
        k, v = (torch.randn(b, hkv, seq, d, device=dev, dtype=torch.float16) for _ in range(2))
        scale = 1.0 / math.sqrt(d)
        gqa = hq != hkv

        offset = seq - q.shape[2]  # the queries sit at the end of the keys: biases <= 0, exact in fp16 for SDPA

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - offset)

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        score_mod = None if op in ("host_decode_plain", "host_decode_compiled") else alibi
        mask_mod = causal if prefill else None
        rows = torch.arange(q.shape[2], device=dev)
        ref = reference_rows(q, k, v, score_mod, mask_mod, rows, scale)
        qi, ki = rows[:, None], torch.arange(seq, device=dev)[None, :]
        bias = None
        if score_mod is not None:  # the same scores for SDPA, as an additive mask
            bias = slopes[:, None, None] * (ki - qi - offset)
            if mask_mod is not None:
                bias = bias.masked_fill(qi < ki, float("-inf"))
            bias = bias.to(q.dtype)[None]
        systems, skipped, add = _builder(setup)
        for name, front in _fronts(setup).items():
            if op == "host_decode_compiled":
                fn = front.compile(plain("plain", front))
                add(name, lambda fn=fn: System(lambda: fn(q, k, v, slopes, scale)))
            else:
                add(name, lambda front=front: System(lambda: front.attention(
                    q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, enable_gqa=gqa)))
        add("sdpa", lambda: System(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                                                         enable_gqa=gqa)))
        return Built(systems, lambda out: rel_err(out, ref), TOLERANCE[q.dtype], skipped, {},
                     {"batch": b, "heads_q": hq, "heads_kv": hkv, "dim": d, "queries": q.shape[2]})

    return build


# --- selection ---------------------------------------------------------------------------------
SUITES = ("prefill", "decode", "flex", "general", "host")
_QUICK = {"prefill": (("pf_causal", 64), ("pf_softcap", 64)), "decode": (("dc_gqa", 256),),
          "flex": (("dc_lengths", 128),), "general": (("softmax_pooling", None),), "host": ()}


def _all(suite: str) -> list[tuple[str, int | None]]:
    if suite == "prefill":
        ops = ("pf_global", "pf_causal", "pf_alibi", "pf_gqa", "pf_softcap", "pf_window")
        return [(op, s) for op in ops for s in PREFILL_SEQS]
    if suite == "decode":
        return [(op, s) for op in DECODE_OPS for s in DECODE_SEQS]
    if suite == "flex":
        return [(op, s) for op in ("pf_document", "pf_prefix_lm") for s in FLEX_SEQS] + \
               [("dc_lengths", s) for s in DECODE_SEQS]
    if suite == "general":
        return [(op, None) for op in GENERAL]
    return [(op, 16 if op == "host_prefill_alibi" else 4096) for op in HOST_CASES]


_BUILDERS = {"prefill": _prefill, "decode": _decode, "general": _general, "host": _host}


def select(suites: Sequence[str], ops: Sequence[str] | None = None, seqs: Sequence[int] | None = None,
           quick: bool = False) -> list[Case]:
    """The cases of these suites, in order, keeping only `ops` and `seqs` where given (`quick`: the
    few tiny cases the interpreter runs)."""
    cases = []
    for suite in suites:
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; the suites are {', '.join(SUITES)}")
        for op, seq in (_QUICK[suite] if quick else _all(suite)):
            if (ops and op not in ops) or (seqs and seq is not None and seq not in seqs):
                continue
            make = _lengths if op == "dc_lengths" else _BUILDERS.get(suite, _prefill)
            cases.append(Case(suite, op, seq, make(op, seq), "host" if suite == "host" else "device"))
    return cases
