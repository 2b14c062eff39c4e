"""The transformers integration: tiny random models give the logits and the tokens of transformers'
own attention (sdpa, or eager where sdpa has no softcapping), with padding, sliding windows,
softcapping, grouped-query heads, dynamic and static KV caches and torch.compile(fullgraph=True).

Each model pair shares one state dict; the query / key projections are scaled up so attention is
sharp and a wrong mask, window or softcap changes the logits by far more than the tolerance
(checked in test_the_checks_are_sensitive)."""

from __future__ import annotations

import copy
import doctest
import inspect
import logging
from typing import Callable

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertModel,
    Gemma2Config,
    GptOssConfig,
    LlamaConfig,
    LlamaModel,
    ModernBertConfig,
    ModernBertModel,
    StaticCache,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers import masking_utils as mu
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import neptune_fusion.integrations.transformers as nft

NAME = nft.register()
PROMPT = 24
NEW = 16
ATOL = 2e-4  # fp32 logits of magnitude ~1
# The cache argument of the models' forward: `past_key_values` in 5.17, `cache` (old name deprecated) by 5.24.
CACHE = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def _llama_config(**over: object) -> LlamaConfig:
    kw: dict[str, object] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    kw.update(over)
    return LlamaConfig(**kw)


def _gemma2_config(**over: object) -> Gemma2Config:
    kw: dict[str, object] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                 sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                 query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    kw.update(over)
    return Gemma2Config(**kw)


def _model(cfg: object, impl: str, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A model of `cfg` (copied: from_config keeps the config object it is given and sets its
    attn_implementation, so two models built from one config would share the last one)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
    if state is None:
        with torch.no_grad():
            for layer in model.model.layers:  # sharp attention: scores up to ~50 before softcapping
                layer.self_attn.q_proj.weight.mul_(8.0)
                layer.self_attn.k_proj.weight.mul_(8.0)
    else:
        model.load_state_dict(state)
    return model


def _pair(cfg: object, ref_impl: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    ref = _model(cfg, ref_impl)
    return ref, _model(cfg, NAME, ref.state_dict())


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, torch.nn.Module]:
    ref, ours = _pair(_llama_config(), "sdpa")
    assert ref.config._attn_implementation == "sdpa" and ours.config._attn_implementation == NAME
    return ref, ours


@pytest.fixture(scope="module")
def gemma2() -> tuple[torch.nn.Module, torch.nn.Module]:
    return _pair(_gemma2_config(), "eager")  # transformers' sdpa refuses softcap (Gemma2 has _supports_sdpa False)


def _inputs(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    if not padded:
        return ids, None
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as for generation
    return ids, mask


def _check_logits(ref: torch.nn.Module, ours: torch.nn.Module, padded: bool) -> None:
    ids, mask = _inputs(padded)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    # Padding query rows see no key: ours give 0 there, eager a uniform average; neither is used.
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)


def _check_generate(ref: torch.nn.Module, ours: torch.nn.Module, **kwargs: object) -> None:
    ids, mask = _inputs(True)
    args = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                return_dict_in_generate=True, **kwargs)
    with torch.no_grad():
        expected = ref.generate(ids, **args)
        got = ours.generate(ids, **args)
    assert torch.unique(expected.sequences[:, PROMPT:]).numel() > 4  # not a degenerate repetition
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=ATOL, rtol=0)
    assert torch.equal(got.sequences, expected.sequences)


def _check_gradients(ours: torch.nn.Module, ref: torch.nn.Module,
                     loss: Callable[[torch.nn.Module], torch.Tensor]) -> None:
    """Every parameter of `ours` gets the gradient `loss` gives the same parameter of `ref` (where
    `ref`'s gets one: an expert no token chose gets none)."""
    for model in (ours, ref):
        model.zero_grad()
        loss(model).backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if b.grad is not None:
            assert a.grad is not None, name
            torch.testing.assert_close(a.grad, b.grad, atol=2e-4, rtol=2e-3, msg=name)


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padding"])
def test_llama_gqa_logits_match_sdpa(llama: tuple[torch.nn.Module, torch.nn.Module], padded: bool) -> None:
    _check_logits(*llama, padded)


def test_llama_fp16_logits_match_sdpa() -> None:
    """The model's dtype end to end: fp16 activations in, fp16 attention output."""
    ref, ours = (m.half() for m in _pair(_llama_config(num_hidden_layers=1), "sdpa"))
    ids, mask = _inputs(True)
    with torch.no_grad():
        expected, got = (m(ids, attention_mask=mask).logits for m in (ref, ours))
    assert got.dtype == torch.float16
    real = mask.bool()
    torch.testing.assert_close(got[real].float(), expected[real].float(), atol=2e-2, rtol=0)


