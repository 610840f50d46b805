"""npattn.transformers: a transformers model with attn_implementation="npattn" computes
the model that "eager" computes.

Tiny models built from configs with random weights (nothing is downloaded): the same
greedy tokens as "eager" and logits within the float32 tolerance, for a batch of
prompts left-padded to one length, with transformers' DynamicCache and with
npattn.transformers.Cache; one training step's gradients; bfloat16; torch.compile.
Through npattn.transformers.QuantizedCache, the logits of eager attention over the
dequantized codes that cache holds, and one byte an element.
The mask function's patterns against transformers' own, and the keywords a layer may
pass that npattn cannot honour, each refused by name.
"""

import numpy as np
import pytest

import npattn
from npattn import _interop

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
nt = pytest.importorskip("npattn.transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

nt.register()

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.2,  # peaked logits: no near-ties between greedy candidates
)


def _config(name):
    """A tiny config of each architecture the installed transformers has (None if not)."""
    configs = {
        "llama": ("LlamaConfig", {}),
        "qwen2": ("Qwen2Config", {}),
        "qwen3": ("Qwen3Config", {}),
        "mistral": ("MistralConfig", {"sliding_window": 5}),  # a window shorter than the context
        "gemma2": ("Gemma2Config", {"sliding_window": 5, "attn_logit_softcapping": 3.0}),  # alternating windows
        "gpt_oss": ("GptOssConfig", {"sliding_window": 5, "num_local_experts": 4}),  # sinks
    }
    cls_name, extra = configs[name]
    cls = getattr(transformers, cls_name, None)
    return None if cls is None else cls(**SMALL, **extra)


MODELS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt_oss"]
# float32 logits of a 2-layer model: each op rounds within a few ulps of 1e-7, and
# npattn and eager sum in other orders; 1e-5 leaves a wide margin, and a mask that
# was dropped or misaligned moves logits by 1e-2 and more (test_the_check_can_fail)
LOGITS_ATOL = 1e-5


def model(name, dtype=torch.float32, implementation="eager"):
    config = _config(name)
    if config is None:
        pytest.skip(f"this transformers has no {name}")
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=dtype)
    return m.eval()


def prompts(B=3, L=9, pads=(0, 3, 5), seed=1):
    """B prompts of L tokens, request b left-padded by pads[b]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SMALL["vocab_size"], (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    return ids, mask


def generate(m, implementation, cache=None, new=32, **inputs):
    m.set_attn_implementation(implementation)
    with torch.no_grad():
        out = m.generate(
            **inputs, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
            past_key_values=cache, pad_token_id=0,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("cache", ["DynamicCache", "npattn.Cache"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_and_logits_equal_eager_for_a_left_padded_batch(name, cache):
    """generate(32 tokens) of three prompts left-padded by 0, 3 and 5: the same tokens
    as "eager", every step's logits within LOGITS_ATOL."""
    m = model(name)
    ids, mask = prompts()
    want_tokens, want_logits = generate(m, "eager", input_ids=ids, attention_mask=mask)
    made = DynamicCache() if cache == "DynamicCache" else nt.Cache()
    got_tokens, got_logits = generate(m, "npattn", made, input_ids=ids, attention_mask=mask)
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=LOGITS_ATOL)


