"""FlexAttention-compatible attention: the same `score_mod` / `mask_mod` functions, fused and compiled.

`attention(q, k, v, score_mod=..., block_mask=...)` (FlexAttention's signature) traces the plain
attention program

    s = q @ k^T * scale                      (default scale 1 / sqrt(head_dim))
    s = score_mod(s, b, h, q_idx, kv_idx)
    s = where(keep(b, h, q_idx, kv_idx), s, -inf)      (keep: the mask_mod, or a BlockMask's lists
                                                        and mask_mod: integrations/blockmask.py;
                                                        its mask_mod alone where that implies them)
    m = max_kv s;  p = exp(s - m);  l = sum_kv p;  u = p @ v
    out = where(m == -inf, 0, u / l)         (a row with no visible key gives 0; NaN stays NaN)
    lse = where(m == -inf, -inf, m + log(l)) (on request; natural log, float32; max scores: m)

where `b, h, q_idx, kv_idx` are symbolic integer index tensors, and hands it to the compiler, which
derives the online softmax (FlashAttention) itself. `score_mod` and `mask_mod` are written exactly
as for `torch.nn.attention.flex_attention`: torch operations on their arguments and indexing of
captured tensors (`slopes[h]`, `doc_id[q_idx] == doc_id[kv_idx]`, `bias[h, q_idx]`). Captured
tensors become extra kernel inputs, passed on every call (so in-place updates are seen); their
indices are not bounds-checked (as in FlexAttention, out-of-range indices are the caller's bug).
Inputs or captured tensors that require grad (in grad mode) get the backward the compiler derives
(integrations/autograd.py). `attend` takes the masks
models ask for by value (causal, window, softcap, key padding), with nothing to trace per call.
Inside torch.compile a call is one registered op (`neptune_fusion::flex_attention`) whose inputs
include the tensors the mods capture (reached by the paths `_fn_key` records).

Caching: traced programs are cached per (score_mod, mask_mod, shapes, dtypes, flags) and compiled
kernels per (score_mod, mask_mod, schedule, flags). A function is identified by its code and the
values it closes over (closure cells, globals it names, defaults, nested functions): Python
scalars by value, tensors by shape/dtype (and passed anew on every call). A new closure from the
same factory reuses the compiled kernel. An object a mod reaches (`self` of a bound method, a
captured config) is keyed by identity and by its own attributes that the mod's code names
(`self.cap`, `self.slopes`, nested objects the same way), read again on every repeated call (inside
torch.compile by the op, which keys its kernels again when one changed); attributes found otherwise
(`getattr` with a computed name, a property) are fixed at the first trace.

Example:
    >>> import torch, neptune_fusion as nf
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> def softcap(score, b, h, q_idx, kv_idx):
    ...     return 30.0 * torch.tanh(score / 30.0)
    >>> q = k = v = torch.randn(1, 2, 16, 16)
    >>> out = nf.attention(q, k, v, score_mod=softcap, mask_mod=causal)
    >>> tuple(out.shape)
    (1, 2, 16, 16)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch

from neptune_fusion.integrations.autograd import handle_for, refresh_with
from neptune_fusion.integrations.autograd import train_forward as _train_forward
from neptune_fusion.integrations.blockmask import block_tables, implied_by_mask_mod, mask_mod_of, visible
from neptune_fusion.ir.expr import Const, simplify
from neptune_fusion.ir.program import Program
from neptune_fusion.lang.ops import einsum, exp, index, log, repeat_interleave, size, tanh, where
from neptune_fusion.lang.tensor import SymTensor, broadcast, cast, lift
from neptune_fusion.lang.torch_function import CaptureTable
from neptune_fusion.lang.trace import ArgSpec, ProgramDef, trace
from neptune_fusion.runtime.compiled import Compiled
from neptune_fusion.runtime.state import CALL_STATE, in_cudagraph_tree, object_of, private_state, static_shape
from neptune_fusion.schedule.templates import Auto, Flash, Schedule, SplitK

__all__ = ["AuxOutput", "Builtins", "attend", "attention", "attention_inputs", "attention_program", "clear_cache",
           "explain_attention"]

ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]
MaskMod = Callable[[Any, Any, Any, Any], Any]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_PROGRAMS = 256
_MAX_COMPILED = 64


# --------------------------------------------------------------------------- argument checks


def _check_inputs(q: Any, k: Any, v: Any, score_mod: Any, scale: Any, enable_gqa: bool) -> tuple[int, float]:
    """Validate like flex_attention; returns (query heads per kv head, scale)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} is a {t.layout} tensor; attention reads dense (strided) tensors")
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
    # inside torch.compile the scale may be symbolic (dynamic shapes, a float variable): the
    # launch checks it (a kernel's float parameters must be finite)
    if not torch.compiler.is_compiling() and not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return (hq // hk if hk else 1), scale


# --------------------------------------------------------------------------- the traced program


def _broadcast_to(x: SymTensor, like: SymTensor, what: str) -> SymTensor:
    dims, (expr, _) = broadcast([x, like], what)
    if len(dims) != like.ndim:
        raise ValueError(f"{what} must return one value per (b, h, q_idx, kv_idx), got a result of rank {x.ndim}")
    return SymTensor(dims, expr, x.tracer, x.kind)


class Builtins(NamedTuple):
    """Masks and score changes the caller describes by value instead of by a function (transformers
    models, BlockMasks): tuples of constants, so torch.compile can treat them as constants, with the
    tensors they read passed as `extras` (in this order: block tables, key padding, document ids, a
    given mask)."""

    causal_end: bool = False  # query i sits at key position Lk - Lq + i and sees keys up to it
    # with causal_end, only the `window` keys ending at the query's position; without, the keys
    # less than `window` positions from it on either side (a bidirectional band)
    window: int | None = None
    softcap: float | None = None  # score -> softcap * tanh(score / softcap)
    padding: bool = False  # extras hold a (B, Lk) bool key-padding mask: True = attend
    documents: bool = False  # extras hold (B, Lk) integer ids: a query sees the keys with its own position's id
    block: tuple[int, int, bool] | None = None  # (q block, kv block, has full lists): extras hold BlockMask tables
    # extras hold a 4-D mask (B or 1, H or 1, Lq or 1, Lk): ("mask", ...) bool, True = attend, or
    # ("bias", ...) added to the scores; then whether its batch, head and query axes are whole (not 1)
    given: tuple[str, bool, bool, bool] | None = None


class Outputs(NamedTuple):
    """Which row statistics a call returns besides the output (both float32, natural log)."""

    lse: bool = False
    max_scores: bool = False


def _body(score_mod: ScoreMod | None, mask_mod: MaskMod | None, builtins: Builtins, extras: tuple[torch.Tensor, ...],
          groups: int, outputs: Outputs, table: CaptureTable) -> Callable[..., Any]:
    def attention(q: SymTensor, k: SymTensor, v: SymTensor, scale: SymTensor) -> Any:
        tracer = q.tracer
        tracer.captures = table  # type: ignore[attr-defined]
        if groups > 1:  # grouped-query attention: query head h reads key/value head h // groups
            k = repeat_interleave(k, groups, 1)
            v = repeat_interleave(v, groups, 1)
        s = einsum("bhqd,bhkd->bhqk", q, k) * scale
        b, h, q_idx, kv_idx = (index(s, axis) for axis in range(4))
        if builtins.softcap is not None:
            s = builtins.softcap * tanh(s * (1.0 / builtins.softcap))
        if score_mod is not None:
            r = lift(score_mod(s, b, h, q_idx, kv_idx), tracer)
            if r.kind == "bool":
                raise TypeError("score_mod must return a score (a float), got a boolean; use mask_mod for masks")
            if r.kind == "int":
                r = cast(r, "f32")
            s = _broadcast_to(r, s, "score_mod")
        keep = None if mask_mod is None else _mask_of(mask_mod(b, h, q_idx, kv_idx), tracer)
        rest = list(extras)
        if builtins.block is not None:
            q_block, kv_block, has_full = builtins.block
            partial = rest.pop(0)
            full = rest.pop(0) if has_full else None
            keep = visible(partial, full, q_block, kv_block, keep, b, h, q_idx, kv_idx)
            keep = _mask_of(keep, tracer)
        # the query's key position; with one query it is the last key, and the causal condition holds
        # for every key: leaving the query axis out of decode's mask lets GQA groups share K/V reads.
        # The lengths stay symbolic (kernel arguments): every KV-cache length is one program and kernel
        position = q_idx + (size(k, 2) - size(q, 2)) if q.shape[2] > 1 else size(k, 2) - 1
        if builtins.causal_end and q.shape[2] > 1:
            keep = _and(keep, _mask_of(position >= kv_idx, tracer))
        if builtins.window is not None:
            keep = _and(keep, _mask_of(position - kv_idx < builtins.window, tracer))
            if not builtins.causal_end:
                keep = _and(keep, _mask_of(kv_idx - position < builtins.window, tracer))
        if builtins.padding:
            keep = _and(keep, _mask_of(rest.pop(0)[b, kv_idx], tracer))
        if builtins.documents:
            ids = rest.pop(0)
            keep = _and(keep, _mask_of(ids[b, position] == ids[b, kv_idx], tracer))
        if builtins.given is not None:
            kind, whole_b, whole_h, whole_q = builtins.given
            at = rest.pop(0)[b if whole_b else 0, h if whole_h else 0, q_idx if whole_q else 0, kv_idx]
            if kind == "mask":
                keep = _and(keep, _mask_of(at, tracer))
            else:
                s = s + at
        if keep is not None:
            cond = simplify(keep.expr)  # e.g. and_masks' `True & m` -> m, so the mask analysis sees m
            if not (isinstance(cond, Const) and cond.value is True):
                s = where(SymTensor(keep.dims, cond, tracer, "bool"), s, -math.inf)
        m = s.max(axis=-1, keepdims=True)
        p = exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        u = einsum("bhqk,bhke->bhqe", p, v)
        # only rows whose every score is -inf (no visible key) give 0: a NaN score reaches its row
        empty = m == -math.inf
        out = where(empty, 0.0, u / denom)
        stats = []
        if outputs.lse:
            # a +inf score makes the row's exponentials NaN, and its LSE +inf, as FlexAttention's
            lse = where(empty, -math.inf, where(m == math.inf, math.inf, m + log(denom)))
            stats.append(cast(lse[..., 0], "f32"))  # float32, as FlexAttention
        if outputs.max_scores:
            stats.append(cast(m[..., 0], "f32"))
        return (out, *stats) if stats else out

    return attention


def _mask_of(value: Any, tracer: Any) -> SymTensor:
    keep = lift(value, tracer)
    if keep.kind != "bool":
        raise TypeError(f"mask_mod must return a boolean (e.g. q_idx >= kv_idx), got a value of kind {keep.kind}")
    return keep


def _and(a: SymTensor | None, b: SymTensor) -> SymTensor:
    return b if a is None else a & b


# --------------------------------------------------------------------------- caching


_SCALARS = (type(None), bool, int, float, complex, str, bytes)

# How to reach a tensor a mod closes over, from the mod: a tuple of steps, each ("cell", i),
# ("global", name), ("default", i), ("kwdefault", name), ("item", i or a dict's key), ("func",),
# ("self",), ("class", name) (a callable object's function), ("arg", i) or ("keyword", name).
# torch.compile follows the same steps (`_follow`) to pass the tensors into the graph as inputs,
# so it sees (and guards) the values of every call.
Path = tuple[tuple[Any, ...], ...]


class _Walk:
    """Tensors found while keying a mod, in order, with the path to each, and every mutable place
    the key was read from (so a later call can check, by identity, that the key still holds)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.paths: list[Path] = []
        self.seen: set[int] = set()
        self.reads: list[tuple[str, Any, Any, Any]] = []  # (kind, holder, where, the value read)

    def read(self, kind: str, holder: Any, where: Any, value: Any) -> Any:
        self.reads.append((kind, holder, where, value))
        return value


_MISSING = object()


def tensor_layout(t: torch.Tensor) -> tuple[Any, ...]:
    """What a compiled launcher is specialised on besides a tensor's identity: shape, strides, dtype,
    device and 16-byte alignment (`model.half()` changes a parameter's dtype in place)."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _same_layout(t: torch.Tensor, layout: tuple[Any, ...]) -> bool:
    """`tensor_layout(t) == layout`, without building the tuple (a repeated call's check).

    Example:
        >>> t = torch.zeros(2, 3)
        >>> _same_layout(t, tensor_layout(t)), _same_layout(t.t(), tensor_layout(t))
        (True, False)
    """
    shape, stride, dtype, device, aligned = layout
    return (t.dtype is dtype and t.shape == shape and t.stride() == stride and t.device == device
            and (t.data_ptr() % 16 == 0) is aligned)


def _unchanged(reads: list[tuple[str, Any, Any, Any]]) -> bool:
    """Whether every place a key was read from still holds the same object (tensors: same layout)."""
    for kind, holder, place, value in reads:
        if kind == "cell":
            try:
                if holder.cell_contents is not value:
                    return False
            except ValueError:  # the cell was emptied
                return False
        elif kind == "item":
            if place >= len(holder) or holder[place] is not value:
                return False
        elif kind == "len":
            if len(holder) != value:
                return False
        elif kind == "tensor":
            if tensor_layout(holder) != value:
                return False
        elif kind == "attr":
            if getattr(holder, place, _MISSING) is not value:
                return False
        elif kind == "array":
            if holder.shape != value.shape or holder.dtype != value.dtype or not (holder == value).all():
                return False
        elif holder.get(place, _MISSING) is not value:  # "key": a dict entry (globals, keywords)
            return False
    return True


def _instance_attributes(obj: Any, names: tuple[str, ...]) -> list[tuple[str, Any]]:
    """The attributes among `names` that `obj` holds itself (its instance dict; a Module's
    parameters, buffers and submodules too), sorted: what a function whose code names them may
    read through it (`self.cap`, `cfg.slopes`)."""
    if not names:
        return []
    d = getattr(obj, "__dict__", None)
    stores = [d] if isinstance(d, dict) else []
    if isinstance(obj, torch.nn.Module) and stores:
        stores += [d.get("_parameters"), d.get("_buffers"), d.get("_modules")]
    found: dict[str, Any] = {}
    for store in stores:
        if isinstance(store, dict):
            for n in names:
                if n in store and n not in found:
                    found[n] = store[n]
    for n in names:  # attributes in __slots__
        if n not in found and isinstance(getattr(type(obj), n, None), types.MemberDescriptorType):
            value = getattr(obj, n, _MISSING)
            if value is not _MISSING:
                found[n] = value
    return sorted(found.items())


def _value_key(value: Any, walk: _Walk, path: Path, depth: int, names: tuple[str, ...] = ()) -> Any:
    """The key of a value a mod reaches; `names`: the names its code uses, so the attributes of an
    object it reaches that those name are part of the key (and read again by `_unchanged`)."""
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        walk.tensors.append(value)
        walk.paths.append(path)
        walk.read("tensor", value, None, tensor_layout(value))
        return ("tensor", tuple(value.shape), value.dtype, str(value.device))
    if isinstance(value, (torch.dtype, torch.device)):
        return ("torch", str(value))
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return _fn_key(value, walk, path, depth + 1)
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        if isinstance(value, list):
            walk.read("len", value, None, len(value))
            for i, x in enumerate(value):
                walk.read("item", value, i, x)
        return (type(value).__name__,
                tuple(_value_key(x, walk, (*path, ("item", i)), depth, names) for i, x in enumerate(value)))
    if isinstance(value, dict):
        return _dict_key(value, walk, path, depth, names)
    if type(value).__module__ == "numpy":
        return _numpy_key(value, walk)
    if isinstance(value, type):
        return ("type", value)
    if depth > 6 or id(value) in walk.seen:
        return ("object", type(value).__qualname__, id(value))
    walk.seen.add(id(value))
    attrs = tuple((n, _value_key(walk.read("attr", value, n, x), walk, (*path, ("attr", n)), depth + 1, names))
                  for n, x in _instance_attributes(value, names))
    return ("object", type(value).__qualname__, id(value), attrs)


def _dict_key(value: dict[Any, Any], walk: _Walk, path: Path, depth: int, names: tuple[str, ...]) -> Any:
    """A dict's key: its entries that the code may read (those whose key the code names, or every
    entry of a small dict keyed by scalars), each read again by `_unchanged`."""
    if not all(isinstance(k, _SCALARS) for k in value):
        return ("object", "dict", id(value))
    keys = [k for k in value if len(value) <= 64 or k in names]
    walk.read("len", value, None, len(value))
    return ("dict", tuple((k, _value_key(walk.read("key", value, k, value[k]), walk, (*path, ("item", k)), depth, names))
                          for k in keys))


def _numpy_key(value: Any, walk: _Walk) -> Any:
    """A numpy value's key: its contents (a mod reads them as constants while it is traced); an
    array is mutable, so `_unchanged` compares its contents again."""
    import numpy as np

    if isinstance(value, np.ndarray):
        walk.read("array", value, None, value.copy())
        return ("ndarray", value.shape, str(value.dtype), value.tobytes())
    if isinstance(value, np.generic):
        return ("numpy", str(value.dtype), value.item())
    return ("object", type(value).__qualname__, id(value))


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a function's code (and the code nested in it) may read as globals or attributes, and
    its string constants (`cfg["cap"]`, `getattr(self, "cap")`), sorted."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= set(_global_names(const))
        elif isinstance(const, str) and const.isidentifier():
            names.add(const)
    return tuple(sorted(names))


def _call_function(obj: Any) -> types.FunctionType | None:
    """The Python function a call of the object `obj` runs (a Module's `forward`, a class's
    `__call__`), or None: what its key reads through `self`."""
    if isinstance(obj, torch.nn.Module):
        if obj._forward_hooks or obj._forward_pre_hooks:
            return None  # the hooks run too: keyed by identity only
        fn = getattr(type(obj), "forward", None)
    else:
        fn = next((c.__dict__["__call__"] for c in type(obj).__mro__ if "__call__" in c.__dict__), None)
    return fn if isinstance(fn, types.FunctionType) else None


def _fn_key(fn: Any, walk: _Walk, path: Path = (), depth: int = 0) -> Any:
    """What a traced function depends on: its code and what it closes over (see module docstring)."""
    if fn is None:
        return None
    if depth > 6:
        return ("deep", id(fn))
    if isinstance(fn, functools.partial):
        args = tuple(_value_key(x, walk, (*path, ("arg", i)), depth) for i, x in enumerate(fn.args))
        walk.read("len", fn.keywords, None, len(fn.keywords))
        kws = tuple((n, _value_key(walk.read("key", fn.keywords, n, fn.keywords[n]), walk, (*path, ("keyword", n)), depth))
                    for n in sorted(fn.keywords))
        return ("partial", _fn_key(fn.func, walk, (*path, ("func",)), depth + 1), args, kws)
    if isinstance(fn, types.MethodType):
        code = getattr(fn.__func__, "__code__", None)
        names = _global_names(code) if isinstance(code, types.CodeType) else ()
        return ("method", _value_key(fn.__self__, walk, (*path, ("self",)), depth, names),
                _fn_key(fn.__func__, walk, (*path, ("func",)), depth + 1))
    if not isinstance(fn, types.FunctionType):
        call = _call_function(fn)
        if call is None:
            return ("callable", type(fn).__qualname__, id(fn))
        # a callable object (a Module, a class with __call__): its function, and what that reads
        # through self, as a bound method's
        names = _global_names(call.__code__)
        return ("object", _value_key(fn, walk, path, depth, names),
                _fn_key(call, walk, (*path, ("class", call.__name__)), depth + 1))
    if id(fn) in walk.seen:
        return ("recursive", fn.__code__)
    walk.seen.add(id(fn))
    names = _global_names(fn.__code__)  # also every attribute name the code reads
    cells = []
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            contents = walk.read("cell", cell, None, cell.cell_contents)
        except ValueError:  # an empty cell (filled later: the fast path's check then fails)
            walk.read("cell", cell, None, _MISSING)
            cells.append(("empty",))
            continue
        cells.append(_value_key(contents, walk, (*path, ("cell", i)), depth, names))
    g = fn.__globals__
    globs = tuple((n, _value_key(g[n], walk, (*path, ("global", n)), depth, names))
                  for n in names if walk.read("key", g, n, g.get(n, _MISSING)) is not _MISSING)
    defaults = tuple(_value_key(x, walk, (*path, ("default", i)), depth, names)
                     for i, x in enumerate(walk.read("attr", fn, "__defaults__", fn.__defaults__) or ()))
    kwdefaults = tuple((n, _value_key(x, walk, (*path, ("kwdefault", n)), depth, names))
                       for n, x in sorted((walk.read("attr", fn, "__kwdefaults__", fn.__kwdefaults__) or {}).items()))
    return ("fn", fn.__code__, tuple(cells), globs, defaults, kwdefaults)


def _follow(obj: Any, path: Path) -> Any:
    """The value `path` (from `_fn_key`) reaches from `obj`; written so torch.compile can trace it."""
    for step in path:
        kind = step[0]
        if kind == "cell":
            obj = obj.__closure__[step[1]].cell_contents
        elif kind == "global":
            obj = obj.__globals__[step[1]]
        elif kind == "default":
            obj = obj.__defaults__[step[1]]
        elif kind == "kwdefault":
            obj = obj.__kwdefaults__[step[1]]
        elif kind in ("item", "arg"):
            obj = (obj if kind == "item" else obj.args)[step[1]]
        elif kind == "keyword":
            obj = obj.keywords[step[1]]
        elif kind == "func":
            obj = obj.func if isinstance(obj, functools.partial) else obj.__func__
        elif kind == "attr":
            obj = getattr(obj, step[1])
        elif kind == "class":
            obj = getattr(type(obj), step[1])
        else:  # "self"
            obj = obj.__self__
    return obj


def _capture_names(request: Any, paths: Any) -> tuple[str, ...]:
    """`_describe` of each path `_keys(request)` recorded (they start at (score_mod, mask_mod))."""
    mods = (request.score_mod, request.mask_mod)
    return tuple(_describe(("score_mod", "mask_mod")[p[0][1]], mods[p[0][1]], p[1:]) for p in paths)


def _describe(mod_name: str, fn: Any, path: Path) -> str:
    """Where a captured tensor comes from, for error messages ("score_mod's closure variable 'slopes'")."""
    step = path[-1] if path else ("",)
    if step[0] == "cell":
        owner = fn
        for s in path[:-1]:
            owner = _follow(owner, (s,))
        names = getattr(getattr(owner, "__code__", None), "co_freevars", ())
        if step[1] < len(names):
            return f"{mod_name}'s closure variable {names[step[1]]!r}"
    if step[0] == "global":
        return f"{mod_name}'s global {step[1]!r}"
    if step[0] == "attr":
        return f"the attribute {step[1]!r} {mod_name} reads"
    return f"a tensor {mod_name} captures"


# (id of a captured 0-d tensor, device) -> (weak reference to it, its version when copied, the copy)
_scalar_copies: OrderedDict[tuple[int, str], tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = OrderedDict()


def scalar_on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a 0-d tensor) on `device`: one copy per version of `t`, so repeated calls do not copy
    again and in-place updates (`cap.fill_(20.0)`) are seen. The weak reference tells a new tensor
    that reuses a freed one's id from the one copied."""
    if CALL_STATE.private:
        return t.to(device)
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
    _fast.clear()
    _lean.clear()


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


class _Request(NamedTuple):
    """What a call asks for, apart from its tensors: constants (torch.compile keys a handle on them)."""

    score_mod: Any
    mask_mod: Any
    builtins: Builtins
    outputs: Outputs
    enable_gqa: bool
    schedule: Schedule | None


@dataclass
class _Call:
    """Everything one call resolves: the program, its named arguments and the compile key."""

    program: Program
    args: dict[str, Any]
    struct_key: Any
    paths: tuple[Path, ...]  # per found closure tensor (the extras follow them): where it lives
    struct: Any = None  # the key of the traced program


def _keys(request: _Request) -> tuple[Any, _Walk]:
    walk = _Walk()
    fns = (_fn_key(request.score_mod, walk, (("item", 0),)), _fn_key(request.mask_mod, walk, (("item", 1),)))
    return fns, walk


def _resolve(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: _Request, extras: tuple[torch.Tensor, ...],
             scale: float, groups: int, keyed: tuple[Any, _Walk] | None = None,
             found: list[torch.Tensor] | None = None) -> _Call:
    """The program and named arguments of a call. `found` (the closure tensors, then the extras)
    is given when torch.compile passes them; otherwise they are found by walking the mods."""
    fns, walk = keyed or _keys(request)
    if found is None:
        found = [*walk.tensors, *extras]
    struct = (fns, request.builtins, request.outputs, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
              tuple((tuple(t.shape), t.dtype) for t in extras))
    any_length = (fns, request.builtins, request.outputs, _length_class(q.shape), _length_class(k.shape),
                  _length_class(v.shape), q.dtype, tuple((tuple(map(_size_class, t.shape)), t.dtype) for t in extras))
    entry = _programs.get(any_length)
    if entry is not None:
        struct = any_length
    else:
        entry = _programs.get(struct)
    if entry is _IDENTITY:
        entry = _programs.get((struct, tuple(id(t) for t in found)))
    if entry is None:
        entry = _trace_entry(q, k, v, request, extras, groups, [*walk.tensors, *extras])
        if entry.by_identity:
            _remember(_programs, struct, _IDENTITY, _MAX_PROGRAMS)
            _remember(_programs, (struct, tuple(id(t) for t in found)), entry, _MAX_PROGRAMS)
        else:
            if _length_free(entry.program):
                struct = any_length
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
    return _Call(entry.program, args, (fns, request.builtins, request.outputs), tuple(walk.paths), struct)


def _size_class(size: int) -> int:
    """What a trace sees of a sequence length: 1 (a broadcast dimension) or not (-1)."""
    return 1 if size == 1 else -1


def _length_class(shape: torch.Size) -> tuple[int, ...]:
    """A (B, H, L, E) shape with its length classed: one trace serves every length of the class."""
    return (shape[0], shape[1], _size_class(shape[2]), shape[3])


def _length_free(program: Program) -> bool:
    """Whether a traced attention program holds for every length of its class: the body reads the
    lengths only symbolically (`size`), so it does unless a captured tensor was broadcast against
    the score by shape (its dimensions then are the query or key axes, and sized by them)."""
    lengths = {program.input("q").dims[2], program.input("k").dims[2]} - {None}
    return not any(lengths & set(b.dims) for b in program.inputs if b.name not in ("q", "k", "v"))


def _trace_entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: _Request,
                 extras: tuple[torch.Tensor, ...], groups: int, found: list[torch.Tensor]) -> _Traced:
    table = CaptureTable(q.device)
    specs = [ArgSpec(n, tuple(int(s) for s in t.shape), "float") for n, t in (("q", q), ("k", k), ("v", v))]
    specs.append(ArgSpec("scale", None, "float"))
    body = _body(request.score_mod, request.mask_mod, request.builtins, extras, groups, request.outputs, table)
    program = trace(body, specs, "attention")
    sources: list[int | torch.Tensor] = []
    for t in table.tensors:
        pos = next((i for i, f in enumerate(found) if f is t), None)
        sources.append(t if pos is None else pos)
    entry = _Traced(program, tuple(table.names), tuple(sources))
    if entry.by_identity:
        entry.keepalive = tuple(found)
    return entry


class _FlexDef(ProgramDef):
    """The ProgramDef behind a Compiled attention: named arguments, the program resolved by the
    caller; the output has the query's dtype, as FlexAttention's (captured fp32 tables do not promote it)."""

    promotes_outputs = False

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


def _needs_grad(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any of `tensors` requires grad (callers check grad mode first: no list is built
    on the inference path)."""
    return any(t.requires_grad for t in tensors)


def _run_with_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: _Request,
                   extras: tuple[torch.Tensor, ...], scale: float, groups: int) -> tuple[torch.Tensor, ...]:
    """An eager call that records gradients: the program's derived backward (integrations/autograd.py)
    takes q, k, v and every captured tensor that requires grad."""
    call = _resolve(q, k, v, request, extras, scale, groups)
    result = _compiled_for(call, request.schedule)(**call.args)
    return result if isinstance(result, tuple) else (result,)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: _Request, extras: tuple[torch.Tensor, ...],
         scale: float, groups: int, found: list[torch.Tensor] | None = None,
         keyed: tuple[Any, _Walk] | None = None, fast_key: Any = None) -> tuple[torch.Tensor, ...]:
    """Run the fused kernel: (out, *requested statistics). `found` (the closure tensors, then the
    extras) and `keyed` come from torch.compile's op; an eager call walks the mods here. The
    resolution is kept under `fast_key` for the next call with the same key (`_call`)."""
    if 0 in q.shape[:3] or k.shape[2] == 0:  # nothing to compute, or every row fully masked
        out = q.new_zeros((*q.shape[:3], v.shape[3]))
        stat = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        return (out, *(stat.clone() for _ in range(sum(request.outputs))))
    if found is None:  # an eager call (torch.compile checks before its op)
        keyed = _keys(request)
        if torch.is_grad_enabled() and _needs_grad([q, k, v, *keyed[1].tensors, *extras]):
            return _run_with_grad(q, k, v, request, extras, scale, groups)
    call = _resolve(q, k, v, request, extras, scale, groups, keyed, found)
    args = tuple(call.args.values())
    compiled = _compiled_for(call, request.schedule)
    result = compiled.launcher_for(args)(args)
    run = compiled.launcher_for(args)  # after the first launch: the launcher itself (see launcher_for)
    entry = _programs.get(call.struct)
    if fast_key is not None and isinstance(entry, _Traced):  # not for entries keyed by tensor identity too
        assert keyed is not None
        layouts = (tensor_layout(q), tensor_layout(k), tensor_layout(v), *map(tensor_layout, extras))
        _remember(_fast, fast_key, _FastCall(request, keyed, run, scale, tuple(entry.sources), checks=found is None,
                                             layouts=layouts), _MAX_COMPILED)
    return result if isinstance(result, tuple) else (result,)


class _FastCall:
    """A repeated call's resolution: the mods' key, the launcher, and where each captured argument
    comes from (positions among the closure tensors, then the extras). The fast key fixes the
    layout of q, k, v and the extras; an eager call's key holds while `_unchanged(walk.reads)`
    (captured tensors: the same objects, with the same layout); torch.compile's op passes its
    tensors explicitly and keys their layouts."""

    def __init__(self, request: _Request, keyed: tuple[Any, _Walk], run: Callable[[Sequence[Any]], Any],
                 scale: float, sources: tuple[int, ...], checks: bool, layouts: tuple[Any, ...] = ()) -> None:
        self.request = request
        self.fns, self.walk = keyed
        self.run = run  # the compiled launcher for exactly these argument layouts
        self.scale = scale
        self.sources = sources
        self.checks = checks
        self.layouts = layouts  # of q, k, v and the extras (eager calls)

    def valid(self) -> bool:
        """Whether what the mods' key was read from still holds (the fast key, which keys the mods
        by `_mod_id`, already fixes the mods themselves)."""
        return not self.checks or _unchanged(self.walk.reads)

    def _result(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, found: Sequence[torch.Tensor]) -> Any:
        """The launcher's result for q, k, v and the captured arguments at `sources` in `found`."""
        args: list[Any] = [q, k, v, self.scale]
        for pos in self.sources:
            t = found[pos]
            args.append(t if t.device == q.device else scalar_on_device(t, q.device))
        return self.run(args)

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, found: list[torch.Tensor]) -> tuple[Any, ...]:
        result = self._result(q, k, v, found)
        return result if isinstance(result, tuple) else (result,)

    def again(self, q: Any, k: Any, v: Any, extras: tuple[torch.Tensor, ...]) -> Any:
        """The launcher's result (the output, or a tuple with the statistics) for an eager call
        whose arguments other than tensors are those of the call that made this entry (`_lean`
        keys them), or None where anything `_call` would check differs: tensor layouts, grad,
        what the mods read."""
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            return None
        layouts = self.layouts
        if not (_same_layout(q, layouts[0]) and _same_layout(k, layouts[1]) and _same_layout(v, layouts[2])
                and (not extras or all(map(_same_layout, extras, layouts[3:])))):
            return None
        found = self.walk.tensors
        if torch.is_grad_enabled() and _needs_grad([q, k, v, *found, *extras]):
            return None
        if self.checks and not _unchanged(self.walk.reads):
            return None
        return self._result(q, k, v, [*found, *extras] if extras else found)


