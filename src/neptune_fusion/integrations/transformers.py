"""Hugging Face transformers integration: our fused kernels as an `attn_implementation`.

Select it with (once per process, before the model is built):

    from neptune_fusion.integrations.transformers import register
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register())   # "neptune_fusion"

`register(name)` adds `attention_forward` to transformers' `AttentionInterface` and `mask` to its
`AttentionMaskInterface` under `name` (transformers skips mask creation entirely for names that
have no mask function, which would drop the padding mask). Supported: causal attention aligned
to the end of the keys (prefill and decode over a KV cache), bidirectional attention
(`module.is_causal` False, e.g. encoders and cross-attention), padding from the 2-D
`attention_mask` (left or right), sliding windows (transformers' convention: query at position q
sees key k iff 0 <= q - k < sliding_window; bidirectional bands |q - k| < sliding_window),
chunked attention (Llama-4) and packed sequences (position_ids restarting inside a row, no
attention_mask, no cache: transformers detects them) as document ids, logit softcapping,
grouped-query heads, dynamic and static caches, and `torch.compile(fullgraph=True)` (nothing here
reads tensor values while compiling), 4-D bool or float masks given to the model (read as sdpa
reads them). Position biases (T5's `position_bias`) are added to the scores; attention sinks
(`s_aux`, gpt-oss) rescale the output by the log-normaliser (`_sunk`). Not supported, with an
error naming it: dropout in training mode, `or_mask_function` / `and_mask_function` overlays
(image tokens), chunked attention or packed sequences over a static cache. The pattern is
recognised from the mask function outside tracing only: under torch.compile the overlays are
still refused and chunked attention is refused from the config, but packed sequences are not
seen and would run as plain causal attention: pass an attention_mask when compiling such inputs.
`output_attentions=True` warns and returns no
weights, as transformers' sdpa does. Training runs the derived backward (README, Training).

What the mask function returns (the model hands it to every layer as `attention_mask`):
- `None` when no key is masked beyond the causal/window pattern;
- a uint8 tensor (B, 1, 1, Lk), 1 where the key may be attended, 0 padding, when the keys end
  where the queries end (no cache, dynamic caches), so `attend`'s end-aligned causal mask is right;
- an int32 tensor (B, 1, 1, Lk) of document ids for packed sequences (position_ids restarting
  inside a row) and chunked attention (Llama-4: the chunk of each key's position, counted from the
  row's first token), `_NO_DOCUMENT` on padding keys: a query sees the keys that share the id at
  its own position (`attend`'s `documents`);
- an int8 tensor (B, 1, 1, Lk) for causal masks whose keys may not end at the last query (static
  caches: unwritten slots follow the last query, and the query offset is a tensor there):
  1 attend, 0 padding, -1 a slot after the last query. The attention function then rotates those
  trailing slots to the front (an index_select of K/V, only when Lq > 1 or a window applies), so
  the written keys end at the last query again.
It is 4-D so that transformers passes it through unchanged when it meets it a second time (generate
builds masks ahead of the forward for static caches, and the model's `create_causal_mask` returns a
4-D mask as is). Its integer dtype tells it from a 4-D mask the caller gives the model (bool or
float, as sdpa takes them), which transformers also hands to the layers unchanged: such a mask is
the whole mask, as sdpa reads it (no causal part added; `_given_mask_attention`).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from transformers import AttentionInterface
from transformers import masking_utils as mu
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils import logging
from transformers.utils.import_utils import is_tracing

from neptune_fusion.integrations.attention import attend

__all__ = ["DEFAULT_NAME", "attention_forward", "mask", "register"]

DEFAULT_NAME = "neptune_fusion"

_logger = logging.get_logger(__name__)
_ATTEND = 1  # int8 mask states
_PADDING = 0
_UNWRITTEN = -1
_NO_DOCUMENT = -(2**31)  # the document id of a padding key


# --------------------------------------------------------------------------- mask interface


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


class _Pattern(NamedTuple):
    """A mask function transformers' masking_utils builds, read back: its base pattern ('causal',
    'sliding', 'bidirectional', 'bidirectional_sliding'), and the chunks (size, each row's left
    padding) or the packed sequences' ids (B, L) that split it into documents."""

    base: str
    chunk: tuple[int, torch.Tensor] | None = None
    packed: torch.Tensor | None = None