def test_the_check_can_fail():
    """Without the padding (attention_mask dropped), npattn's logits differ from eager's
    padded run by far more than LOGITS_ATOL: the comparison above tells them apart."""
    m = model("qwen2")
    ids, mask = prompts()
    _, want = generate(m, "eager", new=4, input_ids=ids, attention_mask=mask)
    _, dropped = generate(m, "npattn", new=4, input_ids=ids)
    assert (dropped[:, 1:] - want[:, 1:]).abs().max() > 1e3 * LOGITS_ATOL


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gpt_oss"])
def test_training_step_gradients_equal_eager(name):
    """One step's loss and parameter gradients (sinks included) on a padded batch equal
    eager's within float32 rounding."""
    m = model(name).train()
    ids, mask = prompts(B=2, L=12, pads=(0, 4))
    # a label is predicted from the position before it: the first real token's from a
    # padding row, whose output eager computes otherwise (it averages V; npattn gives 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100
    grads = {}
    for implementation in ("eager", "npattn"):
        m.zero_grad()
        m.set_attn_implementation(implementation)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[implementation] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["npattn"].keys() == grads["eager"].keys()
    for n, g in grads["eager"].items():
        torch.testing.assert_close(grads["npattn"][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_bfloat16_stays_within_the_bfloat16_tolerance_of_eager(name):
    """bfloat16 weights and caches: the first steps' logits within bfloat16's rounding
    of eager's in bfloat16 (both round each layer's activations to 8 bits)."""
    m = model(name, torch.bfloat16)
    ids, mask = prompts()
    _, want = generate(m, "eager", new=4, input_ids=ids, attention_mask=mask)
    _, got = generate(m, "npattn", nt.Cache(), new=4, input_ids=ids, attention_mask=mask)
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 0.05 * scale


def test_output_attentions_are_the_weights():
    """output_attentions=True: each layer's weights, as eager's (rows of padding aside)."""
    m = model("qwen2")
    ids, mask = prompts()
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        m.set_attn_implementation("npattn")
        got = m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    for w, g in zip(want, got):
        real = mask.bool()[:, None, :, None]  # query rows of real tokens
        torch.testing.assert_close(g * real, w * real, rtol=0, atol=1e-6)


def test_torch_compile_fullgraph_equals_eager():
    """torch.compile(model, fullgraph=True) runs npattn's operator, with and without padding."""
    m = model("qwen3", implementation="npattn")
    ids, mask = prompts(pads=(0, 2, 0))
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask).logits
        compiled = torch.compile(m, fullgraph=True, backend="eager")
        got = compiled(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()[..., None]
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=LOGITS_ATOL)


# ---- the mask ----


def test_padding_that_is_not_one_run_is_a_mask_and_equals_eager():
    """A request whose real tokens are not one run (a hole inside): its mask is computed
    as a mask, and the logits of its real tokens equal eager's."""
    m = model("llama")
    ids, mask = prompts(pads=(0, 0, 0))
    mask[1, 4] = 0
    m_mask = nt.mask(3, 9, 9, mask_function=causal_mask_function, attention_mask=mask.bool())
    assert "k_start" not in m_mask.arguments(9, 9)
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask).logits
        m.set_attn_implementation("npattn")
        got = m(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()[..., None]
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize(
    "function, local, expect_band",
    [
        (causal_mask_function, None, True),
        (sliding_window_causal_mask_function(4), 4, True),
        (chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)), 3, False),
    ],
    ids=["causal", "sliding", "chunked"],
)
def test_mask_draws_transformers_pattern(function, local, expect_band):
    """mask() for each pattern: a band where it is one (no L x S mask), and whatever it
    makes, visible() equals transformers' sdpa_mask with the same padding."""
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10], dtype=torch.bool)
    made = nt.mask(2, 4, 10, q_offset=6, mask_function=function, attention_mask=padding, local_size=local)
    assert (made.array is None) == expect_band
    want = sdpa_mask(2, 4, 10, 6, 0, function, attention_mask=padding, allow_is_causal_skip=False)
    assert torch.equal(made.visible().expand_as(want), want)


def test_ranges_are_per_request_key_ranges():
    """Left padding of one run per request becomes k_start/k_lengths, positions shifted
    by each request's first real key."""
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    made = nt.mask(3, 1, 5, q_offset=4, attention_mask=padding)
    args = made.arguments(1, 5)
    np.testing.assert_array_equal(args["k_start"], [2, 0, 0])
    np.testing.assert_array_equal(args["k_lengths"], [3, 5, 0])
    np.testing.assert_array_equal(args["q_offset"], [2, 4, 4])