_fast: OrderedDict[Any, _FastCall] = OrderedDict()
# eager calls by their arguments other than tensors (the mods by identity: an entry holds them), so
# a repeated call skips building its request and its full key; a few entries per key, newest
# first, for calls with the same mods at other shapes (prefill and decode, two layer sizes)
_lean: OrderedDict[Any, tuple[_FastCall, ...]] = OrderedDict()
_LEAN_PER_KEY = 4


def _lean_hit(lean_key: Any, q: Any, k: Any, v: Any, extras: tuple[torch.Tensor, ...]) -> Any:
    """The result of the call through a `_lean` entry, or None (the caller takes the full path)."""
    # the key fixes the mods and the schedule (`_mod_id`, id: an entry holds them, so no id it keys
    # by is reused while it lives); each entry is one layout of q, k, v
    for hit in _lean.get(lean_key, ()):
        result = hit.again(q, k, v, extras)
        if result is not None:
            return result
    return None


def _lean_remember(lean_key: Any, hit: _FastCall) -> None:
    entries = _lean.get(lean_key, ())
    if hit.layouts and (not entries or entries[0] is not hit):
        _remember(_lean, lean_key, (hit, *(e for e in entries if e is not hit))[:_LEAN_PER_KEY], _MAX_COMPILED)


