"""PyTorch entry points: a differentiable flash attention and an SDPA-compatible wrapper.

Two functions, both autograd-aware:

:func:`flash_attention`
    The NumPy API's :func:`host.flash_attention` for torch tensors, as the ``torch.library``
    custom op ``nki_flash::attention_fwd`` whose autograd formula calls
    ``nki_flash::attention_bwd`` (the flash backward kernel, :func:`host.flash_attention_backward`).
    Both ops have fake implementations, so ``torch.compile(fullgraph=True)`` and
    ``torch.export`` see them as single graph nodes; differentiating the backward op (double
    backward) raises; ``torch.func.vmap`` runs one call per sample; ``torch.func.grad`` raises.
    Same options and semantics as the NumPy API (docs/semantics.md); in particular
    ``causal=True`` means ``"bottom_right"``.
:func:`scaled_dot_product_attention`
    A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` with PyTorch's
    semantics (``is_causal`` is top-left aligned, ``enable_gqa``, keyword ``scale``, any number
    of batch dims). Masks the kernels can apply themselves are converted (key padding ->
    ``kv_lens``, lower-triangular -> causal, ...); anything else raises.

Where the work runs
-------------------
* **CPU tensors** go through the NumPy API, i.e. the active backend of :mod:`host._launch`: the
  bundled CPU simulator, or a Trainium device via ``nki.baremetal`` when neuronx-cc is installed.
  Tensors are handed over without any cast: float32/float16 through ``Tensor.numpy()``, bfloat16
  through ``view(torch.int16)`` and ``ml_dtypes.bfloat16`` (NumPy has no bfloat16).
  Non-contiguous tensors are copied to contiguous ones first.
* **XLA tensors** (``tensor.device.type == "xla"``, torch-neuronx) call the ``@nki.jit`` kernels
  directly on the device tensors (torch-neuronx convention: the kernel is launched with its
  SPMD grid in the legacy namespace, ``kernel[lnc]`` under ``nki.*``, allocates its outputs in
  HBM and returns them; it becomes one custom call in the XLA graph). **This path is untested: it needs a Trainium host.** See
  :class:`_XlaKernels`.
* Any other device raises.

Dtypes
------
float32, bfloat16 and float16 run as they are (q, k, v share one dtype). Gradients come back
in the input dtype; the LSE is float32.

float64 is accepted **only with** ``mixed_precision=False``: the kernels have no float64 path,
so float64 inputs are explicitly converted to float32, computed with float32 matmuls (relative
error ~1e-6), and the outputs (o, lse and the gradients) are converted back to float64. This is
what makes :func:`torch.autograd.gradcheck` usable (with tolerances for float32 arithmetic).
With the default ``mixed_precision=True`` a float64 input raises, since it would compute in
bfloat16 behind a float64 signature.

torch is imported by this module only; ``import host`` does not import it.
"""
from __future__ import annotations

import math
import numbers
from typing import List, NamedTuple, Optional, Tuple

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "host.torch_ops needs PyTorch; install it with pip install 'nki-flash[torch]'"
    ) from _exc

import host
from host import validation as _v

__all__ = ["flash_attention", "scaled_dot_product_attention", "flash_decode",
           "flash_attention_with_kvcache"]

# --------------------------------------------------------------------------------------------
# Dtypes and conversion
# --------------------------------------------------------------------------------------------

#: torch dtype -> NumPy dtype of the arrays the NumPy API takes (same bits, no conversion).
_NUMPY_DTYPE = {
    torch.float32: np.dtype(np.float32),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
}
#: torch's 8-bit float types that have an ml_dtypes twin (an FP8 KV cache of flash_decode; torch
#: has no IEEE-style E4M3, trn2's ``float8_e4m3``).
_FP8_NUMPY_DTYPE = {
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
}
#: The dtype the kernels compute a float64 call in (with ``mixed_precision=False`` only).
_FLOAT64_COMPUTE = torch.float32
_ALLOWED_DTYPES = "float32, bfloat16, float16 (float64 only with mixed_precision=False)"

_DEVICE_CPU = "cpu"
_DEVICE_XLA = "xla"


