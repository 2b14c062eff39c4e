"""FlexAttention-compatible attention: the same `score_mod` / `mask_mod` functions, fused and compiled.

`attention(q, k, v, score_mod=..., mask_mod=...)` traces the plain attention program

    s = q @ k^T * scale                      (default scale 1 / sqrt(head_dim))
    s = score_mod(s, b, h, q_idx, kv_idx)
    s = where(mask_mod(b, h, q_idx, kv_idx), s, -inf)
    m = max_kv s;  p = exp(s - m);  l = sum_kv p;  u = p @ v
    out = where(l > 0, u / l, 0)             (a fully masked row gives 0, never NaN)
    lse = where(l > 0, m + log(l), -inf)     (with return_lse; natural log)

where `b, h, q_idx, kv_idx` are symbolic integer index tensors, and hands it to the compiler, which
derives the online softmax (FlashAttention) itself. `score_mod` and `mask_mod` are written exactly
as for `torch.nn.attention.flex_attention`: torch operations on their arguments and indexing of
captured tensors (`slopes[h]`, `doc_id[q_idx] == doc_id[kv_idx]`, `bias[h, q_idx]`). Captured
tensors become extra kernel inputs, passed on every call (so in-place updates are seen); their
indices are not bounds-checked (as in FlexAttention, out-of-range indices are the caller's bug).
Differences from FlexAttention: the mask is given as `mask_mod` (a `BlockMask` is accepted for its
`mask_mod`), and there is no autograd. The lse is computed and stored in float32.

Caching: traced programs are cached per (score_mod, mask_mod, shapes, dtypes, flags) and compiled
kernels per (score_mod, mask_mod, schedule, flags). A function is identified by its code and the
values it closes over (closure cells, globals it names, defaults, nested functions): Python
scalars by value, tensors by shape/dtype (and passed anew on every call). A new closure from the
same factory reuses the compiled kernel. Values reached only through attributes of other objects
are fixed at the first trace; pass them through a closure or global instead.

Example:
    >>> import torch, neptune_fusion as nf
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> def softcap(score, b, h, q_idx, kv_idx):
    ...     return 30.0 * torch.tanh(score / 30.0)
    >>> # out = nf.attention(q, k, v, score_mod=softcap, mask_mod=causal)
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from neptune_fusion.ir.expr import Const, simplify
from neptune_fusion.ir.program import Program
from neptune_fusion.lang.ops import einsum, exp, index, log, repeat_interleave, where
from neptune_fusion.lang.tensor import SymTensor, broadcast, cast, lift
from neptune_fusion.lang.torch_function import CaptureTable
from neptune_fusion.lang.trace import ArgSpec, ProgramDef, trace
from neptune_fusion.runtime.compiled import Compiled
from neptune_fusion.schedule.templates import Auto, Schedule

__all__ = ["attention", "attention_inputs", "attention_program", "clear_cache", "explain_attention"]

ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]
MaskMod = Callable[[Any, Any, Any, Any], Any]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_PROGRAMS = 256
_MAX_COMPILED = 64


# --------------------------------------------------------------------------- argument checks


def _mask_mod_of(mask_mod: Any) -> MaskMod | None:
    """A mask_mod function, or the mask_mod of a FlexAttention BlockMask."""
    if mask_mod is None or isinstance(mask_mod, (types.FunctionType, types.MethodType, functools.partial)):
        return mask_mod
    if hasattr(mask_mod, "kv_num_blocks") and hasattr(mask_mod, "mask_mod"):  # a torch BlockMask
        return mask_mod.mask_mod
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
    return mask_mod


def _check_inputs(q: Any, k: Any, v: Any, score_mod: Any, scale: Any, enable_gqa: bool) -> tuple[int, float]:
    """Validate like flex_attention; returns (query heads per kv head, scale)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"query, key and value must be float16, bfloat16 or float32, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device} and {v.device}")
    (bq, hq, _, eq), (bk, hk, lk, ek), (bv, hv, lv, _) = q.shape, k.shape, v.shape
    if not bq == bk == bv:
        raise ValueError(f"query, key and value must have the same batch size, got {bq}, {bk} and {bv}")
    if hk != hv:
        raise ValueError(f"key and value must have the same number of heads, got {hk} and {hv}")
    if lk != lv:
        raise ValueError(f"key and value must have the same sequence length, got {lk} and {lv}")
    if eq != ek:
        raise ValueError(f"query and key must have the same head dimension, got {eq} and {ek}")
    if hq != hk:
        if not enable_gqa:
            raise ValueError(
                f"query and key/value must have the same number of heads unless enable_gqa=True, "
                f"got Hq={hq} and Hkv={hk}"
            )
        if hk == 0 or hq % hk != 0:
            raise ValueError(
                f"with enable_gqa=True the number of query heads must be a multiple of the number of key/value "
                f"heads, got Hq={hq} and Hkv={hk}"
            )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a function (score, b, h, q_idx, kv_idx) -> score, "
                        f"got {type(score_mod).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(eq) if eq > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return (hq // hk if hk else 1), scale