# --------------------------------------------------------------------------- torch.compile


@dataclass(frozen=True)
class _Handle:
    request: _Request
    keyed: tuple[Any, _Walk]  # the mods' key, and the tensors they held when first seen
    paths: tuple[Path, ...]


_handles: list[_Handle] = []
_handle_of: dict[Any, int] = {}


def _as_constants(mod: Any) -> tuple[Any, int | None]:
    """A mod as torch.compile can pass it to `_static_handle`: (function, None), or a bound method
    (`score_mod=self.alibi`) as (its function, the id of its object). torch.compile passes neither
    the bound method nor a module as a constant, but it does pass an object's id (and guards on
    that object's identity, so another object traces again)."""
    if isinstance(mod, types.MethodType):
        return mod.__func__, id(mod.__self__)
    return mod, None


def _rebound(fn: Any, obj_id: int | None) -> Any:
    """The mod `_as_constants` took apart. The object is alive: the call being traced holds it."""
    return fn if obj_id is None else types.MethodType(fn, object_of(obj_id))


@torch._dynamo.assume_constant_result
def _static_handle(score_mod: Any, score_self: int | None, mask_mod: Any, mask_self: int | None, builtins: tuple[Any, ...],
                   outputs: tuple[bool, ...], enable_gqa: bool, schedule: Any) -> tuple[int, tuple[Path, ...],
                                                                                       tuple[str, ...]]:
    """A handle for what the op needs apart from tensors, the paths from the mods to the tensors
    they capture (torch.compile follows them, so each call passes the current ones) and their
    names for error messages. Runs once per compilation: torch.compile keeps the result (the
    request comes in flat: torch.compile passes plain tuples and functions as constants, and a bound
    method as its function and its object's id, `_as_constants`)."""
    request = _Request(_rebound(score_mod, score_self), _rebound(mask_mod, mask_self), Builtins(*builtins),
                       Outputs(*outputs), enable_gqa, schedule)
    keyed = _keys(request)
    fns, walk = keyed
    key = (fns, request)
    if key not in _handle_of:
        _handle_of[key] = len(_handles)
        _handles.append(_Handle(request, keyed, tuple(walk.paths)))
    return _handle_of[key], tuple(walk.paths), _capture_names(request, walk.paths)


