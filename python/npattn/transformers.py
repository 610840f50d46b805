"""npattn as an attention implementation of Hugging Face ``transformers``.

::

    import npattn.transformers
    npattn.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="npattn")
    out = model.generate(**inputs, cache=npattn.transformers.Cache())

:func:`register` adds an attention function and its mask function to
transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` under the
name ``"npattn"``. Every attention layer then runs through ``npattn.torch``
(forward, generation and training): grouped-query attention without
repeating K/V, causal with a cache, left or right padding as per-request key
ranges, ``scaling``, sliding windows, ``softcap`` and ``s_aux`` sinks, and
any other mask as a mask. :class:`Cache` keeps the keys and values in
storage that grows in large steps, so that a decode step appends its rows
in place instead of copying the context.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as e:  # the optional extra is missing
    raise ModuleNotFoundError(
        "npattn.transformers needs PyTorch and transformers: "
        'pip install "npattn[transformers]" (and torch, from https://download.pytorch.org/whl/cpu)',
        name=e.name,
    ) from e

import numpy as np

import npattn

from . import _interop
from . import torch as _torch

__all__ = ["register", "attention", "mask", "Mask", "Cache", "QuantizedCache", "NAME"]

NAME = "npattn"
FN = "npattn.transformers"


def register() -> None:
    """Registers npattn with transformers under the name ``"npattn"``.

    Adds :func:`attention` to ``AttentionInterface`` and :func:`mask` to
    ``AttentionMaskInterface``; both are needed, and this is the one place
    that adds them. Calling it again changes nothing. Then
    ``from_pretrained(..., attn_implementation="npattn")`` and
    ``model.set_attn_implementation("npattn")`` select npattn.

    Examples
    --------
    >>> import npattn.transformers
    >>> npattn.transformers.register()
    >>> from transformers import AttentionInterface
    >>> "npattn" in AttentionInterface()
    True
    """
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)


# ---- the mask ----


@dataclass(frozen=True, eq=False)
class Mask:
    """The mask that :func:`mask` makes for one model call, as npattn reads it.

    Positions are transformers' own (a key's index in the cache, counted from
    ``kv_offset``; the first query row's is ``q_offset``). Either a band
    (``causal``, ``window``) intersected with the padding, which npattn
    computes without an ``L x S`` mask (padding that is one run of real
    tokens per request becomes a per-request key range), or, for any other
    pattern, ``array``: the boolean mask transformers' ``sdpa_mask`` makes.

    Attributes
    ----------
    causal : bool
        A key is visible only at or before the query's position.
    window : (int or None, int or None) or None
        ``(left, right)``: visible only if ``q - left <= k <= q + right``.
    q_offset : int or torch.Tensor
        The position of query row 0.
    kv_offset : int
        The position of key row 0.
    q_length, kv_length : int
        The query rows and the keys the mask was made for.
    padding : torch.Tensor or None, shape (B, S)
        ``True`` for a real token, ``False`` for padding; None: no padding.
    array : torch.Tensor or None, shape (B, 1, L, S)
        A pattern that is no band: ``True`` where visible.
    """

    causal: bool = True
    window: tuple[int | None, int | None] | None = None
    q_offset: Any = 0
    kv_offset: int = 0
    q_length: int = 0
    kv_length: int = 0
    padding: torch.Tensor | None = None
    array: torch.Tensor | None = None

    def _ranges(self) -> tuple[np.ndarray, np.ndarray] | None | bool:
        """(k_start, k_lengths) when each request's real tokens are one run; True
        when every token is real; None when some request's are not one run."""
        assert self.padding is not None
        pad = _interop.asarray(self.padding.to(torch.bool))
        n = pad.sum(axis=-1)
        S = pad.shape[-1]
        if (n == S).all():
            return True
        first = pad.argmax(axis=-1)
        last = S - 1 - pad[:, ::-1].argmax(axis=-1)
        if not ((n == 0) | (last - first + 1 == n)).all():
            return None
        return np.where(n == 0, 0, first).astype(np.int64), n.astype(np.int64)

    def visible(self) -> torch.Tensor:
        """The mask as one boolean tensor, (B or 1, 1, L, S): True where a key is visible."""
        if self.array is not None:
            return self.array
        band = _band(self)
        return band if self.padding is None else band & self.padding[:, None, None, :].to(torch.bool)

    def _once(self, name: str, make: Any) -> Any:
        """make(), computed once per mask (a model's layers share it), but afresh while compiling."""
        if torch.compiler.is_compiling():
            return make()
        if name not in self.__dict__:
            self.__dict__[name] = make()  # a frozen dataclass: its __dict__ holds what is derived
        return self.__dict__[name]

    def arguments(self, L: int, S: int) -> dict[str, Any]:
        """npattn.torch.attention's keywords for L query rows over S keys."""
        if self.array is not None:
            return {"mask": self.array}
        kind = "causal" if self.causal else None
        q_offset = self.q_offset
        if self.padding is None or torch.compiler.is_compiling():
            if self.padding is not None:
                return {"mask": self._once("visible", self.visible)}
            return {"mask": kind, "window": self.window, "q_offset": q_offset, "k_offset": self.kv_offset}
        if self.padding.shape[-1] != S:
            raise ValueError(f"{FN}: the mask's padding covers {self.padding.shape[-1]} keys, but key has S={S}")
        ranges = self._once("ranges", self._ranges)
        if ranges is None:  # a request whose real tokens are not one run
            return {"mask": self._once("visible", self.visible)}
        if ranges is True:
            return {"mask": kind, "window": self.window, "q_offset": q_offset, "k_offset": self.kv_offset}
        k_start, k_lengths = ranges
        # positions shift by each request's first real key, so that npattn's (which count from it) equal
        # transformers' (which count from the cache's row 0) up to one shift per request
        return {
            "mask": kind,
            "window": self.window,
            "k_start": torch.from_numpy(k_start),
            "k_lengths": torch.from_numpy(k_lengths),
            "q_offset": torch.from_numpy(int(q_offset) - k_start),
            "k_offset": self.kv_offset,
        }