def _closure(fn: Any) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def _pattern(mask_function: Any) -> _Pattern | None:
    """The pattern of the mask functions masking_utils builds for plain models, None for anything else."""
    if mask_function is mu.causal_mask_function:
        return _Pattern("causal")
    if mask_function is mu.bidirectional_mask_function:
        return _Pattern("bidirectional")
    if _qualname(mask_function) != "and_masks.<locals>.and_mask":
        return None
    parts = {_qualname(p): p for p in _closure(mask_function).get("mask_functions", ())}
    names = sorted(parts)
    if names == sorted(["causal_mask_function", "sliding_window_overlay.<locals>.inner_mask"]):
        return _Pattern("sliding")
    if names == sorted(["bidirectional_mask_function", "sliding_window_bidirectional_overlay.<locals>.inner_mask"]):
        return _Pattern("bidirectional_sliding")
    if names == sorted(["causal_mask_function", "chunked_overlay.<locals>.inner_mask"]):
        chunk = _closure(parts["chunked_overlay.<locals>.inner_mask"])
        return _Pattern("causal", chunk=(int(chunk["chunk_size"]), chunk["left_padding"]))
    remap, packed = "remap_positions_for_packed_sequence.<locals>.inner_mask", "packed_sequence_mask_function.<locals>.inner_mask"
    if names == sorted([remap, packed]):
        # positions remapped per sequence keep their order inside it: the base pattern on the
        # packed row's own positions, within each sequence
        base = _pattern(_closure(parts[remap]).get("mask_function"))
        if base is None or base.chunk is not None:
            return None
        return base._replace(packed=_closure(parts[packed]).get("packed_sequence_mask"))
    return None


def _document_ids(pattern: _Pattern, batch_size: int, kv_length: int, kv_offset: int, padding: torch.Tensor | None,
                  device: Any) -> torch.Tensor:
    """(B, 1, 1, Lk) int32: the chunk of each key's position counted from its row's first token, or
    its packed sequence's id; `_NO_DOCUMENT` on padding keys."""
    if pattern.chunk is not None:
        size, left_padding = pattern.chunk
        positions = torch.arange(kv_offset, kv_offset + kv_length, device=device)
        ids = torch.div(positions[None, :] - left_padding.to(device).reshape(-1, 1), size, rounding_mode="floor")
    else:
        ids = pattern.packed.to(device)[:, kv_offset:kv_offset + kv_length]
    ids = ids.expand(batch_size, kv_length).to(torch.int32)
    if padding is not None:
        ids = torch.where(padding, ids, _NO_DOCUMENT)
    return ids[:, None, None, :].contiguous()


def mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None,
         q_offset: int | torch.Tensor = 0, kv_offset: int = 0, mask_function: Any = None,
         attention_mask: torch.Tensor | None = None, use_vmap: bool = False,
         device: torch.device | str = "cpu", **kwargs: Any) -> torch.Tensor | None:
    """The `AttentionMaskInterface` function: what `attention_forward` needs, and no more.

    Called by transformers' `create_causal_mask` & co. with the batch size, the query length and
    offset (position of the first query), the key length and offset (position of the first key in
    this layer's K/V: nonzero for sliding-window caches), the pattern as `mask_function` and the
    2-D padding mask (bool, True = token). Returns None, or a 4-D key mask (module docstring).

    Example:
        >>> pad = torch.tensor([[False, True, True, True]])             # one left-padded row
        >>> mask(batch_size=1, q_length=4, kv_length=4, attention_mask=pad).flatten().tolist()
        [0, 1, 1, 1]
        >>> pad = torch.tensor([[False, True, True, True, True]])       # static cache of 6, 5th token
        >>> mask(batch_size=1, q_length=1, kv_length=6, q_offset=torch.tensor(4),
        ...      attention_mask=pad).flatten().tolist()
        [0, 1, 1, 1, 1, -1]
    """
    if q_length is None:  # the older signature: positions of the queries as cache_position
        cache_position = kwargs["cache_position"]
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    if kv_length is None:
        kv_length = q_length
    if use_vmap:  # create_*_mask sets it exactly when an or_mask_function / and_mask_function is given
        raise NotImplementedError(
            "neptune_fusion attention supports causal, sliding-window and bidirectional masks with padding; this "
            "model overlays its own mask function (or_mask_function / and_mask_function, e.g. for image tokens). "
            "Use attn_implementation='sdpa' or 'eager' for it.")
    tracing = is_tracing(attention_mask) or torch.compiler.is_compiling()
    if tracing and getattr(kwargs.get("config"), "attention_chunk_size", None) is not None:
        # chunked attention (Llama-4): refused from the config, which is readable while torch.compile traces
        # (the mask function, a closure made in the traced forward, is not)
        raise NotImplementedError(
            "neptune_fusion attention reads chunked attention (attention_chunk_size) from transformers' mask "
            "function, which cannot be inspected under torch.compile. Run the model eagerly, or use "
            "attn_implementation='sdpa' or 'eager' for it.")
    bidirectional = "allow_is_bidirectional_skip" in kwargs
    pattern = None
    if mask_function is not None and not tracing:
        pattern = _pattern(mask_function)
        if pattern is None:
            raise NotImplementedError(
                f"neptune_fusion attention supports causal, sliding-window, bidirectional, chunked and packed-sequence "
                f"masks with padding; this model builds the mask pattern {_qualname(mask_function)!r} (block "
                f"overlays, or a combination of these). Use attn_implementation='sdpa' or 'eager' for it.")
        bidirectional = pattern.base.startswith("bidirectional")
    elif mask_function is not None:
        bidirectional = bidirectional or mask_function is mu.bidirectional_mask_function

    padding = None
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            raise ValueError(f"expected a 2-D padding mask (batch, length), got shape {tuple(attention_mask.shape)}")
        padding = attention_mask.to(device=device, dtype=torch.bool)
        if (missing := kv_offset + kv_length - padding.shape[-1]) > 0:  # static caches: slots not yet written
            padding = torch.nn.functional.pad(padding, (0, missing))
        padding = padding[:, kv_offset:kv_offset + kv_length]
        if padding.shape[0] != batch_size:
            padding = padding.expand(batch_size, kv_length)
        if not is_tracing(padding) and bool(padding.all()):
            padding = None

    end_aligned = isinstance(q_offset, int) and kv_offset + kv_length == q_offset + q_length
    if pattern is not None and (pattern.chunk is not None or pattern.packed is not None):
        if not (bidirectional or end_aligned):
            raise NotImplementedError(
                "neptune_fusion attention supports chunked attention and packed sequences over keys that end at the "
                "last query (no cache, dynamic caches), not static caches. Use a dynamic cache, or "
                "attn_implementation='sdpa' or 'eager'.")
        return _document_ids(pattern, batch_size, kv_length, kv_offset, padding, device)
    if bidirectional or end_aligned:
        return None if padding is None else padding[:, None, None, :].to(torch.uint8)
    # Causal over keys that may not end at the last query: mark the slots after it.
    written = torch.arange(kv_length, device=device) + kv_offset <= q_offset + (q_length - 1)
    state = torch.where(written, _ATTEND, _UNWRITTEN).to(torch.int8).expand(batch_size, kv_length)
    if padding is not None:
        state = torch.where(written & ~padding, torch.tensor(_PADDING, dtype=torch.int8, device=device), state)
    return state[:, None, None, :].contiguous()