@torch.library.custom_op("neptune_fusion::flex_attention", mutates_args=())
def _flex_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, captures: list[torch.Tensor],
                       handle: int, scale: float) -> list[torch.Tensor]:
    """One fused attention kernel as a torch op: what torch.compile puts in its graph."""
    h = _current_handle(handle)
    groups = query.shape[1] // key.shape[1]
    fast_key = ("op", handle, scale, *map(tensor_layout, (query, key, value, *captures)))
    hit = _fast.get(fast_key)
    with private_state(in_cudagraph_tree()):  # in torch.compile's CUDA graphs no memory may outlive the call
        if hit is not None:
            return list(hit.launch(query, key, value, captures))
        extras = tuple(captures[len(h.paths):])  # the closure tensors come first
        return list(_run(query, key, value, h.request, extras, scale, groups, captures, h.keyed, fast_key))


def _current_handle(handle: int) -> _Handle:
    """The handle, keyed again where a value its mods' key read has changed since (a global float,
    an attribute of an object they reach, a closure cell): torch.compile does not guard those
    values (it sees the mods only as constants), so the op checks them, and the kernels follow."""
    h = _handles[handle]
    if _unchanged(h.keyed[1].reads):
        return h
    keyed = _keys(h.request)
    if tuple(keyed[1].paths) != h.paths:
        raise RuntimeError("neptune_fusion: the tensors the score_mod / mask_mod reach changed since torch.compile "
                           "traced the call (another structure of captured values); call torch._dynamo.reset() "
                           "or pass the changing values as tensors")
    h = _handles[handle] = dataclasses.replace(h, keyed=keyed)
    for key in [k for k in _fast if k[:2] == ("op", handle)]:  # their kernels were compiled for the old values
        del _fast[key]
    return h