def _band(m: Mask) -> torch.Tensor:
    """Mask m's band, without its padding, as a (1, 1, L, S) boolean tensor."""
    L, S = m.q_length, m.kv_length
    q = m.q_offset + torch.arange(L)[:, None]
    k = m.kv_offset + torch.arange(S)[None, :]
    visible = torch.ones(L, S, dtype=torch.bool)
    if m.causal:
        visible &= k <= q
    if m.window is not None:
        left, right = m.window
        if left is not None:
            visible &= k >= q - left
        if right is not None:
            visible &= k <= q + right
    return visible[None, None]


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> Mask:
    """transformers' mask function for npattn (``AttentionMaskInterface``).

    Called by transformers' ``create_causal_mask`` and its kin, with their
    arguments; returns a :class:`Mask`. A causal or bidirectional pattern,
    with or without a sliding window, becomes a band that npattn computes
    without a mask; any other pattern (chunked, packed sequences, image
    tokens) the boolean mask of transformers' ``sdpa_mask``. Each is checked
    against transformers' own pattern before it is trusted, so no pattern is
    dropped.
    """
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset : kv_offset + kv_length] if padding.shape[-1] > kv_length else padding
    if isinstance(q_offset, torch.Tensor) and not torch.compiler.is_compiling():
        q_offset = int(q_offset)
    if mask_function is causal_mask_function or mask_function is bidirectional_mask_function:
        return Mask(mask_function is causal_mask_function, None, q_offset, kv_offset, q_length, kv_length, padding)
    if not torch.compiler.is_compiling():
        pattern = sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask=None,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device,
        )  # fmt: skip
        for band in _bands(local_size):
            candidate = Mask(*band, q_offset, kv_offset, q_length, kv_length, padding)
            if torch.equal(pattern, _band(candidate).expand_as(pattern)):
                return candidate
    array = sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask=attention_mask,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device,
    )  # fmt: skip
    return Mask(q_offset=q_offset, kv_offset=kv_offset, q_length=q_length, kv_length=kv_length, array=array)


def _bands(local_size: int | None) -> list[tuple[bool, tuple[int | None, int | None] | None]]:
    """The bands a mask function with this local size may draw: (causal, window)."""
    if local_size is None:
        return []
    w = int(local_size)
    return [(True, (w - 1, 0)), (False, (w, w)), (False, (w - 1, w - 1)), (True, (w, 0))]


# ---- the attention function ----