# --------------------------------------------------------------------------- the traced program


def _broadcast_to(x: SymTensor, like: SymTensor, what: str) -> SymTensor:
    dims, (expr, _) = broadcast([x, like], what)
    if len(dims) != like.ndim:
        raise ValueError(f"{what} must return one value per (b, h, q_idx, kv_idx), got a result of rank {x.ndim}")
    return SymTensor(dims, expr, x.tracer, x.kind)


def _body(score_mod: ScoreMod | None, mask_mod: MaskMod | None, groups: int, return_lse: bool,
          table: CaptureTable) -> Callable[..., Any]:
    def attention(q: SymTensor, k: SymTensor, v: SymTensor, scale: SymTensor) -> Any:
        tracer = q.tracer
        tracer.captures = table  # type: ignore[attr-defined]
        if groups > 1:  # grouped-query attention: query head h reads key/value head h // groups
            k = repeat_interleave(k, groups, 1)
            v = repeat_interleave(v, groups, 1)
        s = einsum("bhqd,bhkd->bhqk", q, k) * scale
        b, h, q_idx, kv_idx = (index(s, axis) for axis in range(4))
        if score_mod is not None:
            r = lift(score_mod(s, b, h, q_idx, kv_idx), tracer)
            if r.kind == "bool":
                raise TypeError("score_mod must return a score (a float), got a boolean; use mask_mod for masks")
            if r.kind == "int":
                r = cast(r, "f32")
            s = _broadcast_to(r, s, "score_mod")
        if mask_mod is not None:
            keep = lift(mask_mod(b, h, q_idx, kv_idx), tracer)
            if keep.kind != "bool":
                raise TypeError(f"mask_mod must return a boolean (e.g. q_idx >= kv_idx), got a value of kind {keep.kind}")
            cond = simplify(keep.expr)  # e.g. and_masks' `True & m` -> m, so the mask analysis sees m
            if not (isinstance(cond, Const) and cond.value is True):
                keep = SymTensor(keep.dims, cond, tracer, "bool")
                s = where(keep, s, -math.inf)
        m = s.max(axis=-1, keepdims=True)
        p = exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        u = einsum("bhqk,bhke->bhqe", p, v)
        out = where(denom > 0, u / denom, 0.0)
        if not return_lse:
            return out
        lse = where(denom > 0, m + log(denom), -math.inf)
        return out, cast(lse[..., 0], "f32")  # stored in float32, as FlexAttention returns it

    return attention


# --------------------------------------------------------------------------- caching


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _value_key(value: Any, tensors: list[torch.Tensor], seen: set[int], depth: int) -> Any:
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", tuple(value.shape), value.dtype, str(value.device))
    if isinstance(value, (torch.dtype, torch.device)):
        return ("torch", str(value))
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return _fn_key(value, tensors, seen, depth + 1)
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return (type(value).__name__, tuple(_value_key(x, tensors, seen, depth) for x in value))
    if isinstance(value, type):
        return ("type", value)
    return ("object", type(value).__qualname__, id(value))


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a function's code (and the code nested in it) may read as globals, sorted."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(_global_names(const))
    return tuple(sorted(names))


def _fn_key(fn: Any, tensors: list[torch.Tensor], seen: set[int], depth: int = 0) -> Any:
    """What a traced function depends on: its code and what it closes over (see module docstring)."""
    if fn is None:
        return None
    if depth > 6:
        return ("deep", id(fn))
    if isinstance(fn, functools.partial):
        return ("partial", _fn_key(fn.func, tensors, seen, depth + 1),
                _value_key(fn.args, tensors, seen, depth), _value_key(sorted(fn.keywords.items()), tensors, seen, depth))
    if isinstance(fn, types.MethodType):
        return ("method", _value_key(fn.__self__, tensors, seen, depth), _fn_key(fn.__func__, tensors, seen, depth + 1))
    if not isinstance(fn, types.FunctionType):
        return ("callable", type(fn).__qualname__, id(fn))
    if id(fn) in seen:
        return ("recursive", fn.__code__)
    seen.add(id(fn))
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_value_key(cell.cell_contents, tensors, seen, depth))
        except ValueError:  # an empty cell
            cells.append(("empty",))
    g = fn.__globals__
    globs = tuple((n, _value_key(g[n], tensors, seen, depth)) for n in _global_names(fn.__code__) if n in g)
    defaults = _value_key(fn.__defaults__, tensors, seen, depth)
    kwdefaults = _value_key(sorted((fn.__kwdefaults__ or {}).items()), tensors, seen, depth)
    return ("fn", fn.__code__, tuple(cells), globs, defaults, kwdefaults)