@_flex_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, captures: list[torch.Tensor], handle: int,
      scale: float) -> list[torch.Tensor]:
    outputs = _handles[handle].request.outputs
    out = query.new_empty((*query.shape[:3], value.shape[3]))
    return [out, *(query.new_empty(query.shape[:3], dtype=torch.float32) for _ in range(sum(outputs)))]


def _run_compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: _Request,
                  extras: tuple[torch.Tensor, ...], scale: float) -> tuple[torch.Tensor, ...]:
    """The call as torch.compile traces it: the captured tensors become inputs of one op."""
    handle, paths, names = _static_handle(*_as_constants(request.score_mod), *_as_constants(request.mask_mod),
                                          tuple(request.builtins), tuple(request.outputs), request.enable_gqa,
                                          request.schedule)
    mods = (request.score_mod, request.mask_mod)
    captured = [_follow(mods, p) for p in paths]
    found = [*captured, *extras]
    if torch.is_grad_enabled() and _needs_grad([q, k, v, *found]):
        layout = tuple((static_shape(t), str(t.dtype).split(".")[-1], t.requires_grad) for t in (q, k, v, *found))
        train, order = _training_handle_of(handle, layout, scale)
        sources = (q, k, v, *found)
        count = 1 + sum(request.outputs)
        return tuple(_train_forward([sources[i] for i in order], [scale], [], train)[:count])
    return tuple(_flex_attention_op(q, k, v, found, handle, scale))