def test_llama_generate_matches_sdpa(llama: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    _check_generate(*llama)


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "left_padding"])
def test_gemma2_window_softcap_logits_match_eager(gemma2: tuple[torch.nn.Module, torch.nn.Module],
                                                  padded: bool) -> None:
    _check_logits(*gemma2, padded)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gemma2_generate_matches_eager(gemma2: tuple[torch.nn.Module, torch.nn.Module], cache: str) -> None:
    """Prompt 24 and 16 new tokens over a window of 8: the sliding layers' caches are full. The static
    cache prefills 24 queries over 40 slots (the unwritten ones are rotated to the front)."""
    _check_generate(*gemma2, **({"cache_implementation": "static"} if cache == "static" else {}))


def test_gemma2_static_cache_prefill_matches_eager(gemma2: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """All prompt positions of a prefill into static caches of 40 slots (the full layer's keys end
    16 slots after the last query; generate's logits only see the last one)."""
    ref, ours = gemma2
    ids, mask = _inputs(True)
    caches = [StaticCache(config=m.config, max_cache_len=PROMPT + NEW) for m in (ref, ours)]
    with torch.no_grad():
        expected, got = (m(ids, attention_mask=mask, **{CACHE: c}).logits for m, c in zip((ref, ours), caches))
    assert all(c.get_seq_length() == PROMPT for c in caches)
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=ATOL, rtol=0)


def test_the_checks_are_sensitive(gemma2: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """Dropping the window, the softcap or the padding moves the logits far beyond ATOL."""
    ref, _ = gemma2
    ids, mask = _inputs(True)
    real = mask.bool()
    with torch.no_grad():
        base = ref(ids, attention_mask=mask).logits[real]
        for over in ({"sliding_window": 1000}, {"attn_logit_softcapping": None}):
            other = _model(_gemma2_config(**over), "eager", ref.state_dict())
            assert (other(ids, attention_mask=mask).logits[real] - base).abs().max() > 100 * ATOL
        assert (ref(ids).logits[real] - base).abs().max() > 100 * ATOL


def test_bert_bidirectional_padding_matches_sdpa() -> None:
    """An encoder (module.is_causal False, masks from create_bidirectional_mask), right padding."""
    cfg = BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = BertModel._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", add_pooling_layer=False).eval()
    ours = BertModel._from_config(copy.deepcopy(cfg), attn_implementation=NAME, add_pooling_layer=False).eval()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    with torch.no_grad():
        for m in (None, mask):
            torch.testing.assert_close(ours(ids, attention_mask=m).last_hidden_state,
                                       ref(ids, attention_mask=m).last_hidden_state, atol=ATOL, rtol=0)


def test_modernbert_bidirectional_sliding_window_matches_sdpa() -> None:
    """ModernBERT's local layers: a bidirectional band (|q - k| <= local_attention / 2), right padding;
    a band of 4 keys each side in 24 tokens, so the window decides the output."""
    cfg = ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                           global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2)
    torch.manual_seed(0)
    ref = ModernBertModel._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = ModernBertModel._from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    with torch.no_grad():
        for layer in ref.layers:  # sharp attention, as _model does
            layer.attn.Wqkv.weight.mul_(4.0)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 18:] = 0
    with torch.no_grad():
        got, want = (m(ids, attention_mask=mask).last_hidden_state for m in (ours, ref))
        wide = copy.deepcopy(cfg)
        wide.local_attention = 64  # every key inside the window: the band changes the output
        full = ModernBertModel._from_config(wide, attn_implementation="sdpa").eval()
        full.load_state_dict(ref.state_dict())
        unbanded = full(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
    assert (unbanded[real] - want[real]).abs().max() > 100 * ATOL


def test_t5_relative_position_bias_matches_eager() -> None:
    """T5's learned relative position bias (`position_bias`, added to the scores) in its encoder,
    causal decoder and cross-attention, with padding: logits, generated tokens and every gradient
    (the bias table's included) equal transformers' eager attention."""
    cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    ref = T5ForConditionalGeneration._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    with torch.no_grad():  # a bias of a few units: it decides where attention goes
        for stack in (ref.encoder, ref.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(8.0)
    ours = T5ForConditionalGeneration._from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    ours.load_state_dict(ref.state_dict())
    ids, mask = _inputs(True)
    ids, mask = ids[:, :12].flip(1), mask[:, :12].flip(1)  # right padding, as encoders take it
    labels = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask, labels=labels).logits for m in (ours, ref))
        kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    _check_gradients(ours, ref, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_compile_fullgraph() -> None:
    """torch.compile(fullgraph=True) of a padded forward and of a static-cache decode step (the
    graph breaks nowhere: mask and attention read no tensor values while tracing)."""
    cfg = _llama_config()
    ref, ours = _pair(cfg, "sdpa")
    ids, mask = _inputs(True)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                                   ref(ids, attention_mask=mask).logits, atol=ATOL, rtol=0)
        caches = [StaticCache(config=cfg, max_cache_len=PROMPT + 4) for _ in range(2)]
        expected = ref(ids, attention_mask=mask, **{CACHE: caches[0]}).logits
        got = ours(ids, attention_mask=mask, **{CACHE: caches[1]}).logits
        assert caches[1].get_seq_length() == PROMPT
        torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=ATOL, rtol=0)
        step = torch.compile(ours.forward, fullgraph=True, backend="aot_eager")
        token = expected[:, -1:].argmax(-1)
        for _ in range(2):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
            position = mask.sum(-1, keepdim=True) - 1
            expected = ref(token, attention_mask=mask, position_ids=position, **{CACHE: caches[0]}).logits
            got = step(input_ids=token, attention_mask=mask, position_ids=position, **{CACHE: caches[1]}).logits
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
            token = expected[:, -1:].argmax(-1)