# ---- what cannot be honoured is refused ----


class _Layer(torch.nn.Module):
    is_causal = True


def test_keywords_npattn_cannot_honour_are_refused_by_name():
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    band = nt.mask(1, 3, 5, q_offset=2)
    with pytest.raises(ValueError, match="dropout"):
        nt.attention(_Layer(), q, k, v, band, dropout=0.1)
    with pytest.raises(ValueError, match="sliding_window=3"):
        nt.attention(_Layer(), q, k, v, band, sliding_window=3)
    with pytest.raises(ValueError, match="no mask"):
        nt.attention(_Layer(), q, k, v, None)
    with pytest.raises(TypeError, match="register"):
        nt.attention(_Layer(), q, k, v, "causal")


def test_register_is_idempotent():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    nt.register()
    nt.register()
    assert AttentionInterface()["npattn"] is nt.attention
    assert AttentionMaskInterface()["npattn"] is nt.mask


# ---- the cache ----


def test_cache_appends_in_place_and_grows_in_steps():
    """Each update writes its rows into the storage (no copy of the context); storage
    grows by half in whole steps when full, keeping what it held."""
    cache = nt.Cache(capacity=8, step=8)
    rows = [torch.randn(2, 3, n, 4) for n in (5, 1, 1, 1, 7)]
    for r in rows:
        keys, values = cache.update(r, -r, 0)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 15 and layer._store["k"].shape[-2] == 16
    torch.testing.assert_close(keys, torch.cat(rows, -2), rtol=0, atol=0)
    torch.testing.assert_close(values, -torch.cat(rows, -2), rtol=0, atol=0)
    before = keys.data_ptr()
    keys, _ = cache.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), 0)
    assert keys.data_ptr() == before  # appended in place
    cache.crop(-6)
    assert cache.get_seq_length() == 10
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.layers[0].keys.shape == (1, 3, 10, 4)


def test_cache_with_beam_search_equals_dynamic_cache():
    """Beam search reorders the cache each step: the same sequences as with DynamicCache."""
    m = model("qwen2", implementation="npattn")
    ids, mask = prompts(B=1, pads=(0,))
    with torch.no_grad():
        want = m.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=8, do_sample=False)
        got = m.generate(
            input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=8, do_sample=False,
            past_key_values=nt.Cache(),
        )  # fmt: skip
    assert torch.equal(got, want)


def test_cache_refuses_an_update_that_needs_grad():
    cache = nt.Cache()
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference"):
        cache.update(k, k, 0)


@pytest.mark.parametrize("bad", [{"capacity": -1}, {"step": 0}, {"capacity": 2.5}])
def test_cache_arguments_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        nt.Cache(**bad)


def test_quantized_cache_stores_what_quantize_makes():
    """QuantizedCache's rows are npattn.quantize's codes and per-token scales, bit for
    bit, and the views attention reads carry their scales; int8 or fp8 e4m3."""
    g = torch.Generator().manual_seed(4)
    rows = [torch.randn(2, 3, n, 16, generator=g) for n in (5, 1, 300)]
    for dtype in ("int8", "float8_e4m3fn"):
        cache = nt.QuantizedCache(dtype)
        for r in rows:
            keys, values = cache.update(r, 2 * r, 0)
        want = npattn.quantize(torch.cat(rows, -2).numpy(), dtype)
        got_codes = keys.view(torch.uint8).numpy().view(want.codes.dtype)
        np.testing.assert_array_equal(got_codes, want.codes)
        np.testing.assert_array_equal(getattr(keys, nt.SCALE).numpy(), want.scale)
        assert getattr(values, nt.SCALE).shape == (2, 3, 306, 1)


def test_quantized_cache_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="dtype"):
        nt.QuantizedCache("int4")