_SINKS = ("s_aux", "sinks")  # the names layers give their sinks


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Mask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention function for npattn (``AttentionInterface``).

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer.
    query, key, value : torch.Tensor
        ``(B, H_q, L, D)``, ``(B, H_kv, S, D)``, ``(B, H_kv, S, D_v)``: key and
        value heads are read in groups, never repeated.
    attention_mask : Mask, torch.Tensor or None
        What :func:`mask` made; a 4D boolean or additive mask that a model
        made itself; or None (the layer's ``is_causal``).
    scaling : float, optional
        The scale; None is ``1 / sqrt(D)``.
    dropout : float
        Must be 0 (npattn has no dropout): a layer in training with
        attention dropout is a ``ValueError`` naming it.
    **kwargs
        ``softcap`` (Gemma 2), ``s_aux`` or ``sinks`` (gpt-oss), a learned
        ``position_bias`` (added to the scores), ``sliding_window`` (checked
        against the mask's window) and ``is_causal`` are honoured; keywords
        that transformers' own eager attention ignores are ignored here too.

    Returns
    -------
    (attn_output, attn_weights)
        ``attn_output`` of shape ``(B, L, H_q, D_v)``; ``attn_weights`` the
        probabilities (``npattn.attention_weights``) when the model was asked
        for ``output_attentions``, else None.
    """
    if dropout:
        raise ValueError(
            f"{FN}: dropout={dropout} was asked for, but npattn has no dropout; "
            "set the model's attention dropout to 0 for training"
        )
    L, S = query.shape[-2], key.shape[-2]
    arguments = _mask_arguments(module, attention_mask, L, S, kwargs)
    sinks = next((kwargs[name] for name in _SINKS if kwargs.get(name) is not None), None)
    if sinks is not None:
        sinks = sinks.to(torch.float32) if sinks.dtype != query.dtype else sinks
    softcap = kwargs.get("softcap")
    arguments.update(_scales(key, value))
    out = _torch.attention(query, key, value, scale=scaling, sinks=sinks, softcap=softcap, **arguments)
    weights = None
    if _weights_wanted(kwargs):
        weights = _weights(query, key, scaling, sinks, softcap, arguments)
    return out.transpose(1, 2).contiguous(), weights


def _scales(key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scales of keys and values that a QuantizedCache's layer stored as codes."""
    scales = {}
    for name, x in (("k", key), ("v", value)):
        scale = getattr(x, SCALE, None)
        if scale is not None:
            scales[f"{name}_scale"] = scale
        elif not x.dtype.is_floating_point or x.element_size() == 1:
            raise TypeError(
                f"{FN}: the layer's {'key' if name == 'k' else 'value'} holds {x.dtype} codes without their "
                "scales: the model changed what npattn.transformers.QuantizedCache returned before attention"
            )
    return scales


def _mask_arguments(module: Any, attention_mask: Any, L: int, S: int, kwargs: dict) -> dict[str, Any]:
    """npattn's mask keywords for what the layer was given."""
    if attention_mask is None:
        kind = _unmasked(module, L, S, kwargs)
        attention_mask = Mask(kind == "causal", None, S - L, 0, L, S)
    if isinstance(attention_mask, Mask):
        _check_window(attention_mask, kwargs.get("sliding_window"))
    elif not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"{FN}: attention_mask must be what npattn.transformers.mask made, a tensor or None, "
            f"got {type(attention_mask).__name__}; was the mask registered? (npattn.transformers.register())"
        )
    bias = kwargs.get("position_bias")
    if bias is not None:  # a learned bias added to the scores: the mask becomes additive
        if isinstance(attention_mask, Mask):
            attention_mask = attention_mask.visible()
        if attention_mask.dtype == torch.bool:
            return {"mask": bias.masked_fill(~attention_mask, -math.inf)}
        return {"mask": bias + attention_mask}
    if isinstance(attention_mask, Mask):
        return attention_mask.arguments(L, S)
    return {"mask": attention_mask}


def _unmasked(module: Any, L: int, S: int, kwargs: dict) -> str | None:
    """The mask of a layer given none: its is_causal, where that has one meaning."""
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal or L == 1:
        return None
    if L == S:
        return "causal"
    raise ValueError(
        f"{FN}: a causal layer got no mask for L={L} queries over S={S} keys, where top-left and bottom-right "
        "alignment differ; register npattn's mask function (npattn.transformers.register()) so that the model "
        "makes its mask"
    )


def _check_window(m: Mask, sliding_window: int | None) -> None:
    """A layer's sliding_window against its mask's band: a mismatch is refused, never ignored."""
    if sliding_window is None or m.array is not None:
        return
    left = None if m.window is None else m.window[0]
    if left is None or not (sliding_window - 1 <= left <= sliding_window):
        raise ValueError(
            f"{FN}: the layer has sliding_window={sliding_window}, but its mask's window is {m.window}; "
            "the model made its mask without that window"
        )


def _weights_wanted(kwargs: dict) -> bool:
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - another transformers
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


def _weights(query, key, scaling, sinks, softcap, arguments) -> torch.Tensor:
    """The probabilities, for output_attentions (npattn.attention_weights)."""
    kw = {
        name: _interop.asarray(x) if isinstance(x, torch.Tensor) else x
        for name, x in arguments.items()
        if name not in ("v_scale", "v_zero")  # the weights read no values
    }
    w = npattn.attention_weights(
        _interop.asarray(query), _interop.asarray(key), scaling, sinks=None if sinks is None else
        _interop.asarray(sinks), softcap=softcap, **kw
    )  # fmt: skip
    return _interop.to_torch(w)


# ---- the cache ----


class _Layer(CacheLayerMixin):
    """One layer's keys and values in storage that grows in large steps: an
    update writes its rows in place and returns views of the rows so far.
    What is stored are the arrays `_rows` makes of the new keys and values
    (here themselves), each of shape (B, H_kv, rows, width)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, capacity: int | None = None, step: int = 256):
        super().__init__()
        self.capacity_hint, self.step = capacity, step
        self.length = 0
        self._store: dict[str, torch.Tensor] = {}

    def _rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows to store for these keys and values, by name."""
        return {"k": key_states, "v": value_states}

    def _views_of(self, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads, from the stored rows so far."""
        return stored["k"], stored["v"]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _allocate(self, rows: dict[str, torch.Tensor], n: int) -> None:
        n = -(-n // self.step) * self.step
        grown = {name: r.new_empty((*r.shape[:-2], n, r.shape[-1])) for name, r in rows.items()}
        for name, old in self._store.items():
            grown[name][..., : self.length, :] = old[..., : self.length, :]
        self._store = grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            raise RuntimeError(
                f"{FN}.Cache holds keys and values for inference (under torch.no_grad); "
                "train without a cache (use_cache=False)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = self._rows(key_states, value_states)
        if not self._store:
            self._allocate(rows, max(self.capacity_hint or 0, key_states.shape[-2]))
        k = self._store["k"]
        if key_states.shape[:-2] != k.shape[:-2] or rows["k"].dtype != k.dtype:
            raise ValueError(
                f"{FN}.Cache: new keys of shape {tuple(key_states.shape)} and dtype {key_states.dtype} do not "
                f"extend the cached ones, {tuple(k.shape[:-2])} and {k.dtype}"
            )
        end = self.length + key_states.shape[-2]
        if end > k.shape[-2]:  # grow by half, in whole steps: amortised O(1) a row
            self._allocate(rows, max(end, k.shape[-2] * 3 // 2))
        for name, r in rows.items():
            self._store[name][..., self.length : end, :] = r
        self.length = end
        self._views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # transformers' legacy meaning: the length to keep
            tokens_to_remove = tokens_to_remove - self.length if tokens_to_remove < self.length else 0
        self.length = max(0, self.length + tokens_to_remove)
        self._views()

    def _views(self) -> None:
        if self._store:
            self.keys, self.values = self._views_of({n: t[..., : self.length, :] for n, t in self._store.items()})

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch(lambda t: t[indices, ...])

    def _batch(self, fn) -> None:
        if self._store:
            self._store = {name: fn(t) for name, t in self._store.items()}
            self._views()


# The attribute by which a quantized layer's codes carry their scales to attention.
SCALE = "_npattn_scale"

# name: (torch dtype, largest code)
_CODES = {"int8": ("int8", 127.0), "float8_e4m3fn": ("float8_e4m3fn", 448.0)}


def _quantized(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows (along the last axis) as codes with a float32 scale each, as npattn.quantize
    makes them: the scale the row's largest magnitude over the largest code (1 for a row
    of zeros), codes rounded to nearest, ties to even, and clamped."""
    name, largest = _CODES[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / largest, torch.ones_like(amax))
    scaled = x / scale
    if name == "int8":
        codes = torch.round(scaled).clamp_(-128, 127).to(torch.int8)
    else:
        codes = scaled.clamp_(-largest, largest).to(getattr(torch, name))
    return codes, scale


class _QuantizedLayer(_Layer):
    """A layer whose keys and values are stored as 8-bit codes with a float32 scale
    per token and head; attention reads the codes in place, each view carrying its
    scales (SCALE)."""

    def __init__(self, dtype: str, capacity: int | None = None, step: int = 256):
        super().__init__(capacity, step)
        self.dtype = dtype

    def _rows(self, key_states, value_states):
        (k, ks), (v, vs) = _quantized(key_states, self.dtype), _quantized(value_states, self.dtype)
        return {"k": k, "k_scale": ks, "v": v, "v_scale": vs}

    def _views_of(self, stored):
        k, v = stored["k"], stored["v"]
        setattr(k, SCALE, stored["k_scale"])
        setattr(v, SCALE, stored["v_scale"])
        return k, v


class Cache(_HFCache):
    """A transformers KV cache that appends in place, for npattn's attention.

    transformers' ``DynamicCache`` concatenates a new copy of every layer's
    keys and values at every step; this cache keeps them in storage that
    grows by half (in steps of ``step`` rows) when full, and each step
    writes its new rows in place, so a decode step copies no context.
    Attention reads the rows so far as views of that storage. Sliding-window
    layers keep every row too (the window decides what is read). For
    inference: an update in grad mode with inputs that require grad is an
    error.

    Parameters
    ----------
    config : transformers.PretrainedConfig, optional
        The model's config, to make one layer per decoder layer up front;
        without it layers are added as the model reaches them.
    capacity : int, optional
        Rows to allocate at the first update (the prompt plus the tokens to
        generate avoids any growth); the storage grows past it as needed.
    step : int, default 256
        Storage grows in whole multiples of this many rows.

    Examples
    --------
    >>> import npattn.transformers
    >>> cache = npattn.transformers.Cache(capacity=1024)
    >>> cache.get_seq_length()
    0
    """

    def __init__(self, config: Any = None, *, capacity: int | None = None, step: int = 256):
        if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"{FN}.Cache: capacity must be an int >= 0 or None, got {capacity!r}")
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"{FN}.Cache: step must be an int >= 1, got {step!r}")
        make = self._layer(capacity, step)
        if config is None:
            super().__init__(layer_class_to_replicate=make)
        else:
            n = config.get_text_config(decoder=True).num_hidden_layers
            super().__init__(layers=[make() for _ in range(n)])

    def _layer(self, capacity: int | None, step: int) -> Any:
        """What makes one layer's storage."""
        return functools.partial(_Layer, capacity, step)


