"""Hugging Face transformers attention backend on the nki-flash kernels.

One call registers it; models then select it by name::

    import host.integrations.transformers as nki_tf
    nki_tf.register()                                   # -> "nki"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="nki")

The name avoids "flash": transformers resolves attention implementations whose names contain
it through its hub-kernel machinery. ``register`` adds two entries, under the same name, to
transformers' registries: the attention function (:func:`attention_forward`) and the mask
function (transformers' own ``sdpa_mask``: a boolean mask, or None where ``is_causal``
suffices), so the masks models build are the SDPA ones and :func:`attention_forward` converts
them to the kernels' options (host-side, exactly: a mask that is not one the kernels apply
raises, naming the form).

What the kernels run:

- prefill and training: :func:`host.torch_ops.flash_attention` (forward and flash backward),
  GQA native (K/V are not repeated), causal / sliding-window bands, right *and left* padding
  (a left-padded batch is rotated on the host so each sequence's valid positions come first,
  and the output rotated back; fully masked padding rows give zeros), dropout when the module
  is training;
- ``generate()`` steps with one query token and no gradient: the split-KV decode kernel
  (:func:`host.torch_ops.flash_decode`) over the cache's valid keys.

- logit soft-capping (Gemma 2's ``softcap``) and attention sinks (gpt-oss's ``s_aux``, with
  their gradient), in the kernels (``nki_kernels/attention/score_mods.py``).

Not supported (a clear error, never a silent difference): position biases, arbitrary or
per-head masks, ``output_attentions`` (no weights are materialized; a warning, as SDPA
gives).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from host import torch_ops as _ops
from host import validation as _v

#: The registered name (no "flash": see the module docstring).
NAME = "nki"


def register(name: str = NAME) -> str:
    """Register the attention function and its mask function with transformers under
    ``name`` (default ``"nki"``) and return the name. Idempotent."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {_v.describe(name)}")
    if "flash" in name.lower():
        raise ValueError(f"name: {name!r} contains 'flash', which transformers resolves as a hub "
                         f"kernel; choose another name (default {NAME!r})")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:        # an optional extra
        raise ImportError("host.integrations.transformers needs transformers >= 5 "
                          "(pip install 'nki-flash[transformers]')") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _unsupported(kwargs) -> None:
    for key, what in (("position_bias", "an additive position bias"),):
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"{key}: {what} is not supported by the nki attention backend yet; use "
                f"attn_implementation='eager' for this model")
    if kwargs.get("output_attentions", False):
        warnings.warn("output_attentions: the nki backend materializes no attention weights; "
                      "returning None", stacklevel=3)


def _band(module, is_causal, sliding_window, L: int):
    """``(causal, window)`` of a call without a mask tensor: the module's causality and
    transformers' sliding window (key j visible from query i iff i - W < j <= i)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal or L == 1:
        return None, None
    window = None
    if sliding_window is not None:
        window = (int(sliding_window) - 1, _v.WINDOW_UNBOUNDED)
    return _v.CAUSAL_BOTTOM_RIGHT, window


def _form(module, query, key, attention_mask, is_causal, sliding_window) -> "_ops._MaskForm":
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if attention_mask is not None:
        return _ops._mask_to_options(attention_mask, query, (B,), Hq, L, S)
    return _ops._MaskForm(*_band(module, is_causal, sliding_window, L), None, None)


def _packed_offsets(query, key, kwargs):
    """The int32 ``(cu_seqlens_q, cu_seqlens_k)`` of a padding-free packed batch, as
    transformers' flash backend finds them: the ``cu_seq_lens_q``/``cu_seq_lens_k`` keywords
    (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), else ``position_ids``
    that restart (from their minimum) inside one batch row of self-attention; None for an
    unpacked call."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None:
        pos = kwargs.get("position_ids")
        L = query.shape[2]
        if pos is None or query.shape[0] != 1 or key.shape[2] != L or pos.numel() != L:
            return None
        pos = pos.reshape(-1)
        starts = (pos == pos.min()).nonzero().view(-1)
        if starts.numel() < 2:
            return None
        cu_q = cu_k = torch.cat([starts, starts.new_tensor([L])])
    cu_k = cu_q if cu_k is None else cu_k
    return tuple(c.detach().to(device="cpu", dtype=torch.int32) for c in (cu_q, cu_k))


def _check_packed_mask(attention_mask, cu, causal, window, L: int):
    """The kernel applies the offsets, not the mask (as transformers' flash backend does):
    the mask transformers built for a packed batch must be its sequences' own (block
    diagonal, with the band) or the band of the whole row (the sliding-window masks do not
    see the packing), nothing else (a padding mask would be lost)."""
    if attention_mask is None:
        return
    seq = torch.zeros(L, dtype=torch.int64)
    seq[cu[1:-1].long()] = 1
    seq = seq.cumsum(0)
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    band = torch.ones(L, L, dtype=torch.bool)
    if causal is not None:
        band &= j <= i
    if window is not None:
        band &= j >= i - window[0]
    got = attention_mask.reshape(-1, L, L) if attention_mask.dtype == torch.bool else None
    if got is None or not any(bool((got == want).all())
                              for want in (band & (seq[:, None] == seq[None, :]), band)):
        raise ValueError("attention_mask: a packed batch (position_ids restarting, or "
                         "cu_seq_lens_q) must come with its sequences' causal mask, the "
                         "row's, or none; got another mask")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                      **kwargs):
    """transformers' attention-function interface: query ``(B, Hq, L, D)``, key/value ``(B,
    Hkv, S, D)`` (not repeated for GQA), the mask built by the registered mask function;
    returns ``(attn_output (B, L, Hq, D), None)``."""
    _unsupported(kwargs)
    mods = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    # fp32 models keep fp32 matmul operands (as their SDPA would), bf16/fp16 theirs
    mixed = query.dtype not in (torch.float32, torch.float64)
    packed = _packed_offsets(query, key, kwargs)
    if packed is not None:
        # a padding-free packed batch: each sequence attends within itself (the packed kernels)
        causal, window = _band(module, is_causal, sliding_window, query.shape[2])
        _check_packed_mask(attention_mask, packed[0], causal, window, query.shape[2])
        o = _ops.flash_attention(query, key, value, causal=causal, window=window, scale=scaling,
                                 mixed_precision=mixed, dropout_p=float(dropout),
                                 cu_seqlens_q=packed[0], cu_seqlens_k=packed[1], **mods)
        return o.transpose(1, 2).contiguous(), None
    form = _form(module, query, key, attention_mask, is_causal, sliding_window)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (query, key, value, mods["sinks"]))
    if query.shape[2] == 1 and not needs_grad and not dropout and form.q_lens is None:
        o = _decode(query, key, value, form, scaling, mixed, mods)
    else:
        o = _ops._attention_with_form(query, key, value, form, scale=scaling,
                                      mixed_precision=mixed, dropout_p=float(dropout), **mods)
    return o.transpose(1, 2).contiguous(), None


def _decode(query, key, value, form, scaling, mixed, mods):
    """One new token per sequence over the cache's valid keys (left padding rotated away)."""
    B, S = query.shape[0], key.shape[2]
    if form.kv_start is not None:
        key, value = _ops._rotate(key, form.kv_start), _ops._rotate(value, form.kv_start)
    lens = form.kv_lens if form.kv_lens is not None else [S] * B
    return _ops.flash_decode(query, key, value, cache_lens=torch.as_tensor(lens),
                             scale=scaling, mixed_precision=mixed, **mods)


__all__ = ["NAME", "register", "attention_forward"]