# --------------------------------------------------------------------------- the functions themselves


class _Module(torch.nn.Module):
    def __init__(self, is_causal: bool = True, groups: int = 1) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups
        self.train(False)


def _qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(b, h, n, d, generator=g) * 2 for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
               softcap: float | None = None) -> torch.Tensor:
    """Plain attention with a (B, 1, Lq, Lk) bool mask, output (B, Lq, H, D); empty rows give 0."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~visible, -torch.inf), -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def test_static_cache_chunk_with_window() -> None:
    """A chunk of 3 queries at positions 5-7 over a static cache of 12 slots (8-11 unwritten),
    window 4, softcap, GQA, left padding: the mask marks the slots, the keys are rotated."""
    q, k, v = _qkv(2, 4, 2, 3, 12)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, :2] = False
    m = mask_of(batch_size=2, q_length=3, kv_length=12, q_offset=torch.tensor(5), attention_mask=pad,
                mask_function=mu.sliding_window_causal_mask_function(4), local_size=4)
    assert m.dtype == torch.int8 and m.shape == (2, 1, 1, 12)
    assert m[1, 0, 0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1]
    out, weights = nft.attention_forward(_Module(groups=2), q, k, v, m, sliding_window=4, softcap=3.0)
    qpos, kpos = torch.arange(5, 8)[:, None], torch.arange(12)[None]
    visible = (kpos <= qpos) & (qpos - kpos < 4) & torch.nn.functional.pad(pad, (0, 4))[:, None, None, :]
    torch.testing.assert_close(out, _reference(q, k, v, visible, softcap=3.0), atol=1e-5, rtol=0)
    assert weights is None


def mask_of(**kwargs: object) -> torch.Tensor | None:
    """Our mask function, called the way transformers' create_causal_mask calls it."""
    kwargs.setdefault("mask_function", mu.causal_mask_function)
    kwargs.setdefault("allow_is_causal_skip", True)
    return nft.mask(**kwargs)


def test_mask_function() -> None:
    pad = torch.tensor([[True] * 10, [False, False] + [True] * 8])
    # no cache: None without padding, else the padding as (B, 1, 1, Lk) uint8 (1: attended)
    assert mask_of(batch_size=2, q_length=10, kv_length=10, attention_mask=torch.ones(2, 10, dtype=torch.bool)) is None
    m = mask_of(batch_size=2, q_length=10, kv_length=10, attention_mask=pad)
    assert m.dtype == torch.uint8 and torch.equal(m[:, 0, 0].bool(), pad)
    # a full dynamic sliding cache (window 4): keys 7..10 of an 11-token mask; the decode query is at 10
    pad11 = torch.cat([pad, torch.ones(2, 1, dtype=torch.bool)], 1)
    pad11[0, 8] = False
    m = mask_of(batch_size=2, q_length=1, kv_length=4, q_offset=10, kv_offset=7, attention_mask=pad11,
                mask_function=mu.sliding_window_causal_mask_function(4), local_size=4)
    assert m.dtype == torch.uint8 and torch.equal(m[:, 0, 0].bool(), pad11[:, 7:])
    # bidirectional: never marks slots, whatever the offsets
    m = mask_of(batch_size=2, q_length=3, kv_length=10, mask_function=mu.bidirectional_mask_function,
                attention_mask=pad, allow_is_bidirectional_skip=True)
    assert m.dtype == torch.uint8 and torch.equal(m[:, 0, 0].bool(), pad)
    assert doctest.testmod(nft).failed == 0