@torch._dynamo.assume_constant_result
def _training_handle_of(handle: int, layout: tuple[tuple[Any, ...], ...], scale: float) -> tuple[int, tuple[int, ...]]:
    """For torch.compile: the training op's handle of an attention call (resolved and derived on
    meta tensors, once, outside the trace) and, per tensor argument of its program, which of
    (q, k, v, *found tensors) it is."""
    h = _handles[handle]
    metas = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta").requires_grad_(grad)
             for shape, dtype, grad in layout]
    q, k, v, found = metas[0], metas[1], metas[2], metas[3:]
    extras = tuple(found[len(h.paths):])
    call = _resolve(q, k, v, h.request, extras, scale, q.shape[1] // k.shape[1], h.keyed, found)
    order = []
    for value in call.args.values():
        if isinstance(value, torch.Tensor):
            pos = next((i for i, m in enumerate(metas) if m is value), None)
            if pos is None:
                raise NotImplementedError("a tensor the mods capture by identity (not a closure variable "
                                          "torch.compile can follow) in a call that records gradients")
            order.append(pos)
    train = handle_for(_compiled_for(call, h.request.schedule), call.args)
    keyed = h.keyed

    def refresh() -> int:  # torch.compile keeps `train`: the op asks for the handle of the values of now
        if _handles[handle].keyed is keyed and _unchanged(keyed[1].reads):
            return train
        _current_handle(handle)
        return _training_handle_of(handle, layout, scale)[0]

    refresh_with(train, refresh)
    return train, tuple(order)


def _extra_names(builtins: Builtins) -> list[str]:
    names = []
    if builtins.block is not None:
        names += ["the block_mask's partial-block table", *(["its full-block table"] if builtins.block[2] else [])]
    if builtins.padding:
        names.append("the key padding mask")
    if builtins.given is not None:
        names.append(f"the given attention {builtins.given[0]}")
    return names


# --------------------------------------------------------------------------- the user API


# kernel_options keys that mean something here, and the schedule field each sets
_KERNEL_OPTIONS = {"BLOCK_M": "block_q", "BLOCK_N": "block_k", "num_warps": "num_warps", "num_stages": "num_stages"}
_warned_options: set[frozenset[str]] = set()


def _schedule_from(kernel_options: dict[str, Any] | None, schedule: Schedule | None) -> Schedule | None:
    """FlexAttention's kernel_options mapped onto the schedule; the keys that mean nothing here
    are ignored with one warning naming them.

    Example:
        >>> _schedule_from({"BLOCK_M": 64, "BLOCK_N": 32}, None)
        Flash(block_q=64, block_k=32, num_warps=None, num_stages=None, prefetch_dot=None)
    """
    if not kernel_options:
        return schedule
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict, got {type(kernel_options).__name__}")
    ignored = frozenset(k for k in kernel_options if k not in _KERNEL_OPTIONS)
    if ignored and ignored not in _warned_options:
        _warned_options.add(ignored)
        warnings.warn(f"neptune_fusion: kernel_options {sorted(ignored)} have no meaning here and are ignored "
                      f"(used: {sorted(_KERNEL_OPTIONS)})", stacklevel=3)
    fields = {_KERNEL_OPTIONS[k]: v for k, v in kernel_options.items() if k in _KERNEL_OPTIONS}
    if not fields:
        return schedule
    if schedule is None or isinstance(schedule, Auto):
        backend = kernel_options.get("BACKEND")
        return (SplitK if backend == "TRITON_DECODE" else Flash)(**fields)
    if isinstance(schedule, (Flash, SplitK)):
        return dataclasses.replace(schedule, **{f: v for f, v in fields.items() if getattr(schedule, f) is None})
    return schedule


def _outputs_of(return_lse: bool, return_aux: Any) -> Outputs:
    if return_aux is None:
        return Outputs(lse=bool(return_lse))
    if return_lse:
        raise ValueError("Cannot specify both return_lse and return_aux; use return_aux=AuxRequest(lse=True)")
    if not hasattr(return_aux, "lse") or not hasattr(return_aux, "max_scores"):
        raise TypeError(f"return_aux must be an AuxRequest(lse=..., max_scores=...), got {type(return_aux).__name__}")
    return Outputs(lse=bool(return_aux.lse), max_scores=bool(return_aux.max_scores))


class AuxOutput(NamedTuple):
    """FlexAttention's auxiliary outputs (torch's own AuxOutput where torch has it)."""

    lse: torch.Tensor | None = None
    max_scores: torch.Tensor | None = None


try:
    from torch.nn.attention.flex_attention import AuxOutput  # type: ignore[no-redef,assignment] # noqa: F811
except ImportError:  # torch before 2.9
    pass


def _is_block_mask(x: Any) -> bool:
    return hasattr(x, "kv_num_blocks") and hasattr(x, "BLOCK_SIZE") and hasattr(x, "mask_mod")


_NOOP_BLOCK = 1 << 30  # FlexAttention's BLOCK_SIZE of a BlockMask that masks nothing


def mask_arguments(block_mask: Any, mask_mod: Any, q: torch.Tensor) -> tuple[Any, Any]:
    """(the BlockMask or None, the mask function or None) of a call's mask arguments, checked as
    FlexAttention checks them; a BlockMask that masks nothing becomes its mask function."""
    if block_mask is None and _is_block_mask(mask_mod):  # a BlockMask given as mask_mod= means the same
        block_mask, mask_mod = mask_mod, None
    if block_mask is None:
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
        return None, mask_mod
    if mask_mod is not None:
        raise ValueError("pass either block_mask= or mask_mod=, not both (a BlockMask carries its own mask_mod)")
    if not _is_block_mask(block_mask):
        raise TypeError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got "
                        f"{type(block_mask).__name__}; pass a mask function as mask_mod=")
    if block_mask.kv_num_blocks.device != q.device:
        raise RuntimeError(f"Expect q/k/v and block_mask to be on the same device but got {q.device} and "
                           f"{block_mask.kv_num_blocks.device}")
    if tuple(block_mask.BLOCK_SIZE) == (_NOOP_BLOCK, _NOOP_BLOCK):
        return None, block_mask.mask_mod
    return block_mask, None


# a BlockMask's dense tables, by the mask and the call's sizes, with whether its mask_mod implies
# them: the same tables on every call, so the block maps built from them are found in their cache
# (keyed by the tensors they read) instead of rebuilt per call, in the forward and in each backward
# kernel; and the mask_mod is evaluated over the whole grid once, not per call
_TABLES: OrderedDict[tuple[Any, ...], tuple[weakref.ref[Any], Any, bool]] = OrderedDict()
_TABLES_SIZE = 32