# --------------------------------------------------------------------------- attention interface


def _key_padding(attention_mask: Any, batch: int, kv_len: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(key padding (B, Lk) bool or None, the int8 static-cache mask or None, document ids (B, Lk)
    or None) of the mask a layer gets."""
    if attention_mask is None:
        return None, None, None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"neptune_fusion attention got an attention_mask of type {type(attention_mask).__name__}; "
                        "it needs the mask its own mask function builds (register() installs it)")
    if not _ours(attention_mask):
        raise ValueError(
            f"neptune_fusion attention got a {attention_mask.dtype} mask of shape {tuple(attention_mask.shape)}; it "
            "takes the masks its mask function builds, and 4-D bool or float masks (B or 1, H or 1, Lq or 1, Lk) "
            "given to the model. Pass a 2-D attention_mask, or use attn_implementation='sdpa' or 'eager'.")
    if attention_mask.shape[-1] != kv_len:
        raise ValueError(f"the attention mask covers {attention_mask.shape[-1]} keys, the layer has {kv_len}")
    state = attention_mask[:, 0, 0, :]
    if attention_mask.dtype == torch.int32:  # document ids; padding keys stay out of every row, their own too
        ids = state.expand(batch, kv_len).contiguous()
        return ids != _NO_DOCUMENT, None, ids
    padding = state > _PADDING
    if attention_mask.dtype == torch.uint8:  # keys end at the last query: nothing to rotate
        state = None
    if padding.shape[0] != batch:
        padding = padding.expand(batch, kv_len)
    return padding.contiguous(), state, None


def _ours(attention_mask: torch.Tensor) -> bool:
    """Whether a layer's mask is one `mask` built (uint8, int8 or int32, (B, 1, 1, Lk)); a model's caller
    passes bool or float 4-D masks, which transformers hands to the layers as they are."""
    return (attention_mask.ndim == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1
            and attention_mask.dtype in (torch.uint8, torch.int8, torch.int32))


def _given_mask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, given: torch.Tensor,
                          scaling: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention under a 4-D mask the model's caller gave, as sdpa reads it: the whole mask (no
    causal part added), bool True where a key is attended, float added to the (softcapped) scores;
    each of its first three axes the length of that axis or 1. Returns (B, Lq, H, D)."""
    if given.dtype != torch.bool and not given.is_floating_point():
        raise ValueError(f"a 4-D attention mask must be bool or floating point, got {given.dtype}")
    if given.ndim == 4 and given.shape[-1] > key.shape[2]:  # sdpa reads the first Lk columns
        given = given[..., :key.shape[2]]
    try:
        out = attend(query, key, value, scale=scaling, enable_gqa=query.shape[1] != key.shape[1], softcap=softcap,
                     return_lse=sinks is not None, **{"mask" if given.dtype == torch.bool else "bias": given})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the 4-D attention mask given to the model: {exc}") from exc
    return _sunk(out, sinks).transpose(1, 2).contiguous()


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The `AttentionInterface` function: one fused kernel per call, through `attend`.

    query (B, Hq, Lq, D), key / value (B, Hkv, Lk, D) as the model produces them (Hq a multiple of
    Hkv), `attention_mask` from `mask`; returns (output (B, Lq, Hq, D) in the model's dtype, None).
    Causal unless `is_causal=False` is passed or `module.is_causal` is False. Queries sit at the end
    of the keys (query i at key Lk - Lq + i). `sliding_window=W` keeps key k for query q iff
    q - k < W (causal) or |q - k| < W (bidirectional: ModernBERT passes its half-window + 1),
    `softcap=c` maps the scaled score s to c * tanh(s / c)."""
    if dropout and module.training:
        raise ValueError("neptune_fusion attention has no dropout: call model.eval(), or set the config's "
                         "attention_dropout to 0")
    position_bias = kwargs.get("position_bias")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if kwargs.get("output_attentions") and not is_tracing():
        _logger.warning_once(
            "neptune_fusion attention does not return attention weights (output_attentions=True): use "
            "attn_implementation='eager' to get them")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)

    batch, hq, lq = query.shape[:3]
    hkv, lk = key.shape[1], key.shape[2]
    window = sliding_window
    if window is not None and window >= lk:  # every key lies inside the window
        window = None
    if isinstance(attention_mask, torch.Tensor) and not _ours(attention_mask):
        given = _biased(attention_mask, position_bias)
        return _given_mask_attention(query, key, value, given, scaling, softcap, sinks), None
    padding, state, documents = _key_padding(attention_mask, batch, lk)
    if state is not None and is_causal and (lq > 1 or window is not None):
        # Static cache: the written keys are followed by unwritten slots (state -1, the same in every
        # row). Rotate those slots to the front so the written keys end at the last query.
        unwritten = (state[0] < 0).sum()
        order = torch.remainder(torch.arange(lk, device=key.device) - unwritten, lk)
        key, value = key.index_select(2, order), value.index_select(2, order)
        padding = padding.index_select(1, order.to(padding.device))
    out = attend(query, key, value, scale=scaling, enable_gqa=hq != hkv, causal=is_causal, window=window,
                 softcap=softcap, key_padding=padding, documents=documents, bias=position_bias,
                 return_lse=sinks is not None)
    return _sunk(out, sinks).transpose(1, 2).contiguous(), None


def _biased(given: torch.Tensor, position_bias: torch.Tensor | None) -> torch.Tensor:
    """A 4-D mask the caller gave with a position bias (T5's relative attention bias) added: one
    float mask, -inf where a bool mask drops the key."""
    if position_bias is None:
        return given
    if given.dtype == torch.bool:
        return torch.where(given, position_bias, float("-inf"))
    return given + position_bias


def _sunk(out: Any, sinks: torch.Tensor | None) -> torch.Tensor:
    """`out` (or `(out, lse)` where `sinks` is given) with attention sinks: a per-head logit that joins
    each row's softmax and attends to nothing (gpt-oss's `s_aux`). The sink adds exp(sink) to the
    row's normaliser exp(lse), so the output shrinks by exp(lse) / (exp(lse) + exp(sink)) =
    sigmoid(lse - sink); a row with no visible key (lse -inf) stays 0, as the softmax over the sink
    alone gives. Differentiable in out, lse and the sinks."""
    if sinks is None:
        return out
    out, lse = out
    if sinks.shape != (out.shape[1],):
        raise ValueError(f"attention sinks must have one value per query head ({out.shape[1]}), got shape "
                         f"{tuple(sinks.shape)}")
    kept = torch.sigmoid(lse - sinks.float()[None, :, None])
    return (out.float() * kept.unsqueeze(-1)).to(out.dtype)


# --------------------------------------------------------------------------- registration


def register(name: str = DEFAULT_NAME) -> str:
    """Register our attention and mask functions with transformers under `name`; returns `name`.

    Pass the name as `attn_implementation=` (from_pretrained, from_config) or set it later with
    `model.set_attn_implementation(name)`. Registering again is harmless.
    """
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask)
    return name