def _to_numpy(t: "torch.Tensor") -> np.ndarray:
    """CPU tensor -> NumPy array with the same dtype and values (no cast; copies only if strided)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype in _FP8_NUMPY_DTYPE:      # an FP8 KV cache: the same bytes, ml_dtypes' type
        return t.view(torch.uint8).numpy().view(_FP8_NUMPY_DTYPE[t.dtype])
    if t.dtype in _NUMPY_DTYPE:
        return t.numpy()
    raise TypeError(f"internal: no NumPy dtype for {t.dtype}")


def _to_torch(a, name: str, dtype: "torch.dtype") -> "torch.Tensor":
    """NumPy result of the host API -> CPU tensor of ``dtype``; any other dtype is an error.

    The host API promises its output dtypes (o in q's dtype, lse float32); a different dtype
    would mean a silent conversion somewhere, so it is reported instead of being cast.
    """
    a = np.asarray(a)
    expected = _NUMPY_DTYPE[dtype]
    if a.dtype != expected:
        raise RuntimeError(
            f"internal: {name} came back from the NumPy API as {a.dtype}, expected {expected.name}"
        )
    if not (a.flags.c_contiguous and a.flags.writeable):
        a = np.array(a, copy=True, order="C")
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _lens_to_host(name: str, lens):
    """kv_lens / q_lens: torch int tensors become NumPy arrays; anything else is passed on.

    Values and dtypes are checked by :func:`host.validation.check_lengths` (float tensors are
    rejected there, not truncated).
    """
    if isinstance(lens, torch.Tensor):
        if lens.dtype.is_floating_point or lens.dtype.is_complex or lens.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {_v.dtype_name(lens)}")
        return lens.detach().cpu().numpy()
    return lens


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


class _Options(NamedTuple):
    """Validated options of one attention call (canonical forms of :mod:`host.validation`)."""

    scale: float
    causal: Optional[str]
    window: Optional[Tuple[int, int]]
    kv_lens: Optional[np.ndarray]
    q_lens: Optional[np.ndarray]
    mixed_precision: bool
    dropout_p: float = 0.0
    seed: Optional[int] = None
    block_mask: object = None   # None, a bool array, or a (num_blocks, indices) pair
    softcap: Optional[float] = None
    alibi_slopes: Optional[np.ndarray] = None   # float32 (Hq,) or (B, Hq)
    sinks: Optional[np.ndarray] = None          # float32 (Hq,)
    cu_seqlens_q: Optional[np.ndarray] = None   # int32 (S + 1,): packed sequences
    cu_seqlens_k: Optional[np.ndarray] = None

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`host.flash_attention` / ``flash_attention_backward``."""
        kw = dict(scale=self.scale, causal=self.causal, window=self.window,
                  kv_lens=self.kv_lens, q_lens=self.q_lens,
                  mixed_precision=self.mixed_precision)
        if self.dropout_p:
            kw.update(dropout_p=self.dropout_p, seed=self.seed)
        if self.block_mask is not None:
            kw["block_mask"] = self.block_mask
        for name in ("softcap", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        return kw


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_v.describe(x)}")


def _device_kind(q, k, v) -> str:
    """'cpu' or 'xla' (all three on one device), else a ValueError naming the argument."""
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(
                f"{name}: expected the same device as q ({q.device}), got {x.device}"
            )
    kind = q.device.type
    if kind not in (_DEVICE_CPU, _DEVICE_XLA):
        raise ValueError(
            f"q: device {q.device} is not supported; allowed: cpu (the active nki-flash backend: "
            f"CPU simulator or a Neuron device through the NumPy launcher) and xla (torch-neuronx)"
        )
    return kind


def _compute_dtype(q, mixed_precision: bool) -> "torch.dtype":
    """The dtype the kernels run in for q's dtype; raises for unsupported dtypes."""
    if q.dtype in _NUMPY_DTYPE:
        return q.dtype
    if q.dtype == torch.float64:
        if mixed_precision:
            raise TypeError(
                "q: dtype float64 needs mixed_precision=False: the kernels have no float64 path, "
                "and with mixed_precision=False float64 inputs are computed with float32 matmuls "
                "and returned as float64 (relative error ~1e-6); with mixed_precision=True they "
                "would run in bfloat16. Pass mixed_precision=False, or cast to "
                "float32/bfloat16/float16 yourself"
            )
        return _FLOAT64_COMPUTE
    raise TypeError(f"q: dtype {_v.dtype_name(q)} is not supported; allowed: {_ALLOWED_DTYPES}")


def _validate(q, k, v, *, scale, causal, window, kv_lens, q_lens, mixed_precision) -> Tuple[
        _v.AttentionShape, _Options]:
    """Validate a call with the NumPy API's validators (so messages match it)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not isinstance(mixed_precision, (bool, np.bool_)):
        raise TypeError(
            f"mixed_precision: expected True or False, got {_v.describe(mixed_precision)}"
        )
    dtypes = _v.FLOAT_DTYPES + ((np.dtype(np.float64),) if not mixed_precision else ())
    if q.dtype == torch.float64:
        _compute_dtype(q, bool(mixed_precision))  # the explicit float64 message
    dims = _v.check_attention_inputs(q, k, v, dtypes=dtypes)
    kv = _v.check_lengths("kv_lens", _lens_to_host("kv_lens", kv_lens), dims.B, dims.Nk,
                          upper_name="Nk")
    ql = _v.check_lengths("q_lens", _lens_to_host("q_lens", q_lens), dims.B, dims.Nq,
                          upper_name="Nq")
    opts = _Options(
        scale=_v.check_scale(scale, dims.D),
        causal=_v.normalize_causal(causal),
        window=_v.normalize_window(window),
        kv_lens=kv,
        q_lens=ql,
        mixed_precision=bool(mixed_precision),
    )
    return dims, opts


# --------------------------------------------------------------------------------------------
# Executors: where the kernels run
# --------------------------------------------------------------------------------------------


class _HostKernels:
    """CPU tensors through the NumPy API (:func:`host.flash_attention` and its backward).

    ``host.flash_attention`` is looked up at call time, so the active backend (and a test's
    monkeypatch) is honoured.
    """

    def forward(self, q, k, v, opts: _Options):
        o, lse = host.flash_attention(_to_numpy(q), _to_numpy(k), _to_numpy(v), return_lse=True,
                                      **opts.kwargs())
        return _to_torch(o, "o", q.dtype), _to_torch(lse, "lse", torch.float32)

    def backward(self, do, q, k, v, o, lse, opts: _Options):
        """``(dq, dk, dv)``, and ``dsinks`` (Hq,) float32 when the call has sinks."""
        grads = host.flash_attention_backward(
            _to_numpy(do), _to_numpy(q), _to_numpy(k), _to_numpy(v), _to_numpy(o),
            _to_numpy(lse), **opts.kwargs())
        out = (_to_torch(grads[0], "dq", q.dtype), _to_torch(grads[1], "dk", k.dtype),
               _to_torch(grads[2], "dv", v.dtype))
        if opts.sinks is not None:
            out += (_to_torch(grads[3], "dsinks", torch.float32),)
        return out


class _XlaKernels:
    """XLA tensors (torch-neuronx): the ``@nki.jit`` kernels called directly on device tensors.

    **Untested: it needs a Trainium host with torch-neuronx** (and neuronx-cc 2.20 - 2.24 for
    the legacy namespace, or Neuron SDK 2.30+ with AWS's ``nki`` for ``nki.*``). Written to the
    torch-neuronx convention (reference/ecosystem.md §1): ``kernel[grid](*xla_tensors,
    **compile_time_options)`` traces the kernel into one ``AwsNeuronCustomNativeKernel`` custom
    call of the XLA graph; the kernel allocates its outputs in HBM (``nl.shared_hbm``) and
    returns them. The kernels take the standard ``(B, H, N, D)`` layout, so no permutes are
    needed on the host.

    * forward: the launch the NumPy API makes, from :func:`host.api.plan_attention_forward`,
      in the namespace it selected (``NKI_FLASH_API``): legacy ``flash_attention_fwd[(B,
      Hkv)]`` (SPMD grid), or under ``nki.*`` ``flash_attention_fwd[lnc]`` as SDK 2.33 launches
      (the kernel walks (batch, kv head) itself, :func:`nki_kernels.port.for_programs`), with
      its compile-time options and tiles, called on the device tensors with
      ``kv_lens``/``q_lens`` as (B,) int32 device tensors (the planner's default SBUF budget is
      trn1's, a tiling that also fits trn2).
    * backward: likewise from :func:`host.api.plan_attention_backward` (``flash_attn_bwd`` on
      ``(B, Hkv)`` in legacy, ``[lnc]`` under ``nki.*``), with the same (B,) int32 device
      length tensors: the compiled kernels depend
      on shapes and options only, so a new set of lengths (every step of padded training) does
      not recompile.
    """

    @staticmethod
    def _lens(device, lens):
        return None if lens is None else torch.as_tensor(lens, dtype=torch.int32, device=device)

    @staticmethod
    def _no_blocks(opts: _Options):
        if opts.block_mask is not None:
            raise NotImplementedError(
                "block_mask: block-sparse attention on XLA tensors is not wired yet (the "
                "kernel's tables are built on the host); call it with CPU tensors")
        if opts.cu_seqlens_q is not None:
            raise NotImplementedError(
                "cu_seqlens_q: packed sequences on XLA tensors are not wired yet; call it "
                "with CPU tensors")

    def forward(self, q, k, v, opts: _Options):
        from host import api

        self._no_blocks(opts)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kernel, grid, kernel_kwargs = api.plan_attention_forward(
            q, k, v, **opts.kwargs())
        o, lse = kernel[grid](q, k, v, kv_lens=self._lens(q.device, opts.kv_lens),
                              q_lens=self._lens(q.device, opts.q_lens),
                              **self._seed(q.device, opts), **self._mods(q.device, opts),
                              **kernel_kwargs)
        return o, lse

    @staticmethod
    def _mods(device, opts):
        return {name: torch.as_tensor(getattr(opts, name), dtype=torch.float32, device=device)
                for name in ("alibi_slopes", "sinks") if getattr(opts, name) is not None}

    @staticmethod
    def _seed(device, opts):
        if not opts.dropout_p:
            return {}
        from nki_kernels import tiles
        return dict(seed=torch.tensor([opts.seed % tiles.DROPOUT_SEED_MOD], dtype=torch.int32,
                                      device=device))

    def backward(self, do, q, k, v, o, lse, opts: _Options):
        from host import api

        self._no_blocks(opts)
        do = do.contiguous()
        kernel, grid, kernel_kwargs = api.plan_attention_backward(do, q, k, v, o, lse,
                                                                  **opts.kwargs())
        grads = kernel[grid](q, k, v, o, do, lse,
                             kv_lens=self._lens(q.device, opts.kv_lens),
                             q_lens=self._lens(q.device, opts.q_lens),
                             **self._seed(q.device, opts), **self._mods(q.device, opts),
                             **kernel_kwargs)
        if opts.sinks is None:
            return tuple(grads)
        # the kernel writes each sequence's share of dsinks (B, Hq)
        return tuple(grads[:3]) + (grads[3].sum(dim=0),)


_EXECUTORS = {_DEVICE_CPU: _HostKernels(), _DEVICE_XLA: _XlaKernels()}


def flash_attention(q, k, v, *, scale=None, causal=False, window=None, kv_lens=None,
                    q_lens=None, mixed_precision=True, return_lse=False, dropout_p=0.0,
                    seed=None, generator=None, block_mask=None, softcap=None,
                    alibi_slopes=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Differentiable flash attention on torch tensors (the NumPy API's semantics).

    Parameters
    ----------
    q : torch.Tensor (B, Hq, Nq, D)
    k, v : torch.Tensor (B, Hkv, Nk, D)
        ``Hq % Hkv == 0`` (query head h reads kv head ``h // (Hq // Hkv)``); one dtype for all
        three: float32, bfloat16, float16, or float64 with ``mixed_precision=False`` (computed in
        float32, see the module docstring); ``D <= 256``. CPU tensors run on the active
        nki-flash backend; XLA tensors call the kernels on the Neuron device (untested without
        hardware). Any strides.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    causal : None, False, True, "top_left" or "bottom_right"
        ``True`` means ``"bottom_right"`` (FlashAttention's convention; docs/semantics.md).
    window : (left, right), optional
        Sliding window; -1 = unbounded on that side.
    kv_lens, q_lens : (B,) ints, optional
        Valid key / query lengths per sequence: an integer torch tensor, NumPy array or list.
        Query rows past ``q_lens[b]`` output zeros (and LSE = -inf); their gradients are 0.
    mixed_precision : bool
        For float32 inputs: bfloat16 matmul operands (default) or float32 (False).
    return_lse : bool
        Also return the log-sum-exp. It is differentiable: a gradient g flowing into it adds
        the softmax backward of ``dS = g P`` (times the soft-cap's derivative) to dq and dk,
        and ``g exp(sink - lse)`` to dsinks -- one more backward-kernel call, with v = 0 and
        ``rowsum(do o) = -g``, made only when the lse is used by the loss.
    dropout_p : float in [0, 1)
        Attention dropout (:func:`host.flash_attention`): kept probabilities scaled by
        ``1 / (1 - p)``, the mask regenerated by the backward from the seed, never stored. As
        in PyTorch's functional SDPA, it applies whenever ``dropout_p > 0`` (a module decides by
        its training flag).
    seed : int, optional
        The mask's seed; default: drawn from ``generator`` (``torch.Generator``, default
        torch's global CPU generator), so ``torch.manual_seed`` makes runs reproducible.
    block_mask : optional
        Block-sparse attention (:func:`host.flash_attention`): a bool tensor ``(B or 1, Hq or
        1, ceil(Nq/128), ceil(Nk/128))`` or FlexAttention's ``(num_blocks, indices)`` pair
        (integer tensors or arrays). CPU tensors only (the XLA path raises).
    softcap : float, optional
        Logit soft-capping ``softcap * tanh(s / softcap)`` (Gemma 2), in [2^-24, 2^24].
    alibi_slopes : tensor or array (Hq,) or (B, Hq), optional
        ALiBi slopes (a constant: no gradient flows to them).
    sinks : tensor or array (Hq,), optional
        Attention-sink logits (gpt-oss); differentiable: a float tensor that requires grad
        gets ``dsinks``.
    cu_seqlens_q, cu_seqlens_k : int32 tensors or arrays (num_seqs + 1,), optional
        Packed variable-length sequences (:func:`host.flash_attention`): q ``(1, Hq,
        total_q, D)``, k and v ``(1, Hkv, total_k, D)``; forward and backward. Outside
        torch.compile the offsets are validated here (their values read on the host); in a
        traced graph they are op inputs, validated when the op runs. CPU tensors only.

    Returns
    -------
    o : torch.Tensor (B, Hq, Nq, D)
        In q's dtype, on q's device.
    lse : torch.Tensor (B, Hq, Nq), only with ``return_lse``
        Natural log; float32 (float64 for float64 inputs); -inf for rows without a visible key.

    Raises
    ------
    TypeError, ValueError
        Bad inputs or options; the message names the argument, what was given and what is
        allowed.
    """
    if torch.compiler.is_compiling():
        # traced by torch.compile / torch.export: the NumPy-side validators cannot be traced;
        # the kernels' host API validates every argument when the op runs
        opts, kv_t, q_t = _traced_options(q, scale, causal, window, kv_lens, q_lens,
                                          mixed_precision)
        p, seed_t = _traced_dropout(dropout_p, seed, generator)
    else:
        dims, opts = _validate(q, k, v, scale=scale, causal=causal, window=window,
                               kv_lens=kv_lens, q_lens=q_lens, mixed_precision=mixed_precision)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse: expected True or False, got "
                            f"{_v.describe(return_lse)}")
        p, seed_t = _dropout_args(dropout_p, seed, generator)
        _device_kind(q, k, v)           # the device check, before the op
        kv_t, q_t = _lens_tensor(opts.kv_lens), _lens_tensor(opts.q_lens)
        if block_mask is not None:
            from host import block_sparse as _bs
            _bs.check_block_mask(block_mask, dims.B, dims.Hq, dims.Nq, dims.Nk)
        from host import api
        api._score_mods_call(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
        _v.check_packing(cu_seqlens_q, cu_seqlens_k, dims.B, dims.Nq, dims.Nk)
    bm, bi = _block_mask_tensors(block_mask)
    cu_q, cu_k = _offsets_tensor(cu_seqlens_q), _offsets_tensor(cu_seqlens_k)
    cap, slopes_t, sinks_t = _mod_args(softcap, alibi_slopes, sinks)
    o, lse = torch.ops.nki_flash.attention_fwd(
        q, k, v, opts.scale, opts.causal, list(opts.window) if opts.window else None, kv_t, q_t,
        opts.mixed_precision, p, seed_t, bm, bi, cap, slopes_t, sinks_t, cu_q, cu_k)
    return (o, lse) if return_lse else o


def _offsets_tensor(cu):
    """A packed-sequence offsets argument of the op: a tensor as given, an array as a CPU
    tensor of its own dtype (the host API refuses any but int32), or None."""
    if cu is None or isinstance(cu, torch.Tensor):
        return cu
    return torch.as_tensor(np.asarray(cu))


def _mod_args(softcap, alibi_slopes, sinks):
    """The custom op's modifier arguments: the cap as a float (None for 0/None), the slopes and
    sinks as tensors (a given tensor as is, so a sinks parameter keeps its autograd graph)."""
    cap = None if softcap is None or float(softcap) == 0.0 else float(softcap)

    def tensor(x):
        if x is None or isinstance(x, torch.Tensor):
            return x
        return torch.as_tensor(np.asarray(x, dtype=np.float32))

    return cap, tensor(alibi_slopes), tensor(sinks)


def _dropout_args(dropout_p, seed, generator):
    """``(p, seed tensor)`` of a call: the validated probability and an int64 scalar tensor
    holding the seed (drawn from ``generator``, or torch's default generator, when none is
    given and ``dropout_p > 0``; a tensor, so that torch.compile traces the draw)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got "
                        f"{_v.describe(generator)}")
    p, _ = _v.check_dropout(dropout_p, 0 if seed is None else seed)
    if not p:
        return 0.0, torch.zeros((), dtype=torch.int64)
    if seed is None:
        return p, torch.randint(0, _v.MAX_DROPOUT_SEED, (), generator=generator,
                                dtype=torch.int64)
    return p, torch.tensor(int(seed), dtype=torch.int64)


def _traced_options(q, scale, causal, window, kv_lens, q_lens, mixed_precision):
    """The options of a call being traced by torch.compile/export, in plain Python (the op's
    host API call validates them again when it runs)."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    causal = {True: "bottom_right", False: None, None: None}.get(causal, causal)
    window = None if window is None else tuple(int(w) for w in window)
    lens = []
    for name, x in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if x is None or isinstance(x, torch.Tensor):
            lens.append(None if x is None else x.to(torch.int32))
        else:
            lens.append(torch.tensor([int(n) for n in x], dtype=torch.int32))
    opts = _Options(scale=scale, causal=causal, window=window, kv_lens=None, q_lens=None,
                    mixed_precision=bool(mixed_precision))
    return opts, lens[0], lens[1]


def _traced_dropout(dropout_p, seed, generator):
    p = float(dropout_p)
    if not p:
        return 0.0, torch.zeros((), dtype=torch.int64)
    if seed is None:
        return p, torch.randint(0, 2 ** 31 - 1, (), generator=generator, dtype=torch.int64)
    return p, torch.tensor(int(seed), dtype=torch.int64)


def _lens_tensor(lens):
    return None if lens is None else torch.as_tensor(np.asarray(lens, dtype=np.int32))


# --------------------------------------------------------------------------------------------
# torch.library custom ops: what torch.compile, torch.export and torch.func see
# --------------------------------------------------------------------------------------------
#
# nki_flash::attention_fwd(q, k, v, scale, causal, window, kv_lens, q_lens, mixed_precision,
#                          dropout_p, seed, block_mask=None, block_indices=None, softcap=None,
#                          alibi_slopes=None, sinks=None, cu_seqlens_q=None,
#                          cu_seqlens_k=None) -> (o, lse)
#   (block_mask: a dense bool pattern, or with block_indices the index form's num_blocks)
# nki_flash::attention_bwd(do, q, k, v, o, lse, <the same options>) -> (dq, dk, dv, dsinks)
#   (dsinks: (Hq,) float32 with sinks, an empty (0,) tensor without)
#
# Each has a fake (meta) implementation for shape and dtype propagation; attention_fwd's
# autograd formula calls attention_bwd (and, for a gradient flowing into the LSE, the two ops
# again), so compiled and exported graphs contain only these ops. attention_bwd has no
# derivative: differentiating it (double backward, Hessian-vector products) raises.


def _op_options(scale, causal, window, kv_lens, q_lens, mixed_precision, dropout_p, seed,
                block_mask=None, block_indices=None, softcap=None, alibi_slopes=None,
                sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    if block_mask is not None:
        block_mask = (block_mask.cpu().numpy() if block_indices is None else
                      (block_mask.cpu().numpy(), block_indices.cpu().numpy()))
    return _Options(scale=float(scale), causal=causal, window=None if window is None else
                    tuple(int(w) for w in window),
                    kv_lens=None if kv_lens is None else kv_lens.cpu().numpy(),
                    q_lens=None if q_lens is None else q_lens.cpu().numpy(),
                    mixed_precision=bool(mixed_precision), dropout_p=float(dropout_p),
                    seed=int(seed) if dropout_p else None, block_mask=block_mask,
                    softcap=None if softcap is None else float(softcap),
                    alibi_slopes=_host_floats(alibi_slopes), sinks=_host_floats(sinks),
                    cu_seqlens_q=None if cu_seqlens_q is None else cu_seqlens_q.cpu().numpy(),
                    cu_seqlens_k=None if cu_seqlens_k is None else cu_seqlens_k.cpu().numpy())


def _host_floats(x):
    """A float32 host copy of a small per-head tensor (slopes, sinks), or None."""
    return None if x is None else x.detach().to(_DEVICE_CPU, torch.float32).numpy()


def _block_mask_tensors(block_mask):
    """``(block_mask, block_indices)`` op arguments of a pattern: a dense bool tensor and
    None, or the index form's ``num_blocks`` and ``indices`` as int32 tensors."""
    def cpu(x, dtype=None):
        t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        return t if dtype is None else t.to(dtype)

    if block_mask is None:
        return None, None
    if isinstance(block_mask, tuple) and len(block_mask) == 2:
        return cpu(block_mask[0], torch.int32), cpu(block_mask[1], torch.int32)
    return cpu(block_mask), None


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("nki_flash::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: Optional[str], window: Optional[List[int]],
                   kv_lens: Optional[torch.Tensor], q_lens: Optional[torch.Tensor],
                   mixed_precision: bool, dropout_p: float, seed: torch.Tensor,
                   block_mask: Optional[torch.Tensor] = None,
                   block_indices: Optional[torch.Tensor] = None,
                   softcap: Optional[float] = None,
                   alibi_slopes: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None,
                   cu_seqlens_q: Optional[torch.Tensor] = None,
                   cu_seqlens_k: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    opts = _op_options(scale, causal, window, kv_lens, q_lens, mixed_precision, dropout_p,
                       seed, block_mask, block_indices, softcap, alibi_slopes, sinks,
                       cu_seqlens_q, cu_seqlens_k)
    ex = _EXECUTORS[_device_kind(q, k, v)]
    cdt = _compute_dtype(q, opts.mixed_precision)
    o, lse = ex.forward(*(x.detach().to(cdt) for x in (q, k, v)), opts)
    # fresh tensors over the kernels' output arrays: no copy, no aliasing of the inputs
    return o.to(q.dtype), lse.to(_lse_dtype(q))


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, scale, causal, window, kv_lens, q_lens, mixed_precision,
                        dropout_p, seed, block_mask=None, block_indices=None, softcap=None,
                        alibi_slopes=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op("nki_flash::attention_bwd", mutates_args=())
def _attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, scale: float, causal: Optional[str],
                   window: Optional[List[int]], kv_lens: Optional[torch.Tensor],
                   q_lens: Optional[torch.Tensor], mixed_precision: bool, dropout_p: float,
                   seed: torch.Tensor, block_mask: Optional[torch.Tensor] = None,
                   block_indices: Optional[torch.Tensor] = None,
                   softcap: Optional[float] = None,
                   alibi_slopes: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None,
                   cu_seqlens_q: Optional[torch.Tensor] = None,
                   cu_seqlens_k: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    opts = _op_options(scale, causal, window, kv_lens, q_lens, mixed_precision, dropout_p,
                       seed, block_mask, block_indices, softcap, alibi_slopes, sinks,
                       cu_seqlens_q, cu_seqlens_k)
    ex = _EXECUTORS[_device_kind(q, k, v)]
    cdt = _compute_dtype(q, opts.mixed_precision)
    qc, kc, vc, oc, doc = (x.detach().to(cdt) for x in (q, k, v, o, do))
    grads = ex.backward(doc, qc, kc, vc, oc, lse.detach().to(torch.float32), opts)
    # dsinks: (Hq,) float32 with sinks, an empty (0,) tensor without (the op's arity is fixed)
    dsinks = (grads[3].to(torch.float32) if sinks is not None
              else q.new_empty((0,), dtype=torch.float32))
    return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), dsinks


@_attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, lse, scale, causal, window, kv_lens, q_lens,
                        mixed_precision, dropout_p, seed, block_mask=None, block_indices=None,
                        softcap=None, alibi_slopes=None, sinks=None, cu_seqlens_q=None,
                        cu_seqlens_k=None):
    n = 0 if sinks is None else q.shape[1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((n,), dtype=torch.float32))


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, scale, causal, window, kv_lens, q_lens, mp, dropout_p, seed, bm, bi, softcap,
     slopes, sinks, cu_q, cu_k) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, seed)
    ctx.lens = (kv_lens, q_lens)
    ctx.blocks = (bm, bi)
    ctx.mods = (softcap, slopes, sinks, cu_q, cu_k)
    ctx.opts = (scale, causal, window, mp, dropout_p)
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse, seed = ctx.saved_tensors
    scale, causal, window, mp, dropout_p = ctx.opts
    kv_lens, q_lens = ctx.lens
    bm, bi = ctx.blocks
    softcap, slopes, sinks, cu_q, cu_k = ctx.mods
    nothing = (None,) * 12
    packing = (None, None)          # the offsets get no gradient
    if grad_o is None and grad_lse is None:
        return (None, None, None) + nothing + (None,) + packing
    bwd = torch.ops.nki_flash.attention_bwd
    mods = (softcap, slopes, sinks, cu_q, cu_k)
    do = torch.zeros_like(o) if grad_o is None else grad_o.to(o.dtype)
    dq, dk, dv, dsinks = bwd(do, q, k, v, o, lse, scale, causal, window, kv_lens, q_lens, mp,
                             dropout_p, seed, bm, bi, *mods)
    if grad_lse is not None:
        # d lse_i / d s_ij = P_ij (times the cap's derivative under soft-capping) and
        # d lse_i / d sink_h = exp(sink_h - lse_i): the softmax backward with dP = 0 and
        # D_i = -g_i, i.e. the backward kernel run with v = 0, do = e_0 and o = -g e_0
        # (rowsum(do o) = -g): its dS = g P (1 - t^2) gives the extra dq and dk, its dsinks the
        # sinks' share; dv is discarded. The undropped softmax's: no dropout.
        no_drop = torch.zeros((), dtype=torch.int64)
        g32 = grad_lse.to(torch.float32)
        e0 = torch.zeros_like(o)
        e0[..., 0] = 1.0
        o_g = torch.zeros_like(o)
        o_g[..., 0] = (-g32).to(o.dtype)
        dq_g, dk_g, _, dsinks_g = bwd(e0, q, k, torch.zeros_like(v), o_g, lse, scale, causal,
                                      window, kv_lens, q_lens, mp, 0.0, no_drop, bm, bi, *mods)
        dq = (dq.to(torch.float32) + dq_g.to(torch.float32)).to(q.dtype)
        dk = (dk.to(torch.float32) + dk_g.to(torch.float32)).to(k.dtype)
        if sinks is not None:
            dsinks = dsinks + dsinks_g
    d_sinks = None if sinks is None else dsinks.to(sinks.dtype)
    return (dq, dk, dv) + nothing + (d_sinks,) + packing


_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _bwd_setup_context(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    raise RuntimeError(
        "nki_flash: double backward (a gradient of the attention gradients, e.g. a "
        "Hessian-vector product or create_graph=True followed by another backward) is not "
        "supported: the flash backward kernel has no derivative. Use PyTorch's SDPA for "
        "higher-order gradients.")


_attention_bwd.register_autograd(_bwd_backward, setup_context=_bwd_setup_context)


# --------------------------------------------------------------------------------------------
# SDPA-compatible entry point
# --------------------------------------------------------------------------------------------

_SUPPORTED_MASKS = (
    "Supported attn_mask forms (bool, True = attend; or a float mask holding only 0.0 and "
    "-inf), identical across heads and broadcastable to (..., H, L, S): all True; a per-batch "
    "key-padding prefix (key j visible iff j < kv_len[b]) -> kv_lens; a lower-triangular causal "
    "mask, top-left (j <= i) or bottom-right (j <= i + S - L) aligned -> causal; a causal mask "
    "with a sliding-window band (j >= i + off - left) -> window; trailing all-False query rows "
    "(i >= q_len[b]) -> q_lens; left padding (leading all-False key columns and query rows of a "
    "sequence: rotated on the host so the valid part comes first); and combinations of these as "
    "in docs/semantics.md. For anything else (additive biases, per-head or arbitrary masks) use "
    "PyTorch's own SDPA"
)


class _MaskForm(NamedTuple):
    causal: Optional[str]
    window: Optional[Tuple[int, int]]
    kv_lens: Optional[np.ndarray]
    q_lens: Optional[np.ndarray]
    #: left padding: per-batch first query row / first key that any row sees (None: all 0).
    #: The sequences are rotated by them before the kernels run (valid positions first) and
    #: the output rotated back.
    q_start: Optional[np.ndarray] = None
    kv_start: Optional[np.ndarray] = None


def _first_true(any_: np.ndarray) -> np.ndarray:
    """(B, N) bool -> (B,) int64: index of the first True (0 when a row has none)."""
    return np.where(any_.any(axis=1), np.argmax(any_, axis=1), 0).astype(np.int64)


def _recognize_padded_mask(m: np.ndarray, rows_broadcast: bool) -> Optional[_MaskForm]:
    """:func:`_recognize_mask`, also for left-padded batches: when the visible keys (and
    query rows) of a sequence start after position 0, rotate each sequence so they come first
    and recognize the rotated mask (a key-padding prefix, trailing empty query rows, causal or
    window bands of the valid part)."""
    form = _recognize_mask(m)
    if form is not None:
        return form
    ks = _first_true(m.any(axis=1))
    qs = np.zeros_like(ks) if rows_broadcast else _first_true(m.any(axis=2))
    if not (ks.any() or qs.any()):
        return None
    B, L, S = m.shape
    rolled = np.stack([np.roll(m[b], (-int(qs[b]), -int(ks[b])), axis=(0, 1))
                       for b in range(B)])
    form = _recognize_mask(rolled)
    if form is None:
        return None
    return form._replace(q_start=qs if qs.any() else None, kv_start=ks if ks.any() else None)


def _rotate(x: "torch.Tensor", start: np.ndarray, inverse: bool = False) -> "torch.Tensor":
    """Rotate each sequence b of ``x`` (B, H, N, D) along N by ``start[b]`` (row i of the
    result is row ``(i + start[b]) mod N``; ``inverse`` undoes it). A gather: differentiable."""
    B, H, N, D = x.shape
    i = torch.arange(N)[None, :]
    shift = torch.as_tensor(start, dtype=torch.int64)[:, None]
    idx = (i - shift) % N if inverse else (i + shift) % N
    return torch.gather(x, 2, idx.to(x.device)[:, None, :, None].expand(B, H, N, D))


def _last_true_plus_one(any_: np.ndarray) -> np.ndarray:
    """(B, N) bool -> (B,) int64: index of the last True + 1 (0 when a row has none)."""
    n = any_.shape[1]
    rev_first = np.argmax(any_[:, ::-1], axis=1)
    return np.where(any_.any(axis=1), n - rev_first, 0).astype(np.int64)


def _window_left(m: np.ndarray, causal: str, kv: np.ndarray, ql: np.ndarray) -> Optional[int]:
    """Left window bound that would explain the first visible key of each row, or None."""
    B, L, S = m.shape
    i = np.arange(L)[None, :]
    off = np.zeros((B, 1), np.int64) if causal == _v.CAUSAL_TOP_LEFT else (kv - ql)[:, None]
    has = m.any(axis=2)
    if not has.any():
        return None
    first = np.argmax(m, axis=2)
    left = int(np.max(np.where(has, i + off - first, -1)))
    return left if left >= 0 else None


def _recognize_mask(m: np.ndarray) -> Optional[_MaskForm]:
    """The kernel options whose visibility mask equals ``m`` (B, L, S) exactly, or None.

    Candidates are read off the mask (last visible row and column per batch, the causal
    alignments, a left window bound) and tried simplest first; each is checked by rebuilding
    its mask with :func:`host.reference.attention_mask` (the semantics' own definition) and
    comparing every element, so an accepted mask computes exactly what it says.
    """
    from host import reference

    B, L, S = m.shape
    ql_c = _last_true_plus_one(m.any(axis=2))
    kv_c = _last_true_plus_one(m.any(axis=1))
    lens_choices = [(None, None)]
    if not np.all(kv_c == S):
        lens_choices.append((None, kv_c))
    if not np.all(ql_c == L):
        lens_choices += [(ql_c, None), (ql_c, kv_c)] if len(lens_choices) == 2 else [(ql_c, None)]
    for causal in (None, _v.CAUSAL_TOP_LEFT, _v.CAUSAL_BOTTOM_RIGHT):
        for ql, kv in lens_choices:
            windows = [None]
            if causal is not None:
                left = _window_left(m, causal, np.full(B, S, np.int64) if kv is None else kv,
                                    np.full(B, L, np.int64) if ql is None else ql)
                if left is not None:
                    windows.append((left, _v.WINDOW_UNBOUNDED))
            for window in windows:
                want = reference.attention_mask(L, S, batch=B, causal=causal, window=window,
                                                q_lens=ql, kv_lens=kv)
                if np.array_equal(want, m):
                    return _MaskForm(causal, window, kv, ql)
    return None


def _mask_to_options(attn_mask, query, batch_shape, H: int, L: int, S: int) -> _MaskForm:
    """Convert an SDPA ``attn_mask`` to kernel options, or raise naming ``attn_mask``.

    The mask is reduced before it is inspected: to one head (it must not vary over heads), to
    one batch entry when it is broadcast over the batch, and to one row per sequence when it is
    broadcast over the queries (then only a key-padding prefix can describe it).
    """
    _check_tensor("attn_mask", attn_mask)
    full = tuple(batch_shape) + (H, L, S)
    if attn_mask.dtype == torch.bool:
        keep = attn_mask
    elif attn_mask.dtype == query.dtype:
        if attn_mask.requires_grad:
            raise ValueError(
                "attn_mask: a float mask that requires grad is not supported (the kernels take "
                "masks as structure, not as a differentiable bias); got requires_grad=True"
            )
        finite = torch.isfinite(attn_mask)
        ok = (finite & (attn_mask == 0)) | (~finite & (attn_mask < 0))
        if not bool(ok.all()):
            bad = attn_mask[~ok].flatten()[0].item()
            raise ValueError(
                f"attn_mask: a float mask must hold only 0.0 (attend) and -inf (masked) to run in "
                f"the kernels; got the value {bad!r} (additive biases such as ALiBi, or "
                f"torch.finfo(dtype).min in place of -inf, are not supported; convert the "
                f"latter with mask == 0). {_SUPPORTED_MASKS}"
            )
        keep = attn_mask == 0
    else:
        raise TypeError(
            f"attn_mask: dtype {_v.dtype_name(attn_mask)} is not supported; allowed: bool or "
            f"query's dtype {_v.dtype_name(query)}"
        )
    try:
        ok_shape = torch.broadcast_shapes(tuple(keep.shape), full) == torch.Size(full)
    except RuntimeError:
        ok_shape = False
    if not ok_shape:
        raise ValueError(
            f"attn_mask: shape {tuple(keep.shape)} is not broadcastable to the attention shape "
            f"(..., H, L, S) = {full}"
        )
    keep = keep.detach().to(_DEVICE_CPU)
    keep = keep.reshape((1,) * (len(full) - keep.dim()) + tuple(keep.shape))
    if keep.shape[-3] != 1:
        if not bool((keep == keep.narrow(-3, 0, 1)).all()):
            raise ValueError(
                f"attn_mask: the mask differs between heads (shape {tuple(attn_mask.shape)}); "
                f"the kernels apply one mask to all heads. {_SUPPORTED_MASKS}"
            )
        keep = keep.narrow(-3, 0, 1)
    B = 1
    for d in batch_shape:
        B *= int(d)
    per_batch = all(d == 1 for d in keep.shape[:-3])
    Bm = 1 if per_batch else B
    Lm = int(keep.shape[-2])
    m = torch.broadcast_to(keep, (tuple(keep.shape[:-3]) if per_batch else tuple(batch_shape))
                           + (1, Lm, S)).reshape(Bm, Lm, S).numpy().astype(bool, copy=True)
    form = _recognize_padded_mask(m, rows_broadcast=Lm != L)
    if form is not None and Lm != L:
        # Broadcast over queries: one row per sequence, only a key-padding prefix describes it.
        form = None if form.causal is not None or form.q_lens is not None else form
    if form is None:
        raise ValueError(
            f"attn_mask: this {_v.dtype_name(attn_mask)} mask of shape {tuple(attn_mask.shape)} "
            f"is not one the kernels can apply. {_SUPPORTED_MASKS}"
        )
    if Bm != B:
        rep = (lambda a: None if a is None else np.repeat(a, B))
        form = _MaskForm(form.causal, form.window, rep(form.kv_lens), rep(form.q_lens),
                         rep(form.q_start), rep(form.kv_start))
    return form


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {_v.describe(value)}")
    return bool(value)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 mixed_precision=None):
    """:func:`torch.nn.functional.scaled_dot_product_attention` on the nki-flash kernels.

    Same signature and semantics as PyTorch's, differentiable, with these limits (each raises
    a ValueError/TypeError naming the argument rather than being ignored):

    * ``dropout_p`` applies whenever it is > 0, as in PyTorch's functional SDPA (the mask's
      seed is drawn from torch's global generator; 1.0 is refused, see
      :func:`host.validation.check_dropout`);
    * ``attn_mask`` must be one the kernels apply themselves: bool (True = attend) or a float
      mask of only 0.0 / -inf, identical across heads, that is all True, a per-batch
      key-padding prefix (-> ``kv_lens``), a top-left or bottom-right lower-triangular causal
      mask (-> ``causal``), a causal sliding-window band (-> ``window``), trailing all-False
      query rows (-> ``q_lens``), or a combination of these. The mask is inspected on the host
      (one pass over its values) and must be exactly one of these forms;
    * ``is_causal`` with ``attn_mask`` is an error (as in PyTorch);
    * different kv head counts need ``enable_gqa=True`` (PyTorch's rule);
    * value's head dim must equal query's (E == Ev); key and value share one shape.

    Parameters
    ----------
    query : torch.Tensor (..., Hq, L, E)
    key, value : torch.Tensor (..., Hkv, S, E)
        Same leading (batch) dims as query, no broadcasting between them. Inputs with 2 dims
        ``(L, E)`` are one head of one sequence. Dtypes as in :func:`flash_attention`.
    attn_mask : torch.Tensor, optional
        See above.
    dropout_p : float in [0, 1)
        Attention dropout (the kernels' own, regenerated in the backward).
    is_causal : bool
        Top-left aligned causal mask (query i sees keys j <= i), PyTorch's meaning. (The
        NumPy API's ``causal=True`` is bottom-right; this wrapper passes ``"top_left"``.)
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Allow ``Hq != Hkv`` with ``Hq % Hkv == 0`` (query head h reads kv head
        ``h // (Hq // Hkv)``, i.e. PyTorch's repeat_interleave).
    mixed_precision : bool or None, keyword-only (nki-flash extension)
        For float32 inputs: bfloat16 matmul operands (True, faster) or float32 (False). The
        default None keeps PyTorch's precision, as a drop-in should: float32 (and float64)
        inputs compute with float32 operands, about 1e-6 from PyTorch's SDPA instead of the
        ~5e-3 of bf16 operands. bf16/fp16 inputs are unaffected.

    Returns
    -------
    torch.Tensor (..., Hq, L, E)
        In query's dtype. Rows whose mask has no visible key are 0 (as in PyTorch 2.5+).
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, x)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {_v.describe(dropout_p)}")
    is_causal = _check_bool("is_causal", is_causal)
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    if is_causal and attn_mask is not None:
        raise ValueError(
            "is_causal: is_causal=True cannot be combined with attn_mask (PyTorch's rule); got "
            f"an attn_mask of shape {tuple(attn_mask.shape)}. Fold the causal mask into "
            "attn_mask or pass only is_causal=True"
        )

    if query.dim() < 2:
        raise ValueError(
            f"query: expected shape (..., Hq, L, E) with at least 2 dims, got {tuple(query.shape)}"
        )
    for name, x in (("key", key), ("value", value)):
        if x.dim() != query.dim():
            raise ValueError(
                f"{name}: expected {query.dim()} dims like query {tuple(query.shape)} "
                f"(..., Hkv, S, E), got {tuple(x.shape)}"
            )
    if query.dim() == 2:
        batch_shape, heads = (), (1, 1)
    else:
        batch_shape = tuple(query.shape[:-3])
        heads = (int(query.shape[-3]), int(key.shape[-3]))
    if tuple(key.shape[:-3]) != batch_shape:
        raise ValueError(
            f"key: batch dims {tuple(key.shape[:-3])} must equal query's {batch_shape} "
            f"(no broadcasting); got key {tuple(key.shape)}, query {tuple(query.shape)}"
        )
    if tuple(value.shape[:-1]) != tuple(key.shape[:-1]):
        raise ValueError(
            f"value: expected shape (..., Hkv, S, Ev) = {tuple(key.shape[:-1])} + (Ev,) matching "
            f"key {tuple(key.shape)}, got {tuple(value.shape)}"
        )
    L, E = int(query.shape[-2]), int(query.shape[-1])
    S, Ek, Ev = int(key.shape[-2]), int(key.shape[-1]), int(value.shape[-1])
    if Ek != E:
        raise ValueError(f"key: head dim E={Ek} must equal query's E={E}; got {tuple(key.shape)}")
    if Ev != E:
        raise ValueError(
            f"value: head dim Ev={Ev} different from query's E={E} is not supported by the "
            f"kernels; got value {tuple(value.shape)}"
        )
    Hq, Hkv = heads
    if Hq != Hkv and not enable_gqa:
        raise ValueError(
            f"enable_gqa: query has Hq={Hq} heads and key/value Hkv={Hkv}; grouped-query "
            f"attention needs enable_gqa=True (PyTorch's rule), got enable_gqa=False"
        )
    if Hq % Hkv:
        raise ValueError(
            f"key: Hkv={Hkv} kv heads must divide query's Hq={Hq} heads for enable_gqa; got key "
            f"{tuple(key.shape)}, query {tuple(query.shape)}"
        )

    if mixed_precision is None:
        mixed_precision = query.dtype not in (torch.float32, torch.float64)
    causal = _v.CAUSAL_TOP_LEFT if is_causal else None
    form = _MaskForm(causal, None, None, None)
    if attn_mask is not None:
        form = _mask_to_options(attn_mask, query, batch_shape, Hq, L, S)
    B = 1
    for d in batch_shape:
        B *= int(d)
    q4 = query.reshape(B, Hq, L, E)
    k4 = key.reshape(B, Hkv, S, E)
    v4 = value.reshape(B, Hkv, S, E)
    return _attention_with_form(q4, k4, v4, form, scale=scale, mixed_precision=mixed_precision,
                                dropout_p=float(dropout_p)).reshape(tuple(query.shape))


def _attention_with_form(q, k, v, form: _MaskForm, **kw):
    """:func:`flash_attention` of (B, H, N, D) tensors under a recognized mask, rotating
    left-padded sequences so that their valid positions come first (and the output back)."""
    if form.q_start is not None:
        q = _rotate(q, form.q_start)
    if form.kv_start is not None:
        k, v = _rotate(k, form.kv_start), _rotate(v, form.kv_start)
    o = flash_attention(q, k, v, causal=form.causal, window=form.window, kv_lens=form.kv_lens,
                        q_lens=form.q_lens, **kw)
    if form.q_start is not None:
        o = _rotate(o, form.q_start, inverse=True)
    return o


# --------------------------------------------------------------------------------------------
# Decode over a KV cache (serving loops): no autograd
# --------------------------------------------------------------------------------------------


def _host_ints(name: str, x):
    """A host NumPy copy of an integer tensor/array argument (lengths, block tables)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex():
            raise TypeError(f"{name}: expected an integer tensor, got dtype {x.dtype}")
        return x.detach().to(_DEVICE_CPU).numpy()
    return x


def flash_decode(q, k_cache, v_cache, *, cache_lens, block_table=None, scale=None,
                 tree_mask=None, num_splits=None, mixed_precision=True, return_lse=False,
                 softcap=None, alibi_slopes=None, sinks=None, window=None, k_scale=None,
                 v_scale=None, k_layout="bhsd"):
    """:func:`host.flash_decode` on torch tensors: T new tokens per sequence over a contiguous
    ``(B, Hkv, S_max, D)`` or paged KV cache (or, with ``k_layout="bhds"``, a contiguous K
    cache ``(B, Hkv, D, S_max)``, as in :func:`host.flash_decode`).

    An FP8 cache is a ``torch.float8_e5m2`` one, or on trn3 ``torch.float8_e4m3fn`` (torch has
    no IEEE-style E4M3, trn2's other format), with ``k_scale`` and ``v_scale`` (numbers or
    ``(Hkv,)`` tensors) as in :func:`host.flash_decode`.

    ``block_table`` (``(B, max_blocks_per_seq)`` integers) lays pages out as vLLM does:
    logical position p of sequence b is offset ``p % page_size`` of page
    ``block_table[b, p // page_size]`` of the pools ``(num_blocks, Hkv, page_size, D)``.
    ``cache_lens``/``block_table`` may be tensors (read on the host: the split plan and the
    work list are built from the lengths) or arrays. CPU tensors run on the active backend;
    XLA tensors launch the kernels on the device (untested without hardware). No autograd: a
    call with inputs that require grad while grad mode is on raises (use
    :func:`flash_attention` to differentiate). ``softcap``, ``alibi_slopes``, ``sinks``,
    ``window``: as in :func:`host.flash_decode`. Returns o (and lse) as torch tensors on q's
    device, o in q's dtype, lse float32.
    """
    return _over_cache("flash_decode", q, k_cache, v_cache, cache_lens=cache_lens,
                       block_table=block_table, tree_mask=tree_mask, alibi_slopes=alibi_slopes,
                       sinks=sinks, return_lse=return_lse, scale=scale, num_splits=num_splits,
                       mixed_precision=mixed_precision, softcap=softcap, window=window,
                       k_scale=k_scale, v_scale=v_scale, k_layout=k_layout)


def flash_attention_with_kvcache(q, k_cache, v_cache, *, cache_lens, block_table=None,
                                 scale=None, causal=True, window=None, tree_mask=None,
                                 softcap=None, alibi_slopes=None, sinks=None, num_splits=None,
                                 mixed_precision=True, return_lse=False, k_scale=None,
                                 v_scale=None):
    """:func:`host.flash_attention_with_kvcache` on torch tensors: any T new tokens per
    sequence over a contiguous or paged KV cache (chunked prefill, prefix caching, decode).
    Arguments and devices as :func:`flash_decode` here (``causal``: True/"bottom_right" or
    False; ``"top_left"`` is refused); no autograd. Returns o (and lse) as torch tensors on
    q's device."""
    return _over_cache("flash_attention_with_kvcache", q, k_cache, v_cache,
                       cache_lens=cache_lens, block_table=block_table, tree_mask=tree_mask,
                       alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
                       scale=scale, causal=causal, window=window, softcap=softcap,
                       num_splits=num_splits, mixed_precision=mixed_precision,
                       k_scale=k_scale, v_scale=v_scale)


def _over_cache(entry: str, q, k_cache, v_cache, *, cache_lens, block_table, tree_mask,
                alibi_slopes, sinks, return_lse, **options):
    """The torch form of the host entry point ``entry`` over a KV cache (``flash_decode``
    or ``flash_attention_with_kvcache``): one validated call (:func:`host.api._kvcache_call`)
    run on the active backend for CPU tensors, or launched on q's device (one NeuronCore)."""
    from host import api

    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, x)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_cache, v_cache)):
        raise RuntimeError(
            f"{entry}: has no autograd (it serves generation); call it under "
            f"torch.no_grad(), or use flash_attention to differentiate")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected True or False, got {_v.describe(return_lse)}")
    lens, table = _host_ints("cache_lens", cache_lens), _host_ints("block_table", block_table)
    tree = None if tree_mask is None else (tree_mask.detach().to(_DEVICE_CPU).numpy()
                                           if isinstance(tree_mask, torch.Tensor) else tree_mask)
    mods = dict(alibi_slopes=_host_floats(alibi_slopes)
                if isinstance(alibi_slopes, torch.Tensor) else alibi_slopes,
                sinks=_host_floats(sinks) if isinstance(sinks, torch.Tensor) else sinks)
    cpu = _device_kind(q, k_cache, v_cache) == _DEVICE_CPU
    # one NeuronCore on a device: these entry points take no lnc
    call = api._kvcache_call(q, k_cache, v_cache, cache_lens=lens, block_table=table,
                             tree_mask=tree, return_lse=True, lnc=None if cpu else 1,
                             decode_only=entry == "flash_decode", **mods, **options)
    if cpu:
        o, lse = api._kvcache_outputs(call, _to_numpy(q), _to_numpy(k_cache),
                                      _to_numpy(v_cache))
        o, lse = _to_torch(o, "o", q.dtype), _to_torch(lse, "lse", torch.float32)
    else:
        o, lse = api.run_kvcache(
            call, q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
            lambda kernel, grid, *a, **kw: kernel[grid](*a, **kw),
            lambda a: torch.as_tensor(np.ascontiguousarray(a)).to(q.device))
    B, Hq, T, D = (int(x) for x in q.shape)
    o, lse = o.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)
    return (o, lse) if return_lse else o