def _tables_of(block_mask: Any, batch: int, heads: int, q_len: int, kv_len: int) -> tuple[Any, bool]:
    """`block_tables(...)` and `implied_by_mask_mod(...)` of them, cached per BlockMask object, the
    versions of its block lists and what its mask_mod reads (its verdict depends on their values).
    Neither cached nor checked while tracing or capturing a CUDA graph: there the densification is
    part of what is recorded, and the tables, always right, stay."""
    if torch.compiler.is_compiling() or CALL_STATE.private or in_cudagraph_tree():
        return block_tables(block_mask, batch, heads, q_len, kv_len), False
    lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
             block_mask.full_kv_indices)
    walk = _Walk()
    mod_key = _fn_key(mask_mod_of(block_mask), walk)
    key = (id(block_mask), id(block_mask.mask_mod), tuple(block_mask.BLOCK_SIZE), batch, heads, q_len, kv_len,
           tuple(None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.stride()) for t in lists),
           mod_key, tuple((id(t), t.data_ptr(), t._version) for t in walk.tensors))
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is block_mask:
        _TABLES.move_to_end(key)
        return hit[1], hit[2]
    tables = block_tables(block_mask, batch, heads, q_len, kv_len)
    implied = implied_by_mask_mod(tables, batch, heads, q_len, kv_len)
    _TABLES[key] = (weakref.ref(block_mask), tables, implied)
    while len(_TABLES) > _TABLES_SIZE:
        _TABLES.popitem(last=False)
    return tables, implied


def _block_builtins(block_mask: Any, mask_mod: Any, q: torch.Tensor, k: torch.Tensor
                    ) -> tuple[Any, tuple[int, int, bool] | None, tuple[torch.Tensor, ...]]:
    """(the mask_mod to trace, the block-table builtin, the tables) of a call's mask arguments: a
    BlockMask whose mask_mod implies its tables is traced as that mask_mod alone."""
    block_mask, mask_mod = mask_arguments(block_mask, mask_mod, q)
    if block_mask is None:
        return mask_mod, None, ()
    tables, implied = _tables_of(block_mask, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if implied:
        return tables.mask_mod, None, ()
    extras = (tables.partial,) if tables.full is None else (tables.partial, tables.full)
    return tables.mask_mod, (tables.q_block, tables.kv_block, tables.full is not None), extras


def _mod_id(fn: Any) -> Any:
    """A mod's identity in the call caches: a bound method (`score_mod=self.alibi`, a new object at
    every attribute access) by its function and its object; anything else by `id`. A cache entry
    holds the mod it was made for, so no id it keys by is reused while it lives."""
    if isinstance(fn, types.MethodType):
        return (id(fn.__func__), id(fn.__self__))
    return id(fn)


def _lean_key(score_mod: Any, mask_mod: Any, flags: tuple[Any, ...], schedule: Any, scale: Any) -> Any:
    """`_lean`'s key of an eager call (None: the call is not one it keys): the mods and the
    schedule by identity, the flags and a float scale by value."""
    if scale is not None and type(scale) is not float:
        return None
    return (_mod_id(score_mod), _mod_id(mask_mod), flags, id(schedule), scale)


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, request: _Request, extras: tuple[torch.Tensor, ...],
          scale: float | None, lean_key: Any = None) -> tuple[torch.Tensor, ...]:
    if torch.compiler.is_compiling():
        for t in (q, k, v):  # heads and head dim fixed, as FlexAttention marks them: kernels specialise on them
            torch._dynamo.mark_static(t, -3)
            torch._dynamo.mark_static(t, -1)
        _, scale = _check_inputs(q, k, v, request.score_mod, scale, request.enable_gqa)
        return _run_compiled(q, k, v, request, extras, scale)
    # a call like an earlier one (same mods, flags, tensor shapes, dtypes, devices and scale) skips
    # the checks and the resolution that call passed; only what its mods read is checked again
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        _check_inputs(q, k, v, request.score_mod, scale, request.enable_gqa)  # raises the TypeError
    try:
        fast_key = (_mod_id(request.score_mod), _mod_id(request.mask_mod), request[2:], scale, tensor_layout(q),
                    tensor_layout(k), tensor_layout(v), *map(tensor_layout, extras))
    except RuntimeError:  # a tensor without data (sparse): the checks say which
        _check_inputs(q, k, v, request.score_mod, scale, request.enable_gqa)
        raise
    hit = _fast.get(fast_key)
    if hit is not None and hit.valid() and not (torch.is_grad_enabled()
                                                and _needs_grad([q, k, v, *hit.walk.tensors, *extras])):
        if lean_key is not None:
            _lean_remember(lean_key, hit)
        return hit.launch(q, k, v, [*hit.walk.tensors, *extras])
    groups, checked = _check_inputs(q, k, v, request.score_mod, scale, request.enable_gqa)
    return _run(q, k, v, request, extras, checked, groups, fast_key=fast_key)