class QuantizedCache(Cache):
    """:class:`Cache`, its keys and values stored as 8-bit codes, read as stored.

    Each new row is quantized as it is appended, with a float32 scale per
    token and head (``npattn.quantize(x, dtype)`` of the row), and attention
    reads the codes and scales in place: no dequantized copy is ever made
    (transformers' own quantized caches dequantize every layer's whole cache at
    every step). int8 takes a little over half the memory of a bfloat16 cache
    (one byte an element and four a row of D). The model then computes with
    the dequantized values: within int8's rounding of the keys and values
    (about 0.4% of each row's largest magnitude), a different model, like any
    quantized cache.

    Parameters
    ----------
    dtype : {"int8", "float8_e4m3fn"}, default "int8"
        The codes' format.
    config, capacity, step
        As for :class:`Cache`.

    Examples
    --------
    >>> import torch, npattn.transformers
    >>> cache = npattn.transformers.QuantizedCache()
    >>> keys, values = cache.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), 0)
    >>> keys.dtype, keys.shape
    (torch.int8, torch.Size([1, 2, 3, 8]))
    """

    def __init__(self, dtype: str = "int8", config: Any = None, *, capacity: int | None = None, step: int = 256):
        if dtype not in _CODES:
            raise ValueError(f"{FN}.QuantizedCache: dtype must be one of {', '.join(map(repr, _CODES))}, got {dtype!r}")
        self.dtype = dtype
        super().__init__(config, capacity=capacity, step=step)

    def _layer(self, capacity: int | None, step: int) -> Any:
        return functools.partial(_QuantizedLayer, self.dtype, capacity, step)