# ---- the 8-bit cache in a model ----

REPLAY = "eager-over-dequantized"  # an attention implementation of this file, registered below


def _dequantized(stored, name, S, scaled=True):
    """The first S rows of one of a QuantizedCache layer's stored codes (name "k" or "v"), as
    the float32 values they stand for: npattn.dequantize(codes, scale) (with scale 1: the
    codes themselves as numbers, when not scaled)."""
    codes = _interop.asarray(stored[name][..., :S, :])  # torch's int8 or fp8 as NumPy's (ml_dtypes')
    scale = stored[f"{name}_scale"][..., :S, :].numpy() if scaled else np.float32(1)
    return torch.from_numpy(npattn.dequantize(codes, scale))


def _replay(recorded, scaled=True):
    """An attention function that computes the model's own eager attention over the keys and
    values a recorded QuantizedCache holds for the layer, dequantized: the query is the
    run's own; the keys and values it was passed (those of its own cache) are read for
    their length only."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        eager = __import__(type(module).__module__, fromlist=["eager_attention_forward"]).eager_attention_forward
        stored, S = recorded.layers[module.layer_idx]._store, key.shape[-2]
        k, v = (_dequantized(stored, name, S, scaled) for name in ("k", "v"))
        return eager(module, query, k, v, attention_mask, **kwargs)

    return attention


def _generate_over_recorded(m, recorded, scaled=True, **inputs):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(REPLAY, _replay(recorded, scaled))
    AttentionMaskInterface.register(REPLAY, eager_mask)
    return generate(m, REPLAY, DynamicCache(), new=8, **inputs)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("name", ["qwen3", "gemma2"])
def test_quantized_cache_logits_equal_eager_over_its_dequantized_values(name, dtype):
    """generate(8 tokens) through a QuantizedCache, three prompts left-padded by 0, 3 and 5:
    every step's logits within LOGITS_ATOL of the model's eager attention over the very
    codes that cache stored, dequantized with npattn.dequantize and fed as float32 K/V.

    The tolerance is the float32 one of the float caches (LOGITS_ATOL): npattn computes
    sdpa of exactly those float32 values (SPEC 14: scale * code, one rounding, as
    dequantize makes them), so what remains is the order of float32 sums. The eager run
    reads the recorded codes rather than quantizing its own keys: its keys differ from
    npattn's run by float32 rounding, enough to round a code the other way (a step of
    1/127 of the row) now and then. The cache holds one byte an element, plus a float32
    scale a row of keys or values."""
    m = model(name)
    ids, mask = prompts()
    cache = nt.QuantizedCache(dtype)
    tokens, got = generate(m, "npattn", cache, new=8, input_ids=ids, attention_mask=mask)
    want_tokens, want = _generate_over_recorded(m, cache, input_ids=ids, attention_mask=mask)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)
    B, H_kv, D = 3, SMALL["num_key_value_heads"], SMALL["head_dim"]
    for layer in cache.layers:
        S = layer._store["k"].shape[-2]  # the rows allocated
        for side in ("k", "v"):
            assert layer._store[side].nbytes == B * H_kv * S * D  # one byte an element
            assert layer._store[f"{side}_scale"].nbytes == B * H_kv * S * 4
        assert layer.keys.nbytes == B * H_kv * layer.length * D


def test_the_quantized_check_can_fail():
    """The same comparison with the scales dropped from the dequantized values (the codes
    read as numbers) differs by far more than LOGITS_ATOL: the check above sees scales."""
    m = model("qwen3")
    ids, mask = prompts()
    cache = nt.QuantizedCache("int8")
    _, got = generate(m, "npattn", cache, new=8, input_ids=ids, attention_mask=mask)
    _, unscaled = _generate_over_recorded(m, cache, scaled=False, input_ids=ids, attention_mask=mask)
    assert (got - unscaled).abs().max() > 1e3 * LOGITS_ATOL