def test_unsupported_patterns_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="or_mask_function"):
        mask_of(batch_size=1, q_length=4, kv_length=4, use_vmap=True)
    packed = mu.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1]]))
    with pytest.raises(NotImplementedError, match="packed"):
        mask_of(batch_size=1, q_length=4, kv_length=4, mask_function=mu.and_masks(mu.causal_mask_function, packed))
    q, k, v = _qkv(1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="does not broadcast"):
        nft.attention_forward(_Module(), q, k, v, torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="bool or floating point"):
        nft.attention_forward(_Module(), q, k, v, torch.zeros(1, 1, 4, 4, dtype=torch.int32))
    module = _Module().train()
    with pytest.raises(ValueError, match="dropout"):
        nft.attention_forward(module, q, k, v, None, dropout=0.1)


def test_attention_semantics() -> None:
    """Causal decode over a dynamic cache (the query at the end of the keys), and bidirectional
    attention with padding; dropout is ignored outside training, as eager attention does."""
    q, k, v = _qkv(2, 4, 2, 1, 9)
    out, _ = nft.attention_forward(_Module(groups=2), q, k, v, None)
    torch.testing.assert_close(out, _reference(q, k, v, torch.ones(1, 1, 1, 9, dtype=torch.bool)), atol=1e-5, rtol=0)
    q, k, v = _qkv(2, 4, 4, 5, 7)
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[0, 5:] = False
    mask = pad[:, None, None, :]
    sdpa, _ = sdpa_attention_forward(_Module(is_causal=False), q, k, v, mask)
    out, weights = nft.attention_forward(_Module(is_causal=False), q, k, v, mask, dropout=0.5)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=0)
    assert weights is None


def test_output_attentions_and_gradients(llama: tuple[torch.nn.Module, torch.nn.Module],
                                         caplog: pytest.LogCaptureFixture) -> None:
    """output_attentions=True warns (once) and gives no weights, as transformers' sdpa does; a
    forward that records gradients gets gradients (the derived backward), equal to sdpa's."""
    _, ours = llama
    ids, mask = _inputs(True)
    with torch.no_grad(), caplog.at_level(logging.WARNING):
        out = ours(ids, attention_mask=mask, output_attentions=True)
    assert "attention weights" in caplog.text
    assert out.attentions is not None and all(a is None for a in out.attentions)
    sdpa_model, _ = llama
    _check_gradients(ours, sdpa_model, lambda m: m(ids, attention_mask=mask).logits.float().square().mean())


def test_gemma2_gradients_and_compiled_training_equal_the_reference(gemma2: tuple[torch.nn.Module, torch.nn.Module],
                                                                   llama: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """Gemma-2's sliding window and logit softcapping through the derived backward: every
    parameter's gradient equals the eager reference's; and a Llama-style training step inside
    torch.compile(fullgraph=True) gives the eager step's gradients."""
    ids, _ = _inputs(False)
    ref, ours = gemma2
    _check_gradients(ours, ref, lambda m: m(ids).logits.float().square().mean())
    _, model = llama

    def loss() -> torch.Tensor:
        return model(ids, labels=ids).loss

    model.zero_grad()
    loss().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.compile(loss, fullgraph=True, backend="aot_eager")().backward()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, atol=1e-5, rtol=1e-4)


def test_gpt_oss_attention_sinks_match_eager() -> None:
    """gpt-oss's attention sinks (a learned per-head logit in every row's softmax, `s_aux`) with its
    alternating sliding and full layers: logits, generated tokens and every gradient (the sinks'
    included) equal transformers' eager attention. Sinks of a few units move the logits far more
    than the tolerance."""
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                       layer_types=["sliding_attention", "full_attention"])
    ref = _model(cfg, "eager")
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4, generator=torch.Generator().manual_seed(2)) * 3)
    ours = _model(cfg, NAME, ref.state_dict())
    _check_logits(ref, ours, padded=True)
    _check_generate(ref, ours)
    ids, _ = _inputs(False)
    _check_gradients(ours, ref, lambda m: m(ids).logits.float().square().mean())
    with pytest.raises(ValueError, match="one value per query head"):
        nft.attention_forward(ours.model.layers[0].self_attn, *(torch.randn(1, 4, 3, 16) for _ in range(3)), None,
                              s_aux=torch.zeros(3))