# (id of a captured 0-d tensor, device) -> (weak reference to it, its version when copied, the copy)
_scalar_copies: OrderedDict[tuple[int, str], tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = OrderedDict()


def scalar_on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a 0-d tensor) on `device`: one copy per version of `t`, so repeated calls do not copy
    again and in-place updates (`cap.fill_(20.0)`) are seen. The weak reference tells a new tensor
    that reuses a freed one's id from the one copied."""
    key = (id(t), str(device))
    hit = _scalar_copies.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        _scalar_copies.move_to_end(key)
        return hit[2]
    copy = t.to(device)
    _remember(_scalar_copies, key, (weakref.ref(t), t._version, copy), _MAX_PROGRAMS)
    return copy


@dataclass
class _Traced:
    program: Program
    names: tuple[str, ...]  # input names of the captured tensors
    sources: tuple[int | torch.Tensor, ...]  # per capture: its position among the found tensors, or the tensor
    keepalive: tuple[torch.Tensor, ...] = ()  # identity-keyed entries keep the tensors their key names

    @property
    def by_identity(self) -> bool:
        return any(isinstance(s, torch.Tensor) for s in self.sources)


_IDENTITY = object()  # marks a structural key whose entries are keyed by tensor identity too
_programs: OrderedDict[Any, Any] = OrderedDict()
_compiled: OrderedDict[Any, Compiled] = OrderedDict()


def clear_cache() -> None:
    """Forget traced programs and compiled kernels (kernel sources stay in the on-disk cache)."""
    _programs.clear()
    _compiled.clear()


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


@dataclass
class _Call:
    """Everything one call resolves: the program, its named arguments and the compile key."""

    program: Program
    args: dict[str, Any]
    struct_key: Any


def _resolve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, mask_mod: Any, scale: Any,
             enable_gqa: bool, return_lse: bool, checked: tuple[int, float] | None = None) -> _Call:
    mask_mod = _mask_mod_of(mask_mod)
    groups, scale = checked or _check_inputs(q, k, v, score_mod, scale, enable_gqa)
    found: list[torch.Tensor] = []
    fns = (_fn_key(score_mod, found, set()), _fn_key(mask_mod, found, set()))
    struct = (fns, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, return_lse)
    entry = _programs.get(struct)
    if entry is _IDENTITY:
        entry = _programs.get((struct, tuple(id(t) for t in found)))
    if entry is None:
        entry = _trace_entry(q, k, v, score_mod, mask_mod, groups, return_lse, found)
        if entry.by_identity:
            _remember(_programs, struct, _IDENTITY, _MAX_PROGRAMS)
            _remember(_programs, (struct, tuple(id(t) for t in found)), entry, _MAX_PROGRAMS)
        else:
            _remember(_programs, struct, entry, _MAX_PROGRAMS)
    args: dict[str, Any] = {"q": q, "k": k, "v": v, "scale": scale}
    for name, src in zip(entry.names, entry.sources, strict=True):
        t = src if isinstance(src, torch.Tensor) else found[src]
        if t.device != q.device:
            if t.dim() > 0:
                raise ValueError(f"a tensor captured by score_mod/mask_mod (shape {tuple(t.shape)}) is on {t.device}, "
                                 f"but query is on {q.device}")
            t = scalar_on_device(t, q.device)  # a scalar made on the CPU, e.g. torch.tensor(50.0)
        args[name] = t
    return _Call(entry.program, args, (fns, return_lse))


def _trace_entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, mask_mod: Any, groups: int,
                 return_lse: bool, found: list[torch.Tensor]) -> _Traced:
    table = CaptureTable(q.device)
    specs = [ArgSpec(n, tuple(int(s) for s in t.shape), "float") for n, t in (("q", q), ("k", k), ("v", v))]
    specs.append(ArgSpec("scale", None, "float"))
    program = trace(_body(score_mod, mask_mod, groups, return_lse, table), specs, "attention")
    sources: list[int | torch.Tensor] = []
    for t in table.tensors:
        pos = next((i for i, f in enumerate(found) if f is t), None)
        sources.append(t if pos is None else pos)
    entry = _Traced(program, tuple(table.names), tuple(sources))
    if entry.by_identity:
        entry.keepalive = tuple(found)
    return entry