def _request(q: torch.Tensor, k: torch.Tensor, score_mod: Any, block_mask: Any, mask_mod: Any, enable_gqa: bool,
             outputs: Outputs, schedule: Schedule | None) -> tuple[_Request, tuple[torch.Tensor, ...]]:
    mask_fn, block, extras = _block_builtins(block_mask, mask_mod, q, k)
    return _Request(score_mod, mask_fn, Builtins(block=block), outputs, bool(enable_gqa), schedule), extras


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: ScoreMod | None = None,
              block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
              kernel_options: dict[str, Any] | None = None, *, return_aux: Any = None, mask_mod: MaskMod | None = None,
              schedule: Schedule | None = None) -> Any:
    """FlexAttention's `flex_attention`, same signature, compiled to one fused kernel.

    query: (B, Hq, Lq, E); key: (B, Hkv, Lkv, E); value: (B, Hkv, Lkv, Ev), one dtype (float16,
    bfloat16, float32) and one device (CUDA, or CPU under TRITON_INTERPRET=1). `Hq != Hkv` needs
    `enable_gqa=True` and `Hq % Hkv == 0`. `score_mod(score, b, h, q_idx, kv_idx)` returns the
    modified score (already scaled). `block_mask` (a FlexAttention `BlockMask`) is honoured as
    compiled FlexAttention honours it: only listed blocks are visited, its `mask_mod` applies in
    partial blocks, full blocks are visible whole. Where its `mask_mod` implies the lists (no
    masked position in a full block, no visible one in an unlisted block: `create_block_mask`'s
    lists), the call is `mask_mod=block_mask.mask_mod`, checked once per BlockMask and sizes
    (outside torch.compile; `blockmask.implied_by_mask_mod`). `mask_mod=` is a shortcut for a mask
    given as a function (analysed exactly: affine masks become loop bounds). Rows with no visible
    key give 0.
    Returns the output (B, Hq, Lq, Ev) in the input dtype; with `return_lse` also the logsumexp
    (B, Hq, Lq) in float32; with `return_aux=AuxRequest(lse=..., max_scores=...)` the output and
    an `AuxOutput`. `kernel_options` keys BLOCK_M, BLOCK_N, num_warps and num_stages set the
    schedule; others are ignored with a warning. `schedule` (nf.flash(), nf.split_k(), ...)
    overrides the template chosen from the shapes. Where q, k, v or a tensor the mods capture
    requires grad (in grad mode), the call records the backward the compiler derives
    (integrations/autograd.py); `create_graph=True` raises. Works inside
    `torch.compile(fullgraph=True)`, for mods defined outside the compiled function.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> slopes = torch.exp2(-torch.arange(1, 9.0))            # ALiBi, 8 heads
        >>> def alibi(score, b, h, q_idx, kv_idx):
        ...     return score + slopes[h] * (kv_idx - q_idx)
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> q = k = v = torch.randn(1, 8, 16, 16)
        >>> out = nf.attention(q, k, v, score_mod=alibi, mask_mod=causal)
        >>> tuple(out.shape)
        (1, 8, 16, 16)
    """
    lean_key = None
    if block_mask is None and kernel_options is None and return_aux is None and not torch.compiler.is_compiling():
        lean_key = _lean_key(score_mod, mask_mod, (bool(enable_gqa), bool(return_lse)), schedule, scale)
        result = _lean_hit(lean_key, query, key, value, ())
        if result is not None:  # the output, or (output, lse): what this function returns
            return result
    outputs = _outputs_of(return_lse, return_aux)
    request, extras = _request(query, key, score_mod, block_mask, mask_mod, enable_gqa, outputs,
                               _schedule_from(kernel_options, schedule))
    out, *stats = _call(query, key, value, request, extras, scale, lean_key)
    if return_aux is not None:
        lse = stats.pop(0) if outputs.lse else None
        return out, AuxOutput(lse=lse, max_scores=stats.pop(0) if outputs.max_scores else None)
    return (out, stats[0]) if outputs.lse else out


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float | None = None,
           enable_gqa: bool = False, causal: bool = False, window: int | None = None, softcap: float | None = None,
           key_padding: torch.Tensor | None = None, documents: torch.Tensor | None = None,
           mask: torch.Tensor | None = None, bias: torch.Tensor | None = None, return_lse: bool = False,
           schedule: Schedule | None = None) -> Any:
    """Attention described by values, as model code asks for it (transformers models): no functions
    to trace, so it compiles the same inside and outside torch.compile.

    `causal` aligns the queries to the end of the keys (query i sits at key position Lk - Lq + i:
    prefill and decode over a KV cache alike); `window=W` also drops keys W or more positions
    before the query (with causal) or on either side of it (without: a bidirectional band, as
    ModernBERT's local layers); `softcap=c` maps the scaled score s to c * tanh(s / c);
    `key_padding` (B, Lk) bool, True where the key is attended; `documents` (B, Lk) integer ids,
    each query seeing only the keys whose id is the one at its own key position (packed sequences,
    chunked attention); `mask` (bool, True where attended)
    or `bias` (float, added to the softcapped scores), each of shape (B or 1, H or 1, Lq or 1, Lk),
    on top of the rest. Shapes as in `attention`.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 8, 16)
        >>> tuple(attend(q, k, v, causal=True, window=4, softcap=30.0).shape)
        (1, 2, 8, 16)
    """
    lean_key = None
    if not torch.compiler.is_compiling():
        flags = ("attend", bool(enable_gqa), bool(return_lse), bool(causal), (type(window), window),
                 (type(softcap), softcap), key_padding is None, documents is None, mask is None, bias is None)
        lean_key = _lean_key(None, None, flags, schedule, scale)
        given_tensors = tuple(t for t in (key_padding, documents, mask, bias) if t is not None)
        result = _lean_hit(lean_key, query, key, value, given_tensors)
        if result is not None:
            return result
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
            raise ValueError(f"softcap must be a positive finite number, got {softcap!r}")
        softcap = float(softcap)
    extras: tuple[torch.Tensor, ...] = ()
    if key_padding is not None:
        if not isinstance(key_padding, torch.Tensor) or key_padding.dtype != torch.bool:
            raise TypeError("key_padding must be a bool tensor (B, Lk), True where the key is attended")
        if tuple(key_padding.shape) != (query.shape[0], key.shape[2]):
            raise ValueError(f"key_padding must have shape (batch, kv_len) = {(query.shape[0], key.shape[2])}, "
                             f"got {tuple(key_padding.shape)}")
        extras = (key_padding,)
    if documents is not None:
        if not isinstance(documents, torch.Tensor) or documents.is_floating_point() or documents.dtype == torch.bool:
            raise TypeError("documents must be an integer tensor (B, Lk) of ids")
        if tuple(documents.shape) != (query.shape[0], key.shape[2]):
            raise ValueError(f"documents must have shape (batch, kv_len) = {(query.shape[0], key.shape[2])}, "
                             f"got {tuple(documents.shape)}")
        extras = (*extras, documents)
    given = None
    if mask is not None and bias is not None:
        raise ValueError("give a bool mask or a float bias, not both (fold the mask into the bias as -inf)")
    for name, t in (("mask", mask), ("bias", bias)):
        if t is not None:
            given = (name, *_given_axes(name, t, query, key))
            extras = (*extras, t)
    builtins = Builtins(bool(causal), window, softcap, key_padding is not None, documents=documents is not None,
                        given=given)
    request = _Request(None, None, builtins, Outputs(lse=bool(return_lse)), bool(enable_gqa), schedule)
    out, *stats = _call(query, key, value, request, extras, scale, lean_key)
    return (out, stats[0]) if return_lse else out


def _given_axes(name: str, t: Any, query: torch.Tensor, key: torch.Tensor) -> tuple[bool, bool, bool]:
    """Whether `attend`'s mask or bias `t` spans the batch, head and query axes (else has length 1
    there), after checking its dtype and shape."""
    if not isinstance(t, torch.Tensor) or (t.dtype != torch.bool if name == "mask" else not t.is_floating_point()):
        raise TypeError(f"{name} must be a {'bool' if name == 'mask' else 'floating-point'} tensor "
                        "(B or 1, H or 1, Lq or 1, Lk)")
    scores = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if t.ndim != 4 or t.shape[3] != scores[3] or any(n not in (1, w) for n, w in zip(t.shape[:3], scores)):
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to the scores' shape {scores} "
                         "(batch, heads, queries, keys; the keys whole)")
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device}, the queries on {query.device}")
    return t.shape[0] > 1, t.shape[1] > 1, t.shape[2] > 1


def _resolve_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any, block_mask: Any, mask_mod: Any,
                  scale: float | None, enable_gqa: bool, return_lse: bool, schedule: Schedule | None = None
                  ) -> tuple[_Call, _Request]:
    request, extras = _request(q, k, score_mod, block_mask, mask_mod, enable_gqa, Outputs(lse=return_lse), schedule)
    groups, scale = _check_inputs(q, k, v, score_mod, scale, enable_gqa)
    return _resolve(q, k, v, request, extras, scale, groups), request


def attention_program(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                      block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                      return_lse: bool = False, *, mask_mod: MaskMod | None = None) -> Program:
    """The plain (unfused) Program that `attention` compiles for these arguments.

    Its inputs are `q`, `k`, `v`, the captured tensors `cap0`, `cap1`, ... and the scalar
    parameter `scale`; `attention_inputs` gives them by name, for `nf.run_reference`.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> q = k = v = torch.randn(1, 2, 8, 16)
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> prog = nf.attention_program(q, k, v, mask_mod=causal)
        >>> out = nf.run_reference(prog, nf.attention_inputs(q, k, v, mask_mod=causal))
        >>> tuple(out.shape)
        (1, 2, 8, 16)
    """
    return _resolve_call(q, k, v, score_mod, block_mask, mask_mod, scale, enable_gqa, return_lse)[0].program


def attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                     block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                     return_lse: bool = False, *, mask_mod: MaskMod | None = None) -> dict[str, Any]:
    """The named arguments of `attention_program(...)`: q, k, v, scale and the captured tensors."""
    return _resolve_call(q, k, v, score_mod, block_mask, mask_mod, scale, enable_gqa, return_lse)[0].args


def explain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: ScoreMod | None = None,
                      block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                      return_lse: bool = False, *, mask_mod: MaskMod | None = None,
                      schedule: Schedule | None = None) -> str:
    """`nf.explain` for `attention(...)`: the traced program, each fusion pass, the tile program, the Triton source."""
    from neptune_fusion.runtime.explain import explain

    call, request = _resolve_call(q, k, v, score_mod, block_mask, mask_mod, scale, enable_gqa, return_lse, schedule)
    return explain(_compiled_for(call, schedule), **call.args)