def test_chunked_attention_config_is_refused_under_compile() -> None:
    """Chunked attention (Llama-4) is read from the mask function, which torch.compile cannot
    inspect: while compiling it is refused from the config, which torch.compile can read."""
    import types

    config = types.SimpleNamespace(attention_chunk_size=8)

    def build(padding: torch.Tensor) -> torch.Tensor | None:
        return nft.mask(batch_size=1, q_length=4, kv_length=4, config=config, attention_mask=padding)

    with pytest.raises(Exception, match="attention_chunk_size"):
        torch.compile(build, fullgraph=True, backend="eager")(torch.ones(1, 4, dtype=torch.bool))


def test_chunked_and_packed_masks_are_document_ids() -> None:
    """Chunks count from each row's first token (after its left padding); packed sequences keep
    their ids; padding keys get no document; static caches are refused."""
    left_padding = torch.tensor([0, 2])
    chunked = mu.chunked_causal_mask_function(3, left_padding)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, :2] = False
    ids = mask_of(batch_size=2, q_length=8, kv_length=8, mask_function=chunked, attention_mask=pad)
    none = nft._NO_DOCUMENT
    assert ids.dtype == torch.int32 and ids.shape == (2, 1, 1, 8)
    assert ids[:, 0, 0].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2], [none, none, 0, 0, 0, 1, 1, 1]]
    decode = mask_of(batch_size=2, q_length=1, kv_length=9, q_offset=8, mask_function=chunked,
                     attention_mask=torch.cat([pad, torch.ones(2, 1, dtype=torch.bool)], 1))
    assert decode[:, 0, 0, -1].tolist() == [2, 2]
    with pytest.raises(NotImplementedError, match="static caches"):
        mask_of(batch_size=2, q_length=1, kv_length=12, q_offset=torch.tensor(8), mask_function=chunked)
    sequences = torch.tensor([[0, 0, 0, 1, 1, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    packed = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
                          mu.packed_sequence_mask_function(sequences))
    assert mask_of(batch_size=1, q_length=6, kv_length=6, mask_function=packed)[0, 0, 0].tolist() == [0, 0, 0, 1, 1, 2]


def test_llama4_chunked_attention_matches_sdpa() -> None:
    """Llama-4's chunked layers (each query sees the keys of its own chunk of 8 positions, counted
    from the row's first token) beside its global layers, with left padding: logits, generated
    tokens crossing chunk boundaries, and every gradient equal transformers' sdpa."""
    from transformers import Llama4TextConfig

    cfg = Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=256, attention_chunk_size=8, num_local_experts=2,
                           interleave_moe_layer_step=2, no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)
    ref, ours = _pair(cfg, "sdpa")
    _check_logits(ref, ours, padded=True)
    _check_generate(ref, ours)
    ids, mask = _inputs(True)
    weights = torch.randn(2, PROMPT, 128, generator=torch.Generator().manual_seed(5)) * mask[..., None]
    _check_gradients(ours, ref, lambda m: (m(ids, attention_mask=mask).logits.float() * weights).sum())


def test_packed_sequences_match_sdpa(llama: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """Three sequences packed into one row (position_ids restarting, no attention_mask, as
    DataCollatorWithFlattening gives them): each sees only itself, as sdpa's packed mask does, and
    the logits equal those of the sequences run one by one."""
    ref, ours = llama
    ids = torch.randint(0, 128, (1, PROMPT), generator=torch.Generator().manual_seed(6))
    lengths = (10, 8, 6)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = ours(ids, position_ids=positions, use_cache=False).logits  # transformers packs without a cache only
        want = ref(ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([ref(part).logits for part in ids.split(lengths, dim=1)], 1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["bool_keys", "bool_full", "float_full"])
def test_a_4d_mask_given_to_the_model_is_read_as_sdpa_reads_it(kind: str) -> None:
    """A caller's 4-D mask reaches the layers unchanged: it is the whole mask (no causal part), as
    in sdpa, whether bool (B, 1, 1, Lk) or (B, 1, Lq, Lk), or float (added to the scores)."""
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    if kind == "bool_keys":
        given = torch.ones(2, 1, 1, 10, dtype=torch.bool)
        given[1, ..., :4] = False
    else:
        given = torch.rand(2, 1, 10, 10, generator=g) > 0.3
        given[..., 0] = True  # every query sees a key (sdpa gives NaN for a row that sees none)
        if kind == "float_full":
            given = torch.where(given, torch.randn(2, 1, 10, 10, generator=g), torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = ref(ids, attention_mask=given).logits
        got = ours(ids, attention_mask=given).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