class _FlexDef(ProgramDef):
    """The ProgramDef behind a Compiled attention: named arguments, the program resolved by the caller."""

    def __init__(self, names: tuple[str, ...]) -> None:
        def attention(*args: Any) -> Any:
            raise RuntimeError("call nf.attention(...) instead")

        attention.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
        super().__init__(attention)
        self.pending: Program | None = None

    def trace(self, *args: Any, **kwargs: Any) -> Program:
        if self.pending is None:
            raise RuntimeError("no attention program resolved for this call")
        return self.pending


def _compiled_for(call: _Call, schedule: Schedule | None) -> Compiled:
    schedule = schedule or Auto()
    names = tuple(call.args)
    key = (call.struct_key, names, schedule)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = Compiled(_FlexDef(names), schedule)
        _remember(_compiled, key, compiled, _MAX_COMPILED)
    else:
        _compiled.move_to_end(key)
    compiled.program_def.pending = call.program  # type: ignore[attr-defined]
    return compiled


# --------------------------------------------------------------------------- the user API


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
              mask_mod: MaskMod | None = None, scale: float | None = None, enable_gqa: bool = False,
              return_lse: bool = False, schedule: Schedule | None = None) -> Any:
    """Attention with FlexAttention's `score_mod` / `mask_mod`, compiled to one fused kernel.

    q: (B, Hq, Lq, E); k: (B, Hkv, Lkv, E); v: (B, Hkv, Lkv, Ev), one dtype (float16, bfloat16,
    float32) and one device (CUDA, or CPU under TRITON_INTERPRET=1). `Hq != Hkv` needs
    `enable_gqa=True` and `Hq % Hkv == 0` (query head h uses key/value head h // (Hq // Hkv)).
    `score_mod(score, b, h, q_idx, kv_idx)` returns the modified score (score already scaled);
    `mask_mod(b, h, q_idx, kv_idx)` returns True where the key is attended to (a FlexAttention
    `BlockMask` is accepted for its mask_mod). Rows with no attended key give 0. Returns the
    output (B, Hq, Lq, Ev) in the input dtype, and with `return_lse` also the logsumexp
    (B, Hq, Lq) as float32 (natural log, -inf for fully masked rows). `schedule` (nf.flash(),
    nf.split_k(), ...) overrides the template chosen from the shapes. Forward only (no autograd).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> slopes = torch.exp2(-torch.arange(1, 9.0))            # ALiBi, 8 heads
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score + slopes[h] * (kv_idx - q_idx)
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> # out = nf.attention(q, k, v, score_mod=alibi, mask_mod=causal)
    """
    checked = _check_inputs(q, k, v, score_mod, scale, enable_gqa)
    if 0 in q.shape[:3] or k.shape[2] == 0:  # nothing to compute, or every row fully masked
        out = q.new_zeros((*q.shape[:3], v.shape[3]))
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    call = _resolve(q, k, v, score_mod, mask_mod, scale, enable_gqa, return_lse, checked)
    compiled = _compiled_for(call, schedule)
    result = compiled(*call.args.values())
    if return_lse:
        out, lse = result
        return out, lse
    return result


def attention_program(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                      mask_mod: MaskMod | None = None, scale: float | None = None, enable_gqa: bool = False,
                      return_lse: bool = False) -> Program:
    """The plain (unfused) Program that `attention` compiles for these arguments.

    Its inputs are `q`, `k`, `v`, the captured tensors `cap0`, `cap1`, ... and the scalar
    parameter `scale`; `attention_inputs` gives them by name, for `nf.run_reference`.

    Example:
        >>> # prog = nf.attention_program(q, k, v, mask_mod=causal)
        >>> # out = nf.run_reference(prog, nf.attention_inputs(q, k, v, mask_mod=causal))
    """
    return _resolve(q, k, v, score_mod, mask_mod, scale, enable_gqa, return_lse).program


def attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                     mask_mod: MaskMod | None = None, scale: float | None = None, enable_gqa: bool = False,
                     return_lse: bool = False) -> dict[str, Any]:
    """The named arguments of `attention_program(...)`: q, k, v, scale and the captured tensors."""
    return _resolve(q, k, v, score_mod, mask_mod, scale, enable_gqa, return_lse).args


def explain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                      mask_mod: MaskMod | None = None, scale: float | None = None, enable_gqa: bool = False,
                      return_lse: bool = False, schedule: Schedule | None = None) -> str:
    """`nf.explain` for `attention(...)`: the traced program, each fusion pass, the tile program, the Triton source."""
    from neptune_fusion.runtime.explain import explain

    call = _resolve(q, k, v, score_mod, mask_mod, scale, enable_gqa, return_lse)
    return explain(_compiled_for(call, schedule), **call.args)
