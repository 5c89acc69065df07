"""The public NumPy API: validate -> pick tiles -> launch the grid -> return outputs.

Every entry point validates its inputs with :mod:`host.validation` (errors name the argument, what
was given and what is allowed), chooses block sizes with :mod:`nki_kernels.tiles`, and launches
kernels through :func:`host._launch.launch` (the CPU simulator or a Trainium device). An attention
call is validated once, whole, into one immutable record (:class:`AttentionCall` for the forward
and the backward, :class:`DecodeCall` for decode); planning and launching read that record only.
"""
from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple, Optional, Tuple

import numpy as np

from host import block_sparse as _bs
from host import validation as _v
from host._launch import launch
from nki_kernels import port, tiles
from nki_kernels.nki import active_target, select_api

# ============================================================================================
# Fused kernels and the unfused attention baseline
# ============================================================================================

#: ``algorithm`` values of :func:`online_softmax`.
SOFTMAX_ALGORITHMS = ("online", "two_pass")


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {_v.describe(value)}")
    return bool(value)


def _numpy(name: str, x) -> np.ndarray:
    """The NumPy array behind a validated input (torch CPU tensors are converted, not copied)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and getattr(getattr(x, "device", None), "type", "cpu") == "cpu":
        return x.detach().numpy()
    raise TypeError(f"{name}: expected a numpy.ndarray (or a CPU torch.Tensor), got "
                    f"{_v.describe(x)}")


def _mm_dtype(dtype: np.dtype, mixed_precision: bool) -> np.dtype:
    """Matmul operand dtype: the input dtype, except bf16 for fp32 with ``mixed_precision``."""
    if dtype == np.float32 and mixed_precision:
        return np.dtype(_v.FLOAT_DTYPES[1])  # bfloat16
    return dtype


def _check_budget(sbuf_budget):
    if sbuf_budget is None:
        return tiles.FUSED_SBUF_BUDGET
    return _v.check_int("sbuf_budget", sbuf_budget, minimum=1,
                        maximum=min(tiles.SBUF_USABLE_BYTES.values()))


def plan_linear_gelu(M: int, K: int, N: int, mm_itemsize: int, sbuf_budget=None):
    """Blocking of :func:`linear_gelu`: ``(block_m, block_n)``, or ``(0, 0)`` for the streaming
    variant (K too long for a resident x^T block within ``sbuf_budget`` bytes per partition)."""
    blocks = tiles.linear_gelu_blocks(M, K, N, mm_itemsize, budget=_check_budget(sbuf_budget))
    return blocks if blocks is not None else (0, 0)


def linear_gelu(x, w, b, *, approximate: str = _v.GELU_EXACT, fused: bool = True,
                mixed_precision: bool = True, sbuf_budget=None) -> np.ndarray:
    """``GELU(x @ w + b)`` on the active backend.

    Parameters
    ----------
    x : array (M, K)
    w : array (K, N)
    b : array (N,)
        x, w, b share one dtype: float32, bfloat16 or float16; any sizes >= 1.
    approximate : {"none", "tanh"}
        Exact (erf) GELU or the tanh approximation, as ``torch.nn.functional.gelu``.
    fused : bool
        True: one kernel (matmul, bias and GELU with the intermediates on chip). False: the
        unfused pipeline of three kernels (matmul, bias add, GELU), each a round trip through
        HBM -- the baseline of the fusion study.
    mixed_precision : bool
        For float32 inputs, run the matmul operands in bf16 (default) or in fp32 (False, 4x
        slower on TensorE). bf16/fp16 inputs always run in their own dtype.
    sbuf_budget : int, optional
        SBUF bytes per partition for the resident blocks (default
        ``tiles.FUSED_SBUF_BUDGET``). A smaller budget means smaller x blocks and more passes
        over W; one too small for a 128-row block selects the streaming variant.

    Returns
    -------
    numpy.ndarray (M, N) in x's dtype
    """
    from nki_kernels.fused import linear_gelu as k

    shape = _v.check_linear_gelu_inputs(x, w, b, approximate)
    fused = _check_bool("fused", fused)
    mixed_precision = _check_bool("mixed_precision", mixed_precision)
    x, w, b = _numpy("x", x), _numpy("w", w), _numpy("b", b)
    mm = _mm_dtype(x.dtype, mixed_precision)
    block_m, block_n = plan_linear_gelu(shape.M, shape.K, shape.N, mm.itemsize, sbuf_budget)
    opts = dict(mm_dtype=mm.name, block_m=block_m, block_n=block_n)
    if fused:
        return launch(k.linear_gelu_fused, (1,), x, w, b, approximate=shape.approximate, **opts)
    z = launch(k.matmul_kernel, (1,), x, w, **opts)
    z = launch(k.bias_add_kernel, (1,), z, b)
    return launch(k.gelu_kernel, (1,), z, approximate=shape.approximate)


def _check_softmax_options(algorithm, chunk_size):
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm: expected one of {', '.join(map(repr, SOFTMAX_ALGORITHMS))}, "
                        f"got {_v.describe(algorithm)}")
    if algorithm not in SOFTMAX_ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {', '.join(map(repr, SOFTMAX_ALGORITHMS))}, "
                         f"got {algorithm!r}")
    if chunk_size is not None:
        chunk_size = _v.check_int("chunk_size", chunk_size, minimum=1,
                                  maximum=tiles.SOFTMAX_MAX_CHUNK)
    return algorithm, chunk_size


def online_softmax(x, *, algorithm: str = "online", chunk_size=None) -> np.ndarray:
    """Row softmax of a 2-D array (over the last axis) on the active backend.

    Rows are processed 128 at a time; a row longer than fits on chip is streamed in chunks.

    Parameters
    ----------
    x : array (M, N), float32, bfloat16 or float16, any sizes >= 1
    algorithm : {"online", "two_pass"}
        How a streamed row gets its max and sum: in one walk with the online rescaling
        (``"online"``: reads x twice in total, writes once) or the safe softmax's two walks
        (``"two_pass"``: max, then sum; reads x three times). A row that fits on chip is read
        once either way.
    chunk_size : int, optional
        Columns per chunk, in ``[1, tiles.SOFTMAX_MAX_CHUNK]``; rows of at most ``chunk_size``
        columns are kept on chip. Default: whole rows on chip when they fit
        ``tiles.SOFTMAX_RESIDENT_BYTES``, else chunks of ``tiles.SOFTMAX_CHUNK``.

    Returns
    -------
    numpy.ndarray (M, N) in x's dtype. A row that is entirely -inf gives zeros.
    """
    from nki_kernels.fused.softmax import softmax_kernel

    M, N = _v.check_softmax_input(x)
    algorithm, chunk_size = _check_softmax_options(algorithm, chunk_size)
    x = _numpy("x", x)
    chunk, resident = tiles.softmax_plan(N, x.dtype.itemsize, x.dtype.itemsize, chunk_size)
    return launch(softmax_kernel, (1,), x, algorithm=algorithm, chunk=chunk, resident=resident,
                  zero_masked_rows=False)


def _attention_arrays(q, k, v):
    """Accept single-head ``(N, D)`` inputs by viewing them as ``(1, 1, N, D)``."""
    ranks = tuple(getattr(a, "ndim", None) for a in (q, k, v))
    if ranks == (2, 2, 2):
        return tuple(_numpy(n, a)[None, None] for n, a in zip("qkv", (q, k, v))), True
    for name, a in zip("qkv", (q, k, v)):
        _v.check_array(name, a)
        if a.ndim not in (2, 4):
            raise ValueError(f"{name}: expected a 2-D (N, D) or 4-D (B, H, N, D) array, got a "
                             f"{a.ndim}-D array of shape {tuple(a.shape)}")
    return (q, k, v), False


def attention_unfused(q, k, v, *, scale=None, causal=False,
                      mixed_precision: bool = True) -> np.ndarray:
    """Standard attention (Algorithm 0 of the FlashAttention paper): S and P go through HBM.

    Three kernels: ``S = scale q k^T`` (masked), ``P = softmax(S)``, ``o = P v``. The baseline
    the flash kernel is compared with; same semantics as ``flash_attention``
    (docs/semantics.md) for ``scale``, ``causal`` and GQA.

    Parameters
    ----------
    q : array (B, Hq, Nq, D) or (Nq, D)
    k, v : arrays (B, Hkv, Nk, D) or (Nk, D); ``Hq % Hkv == 0``; D <= 256
        One dtype for all three: float32, bfloat16 or float16.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    causal : None, False, True, "top_left" or "bottom_right"
        ``True`` means ``"bottom_right"``. A query row with no visible key outputs zeros.
    mixed_precision : bool
        float32 inputs: bf16 matmul operands (default) or fp32.

    Returns
    -------
    numpy.ndarray, q's shape and dtype
    """
    from nki_kernels.attention import unfused as ua
    from nki_kernels.fused.softmax import softmax_kernel

    (q4, k4, v4), single = _attention_arrays(q, k, v)
    dims = _v.check_attention_inputs(q4, k4, v4)
    causal = _v.normalize_causal(causal)
    scale = _v.check_scale(scale, dims.D)
    mixed_precision = _check_bool("mixed_precision", mixed_precision)
    q4, k4, v4 = (_numpy(n, a) for n, a in zip("qkv", (q4, k4, v4)))
    B, Hq, Hkv, Nq, Nk, D = dims
    dtype = q4.dtype
    mm = _mm_dtype(dtype, mixed_precision)
    offset = None if causal is None else (0 if causal == _v.CAUSAL_TOP_LEFT else Nk - Nq)
    kv_block, v_resident = tiles.unfused_attention_blocks(Nk, D, mm.itemsize)
    grid = ua.grid(B, Hq, Hkv, select_api())

    s = launch(ua.attention_scores_kernel, grid, q4, k4, scale=float(scale),
               causal_offset=offset, mm_dtype=mm.name, s_dtype=dtype.name, kv_block=kv_block)
    chunk, resident = tiles.softmax_plan(Nk, dtype.itemsize, dtype.itemsize)
    p = launch(softmax_kernel, (1,), s.reshape(B * Hq * Nq, Nk), algorithm="online",
               chunk=chunk, resident=resident, zero_masked_rows=True)
    o = launch(ua.attention_pv_kernel, grid, p.reshape(B, Hq, Nq, Nk), v4, mm_dtype=mm.name,
               o_dtype=dtype.name, v_resident=v_resident)
    return o[0, 0] if single else o


# ============================================================================================
# Flash attention forward
# ============================================================================================


#: ``nki_kernels.tiles`` under a name the ``tiles=`` keyword of this section does not shadow.
_tiles = tiles


def _check_forward_tiles(value):
    if value is None or isinstance(value, _tiles.ForwardTiles):
        return value
    raise TypeError(f"tiles: expected None or a nki_kernels.tiles.ForwardTiles, got "
                    f"{_v.describe(value)}")


def _lengths_int32(lens):
    """Validated (B,) lengths as the kernel's int32 HBM input (values already in [0, N])."""
    return None if lens is None else np.ascontiguousarray(lens, dtype=np.int32)


def _check_lnc(lnc):
    """``lnc``: None (2 on trn2, else 1), 1 or 2 (trn2 only: the simulator rejects nc grids on
    trn1, as the hardware does)."""
    if lnc is None:
        return 2 if active_target() == "trn2" else 1
    if isinstance(lnc, bool) or lnc not in (1, 2):
        raise ValueError(f"lnc: expected None, 1 or 2 (NeuronCores per logical core), "
                         f"got {lnc!r}")
    return int(lnc)


class Dropout(NamedTuple):
    """The validated attention dropout of a call (:func:`_check_dropout_call`)."""

    p: float                        # 0.0: no dropout
    seed: Optional[np.ndarray]      # the kernels' (1,) int32 seed, seed mod 2^30; None if p == 0


class KernelScoreMods(NamedTuple):
    """The validated score modifiers of a call as the kernels take them
    (:func:`_score_mods_call`)."""

    kwargs: dict    # compile-time options: {"softcap": cap} or {}
    tensors: dict   # "alibi_slopes" (1 or B, Hq) and "sinks" (Hq,): float32 arrays or None

    @property
    def any(self) -> bool:
        return bool(self.kwargs) or any(x is not None for x in self.tensors.values())

    @property
    def transforms(self) -> bool:
        """The score tiles change: soft-capping or ALiBi (the kernels' ``Mods.transforms``)."""
        return "softcap" in self.kwargs or self.tensors.get("alibi_slopes") is not None


class AttentionCall(NamedTuple):
    """One validated flash-attention call, forward or backward (:func:`_attention_call`):
    everything planning and launching read besides the tensors q, k, v (do, o, lse)."""

    dims: _v.AttentionShape
    dtype: str                              # the inputs' dtype name
    scale: float
    causal: Optional[str]                   # None, "top_left" or "bottom_right"
    window: Optional[Tuple[int, int]]       # (left, right), -1 = unbounded; None: no window
    kv_lens: Optional[np.ndarray]           # (B,) int32 in [0, Nk], the kernels' input
    q_lens: Optional[np.ndarray]            # (B,) int32 in [0, Nq]
    mixed_precision: bool
    mm_dtype: str                           # matmul operand dtype name
    lnc: int                                # NeuronCores per logical core
    dropout: Dropout
    mods: KernelScoreMods
    block_sparse: Optional[_bs.BlockSparsity]  # the pattern the block-sparse kernels run
    tiles: Optional["tiles.ForwardTiles"]   # forward: the caller's tiling (None: planned)
    sbuf_budget: Optional[int]              # forward: SBUF bytes per partition to plan into
    return_lse: bool                        # forward
    return_dropout_mask: bool               # forward
    packing: Optional[_v.Packing] = None    # forward: packed sequences' offsets (varlen)


def _attention_call(dims: _v.AttentionShape, dtype: str, block_sparse=None, *, scale=None,
                    causal=False, window=None, kv_lens=None, q_lens=None,
                    mixed_precision: bool = True, lnc=None, dropout_p=0.0, seed=None,
                    softcap=None, alibi_slopes=None, sinks=None, tiles=None, sbuf_budget=None,
                    return_lse: bool = False,
                    return_dropout_mask: bool = False, packing=None) -> AttentionCall:
    """The :class:`AttentionCall` of a call whose tensors are validated already (sizes
    ``dims``, dtype name ``dtype``), its options validated (as in :func:`flash_attention`).
    ``block_sparse`` is the validated pattern when the block-sparse
    kernels run the call (:func:`_block_sparsity`): they take no ``tiles`` nor
    ``sbuf_budget``, and ``lnc`` None means one NeuronCore for them. ``packing``: the
    validated offsets when the packed variable-length kernel runs the call
    (:func:`_check_packed_options` says what it takes)."""
    scale = _v.check_scale(scale, dims.D)
    causal = _v.normalize_causal(causal)
    window = _v.normalize_window(window)
    kv_lens = _lengths_int32(_v.check_lengths("kv_lens", kv_lens, dims.B, dims.Nk,
                                              upper_name="Nk"))
    q_lens = _lengths_int32(_v.check_lengths("q_lens", q_lens, dims.B, dims.Nq, upper_name="Nq"))
    mixed_precision = _check_bool("mixed_precision", mixed_precision)
    return_lse = _check_bool("return_lse", return_lse)
    if block_sparse is not None:
        for name, value in (("tiles", tiles), ("sbuf_budget", sbuf_budget)):
            if value is not None:
                raise ValueError(f"{name}: not used by the block-sparse kernel (block_mask is "
                                 f"given); got {value!r}, allowed: None")
    tiles = _check_forward_tiles(tiles)
    if sbuf_budget is not None:
        sbuf_budget = _v.check_int("sbuf_budget", sbuf_budget, minimum=1,
                                   maximum=max(_tiles.SBUF_USABLE_BYTES.values()))
    if packing is not None:
        _check_packed_options(kv_lens=kv_lens, q_lens=q_lens, tiles=tiles,
                              sbuf_budget=sbuf_budget)
        if alibi_slopes is not None and np.ndim(alibi_slopes) != 1:
            raise ValueError(f"alibi_slopes: packed sequences (cu_seqlens_q and cu_seqlens_k "
                             f"given) take one slope per query head, shape (Hq,) = "
                             f"({dims.Hq},); got shape {np.shape(alibi_slopes)}")
    if block_sparse is None and packing is None:
        lnc = _check_lnc(lnc)
    else:
        # None: one core, the launch the block-sparse estimates are made with
        lnc = 1 if lnc is None else _check_lnc(lnc)
    dropout = _check_dropout_call(dropout_p, seed, dims.B, dims.Hq, dims.Nq, dims.Nk)
    mods = _score_mods_call(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
    return_dropout_mask = _check_bool("return_dropout_mask", return_dropout_mask)
    if return_dropout_mask and not dropout.p:
        raise ValueError("return_dropout_mask: needs dropout_p > 0 (there is no mask)")
    return AttentionCall(dims, dtype, scale, causal, window, kv_lens, q_lens, mixed_precision,
                         _tiles.fwd_mm_dtype_name(dtype, mixed_precision), lnc, dropout, mods,
                         block_sparse, tiles, sbuf_budget, return_lse, return_dropout_mask,
                         packing)


def _block_sparsity(block_mask, dims: _v.AttentionShape):
    """The validated ``block_mask`` of a call (:func:`host.block_sparse.check_block_mask`) when
    the block-sparse kernels run it, else None. A dense (compile-time) pattern with every block
    active is dense attention, and the dense kernels run it (same results; the block-sparse
    kernel gathers K/V per query tile, which at density 1 is slower than streaming them). The
    index form is a runtime pattern and always runs the block-sparse kernel."""
    sparsity = _bs.check_block_mask(block_mask, dims.B, dims.Hq, dims.Nq, dims.Nk)
    if sparsity is None or (not sparsity.runtime and bool(sparsity.dense.all())):
        return None
    return sparsity


def _forward_call(q, k, v, *, block_mask=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  **options) -> AttentionCall:
    """Validate a forward call (arguments as in :func:`flash_attention`) into one record."""
    dims = _v.check_attention_inputs(q, k, v)
    packing = _v.check_packing(cu_seqlens_q, cu_seqlens_k, dims.B, dims.Nq, dims.Nk)
    if packing is not None:
        _check_packed_options(block_mask=block_mask)
    return _attention_call(dims, _v.dtype_name(q), _block_sparsity(block_mask, dims),
                           packing=packing, **options)


def _check_packed_options(**options):
    """Refuse the options the packed variable-length kernel does not take: padded-batch
    lengths and block masks (the offsets say which keys each row sees), the dense kernel's
    tiling."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"{name}: not supported with packed sequences (cu_seqlens_q and "
                             f"cu_seqlens_k given); got {_v.describe(value)}, allowed: None")


def _backward_call(do, q, k, v, o, lse, *, block_mask=None, cu_seqlens_q=None,
                   cu_seqlens_k=None, **options) -> AttentionCall:
    """Validate a backward call (arguments as in :func:`flash_attention_backward`) into one
    record."""
    dims = _v.check_attention_backward_inputs(do, q, k, v, o, lse)
    packing = _v.check_packing(cu_seqlens_q, cu_seqlens_k, dims.B, dims.Nq, dims.Nk)
    if packing is not None:
        _check_packed_options(block_mask=block_mask)
        if dims.D > _tiles.PMAX:
            raise ValueError(f"q: the packed backward (cu_seqlens_q given) takes head dims up "
                             f"to {_tiles.PMAX}, got D={dims.D}")
    return _attention_call(dims, _v.dtype_name(q), _block_sparsity(block_mask, dims),
                           packing=packing, **options)


def plan_attention_forward(q, k, v, *, scale=None, causal=False, window=None, kv_lens=None,
                           q_lens=None, mixed_precision: bool = True, return_lse: bool = False,
                           tiles=None, sbuf_budget=None, lnc=None, dropout_p=0.0, seed=None,
                           softcap=None, alibi_slopes=None, sinks=None):
    """Validate a forward call and choose its launch: ``(kernel, grid, kernel_kwargs)``.

    The kernel is :func:`nki_kernels.attention.forward.flash_attention_fwd`, the grid
    ``(B, Hkv)`` with LNC=1, or with LNC=2 (trn2) the grid of
    :func:`nki_kernels.attention.forward.forward_grid` (kv heads or batches spread over the two
    cores with ``nl.spmd_dim(n, nl.nc(2))``, else an ``nl.nc(2)`` dimension splitting the query
    tiles); ``kernel_kwargs`` holds the compile-time options (``scale``, ``causal``,
    ``window``, ``mm_dtype``, ``tiles``, ``lnc``) but not the tensors: call it as
    ``kernel[grid](q, k, v, kv_lens=..., q_lens=..., **kernel_kwargs)`` with ``(B,)`` int32
    lengths (or None) and, with score modifiers, ``alibi_slopes=``/``sinks=`` float32 tensors
    (:func:`_score_mods_call`; ``softcap`` is in ``kernel_kwargs``). Shared by
    :func:`flash_attention` and the torch-neuronx path of
    :mod:`host.torch_ops`, so both launch identical kernels. Arguments as in
    :func:`flash_attention`; ``return_lse`` is accepted and ignored (the kernel always writes
    the LSE).
    """
    return _plan_forward(_forward_call(
        q, k, v, scale=scale, causal=causal, window=window, kv_lens=kv_lens, q_lens=q_lens,
        mixed_precision=mixed_precision, return_lse=return_lse, tiles=tiles,
        sbuf_budget=sbuf_budget, lnc=lnc, dropout_p=dropout_p, seed=seed, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks))


def _plan_forward(call: AttentionCall):
    """The dense forward's launch of a validated call, ``(kernel, grid, kernel_kwargs)``, as
    :func:`plan_attention_forward` describes it."""
    from nki_kernels.attention.forward import flash_attention_fwd, forward_grid

    dims = call.dims
    api = select_api()          # the forward is ported to nki.* whole
    chosen = call.tiles
    if chosen is None:
        band = call.causal is not None or call.window is not None
        lens = call.kv_lens is not None or call.q_lens is not None
        chosen = _tiles.choose_forward_tiles(
            dims.Nq, dims.Nk, dims.D, dims.group, _tiles.fwd_itemsize(call.dtype),
            _tiles.fwd_itemsize(call.mm_dtype), sbuf_bytes=call.sbuf_budget,
            kv_lens=call.kv_lens is not None, q_lens=call.q_lens is not None,
            masks=band or lens, api=api, device=active_target(),
            dropout=bool(call.dropout.p), band=band)
    grid, kernel_lnc = forward_grid(dims.B, dims.Hkv, call.lnc, api=api)
    kwargs = dict(scale=call.scale, causal=call.causal, window=call.window,
                  mm_dtype=call.mm_dtype, tiles=chosen, lnc=kernel_lnc)
    if call.dropout.p:
        kwargs["dropout_p"] = call.dropout.p
    kwargs.update(call.mods.kwargs)
    return flash_attention_fwd.on(api), grid, kwargs


def _score_mods_call(softcap, alibi_slopes, sinks, B: int, Hq: int) -> KernelScoreMods:
    """The score modifiers of an attention call as the kernels take them: the compile-time
    ``softcap`` and the device tensors ``alibi_slopes`` ``(1 or B, Hq)`` and ``sinks`` ``(Hq,)``
    as float32 (None when absent), validated for the kernels' ranges
    (``tiles.FWD_FOLD_SCALE_RANGE`` for the cap, ``tiles.SCORE_MOD_ABS_MAX`` for the rest)."""
    mods = _v.check_score_mods(softcap, alibi_slopes, sinks, B, Hq)
    if not mods.any:
        return KernelScoreMods({}, dict(alibi_slopes=None, sinks=None))
    kwargs = {}
    if mods.softcap is not None:
        lo, hi = _tiles.FWD_FOLD_SCALE_RANGE
        if not lo <= mods.softcap <= hi:
            raise ValueError(f"softcap: the kernels take a cap in [2^-24, 2^24], got "
                             f"{mods.softcap!r}")
        kwargs["softcap"] = mods.softcap
    tensors = {}
    for name, arr in (("alibi_slopes", mods.alibi_slopes), ("sinks", mods.sinks)):
        if arr is not None and np.abs(arr).max() > _tiles.SCORE_MOD_ABS_MAX:
            raise ValueError(f"{name}: the kernels take values with |x| <= 2^32, got "
                             f"{float(np.abs(arr).max())!r}")
        tensors[name] = None if arr is None else arr.astype(np.float32)
    return KernelScoreMods(kwargs, tensors)


def _check_dropout_call(dropout_p, seed, B, Hq, Nq, Nk) -> Dropout:
    """The validated dropout options of an attention call with the ``(1,)`` int32 seed tensor
    the kernels take (``seed mod 2^30``)."""
    p, seed = _v.check_dropout(dropout_p, seed)
    if not p:
        return Dropout(0.0, None)
    units = _tiles.dropout_units(B, Hq, Nq, Nk)
    if units >= _tiles.DROPOUT_SEED_MOD:
        raise ValueError(f"dropout_p: a launch numbers its 128 x 128 dropout units with int32 "
                         f"and needs fewer than 2^30 of them; B Hq ceil(Nq/128) ceil(Nk/128) = "
                         f"{units} here (split the batch)")
    return Dropout(p, np.array([seed % _tiles.DROPOUT_SEED_MOD], dtype=np.int32))


def flash_attention(q, k, v, *, scale=None, causal=False, window=None, kv_lens=None,
                    q_lens=None, mixed_precision: bool = True, return_lse: bool = False,
                    tiles=None, sbuf_budget=None, lnc=None, dropout_p=0.0, seed=None,
                    return_dropout_mask: bool = False, block_mask=None, softcap=None,
                    alibi_slopes=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """Flash attention forward on the active backend (docs/semantics.md for the exact meaning).

    Parameters
    ----------
    q : array (B, Hq, Nq, D)
    k, v : arrays (B, Hkv, Nk, D)
        NumPy arrays (or CPU torch tensors) of one dtype: float32, bfloat16 (ml_dtypes) or
        float16. ``Hq % Hkv == 0`` (GQA/MQA: query head h reads kv head ``h // (Hq // Hkv)``);
        any ``Nq, Nk >= 1``; ``1 <= D <= 256``.
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``; any finite value.
    causal : None, False, True, "top_left" or "bottom_right"
        ``True`` means ``"bottom_right"`` (query i sees keys ``j <= i + Nk - Nq``, with valid
        lengths when given); ``"top_left"`` is PyTorch's ``is_causal`` (``j <= i``).
    window : None or (left, right)
        Sliding window: key j visible when ``i + off - left <= j <= i + off + right`` (``off``
        the causal alignment offset, bottom_right without causal); -1 = unbounded side.
    kv_lens, q_lens : (B,) ints, optional
        Valid key / query lengths per sequence of a padded batch (values in [0, Nk] / [0, Nq]).
        Keys past ``kv_lens[b]`` are never seen; rows past ``q_lens[b]`` output 0, LSE -inf.
    mixed_precision : bool
        float32 inputs only: matmul operands in bf16 (default) or float32 (4x slower TensorE).
        bf16/fp16 inputs always use their own dtype. Accumulation and softmax are fp32.
    return_lse : bool
        Also return the log-sum-exp.
    tiles : nki_kernels.tiles.ForwardTiles, optional
        Force a tiling (e.g. ``ForwardTiles(kv_resident=False, q_group=2)`` for the streaming
        regime). Default: chosen by ``tiles.choose_forward_tiles`` from the SBUF budget.
    sbuf_budget : int, optional
        SBUF bytes per partition the default tiling may plan into (default: trn1's usable SBUF).
    lnc : None, 1 or 2
        NeuronCores per logical core: 2 runs on both cores of a trn2 logical core (LNC=2),
        1 on one. None: 2 when the active target is trn2 (the simulator's target), else 1.
    dropout_p : float in [0, 1)
        Attention dropout (FlashAttention appendix Algorithm 2): each attention probability is
        zeroed with probability ``dropout_p`` and the kept ones scaled by ``1 / (1 - p)``; the
        LSE is that of the undropped softmax. The mask is never stored: the backward
        (:func:`flash_attention_backward` with the same ``dropout_p`` and ``seed``) regenerates
        it. 0 (default) is exactly no dropout.
    seed : int in [0, 2^31 - 1], required when ``dropout_p > 0``
        The mask's seed (device data: one compiled kernel serves every seed; ``seed`` and
        ``seed + 2^30`` give the same mask). Each 128 x 128 block of P has its own draw, keyed by
        (sequence, head, query block, key block), so the mask depends on neither the tiling, the
        schedule nor ``lnc``. On the simulator the bit stream is NumPy's, not the hardware's.
    return_dropout_mask : bool
        Debugging (small shapes): also return the keep mask the kernel drew, ``(B, Hq, Nq, Nk)``
        bool in the caller's row and key positions (keys no row can see read False; entries of
        padding rows and keys are unspecified: the kernel draws whole 128 x 128 units).

    Returns
    -------
    o : numpy.ndarray (B, Hq, Nq, D), q's dtype
    lse : numpy.ndarray (B, Hq, Nq) float32, only with ``return_lse``
        Natural log; -inf for rows without a visible key (their o is 0).
    block_mask : optional
        Block-sparse attention (FlashAttention section 3.3): which 128 x 128 blocks of the
        score matrix exist, as a dense bool array ``(B or 1, Hq or 1, ceil(Nq/128),
        ceil(Nk/128))`` (a compile-time pattern: the kernel's loops are cut to it) or
        FlexAttention's index form ``(num_blocks, indices)`` (a runtime pattern: one
        compilation per ``max_blocks`` bound; :mod:`host.block_sparse`). Inactive blocks are
        skipped entirely (no K/V load, no matmul, no exp); the other masks apply inside active
        blocks. Runs :mod:`nki_kernels.attention.block_sparse` on one NeuronCore unless
        ``lnc=2`` is given (``None`` means 1 here; ``tiles`` and ``sbuf_budget`` are refused
        with it): then, as the dense backward, its (batch, kv head) instances are spread over
        the two cores when ``B Hkv`` allows (:func:`_block_sparse_grid`). A dense pattern with
        every block active is dense attention and runs the dense kernel.
    softcap : None or float in [2^-24, 2^24]
        Logit soft-capping (Gemma 2): scores ``s`` become ``softcap * tanh(s / softcap)``
        before masks and ALiBi. 0 or None: off.
    alibi_slopes : array (Hq,) or (B, Hq), optional
        ALiBi: the score of query i and key j gains ``-slope |i' - j|`` (``i'`` the query's
        position aligned as the causal mask aligns it; |slope| <= 2^32). Device data.
    sinks : array (Hq,), optional
        Attention sinks (gpt-oss): one learned logit per head in every row's softmax
        denominator, with no value (|sink| <= 2^32). The LSE includes it; a row without visible
        keys then has o = 0 and ``lse = sink`` (padding rows past ``q_lens`` keep -inf).

    cu_seqlens_q, cu_seqlens_k : int32 arrays (num_seqs + 1,), optional
        Packed variable-length sequences (FlashAttention's varlen): q is ``(1, Hq, total_q,
        D)``, k and v ``(1, Hkv, total_k, D)``; sequence s owns query rows ``[cu_seqlens_q[s],
        cu_seqlens_q[s+1])`` and keys ``[cu_seqlens_k[s], cu_seqlens_k[s+1])``. Offsets start
        at 0, never decrease (a sequence may be empty: its query rows, if any, get o = 0 and
        lse = -inf) and end at the totals. Each row sees only its own sequence's keys;
        ``causal`` and ``window`` apply per sequence (bottom_right: the sequence's own
        ``nk_s - nq_s``). Device data: one compilation per (totals, num_seqs). Not combined
        with ``kv_lens``, ``q_lens``, ``block_mask``, ``tiles`` or ``sbuf_budget``
        (refused). Dropout's units are numbered in the packed frame (docs/semantics.md). Runs :mod:`nki_kernels.attention.varlen` (one NeuronCore
        unless ``lnc=2``, as ``block_mask``).

    mask : numpy.ndarray (B, Hq, Nq, Nk) bool, only with ``return_dropout_mask``
    """
    call = _forward_call(
        q, k, v, block_mask=block_mask, scale=scale, causal=causal, window=window,
        kv_lens=kv_lens, q_lens=q_lens, mixed_precision=mixed_precision, return_lse=return_lse,
        tiles=tiles, sbuf_budget=sbuf_budget, lnc=lnc, dropout_p=dropout_p, seed=seed,
        return_dropout_mask=return_dropout_mask, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if call.block_sparse is not None:
        return _block_sparse_forward(q, k, v, call)
    if call.packing is not None:
        return _varlen_forward(q, k, v, call)
    kernel, grid, kwargs = _plan_forward(call)
    kv32, q32, mod_tensors = call.kv_lens, call.q_lens, call.mods.tensors
    q, k, v = _numpy("q", q), _numpy("k", k), _numpy("v", v)
    if call.dropout.p:
        kwargs.update(dropout_mask=call.return_dropout_mask)
        outs = launch(kernel, grid, q, k, v, kv_lens=kv32, q_lens=q32, seed=call.dropout.seed,
                      **mod_tensors, **kwargs)
    else:
        outs = launch(kernel, grid, q, k, v, kv_lens=kv32, q_lens=q32, **mod_tensors, **kwargs)
    o, lse = outs[0], outs[1]
    res = (o, lse) if call.return_lse else (o,)
    if call.return_dropout_mask:
        res += (_mask_in_user_positions(np.asarray(outs[2]) > 0.5, call),)
    return res if len(res) > 1 else o


def _mask_in_user_positions(mask, call: AttentionCall):
    """The kernel's debug keep mask ``(B, Hq, Nq, Nk)`` in the caller's row and key positions.
    The kernel writes it in its frame, where a sequence with runtime lengths and a
    bottom-right band (or ALiBi) is rotated so its valid rows and keys end at Nq and Nk (frame
    row i' = row (i' + q_len) mod Nq, key j' = key (j' + kv_len) mod Nk): roll it back."""
    from nki_kernels.attention import masks as M

    B, _, Nq, Nk = mask.shape
    q32, kv32 = call.q_lens, call.kv_lens
    spec = M.MaskSpec(Nq, Nk, call.causal, call.window, q32 is not None, kv32 is not None,
                      call.mods.tensors["alibi_slopes"] is not None)
    if not spec.rotates:
        return mask
    out = mask.copy()
    for b in range(B):
        if spec.rotate_q:
            out[b] = np.roll(out[b], int(q32[b]), axis=-2)
        if spec.rotate_k:
            out[b] = np.roll(out[b], int(kv32[b]), axis=-1)
    return out


# ============================================================================================
# Block-sparse attention (FlashAttention section 3.3)
# ============================================================================================


def _block_sparse_grid(dims, lnc: int, api: str):
    """The launch grid of a block-sparse kernel: the dense backward's
    (:func:`nki_kernels.attention.backward.backward_grid`), whose programs are independent
    as these are: with ``lnc=2`` the (batch, kv head) instances spread over the two cores
    (legacy ``nl.spmd_dim(n, nl.nc(2))`` over kv heads when Hkv is even, else batches; nki.*
    ``kernel[2]``, :func:`port.for_programs` taking half of them per core by
    ``nl.program_id(0)``) when ``B Hkv`` is even, else one core runs them all (splitting an
    instance would leave partial dK/dV or dQ sums on two cores)."""
    from nki_kernels.attention.backward import backward_grid

    return backward_grid(dims.B, dims.Hkv, lnc, api=api)


def _block_sparse_forward(q, k, v, call: AttentionCall):
    """The block-sparse forward of a validated call (``call.block_sparse`` given): outputs as
    :func:`flash_attention`'s."""
    from nki_kernels.attention.block_sparse import (block_sparse_attention_fwd, keeps_order,
                                                    shares_at_runtime, window_capacity)

    dims, p = call.dims, call.dropout.p
    api = select_api()          # every block-sparse call is ported to nki.*
    keep = keeps_order(api, dims.Nq, dims.Nk, dims.D, call.mm_dtype,
                       call.block_sparse.index.max_blocks,
                       call.kv_lens is not None or call.q_lens is not None)
    share = shares_at_runtime(api, dims.Nk, dims.D, call.mm_dtype,
                              call.block_sparse.index.max_blocks, call.block_sparse.runtime)
    tables = _bs.launch_tables(call.block_sparse, group=dims.group, backward=False,
                               keep_order=keep, share_runtime=share)
    kwargs = dict(scale=call.scale, causal=call.causal, window=call.window,
                  mm_dtype=call.mm_dtype, **call.mods.kwargs)
    q_tables = tables.q
    trip = call.block_sparse.index.max_blocks
    itemsize = _tiles.fwd_itemsize(call.mm_dtype)
    if api == "nki" and not _tiles.bsp_fwd_kv_resident(dims.Nk, dims.D, itemsize, trip):
        # past SBUF: a key-block window where it gathers fewer blocks than the grouping, in
        # groups small enough to gather no more than the dense forward where they can
        dense = _dense_kv_blocks(call)
        win = _bs.window_plan(call.block_sparse, q_tables, window_capacity(
            dims.D, call.mm_dtype, trip, dims.Nk, call.causal, call.window,
            call.kv_lens is not None or call.q_lens is not None, call.mods.any, bool(p)),
            dense, dims.group)
        sg = _supergroups(call, q_tables, win, dense)
        if sg is not None:
            q_tables = _bs.KernelTables(sg.meta, sg.classes, (0,))
            kwargs.update(sg_rows=sg.rows, sg_keys=sg.keys, sg_own=sg.own)
        elif win is not None:
            q_tables = win.tables
            kwargs.update(window_loads=win.loads, window_slots=win.slots,
                          window_blocks=win.blocks, window_group=win.group,
                          window_shared=win.heads > 1)
    if p:
        kwargs.update(dropout_p=p, dropout_mask=call.return_dropout_mask)
    q, k, v = _numpy("q", q), _numpy("k", k), _numpy("v", v)
    outs = launch(block_sparse_attention_fwd.on(api), _block_sparse_grid(dims, call.lnc, api),
                  q, k, v, q_tables.meta, kv_lens=call.kv_lens, q_lens=call.q_lens,
                  seed=call.dropout.seed, classes=q_tables.classes, shared=q_tables.shared,
                  natural=q_tables.natural, shared_runtime=q_tables.shared_runtime,
                  **call.mods.tensors,
                  **kwargs)
    o, lse = outs[0], outs[1]
    res = (o, lse) if call.return_lse else (o,)
    if call.return_dropout_mask:
        res += (np.asarray(outs[2])[..., :dims.Nk] > 0.5,)
    return res if len(res) > 1 else o


def _dense_kv_blocks(call: AttentionCall) -> Fraction:
    """The key blocks the plain dense forward (no band, full lengths) reads from K (and as
    many from V), in the block-sparse plans' units, key blocks per query head: summed over
    the pattern's ``(b, h)`` entries (the tables broadcast to the ``B Hq`` query heads), each
    entry's share of the dense forward's K/V blocks over ``B Hkv`` kv heads
    (``tiles.forward_kv_passes`` of trn2's nki.* tiling times the ``ceil(Nk / 128)`` key
    blocks each) shared by the ``Hq / Hkv`` query heads of each; exact (a Fraction). A
    window whose member heads share it gathers once per kv head: ``1 / (Hq / Hkv)`` of its
    blocks per query head (``WindowTables.head_loads``). A causal or length-limited dense
    forward reads fewer; the window plans compare with this one."""
    dims = call.dims
    num = np.asarray(call.block_sparse.index.num_blocks)
    itemsize = _tiles.fwd_itemsize(call.dtype)
    tiles = _tiles.choose_forward_tiles(dims.Nq, dims.Nk, dims.D, dims.group, itemsize,
                                        _tiles.fwd_itemsize(call.mm_dtype), target="trn2",
                                        api="nki")
    nkt = _tiles.ceil_div(dims.Nk, _tiles.BLOCK_SPARSE_TILE)
    passes = _tiles.forward_kv_passes(dims.Nq, dims.group, tiles)
    return Fraction(passes * nkt * (num.size // num.shape[-1]), dims.group)


def _supergroups(call: AttentionCall, grouped, win, dense: Fraction):
    """The forward's super-group tables (``host.block_sparse``; nki.*, K/V not resident) for
    a call that returns no dropout mask, or None. The plan taken
    otherwise gathers ``other`` key blocks: the window ``win``'s ``head_loads``, else the
    grouped tables ``grouped``' (``grouped_block_loads``); key-block gathers are the plans'
    HBM bytes beside Q, O and small tables. Exact super-groups (``supergroup_tables``) where
    they gather fewer and leave at most ``tiles.BSP_SG_MAX_IDLE`` of the query tiles' count
    idle; else, where the other plan gathers more than the ``dense`` forward's blocks
    (:func:`_dense_kv_blocks`), super-groups of consecutive tiles that gather fewer: masked
    ones (``masked_supergroup_tables``) where they compute at most
    ``tiles.BSP_SG_SPARSE_PAIR_COST`` times the pattern's active (tile, block) pairs (a
    masked pair costs an active one's work), else sparse ones (``sparse_supergroup_tables``:
    each tile computes only its own blocks, at about that many times a masked pair's
    cost)."""
    if call.return_dropout_mask and call.dropout.p:
        return None
    dims = call.dims
    index = call.block_sparse.index
    other = (win.head_loads if win is not None
             else _bs.grouped_block_loads(grouped, _tiles.BSP_GROUP_TILES))
    mm, itemsize = _tiles.fwd_itemsize(call.mm_dtype), _tiles.fwd_itemsize(call.dtype)
    num = np.asarray(index.num_blocks)
    nkt = _tiles.ceil_div(dims.Nk, _tiles.BLOCK_SPARSE_TILE)
    if index.max_blocks:
        most = _tiles.bsp_fwd_supergroup_tiles(dims.D, mm, itemsize,
                                               _bs.union_width(index.max_blocks)[1])
        sg = _bs.supergroup_tables(index, most)
        # an idle slot costs a tile's sweep: a plan with many is slower whatever its bytes
        if (sg is not None and sg.idle <= _tiles.BSP_SG_MAX_IDLE * num.size
                and sg.block_loads < other):
            return sg
    if other <= dense:
        return None
    most = _tiles.bsp_fwd_supergroup_tiles(dims.D, mm, itemsize, _bs.union_width(nkt)[1],
                                           masked=True)
    # (a masked one adds its mask before a soft-cap's tanh, and ALiBi's bias or a dropped
    # unit can hide a guarded key's NaN from a row that sees it: sparse ones then)
    sg = (None if call.mods.transforms or call.dropout.p
          else _bs.masked_supergroup_tables(index, most, dims.Nk))
    if (sg is not None and sg.block_loads < other
            and sg.pairs <= _tiles.BSP_SG_SPARSE_PAIR_COST * int(num.sum())):
        return sg
    most = _tiles.bsp_fwd_supergroup_tiles(dims.D, mm, itemsize,
                                           _bs.union_width(nkt, sparse=True)[1], own=True)
    sg = _bs.sparse_supergroup_tables(index, most, dims.Nk)
    return sg if sg is not None and sg.block_loads < other else None


def _varlen_forward(q, k, v, call: AttentionCall):
    """The packed variable-length forward of a validated call (``call.packing`` given):
    outputs as :func:`flash_attention`'s."""
    from nki_kernels.attention.varlen import varlen_attention_fwd, varlen_grid

    dims = call.dims
    q, k, v = _numpy("q", q), _numpy("k", k), _numpy("v", v)
    api = select_api()
    outs = launch(varlen_attention_fwd.on(api), varlen_grid(dims.Hkv, dims.group, dims.Nq,
                                                               call.lnc, api),
                  q, k, v, call.packing.cu_q, call.packing.cu_k, **_packed_mods(call),
                  **_packed_dropout(call), scale=call.scale, causal=call.causal,
                  window=call.window, mm_dtype=call.mm_dtype, **call.mods.kwargs)
    o, lse = outs[0], outs[1]
    res = (o, lse) if call.return_lse else (o,)
    if call.return_dropout_mask:
        res += (np.asarray(outs[2])[..., :dims.Nk] > 0.5,)
    return res if len(res) > 1 else o


def _packed_dropout(call: AttentionCall) -> dict:
    """The packed kernels' dropout arguments (none without dropout): ``seed``, ``dropout_p``
    and the forward's debug ``dropout_mask``."""
    if not call.dropout.p:
        return {}
    out = dict(seed=call.dropout.seed, dropout_p=call.dropout.p)
    if call.return_dropout_mask:
        out["dropout_mask"] = True
    return out


def _packed_mods(call: AttentionCall) -> dict:
    """The packed kernels' modifier tensors: ``alibi_slopes`` and ``sinks`` ``(Hq,)``
    float32, or None."""
    slopes = call.mods.tensors["alibi_slopes"]
    return dict(alibi_slopes=None if slopes is None else slopes.reshape(-1),
                sinks=call.mods.tensors["sinks"])


def _varlen_backward(do, q, k, v, o, lse, call: AttentionCall):
    """The packed variable-length backward of a validated call: ``(dq, dk, dv)`` (and
    ``dsinks`` ``(Hq,)`` with sinks)."""
    from nki_kernels.attention.varlen import varlen_grid
    from nki_kernels.attention.varlen_bwd import varlen_attention_bwd

    dims = call.dims
    do, q, k, v, o = (_numpy(n, x) for n, x in (("do", do), ("q", q), ("k", k), ("v", v),
                                                 ("o", o)))
    api = select_api()
    outs = launch(varlen_attention_bwd.on(api),
                  varlen_grid(dims.Hkv, dims.group, dims.Nq, call.lnc, api), q, k, v, o, do,
                  _numpy("lse", lse), call.packing.cu_q, call.packing.cu_k, **_packed_mods(call),
                  **_packed_dropout(call), scale=call.scale, causal=call.causal, window=call.window,
                  mm_dtype=call.mm_dtype, **call.mods.kwargs)
    if call.mods.tensors["sinks"] is None:
        return outs
    return tuple(outs[:3]) + (np.asarray(outs[3], dtype=np.float32)[0],)


def _block_sparse_chunk_tiles(call: AttentionCall) -> int:
    """Query tiles per chunk of the block-sparse backward (``tiles.bsp_bwd_chunks`` with the
    budget the kernel checks: trn2's on NeuronCore-v3 and newer (trn2, trn3), else trn1's,
    the smaller, also when the host does not know the target). A kv group whose query heads
    cannot stage one tile each is refused."""
    dims = call.dims
    target = "trn2" if active_target() in ("trn2", "trn3") else "trn1"
    extras = (call.mods.tensors["alibi_slopes"] is not None
              or call.mods.tensors["sinks"] is not None or bool(call.mods.kwargs)
              or bool(call.dropout.p) or call.kv_lens is not None or call.q_lens is not None)
    op_itemsize = tiles.fwd_itemsize(call.mm_dtype)
    chunks, slots = tiles.bsp_bwd_chunks(dims.group, dims.Nq, dims.D, op_itemsize, target,
                                         extras)
    if not chunks:
        raise ValueError(
            f"block_mask: the block-sparse backward stages one query tile of each of the "
            f"{dims.group} query heads of a kv group in SBUF; at D = {dims.D} with "
            f"{call.mm_dtype} matmuls that exceeds 90 % of {target}'s SBUF; allowed: fewer "
            f"query heads per kv head")
    return slots


def _block_sparse_backward(do, q, k, v, o, lse, call: AttentionCall):
    """The block-sparse backward of a validated call (``call.block_sparse`` given):
    ``(dq, dk, dv)``."""
    from nki_kernels.attention.block_sparse_bwd import block_sparse_attention_bwd

    dims, p = call.dims, call.dropout.p
    chunk_tiles = _block_sparse_chunk_tiles(call)
    kwargs = dict(scale=call.scale, causal=call.causal, window=call.window,
                  mm_dtype=call.mm_dtype, **call.mods.kwargs)
    if p:
        kwargs["dropout_p"] = p
    do, q, k, v, o = (_numpy(n, x) for n, x in (("do", do), ("q", q), ("k", k), ("v", v),
                                                 ("o", o)))
    api = select_api()
    # nki.*: the query tiles in chunks that meet few key blocks (legacy keeps their order)
    tables = _bs.launch_tables(call.block_sparse, group=dims.group, forward=False,
                               chunk_tiles=chunk_tiles, reorder=api == "nki", head_dim=dims.D,
                               kv_itemsize=k.dtype.itemsize)
    outs = launch(block_sparse_attention_bwd.on(api), _block_sparse_grid(dims, call.lnc, api), q,
                  k, v, o, do, _numpy("lse", lse), tables.k.meta, kv_lens=call.kv_lens,
                  q_lens=call.q_lens, seed=call.dropout.seed,
                  acc_k=tables.acc_k if api == "nki" else None, order_q=tables.order_q,
                  slots_k=tables.slots_k, classes_k=tables.k.classes,
                  chunk_tiles=chunk_tiles, **call.mods.tensors, **kwargs)
    if call.mods.tensors["sinks"] is None:
        return outs
    # each sequence's share of dsinks, summed over the batch on the host (as the dense path)
    return tuple(outs[:3]) + (np.asarray(outs[3], dtype=np.float32).sum(axis=0),)


# ============================================================================================
# Decode: split-KV flash decoding over a KV cache
# ============================================================================================

#: Re-exported from the decode tiles (the kernels' int32 addressing limit).
DECODE_MAX_CACHE_POSITIONS = tiles.DECODE_MAX_CACHE_POSITIONS


class KVQuant(NamedTuple):
    """An FP8 KV cache (:func:`_decode_call`): its 8-bit float format and the dequantization
    scales per kv head, ``(Hkv, 2)`` float32 ``(k_scale, v_scale)`` (device data of the split
    kernel and of the prefill forward: K's scale is folded into the softmax scale, V's into
    the outputs)."""

    format: str
    scales: np.ndarray


def _fp8_cache_formats() -> Tuple[Optional[str], Tuple[str, ...]]:
    """``(target, formats)``: the active target (None when the host does not know it) and the
    8-bit float KV-cache formats it defines (``tiles.DECODE_FP8_CACHE_DTYPES``)."""
    target = active_target()
    return target, tiles.DECODE_FP8_CACHE_DTYPES[target]


class DecodeCall(NamedTuple):
    """One validated decode call (:func:`_decode_call`): everything planning and launching read
    besides the tensors q, k_cache and v_cache."""

    inputs: _v.DecodeInputs         # sizes, int64 cache_lens, bool tree_mask (or None)
    pages: Optional[_v.PagedCache]  # a paged call's pools and int32 block table; None: contiguous
    dtype: str                      # q's dtype name (also o's)
    scale: float
    num_splits: Optional[int]       # the caller's split count (None: planned)
    mm_dtype: str                   # matmul operand dtype name
    mods: KernelScoreMods
    lnc: int                        # NeuronCores per logical core
    return_lse: bool
    kv_quant: Optional[KVQuant] = None  # an FP8 cache's format and scales; None: q's dtype
    k_layout: str = "bhsd"          # "bhds": k_cache transposed, (B, Hkv, D, S_max)


def _decode_call(q, k_cache, v_cache, *, cache_lens, block_table=None, scale=None,
                 tree_mask=None, num_splits=None, mixed_precision: bool = True,
                 return_lse: bool = False, softcap=None, alibi_slopes=None, sinks=None,
                 lnc=None, max_new_tokens=_v.MAX_DECODE_TOKENS, k_scale=None,
                 v_scale=None, k_layout="bhsd") -> DecodeCall:
    """Validate a decode call (arguments as in :func:`flash_decode`) into one record. In a
    paged call ``inputs.S_max`` is the logical capacity ``max_blocks * page_size``.
    ``max_new_tokens``: the largest T (None: any, :func:`flash_attention_with_kvcache`)."""
    k_cache = _k_cache_as_bhsd(k_layout, k_cache, v_cache, block_table)
    target, formats = _fp8_cache_formats()
    fp8 = _v.check_fp8_cache(k_cache, v_cache, formats, target)
    cache_dtypes = None if fp8 is None else (fp8,)
    if block_table is None:
        inputs, pages = _v.check_decode_inputs(q, k_cache, v_cache, cache_lens, tree_mask,
                                               max_new_tokens=max_new_tokens,
                                               cache_dtypes=cache_dtypes), None
    else:
        inputs, pages = _v.check_paged_decode_inputs(
            q, k_cache, v_cache, cache_lens, block_table, tree_mask,
            page_size_min=tiles.DECODE_PAGE_SIZE_MIN, max_new_tokens=max_new_tokens,
            cache_dtypes=cache_dtypes)
    scales = _v.check_kv_scales(k_scale, v_scale, inputs.Hkv, fp8, _v.dtype_name(k_cache))
    scale = _v.check_scale(scale, inputs.D)
    if num_splits is not None:
        num_splits = _v.check_int("num_splits", num_splits, minimum=1)
    mixed_precision = _check_bool("mixed_precision", mixed_precision)
    if pages is None:
        positions, what = inputs.B * inputs.Hkv * inputs.S_max, "B * Hkv * S_max"
    else:
        positions = pages.num_blocks * inputs.Hkv * pages.page_size
        what = "num_blocks * Hkv * page_size"
    if positions > DECODE_MAX_CACHE_POSITIONS:
        raise ValueError(
            f"k_cache: {what} = {positions} cache positions exceed the "
            f"{DECODE_MAX_CACHE_POSITIONS} the decode kernels index with int32 (shape "
            f"{tuple(k_cache.shape)}); split the batch")
    if k_layout == "bhds":
        n = tiles.decode_key_row(inputs.S_max)        # the smallest key row it may use
        rows = positions * inputs.D // n
        if rows + _tiles.PMAX >= tiles.DECODE_MAX_KT_ROWS:
            raise ValueError(
                f"k_cache: with k_layout='bhds' the decode kernels index B * Hkv * D * S_max / "
                f"{n} = {rows} key-row pieces with int32, at most "
                f"{tiles.DECODE_MAX_KT_ROWS - _tiles.PMAX - 1}; split the batch")
    return_lse = _check_bool("return_lse", return_lse)
    mods = _score_mods_call(softcap, alibi_slopes, sinks, inputs.B, inputs.Hq)
    dtype = _v.dtype_name(q)
    return DecodeCall(inputs, pages, dtype, scale, num_splits,
                      _tiles.fwd_mm_dtype_name(dtype, mixed_precision), mods, _check_lnc(lnc),
                      return_lse, None if fp8 is None else KVQuant(fp8, scales), k_layout)


def _k_cache_as_bhsd(k_layout, k_cache, v_cache, block_table):
    """``k_cache`` as the ``(B, Hkv, S_max, D)`` the shared validation reads: itself, or with
    ``k_layout="bhds"`` (after checking that layout) its transposed view (no copy)."""
    if k_layout not in ("bhsd", "bhds"):
        raise ValueError(f"k_layout: expected 'bhsd' (k_cache (B, Hkv, S_max, D)) or 'bhds' "
                         f"(k_cache (B, Hkv, D, S_max)), got {k_layout!r}")
    if k_layout == "bhsd":
        return k_cache
    if block_table is not None:
        raise ValueError("k_layout: 'bhds' (a transposed K cache) is supported for contiguous "
                         "caches only, not with a block_table (page pools); allowed with a "
                         "block_table: 'bhsd'")
    ks, vs = tuple(getattr(k_cache, "shape", ())), tuple(getattr(v_cache, "shape", ()))
    if len(ks) != 4 or len(vs) != 4 or ks != (vs[0], vs[1], vs[3], vs[2]):
        raise ValueError(
            f"k_cache: with k_layout='bhds' expected (B, Hkv, D, S_max), v_cache's "
            f"(B, Hkv, S_max, D) = {vs} with its last two axes swapped, got {ks}")
    return k_cache.swapaxes(2, 3)


def _decode_tiles(call: DecodeCall) -> "tiles.DecodeTiles":
    """The split kernel's tiling of a validated decode call (:func:`plan_flash_decode`).

    A K^T cache (``k_layout="bhds"``) without a forced ``num_splits`` is also planned as if
    its longest sequence filled the cache: the splits must divide S_max, and an S_max none
    fits is refused whatever the lengths now, never first at the step where a sequence
    grows into it."""
    inputs = call.inputs
    longest = int(np.max(inputs.cache_lens)) - inputs.T
    if call.k_layout == "bhds" and call.num_splits is None:
        _plan_decode_tiles(call, inputs.S_max - inputs.T)
    return _plan_decode_tiles(call, longest)


def _plan_decode_tiles(call: DecodeCall, longest: int) -> "tiles.DecodeTiles":
    """:func:`_decode_tiles` for a longest committed prefix of ``longest`` positions."""
    inputs, pages = call.inputs, call.pages
    if pages is not None:
        n = tiles.decode_paged_key_row(pages.page_size)
    elif call.k_layout == "bhds":
        n = tiles.decode_transposed_key_row(inputs.S_max, longest)
    else:
        n = tiles.decode_key_row(inputs.S_max)
    rows_needed = longest // n
    rows = inputs.group * inputs.T
    plan = tiles.decode_tiles(rows, inputs.D, inputs.S_max, _tiles.fwd_itemsize(call.mm_dtype),
                              rows_needed, call.num_splits, batch=inputs.B, key_row=n,
                              k_transposed=call.k_layout == "bhds")
    if call.k_layout == "bhds":
        plan = tiles.decode_transposed_split(plan, inputs.S_max, inputs.D, rows, rows_needed,
                                             call.num_splits)
    return plan


def decode_work_list(cache_lens, T: int, plan: "tiles.DecodeTiles"):
    """Scheduler metadata of a decode step: ``(work, items_per_program, splits)``.

    ``splits[b]`` is the number of partial slots sequence b uses: the splits holding its
    committed key rows, ``ceil(floor((cache_lens[b] - T) / n) / split_rows)``, at least 1 (a
    sequence without a full key row gets one empty split, written with lse = -inf). ``work``
    lists them as ``(b, s)`` int32 rows, sequence by sequence, padded with ``(B, 0)`` items
    (they read nothing and write a trash row block) to ``tiles.decode_work_items`` of the
    count -- a bucket, so the kernel's grid only changes when the count crosses one -- which
    the split kernel runs ``items_per_program`` at a time. ``work`` is None (``splits`` all 0,
    ``items_per_program`` 1) when no sequence has a full key row: only the tail programs run.
    Work is proportional to the real lengths of the batch, not to B times the longest.
    """
    lens = np.asarray(cache_lens, dtype=np.int64)
    B = len(lens)
    if plan.num_splits == 0:
        return None, 1, np.zeros(B, dtype=np.int32)
    rows = (lens - T) // plan.key_row
    splits = np.maximum(1, -(-rows // plan.split_rows))
    items = [(b, s) for b in range(B) for s in range(int(splits[b]))]
    total, per_program = tiles.decode_work_items(len(items), plan.max_steps)
    items += [(B, 0)] * (total - len(items))
    return np.array(items, dtype=np.int32).reshape(-1, 2), per_program, \
        splits.astype(np.int32)


class DecodeLaunch(NamedTuple):
    """The split kernel's launch (:func:`decode_launch`): the work list (None: tails only),
    work items and kv heads per program, the per-sequence split counts, and the grid as
    ``(head groups, programs per group, axis spread over the two NeuronCores or None)``."""

    work: Optional[np.ndarray]
    items_per_program: int
    heads_per_program: int
    splits: np.ndarray
    groups: int
    programs: int
    core_axis: Optional[int]


def decode_launch(cache_lens, T: int, Hkv: int, plan: "tiles.DecodeTiles",
                  lnc: int = 1, api: str = "legacy") -> DecodeLaunch:
    """The split kernel's launch for these lengths (:func:`decode_work_list`) on ``lnc``
    NeuronCores, traced through ``api``. With LNC=2 the two cores take half of the head groups
    each when their count is even (``tiles.decode_heads_per_program`` keeps it even when Hkv
    is), else half of each group's programs (chunks, then tails): an odd program count gets one
    more chunk of padding items (they read nothing; their partials go to the trash block).
    nki.* walks the chunks and the tails in two loops, each shared by the cores: there the
    chunk count is made even instead (an odd count of tails has its middle one run by both
    cores, :func:`nki_kernels.port.for_programs`)."""
    work, per_program, splits = decode_work_list(cache_lens, T, plan)
    per_head = tiles.decode_heads_per_program(Hkv, per_program, plan.max_steps, cores=lnc)
    B = len(splits)
    W = 0 if work is None else work.shape[0]
    groups, programs, axis = Hkv // per_head, W // per_program + B, None
    if lnc == 2:
        if groups % 2 == 0:
            axis = 0
        else:
            axis = 1
            if (programs if api == "legacy" else programs - B) % 2:
                pad = np.full((per_program, 2), (B, 0), dtype=np.int32)
                work = pad if work is None else np.concatenate([work, pad])
                programs += 1
    return DecodeLaunch(work, per_program, per_head, splits, groups, programs, axis)


def plan_flash_decode(q, k_cache, v_cache, *, cache_lens, block_table=None, tree_mask=None,
                      num_splits=None, mixed_precision: bool = True, k_scale=None,
                      v_scale=None, k_layout="bhsd") -> "tiles.DecodeTiles":
    """Validate a decode call and return its tiling (``nki_kernels.tiles.DecodeTiles``).

    ``num_splits`` of the result is the number of splits of the committed prefix -- the split
    kernel's grid is ``(B, Hkv, num_splits + 1)``, the last program on that axis handling the
    tail (0: no full key row anywhere, only the tail program runs) -- chosen from the
    *real* lengths ``cache_lens`` -- in buckets, so the compiled kernels change only when the
    longest sequence crosses one -- unless ``num_splits`` is given. Arguments as in
    :func:`flash_decode`.
    """
    return _decode_tiles(_decode_call(q, k_cache, v_cache, cache_lens=cache_lens,
                                      block_table=block_table, tree_mask=tree_mask,
                                      num_splits=num_splits, mixed_precision=mixed_precision,
                                      k_scale=k_scale, v_scale=v_scale,
                                      k_layout=k_layout))


def flash_decode_hbm_bytes(B: int, Hq: int, T: int, D: int, Hkv: int, cache_lens,
                           itemsize: int, plan: "tiles.DecodeTiles", tree_mask: bool = False,
                           paged: bool = False, lnc: int = 1, api: str = "legacy",
                           cache_itemsize: Optional[int] = None, k_layout: str = "bhsd"):
    """Exact HBM bytes ``(read, written)`` of :func:`flash_decode` (both kernels).

    With ``N = B Hq T`` query rows, ``s`` the input itemsize (q, caches and o share it),
    ``W = sum(splits)`` real work items and ``P`` padding items of :func:`decode_work_list`
    (both 0 without a split), ``S = num_splits + 1`` partial slots per row and ``H'`` the
    split kernel's head groups (``Hkv / tiles.decode_heads_per_program``: each program reads
    its items' headers once for its kv heads); ``lnc`` as the call's (:func:`decode_launch`:
    its layout can add padding items)::

        read    = 2 s Hkv D sum_b cache_lens[b]     K and V: each valid byte exactly once
                + s Hq T D (W + B)                   q, per real work item and tail program
                + 8 H' (W + P) + 4 H' (W + B)        work items (b, s); one int32 length per
                                                     real work item and per tail program
                + T^2 B H'                           uint8 tree mask per tail program (if any)
                + 4 N (D + 1) S + 4 N [S > 1]        all partial slots (o | lse, one tensor)
                                                     and the per-row split counts, by the merge
        written = 4 Hq T (D + 1) (W + P + B)         partials o | lse, one store per row
                                                     block (padding items: a trash block)
                + s N D + 4 N                        o, lse

    and, with ``tiles.decode_zero_by_dma(plan.split_rows)``, the K/V zero fills
    (``decode._gather_rows``: per kv head, the partitions of a real
    work item's K/V tiles that hold a key row past the committed prefix in their last tile are
    read from a one-row zero tensor, all ``c = ceil(r / 128)`` tiles of them), with ``n =
    plan.key_row``, ``r = plan.split_rows``, ``k = min(r, 128)`` and ``Lp_b = cache_lens[b] -
    T``::

        read   += 2 s Hkv c n D sum_(b, j) (k - clip(floor(Lp_b / n) - j r - (c - 1) 128, 0, k))
                                                     over the real items (b, j)

    With ``paged`` (a block table; ``n = plan.key_row``, ``Lp_b = cache_lens[b] - T``), the
    block table adds one int32 per gathered key row (once per head group: the page does not
    depend on the head) and per gathered tail position (per kv head)::

        read   += 4 H' sum_b floor(Lp_b / n) + 4 Hkv sum_b (Lp_b mod n + T)

    (the K/V bytes are unchanged: a page shared by several sequences is read once per
    sequence that uses it). Nothing at or past ``cache_lens[b]`` is read; padding items read
    only their work row.

    Through ``api="nki"`` with LNC=2 and an odd number ``H' B'`` of tail programs, both cores
    run the middle one (:func:`decode_launch`), sequence ``b = B - B' + ((H' B' - 1) / 2) mod
    B'`` for ``h = Hkv / H'`` kv heads (without a tree mask ``B' = B - C K``: the chunk
    programs, ``C = (W + P) / I`` per head group, run the tails of the first ``C K`` sequences
    beside their splits, ``K = tiles.decode_tails_per_program(B, C, I)``; else ``B' = B``): its reads (``s h G T D`` of q, 4 of the length, ``2 s h D
    (Lp_b mod n + T)`` of K/V, ``T^2`` of the tree mask, paged ``4 h (Lp_b mod n + T)``) and
    its ``4 h G T (D + 1)`` bytes of partials count twice.

    An FP8 cache (``cache_itemsize`` 1; None: the caches in q's itemsize ``s``) has ``s``
    replaced by 1 in the K/V terms, and adds the per-head scales ``(k_scale, v_scale)``, 8
    bytes gathered onto each of the ``r = min(G T, plan.row_tile)`` partitions of a row tile
    once per kv head of each chunk program and of each tail (``I`` work items per program,
    :func:`decode_launch`)::

        read   += 8 r Hkv ((W + P) / I + B)

    (with the doubled middle tail above, ``8 r h`` more).

    With ``k_layout="bhds"`` (a K^T cache) K is read in windows: each real work item reads
    its whole split, ``n r`` positions, and each tail the key rows ``i = 0 .. ceil((2 n - 2 +
    T) / n) - 1`` from ``r0 = floor((Lp_b + 1) / n) - 1`` that start in ``[0, L_b)``
    (``decode._tail_keys_from_window``), so the K half of the K/V term becomes::

        s Hkv D (n r W + n sum_b #{i : 0 <= (r0_b + i) n < L_b})

    (V's stays ``s Hkv D sum_b L_b``), the zero fills read V's rows only (half the term
    above), and a doubled middle tail's K reads are its ``n`` times its rows.
    """
    N = B * Hq * T
    launch_ = decode_launch(cache_lens, T, Hkv, plan, lnc, api)
    work, splits, groups = launch_.work, launch_.splits, launch_.groups
    W = int(np.sum(splits))
    pad = 0 if work is None else work.shape[0] - W               # padding items
    S = plan.num_splits + 1
    cs = itemsize if cache_itemsize is None else cache_itemsize
    lens = np.asarray(cache_lens, dtype=np.int64)
    total = int(lens.sum())
    kv = 2 * cs * Hkv * D * total
    n = plan.key_row
    if k_layout not in ("bhsd", "bhds") or (paged and k_layout == "bhds"):
        raise ValueError(f"k_layout: expected 'bhsd', or 'bhds' with a contiguous cache "
                         f"(paged=False), got {k_layout!r} with paged={paged}")
    transposed = k_layout == "bhds"
    if transposed:                  # K in split windows and the tails' key rows
        tail_rows = _tail_window_rows(lens, T, n)
        kv += cs * Hkv * D * (n * plan.split_rows * W + n * int(np.sum(tail_rows)) - total)
    read = (kv + itemsize * Hq * T * D * (W + B) + 8 * groups * (W + pad)
            + 4 * groups * (W + B) + 4 * N * (D + 1) * S + (4 * N if S > 1 else 0))
    if tree_mask:
        read += T * T * B * groups
    prefix = lens - T                                       # committed positions
    if paged:
        read += 4 * (groups * int(np.sum(prefix // n)) + Hkv * int(np.sum(prefix % n + T)))
    written = 4 * Hq * T * (D + 1) * (W + pad + B) + itemsize * N * D + 4 * N
    if work is not None and tiles.decode_zero_by_dma(plan.split_rows):  # K/V zero fills
        rs, full = plan.split_rows, prefix // n
        tiles_, kr = _tiles.ceil_div(rs, _tiles.PMAX), min(rs, _tiles.PMAX)
        zeroed = sum(kr - min(max(int(full[b]) - j * rs - (tiles_ - 1) * _tiles.PMAX, 0), kr)
                     for b in range(B) for j in range(int(splits[b])))
        read += (1 if transposed else 2) * cs * Hkv * tiles_ * n * D * zeroed
    scale_rows = 8 * min(Hq // Hkv * T, plan.row_tile) if cs == 1 else 0   # FP8: the scales
    read += scale_rows * Hkv * ((W + pad) // launch_.items_per_program + B)
    tails = B                   # tail programs per head group
    if work is not None:
        chunks = work.shape[0] // launch_.items_per_program
        tails -= chunks * tiles.decode_tails_per_program(
            B, chunks, launch_.items_per_program, api=api, tree_mask=bool(tree_mask))
    if api == "nki" and lnc == 2 and (groups * tails) % 2:
        b = B - tails + ((groups * tails - 1) // 2) % tails
        h, G = Hkv // groups, Hq // Hkv
        tail = int(cache_lens[b]) - T
        tail = tail % plan.key_row + T                       # positions the tail reads
        k_tail = n * int(tail_rows[b]) if transposed else tail
        read += (itemsize * h * G * T * D + 4 + cs * h * D * (tail + k_tail) + scale_rows * h
                 + (T * T if tree_mask else 0) + (4 * h * tail if paged else 0))
        written += 4 * h * G * T * (D + 1)
    return read, written


def _tail_window_rows(lens, T: int, n: int):
    """Key rows each sequence's tail reads from a K^T cache (:func:`flash_decode_hbm_bytes`):
    of the ``ceil((2 n - 2 + T) / n)`` from ``floor((L - T + 1) / n) - 1``, those starting in
    ``[0, L)``."""
    r0 = (lens - T + 1) // n - 1
    first = (r0[:, None] + np.arange(_tiles.ceil_div(2 * n - 2 + T, n))[None, :]) * n
    return np.sum((first >= 0) & (first < lens[:, None]), axis=1)


def flash_decode(q, k_cache, v_cache, *, cache_lens, block_table=None, scale=None,
                 tree_mask=None, num_splits=None, mixed_precision: bool = True,
                 return_lse: bool = False, softcap=None, alibi_slopes=None, sinks=None,
                 lnc=None, window=None, k_scale=None, v_scale=None, k_layout="bhsd"):
    """Attention of T new tokens per sequence over a KV cache (split-KV flash decoding).

    Parameters
    ----------
    q : array (B, Hq, T, D)
        Queries of the new tokens, ``1 <= T <= 128``, ``D <= 256``.
    k_cache, v_cache : arrays (B, Hkv, S_max, D)
        The caches, q's dtype (float32, bfloat16 or float16); ``Hq % Hkv == 0`` (query head h
        reads kv head ``h // (Hq // Hkv)``). They already hold the new tokens' keys and values
        at positions ``cache_lens[b] - T .. cache_lens[b] - 1``. Or an FP8 cache, K and V in
        one 8-bit float format of the target (``tiles.DECODE_FP8_CACHE_DTYPES``: trn2 and trn1
        ``float8_e4m3`` (IEEE-style, max 240) or ``float8_e5m2``; trn3 ``float8_e4m3fn`` (OCP,
        max 448) or ``float8_e5m2``; any other 8-bit float is a TypeError, never a cast), with
        ``k_scale`` and ``v_scale``: the kernel reads 1 byte per element and dequantizes on
        chip.
    cache_lens : (B,) ints, required
        Valid length per sequence, ``T <= cache_lens[b] <= S_max``. Only these positions are
        read; the kernels take them as device data, so they may change every step without a
        recompile.
    block_table : integer array (B, max_blocks_per_seq), optional
        Paged KV cache (FlashAttention's ``flash_attn_with_kvcache(block_table=...)``):
        k_cache and v_cache are then page pools ``(num_blocks, Hkv, page_size, D)``, page_size
        a power of two >= ``tiles.DECODE_PAGE_SIZE_MIN`` (16), and logical position p of
        sequence b is offset ``p % page_size`` of page ``block_table[b, p // page_size]``
        (``cache_lens[b] <= max_blocks_per_seq * page_size``). The blocks a sequence uses must
        name pages in ``[0, num_blocks)``; later entries are never read (e.g. -1). Pages may be
        shared between sequences (prefix sharing). Device data like ``cache_lens``: a new table
        every step does not recompile (the tiling depends on its shape and the page size only).
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    tree_mask : bool array (T, T), optional
        Speculative decoding: new token t sees new token u iff ``tree_mask[t, u]`` (the diagonal
        must be True). Default: causal among the new tokens (``u <= t``). Every new token sees
        the whole committed prefix.
    num_splits : int, optional
        Number of splits of the committed prefix (each one program writing a partial o and LSE;
        the last partial key row and the new tokens always form one more). Default: chosen from
        the real lengths by :func:`plan_flash_decode`. A count too small for the per-split
        SBUF/PSUM limit raises ValueError, and so does one above
        ``nki_kernels.tiles.decode_max_splits(D)`` (126 at D = 128: the merge kernel holds every
        partial of a row on chip); more splits than needed just yield empty partials.
    mixed_precision : bool
        float32 inputs only: matmul operands in bf16 (default) or float32.
    return_lse : bool
        Also return the log-sum-exp.
    softcap, alibi_slopes, sinks : optional
        Score modifiers as in :func:`flash_attention`; new token t sits at position
        ``cache_lens[b] - T + t`` for the ALiBi distance (two-sided with a tree mask).
    lnc : None, 1 or 2
        NeuronCores per logical core (None: 2 on trn2, else 1). With 2 the split kernel's
        programs are spread over both cores (:func:`decode_launch`).
    window : None or (left, right)
        Sliding window as in :func:`flash_attention` (new token t at position ``cache_lens[b]
        - T + t``; -1 = unbounded side). The split-KV kernels have no window: a windowed call
        runs the prefill-class kernel of :func:`flash_attention_with_kvcache` (same
        semantics; ``num_splits`` and ``tree_mask`` are refused with it).
    k_scale, v_scale : number or array (Hkv,), required with (and only with) an FP8 cache
        Dequantization scales, one per kv head or one for all: the cache holds
        ``k / k_scale`` and ``v / v_scale``. Finite and > 0 in float32, the precision they are
        applied in: K's scale is folded into the softmax scale of the head's queries, V's into
        its output (no dequantized cache is formed).
    k_layout : "bhsd" (default) or "bhds"
        ``"bhds"``: k_cache is ``(B, Hkv, D, S_max)``, K transposed (v_cache unchanged), the
        layout nki-library's ``attention_tkg`` reads and a serving stack that writes its own
        cache can keep. The split kernel then loads each split's keys as one long run per
        head-dim row and skips the on-chip K transposes. Contiguous caches only (a
        ``block_table`` is a ValueError), no ``window``; the split size is chosen to divide
        S_max (``nki_kernels.tiles.decode_transposed_split``), so S_max should have a large
        power-of-two factor (a multiple of 8192 keeps the default splits): S_max = 1000
        would give splits of 8 positions, and an S_max whose full cache needs more splits
        than the merge holds is a ValueError at any length. K is read in whole split
        windows and key rows, up to the end of the one holding position ``cache_lens[b] - 1``
        (never past S_max): what lies past the length there is read but replaced before it
        reaches a score (``flash_decode_hbm_bytes(k_layout="bhds")`` counts it).

    Returns
    -------
    o : numpy.ndarray (B, Hq, T, D), q's dtype
    lse : numpy.ndarray (B, Hq, T) float32 (natural log), only with ``return_lse``

    Without a tree mask this equals ``flash_attention(q, k[:, :, :L], v[:, :, :L],
    causal="bottom_right")`` for each sequence with ``L = cache_lens[b]``. HBM traffic:
    :func:`flash_decode_hbm_bytes` (without a window). This is the small-T case of
    :func:`flash_attention_with_kvcache`: the same validation and semantics, with the
    split-KV kernels kept for every T (unless a window is given).
    """
    call = _kvcache_call(q, k_cache, v_cache, cache_lens=cache_lens, block_table=block_table,
                         scale=scale, causal=True, window=window, tree_mask=tree_mask,
                         num_splits=num_splits, mixed_precision=mixed_precision,
                         return_lse=return_lse, softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, lnc=lnc, k_scale=k_scale, v_scale=v_scale,
                         decode_only=True, k_layout=k_layout)
    return _kvcache_outputs(call, q, k_cache, v_cache)


def _cache_tensors(call: DecodeCall, to_device) -> dict:
    """The device tensors of a call over a cache besides q, the caches, lengths and table:
    the score modifiers' and, with an FP8 cache, ``kv_scale`` (both kernels take them by these
    names)."""
    tensors = {name: None if a is None else to_device(a)
               for name, a in call.mods.tensors.items()}
    if call.kv_quant is not None:
        tensors["kv_scale"] = to_device(call.kv_quant.scales)
    return tensors


def run_decode(call: DecodeCall, q, k_cache, v_cache, run, to_device):
    """The two launches of a validated decode call (:func:`_decode_call`): the split kernel
    on ``(Hkv, work items + B)`` and the LSE merge. ``run(kernel, grid, *args, **kw)`` launches
    (:func:`host._launch.launch`, or ``kernel[grid](...)`` on XLA tensors) and ``to_device``
    moves the host-built arrays (lengths, work list, tree mask, block table, slopes, sinks)
    next to q. Returns ``(o, lse)`` flat: ``(B Hq T, D)`` and ``(B Hq T,)``. Both kernels trace
    through the namespace :func:`nki_kernels.nki.select_api` selects (every decode call is
    ported to nki.*)."""
    from nki_kernels.attention import decode as k
    from nki_kernels.attention.decode_merge import flash_decode_merge_kernel

    inputs, pages = call.inputs, call.pages
    api = select_api()
    plan = _decode_tiles(call)
    table = None if pages is None else to_device(pages.block_table)
    lens = np.ascontiguousarray(inputs.cache_lens, dtype=np.int32)
    tree = None if inputs.tree_mask is None else to_device(inputs.tree_mask.astype(np.uint8))
    B, Hq, Hkv, T = inputs.B, inputs.Hq, inputs.Hkv, inputs.T
    ln = decode_launch(lens, T, Hkv, plan, call.lnc, api)
    work, splits = ln.work, ln.splits
    mod_tensors = _cache_tensors(call, to_device)
    # the source of the split kernel's K/V zero fills (one key row of zeros, the caches' dtype)
    cache_dtype = call.dtype if call.kv_quant is None else call.kv_quant.format
    zero_cols = _tiles.decode_zero_row_cols(plan.split_rows, plan.key_row, inputs.D)
    zero_row = (to_device(np.zeros((1, zero_cols), dtype=np.dtype(cache_dtype)))
                if work is not None and tiles.decode_zero_by_dma(plan.split_rows) else None)
    part = run(
        k.flash_decode_split_kernel.on(api),
        k.decode_grid(ln.groups, ln.programs, ln.core_axis, api=api, lnc=call.lnc), q,
        k_cache, v_cache, to_device(lens),
        None if work is None else to_device(work), tree, table, zero_row=zero_row,
        scale=call.scale,
        mm_dtype=call.mm_dtype, key_row=plan.key_row, split_rows=plan.split_rows,
        num_splits=plan.num_splits, row_tile=plan.row_tile, pack=plan.pack,
        items_per_program=ln.items_per_program, heads_per_program=ln.heads_per_program,
        k_layout=call.k_layout, **mod_tensors, **call.mods.kwargs)
    N = B * Hq * T
    # legacy: one program per row tile; nki.* (kernel[1]): one program walks the row tiles
    return run(flash_decode_merge_kernel.on(api),
               port.launch_grid((tiles.ceil_div(N, tiles.DECODE_MERGE_ROWS),), api),
               part, to_device(np.repeat(splits, Hq * T)),
               out_dtype=call.dtype, rows_per_program=tiles.DECODE_MERGE_ROWS)


# ============================================================================================
# Attention over a KV cache for any T (chunked prefill, prefix caching)
# ============================================================================================


class KVCacheCall(NamedTuple):
    """One validated call over a KV cache (:func:`_kvcache_call`): its decode record (sizes,
    lengths, pages, scale, modifiers, ...; the tree mask of the decode kernels), the mask
    options, and which kernel runs it."""

    decode: DecodeCall
    causal: Optional[str]               # "bottom_right" or None
    window: Optional[Tuple[int, int]]   # (left, right), -1 = unbounded; None: no window
    mixed_precision: bool
    prefill: bool                       # the forward kernel; False: the split-KV decode kernels


def _kvcache_call(q, k_cache, v_cache, *, cache_lens, block_table=None, scale=None,
                  causal=True, window=None, tree_mask=None, num_splits=None,
                  mixed_precision: bool = True, return_lse: bool = False, softcap=None,
                  alibi_slopes=None, sinks=None, lnc=None, k_scale=None, v_scale=None,
                  decode_only: bool = False, k_layout="bhsd") -> KVCacheCall:
    """Validate a call over a KV cache (arguments as in
    :func:`flash_attention_with_kvcache`) into one record and choose its kernel: the split-KV
    decode kernels for ``T <= tiles.kvcache_decode_max_tokens(G)`` (and whenever ``tree_mask``
    or ``num_splits`` asks for them), else -- and always with a window, which they lack -- the
    forward with the cache lengths as ``kv_lens`` (and the block table). ``decode_only``
    (:func:`flash_decode`): ``T <= 128``, all of which the decode kernels run."""
    from nki_kernels.attention import masks as M

    max_new_tokens = _v.MAX_DECODE_TOKENS if decode_only else None
    causal = _v.normalize_causal(causal)
    if causal == "top_left":
        raise ValueError("causal: over a KV cache the new tokens are the last T positions of "
                         "each sequence, so the diagonal is bottom-right; expected True (= "
                         "'bottom_right'), 'bottom_right', False or None, got 'top_left'")
    window = _v.normalize_window(window)
    mixed_precision = _check_bool("mixed_precision", mixed_precision)
    call = _decode_call(q, k_cache, v_cache, cache_lens=cache_lens, block_table=block_table,
                        scale=scale, tree_mask=tree_mask, num_splits=num_splits,
                        mixed_precision=mixed_precision, return_lse=return_lse,
                        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, lnc=lnc,
                        max_new_tokens=max_new_tokens, k_scale=k_scale, v_scale=v_scale,
                        k_layout=k_layout)
    T = call.inputs.T
    decode_up_to = (_v.MAX_DECODE_TOKENS if decode_only
                    else tiles.kvcache_decode_max_tokens(call.inputs.group))
    for name, value in (("tree_mask", tree_mask), ("num_splits", num_splits)):
        if value is None:
            continue
        if window is not None or T > _v.MAX_DECODE_TOKENS:
            raise ValueError(f"{name}: an option of the split-KV decode kernels (T <= "
                             f"{_v.MAX_DECODE_TOKENS}, no window); this call has T={T}, "
                             f"window={window!r}; allowed: None")
    if tree_mask is not None and causal is None:
        raise ValueError("tree_mask: replaces the causal mask among the new tokens; needs "
                         "causal=True, got causal=False")
    prefill = window is not None or (tree_mask is None and num_splits is None
                                     and T > decode_up_to)
    if prefill and k_layout != "bhsd":
        raise ValueError(f"k_layout: {k_layout!r} is read by the split-KV decode kernels only; "
                         f"this call (T={T}, window={window!r}) runs the prefill kernel, "
                         f"which takes k_cache as 'bhsd' (B, Hkv, S_max, D)")
    pages = call.pages
    if prefill and pages is not None and max(
            2 * call.inputs.S_max, M.oob_offset(call.inputs.B * pages.max_blocks)
    ) >= tiles.FWD_PAGED_INDEX_LIMIT:
        raise ValueError(
            f"block_table: the prefill kernel over a paged cache indexes positions and table "
            f"entries in fp32 below 2^22 (twice max_blocks * page_size = "
            f"{2 * call.inputs.S_max}, B * max_blocks = {call.inputs.B * pages.max_blocks}); "
            f"split the batch or the table")
    if not prefill and causal is None:
        # no causal mask: every new token sees every new token (the decode kernels' tree)
        call = call._replace(inputs=call.inputs._replace(tree_mask=np.ones((T, T), bool)))
    return KVCacheCall(call, causal, window, mixed_precision, prefill)


def _prefill_call(call: KVCacheCall) -> AttentionCall:
    """The forward's :class:`AttentionCall` of a call over a cache: q's T rows against the
    cache's ``S_max`` key frame (paged: the logical capacity), ``kv_lens = cache_lens``. Its
    bottom-right alignment ``kv_len - Nq`` is ``cache_lens[b] - T``, the new tokens'
    positions."""
    d = call.decode
    i = d.inputs
    dims = _v.AttentionShape(i.B, i.Hq, i.Hkv, i.T, i.S_max, i.D)
    return AttentionCall(dims, d.dtype, d.scale, call.causal, call.window,
                         _lengths_int32(i.cache_lens), None, call.mixed_precision, d.mm_dtype,
                         d.lnc, Dropout(0.0, None), d.mods, None, None, None, d.return_lse,
                         False)


def run_kvcache(call: KVCacheCall, q, k_cache, v_cache, run, to_device):
    """The launches of a validated call over a cache (:func:`_kvcache_call`): the decode
    kernels (:func:`run_decode`) or the forward (:func:`_plan_forward`) with the cache lengths
    and the block table as device data. ``run``/``to_device`` as :func:`run_decode`'s; returns
    ``(o, lse)`` flat, ``(B Hq T, D)`` and ``(B Hq T,)``."""
    d = call.decode
    if not call.prefill:
        return run_decode(d, q, k_cache, v_cache, run, to_device)
    att = _prefill_call(call)
    kernel, grid, kwargs = _plan_forward(att)
    table = None if d.pages is None else to_device(d.pages.block_table)
    o, lse = run(kernel, grid, q, k_cache, v_cache, kv_lens=to_device(att.kv_lens),
                 block_table=table, **_cache_tensors(d, to_device), **kwargs)
    i = d.inputs
    return o.reshape(i.B * i.Hq * i.T, i.D), lse.reshape(i.B * i.Hq * i.T)


def _kvcache_outputs(call: KVCacheCall, q, k_cache, v_cache):
    """Run a validated call on NumPy inputs through :func:`host._launch.launch`: ``o`` (and
    ``lse`` with ``return_lse``) in the caller's shapes."""
    q, k_cache, v_cache = _numpy("q", q), _numpy("k_cache", k_cache), _numpy("v_cache", v_cache)
    o, lse = run_kvcache(call, q, k_cache, v_cache, launch, lambda a: a)
    i = call.decode.inputs
    o = np.asarray(o).reshape(i.B, i.Hq, i.T, i.D)
    return (o, np.asarray(lse).reshape(i.B, i.Hq, i.T)) if call.decode.return_lse else o


def flash_attention_with_kvcache(q, k_cache, v_cache, *, cache_lens, block_table=None,
                                 scale=None, causal=True, window=None, tree_mask=None,
                                 softcap=None, alibi_slopes=None, sinks=None, num_splits=None,
                                 mixed_precision: bool = True, return_lse: bool = False,
                                 lnc=None, k_scale=None, v_scale=None):
    """Attention of T new tokens per sequence over a KV cache, any ``T >= 1``: decoding,
    speculative trees, chunked prefill and prefix caching (FlashAttention's
    ``flash_attn_with_kvcache`` in the ``(B, H, N, D)`` layout; docs/semantics.md).

    Parameters
    ----------
    q : array (B, Hq, T, D)
        Queries of the new tokens, ``T >= 1``, ``D <= 256``.
    k_cache, v_cache : arrays (B, Hkv, S_max, D), or page pools (num_blocks, Hkv, page_size, D)
        with ``block_table``
        q's dtype (float32, bfloat16, float16); ``Hq % Hkv == 0``. They already hold the new
        tokens' keys and values at positions ``cache_lens[b] - T .. cache_lens[b] - 1`` (the
        tokens before them are the cached prefix: a shared prompt, earlier chunks). Or an FP8
        cache with ``k_scale``/``v_scale`` as in :func:`flash_decode`.
    cache_lens : (B,) ints, required
        ``T <= cache_lens[b] <= S_max`` (paged: ``max_blocks_per_seq * page_size``). Device
        data: new lengths do not recompile.
    block_table : integer array (B, max_blocks_per_seq), optional
        Paged cache as in :func:`flash_decode`: position p of sequence b is offset ``p %
        page_size`` of page ``block_table[b, p // page_size]``; page_size a power of two >= 16;
        the pages a sequence uses must be in ``[0, num_blocks)``; pages may be shared between
        sequences (prefix caching).
    scale : float, optional
        Softmax scale, default ``1 / sqrt(D)``.
    causal : True, "bottom_right", False or None
        True (default) is bottom-right: new token t (position ``cache_lens[b] - T + t``) sees
        the positions up to its own. False/None: every new token sees all ``cache_lens[b]``
        positions. ``"top_left"`` is refused (ValueError).
    window : None or (left, right)
        Sliding window of :func:`flash_attention` (-1 = unbounded side), aligned as causal
        aligns the new tokens: position ``cache_lens[b] - T + t`` sees keys j with ``pos - left
        <= j <= pos + right``.
    tree_mask : bool (T, T), optional
        Speculative decoding (``T <= 128``, causal): as in :func:`flash_decode`.
    softcap, alibi_slopes, sinks : optional
        Score modifiers as in :func:`flash_attention`.
    num_splits : int, optional
        Splits of the decode kernels' cache scan (``T <= 128`` only), as in
        :func:`flash_decode`.
    mixed_precision, return_lse, lnc
        As in :func:`flash_attention`.
    k_scale, v_scale : number or array (Hkv,), required with (and only with) an FP8 cache
        As in :func:`flash_decode`, for every T: the prefill forward's key gathers cast the
        cache to the matmul dtype as the decode kernels' do, K's scale joins the query
        scaling and V's the output normalization (``kv_scale``,
        :func:`nki_kernels.attention.forward.flash_attention_fwd`).

    Returns
    -------
    o : numpy.ndarray (B, Hq, T, D), q's dtype
    lse : numpy.ndarray (B, Hq, T) float32, only with ``return_lse``

    Kernels: ``T <= nki_kernels.tiles.kvcache_decode_max_tokens(Hq // Hkv)`` (64, up to 128
    for ``Hq // Hkv <= 2``; and a tree mask or ``num_splits``) runs the split-KV decode
    kernels of :func:`flash_decode` (faster there on the trn2 estimates); larger T, or a
    window, runs the prefill forward (:func:`flash_attention`'s kernel) with ``kv_lens =
    cache_lens``, whose key loads gather the valid cache rows -- through the block table when
    paged, one table entry per key -- into the same K/V staging as a contiguous input. Both
    give the same results up to rounding.
    """
    call = _kvcache_call(q, k_cache, v_cache, cache_lens=cache_lens, block_table=block_table,
                         scale=scale, causal=causal, window=window, tree_mask=tree_mask,
                         num_splits=num_splits, mixed_precision=mixed_precision,
                         return_lse=return_lse, softcap=softcap, alibi_slopes=alibi_slopes,
                         sinks=sinks, lnc=lnc, k_scale=k_scale, v_scale=v_scale)
    return _kvcache_outputs(call, q, k_cache, v_cache)


# ============================================================================================
# Flash attention backward
# ============================================================================================


def plan_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, window=None,
                            kv_lens=None, q_lens=None, mixed_precision: bool = True, lnc=None,
                            dropout_p=0.0, seed=None, softcap=None, alibi_slopes=None,
                            sinks=None):
    """Validate a backward call and choose its launch: ``(kernel, grid, kernel_kwargs)``.

    The kernel is :func:`nki_kernels.attention.backward.flash_attn_bwd` pinned to the namespace
    it traces through (:func:`nki_kernels.nki.select_api`: every backward call is ported), the
    grid
    :func:`nki_kernels.attention.backward.backward_grid`'s for that namespace: in legacy
    ``(B, Hkv)`` with LNC=1, or with LNC=2 (trn2) kv heads or sequences spread over the two
    cores; under nki.* ``(lnc,)``, the kernel looping over the programs;
    ``kernel_kwargs`` holds the compile-time options (``scale``, ``causal``, ``window``,
    ``mixed_precision``) but not the tensors: call it as
    ``kernel[grid](q, k, v, o, do, lse, kv_lens=..., q_lens=..., **kernel_kwargs)`` with
    ``(B,)`` int32 lengths (or None), as the forward. The compiled kernel depends on the shapes,
    these options and whether each length array is given -- never on the lengths' values.
    Shared by :func:`flash_attention_backward` and the torch-neuronx path of
    :mod:`host.torch_ops`. Arguments as in :func:`flash_attention_backward`.
    """
    return _plan_backward(_backward_call(
        do, q, k, v, o, lse, scale=scale, causal=causal, window=window, kv_lens=kv_lens,
        q_lens=q_lens, mixed_precision=mixed_precision, lnc=lnc, dropout_p=dropout_p, seed=seed,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks))


def _plan_backward(call: AttentionCall):
    """The dense backward's launch of a validated call, ``(kernel, grid, kernel_kwargs)``, as
    :func:`plan_attention_backward` describes it."""
    from nki_kernels.attention.backward import backward_grid, flash_attn_bwd

    dims, p = call.dims, call.dropout.p
    kwargs = dict(scale=call.scale, causal=call.causal, window=call.window,
                  mixed_precision=call.mixed_precision)
    if p:
        kwargs["dropout_p"] = p
    kwargs.update(call.mods.kwargs)
    api = select_api()
    return (flash_attn_bwd.on(api), backward_grid(dims.B, dims.Hkv, call.lnc, api=api),
            kwargs)


def flash_attention_backward(do, q, k, v, o, lse, *, scale=None, causal=False, window=None,
                             kv_lens=None, q_lens=None, mixed_precision: bool = True, lnc=None,
                             dropout_p=0.0, seed=None, block_mask=None, softcap=None,
                             alibi_slopes=None, sinks=None, cu_seqlens_q=None,
                             cu_seqlens_k=None):
    """Gradients of flash attention on the active backend: ``(dq, dk, dv)`` (and ``dsinks``
    with ``sinks``).

    The backward of :func:`flash_attention` from its saved output and log-sum-exp: with
    ``P = exp(scale q k^T - lse)`` recomputed tile by tile, ``D = rowsum(do * o)``,
    ``dv = P^T do``, ``dS = P * (do v^T - D)``, ``dq = scale dS k``, ``dk = scale dS^T q``
    (docs/semantics.md). One kernel, one pass over K/V when the query-side state of a kv
    group fits SBUF; dK/dV accumulate on chip and dQ stays in SBUF, so every input is read
    once and every gradient written once.

    Parameters
    ----------
    do : array (B, Hq, Nq, D)
        Gradient of the loss with respect to o.
    q : array (B, Hq, Nq, D)
    k, v : arrays (B, Hkv, Nk, D)
    o : array (B, Hq, Nq, D)
        The forward output. do, q, k, v, o are NumPy arrays (or CPU torch tensors) of one
        dtype: float32, bfloat16 (ml_dtypes) or float16. ``Hq % Hkv == 0``; any
        ``Nq, Nk >= 1``; ``1 <= D <= 256``.
    lse : array (B, Hq, Nq) float32
        The forward's log-sum-exp (natural log; ``flash_attention(..., return_lse=True)``);
        -inf for rows without a visible key, which then get zero gradients.
    scale, causal, window, kv_lens, q_lens :
        Exactly as passed to the forward (:func:`flash_attention`): ``causal=True`` means
        ``"bottom_right"``; ``window=(left, right)`` with -1 = unbounded; per-sequence valid
        lengths of a padded batch, passed to the kernel as runtime int32 tensors (one
        compilation serves every set of lengths). Padding rows and keys are never read; their
        gradients are 0.
    mixed_precision : bool
        float32 inputs only: matmul operands in bf16 (default) or float32 (4x slower TensorE).
        bf16/fp16 inputs always use their own dtype. Accumulation, D and the dS arithmetic are
        fp32.
    lnc : None, 1 or 2
        NeuronCores per logical core (None: 2 on trn2, else 1). With 2, the (sequence, kv head)
        programs are spread over the two cores when Hkv or B is even
        (:func:`nki_kernels.attention.backward.backward_grid`).
    dropout_p, seed :
        The forward's attention dropout: the kernel regenerates the forward's mask block by
        block from the seed (appendix Algorithm 4) and differentiates through it.
    block_mask, softcap, alibi_slopes, sinks :
        As passed to the forward (``lse`` then includes the sinks).
    cu_seqlens_q, cu_seqlens_k :
        Packed variable-length sequences, as passed to the forward (its layouts; the same
        refusals; head dims up to 128 here). Runs
        :mod:`nki_kernels.attention.varlen_bwd`.

    Returns
    -------
    dq : numpy.ndarray (B, Hq, Nq, D)
    dk, dv : numpy.ndarray (B, Hkv, Nk, D)
        In the inputs' dtype. For GQA/MQA dk and dv are summed over the query heads of each
        kv group.
    dsinks : numpy.ndarray (Hq,) float32, only with ``sinks``
        ``-sum over rows of exp(sink - lse) * rowsum(do * o)`` (ALiBi slopes and the cap get
        no gradient: they are constants of the model).
    """
    call = _backward_call(
        do, q, k, v, o, lse, block_mask=block_mask, scale=scale, causal=causal, window=window,
        kv_lens=kv_lens, q_lens=q_lens, mixed_precision=mixed_precision, lnc=lnc,
        dropout_p=dropout_p, seed=seed, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if call.block_sparse is not None:
        return _block_sparse_backward(do, q, k, v, o, lse, call)
    if call.packing is not None:
        return _varlen_backward(do, q, k, v, o, lse, call)
    kernel, grid, kwargs = _plan_backward(call)
    mod_tensors = call.mods.tensors
    do, q, k, v, o = (_numpy(n, x) for n, x in (("do", do), ("q", q), ("k", k), ("v", v),
                                                 ("o", o)))
    lse = _numpy("lse", lse)
    if call.dropout.seed is not None:
        kwargs["seed"] = call.dropout.seed
    outs = launch(kernel, grid, q, k, v, o, do, lse, kv_lens=call.kv_lens, q_lens=call.q_lens,
                  **mod_tensors, **kwargs)
    if mod_tensors["sinks"] is None:
        return outs
    # each sequence's share of dsinks, summed over the batch on the host (B x Hq floats)
    return tuple(outs[:3]) + (np.asarray(outs[3], dtype=np.float32).sum(axis=0),)


def flash_attention_backward_hbm_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int,
                                       itemsize: int, *, causal=False, window=None,
                                       q_lens=None, kv_lens=None,
                                       mixed_precision: bool = True, target: str = "trn2"):
    """Exact HBM bytes ``(read, written)`` of :func:`flash_attention_backward`, counted from the
    kernel's own loop plan (:func:`nki_kernels.attention.backward.plan_hbm_bytes`).

    ``P`` passes over K/V per (sequence, kv head) (:func:`tiles.bwd_passes`: 1 when the ``G *
    Nq`` query rows of a kv group fit 90 % of SBUF). Per sequence b with valid lengths ``nq_b``,
    ``nk_b`` (Nq, Nk when not given):

    * read: do, q, o of the valid rows (``3 Hq nq_b D`` elements), the float32 lse of the valid
      rows (``4 Hq nq_b`` bytes), k and v of the valid keys some query row can see once per pass
      (with ``causal``/``window``, key tiles no row sees are not read): padding rows and keys
      are skipped by the kernel's gathers, never read; plus one int32 per (sequence, kv head)
      program for each length array given;
    * written: dq, dk, dv in full, padding included (``Hq Nq D + 2 Hkv Nk D`` elements);
    * with ``P > 1``, an fp32 dK/dV scratch per program: zeroed (``2 Nk D`` floats), read and
      written by every pass over the keys it sees, and read once at the end.

    ``itemsize`` is the inputs' element size; the pass count uses the matmul operand size
    (bf16 for float32 with ``mixed_precision``) and ``target``'s SBUF.
    """
    from nki_kernels.attention import backward as _bwd
    G = Hq // Hkv
    op_itemsize = 2 if (itemsize == 2 or mixed_precision) else 4
    rows = tiles.bwd_rows_per_pass(D, op_itemsize, target)
    spec = _bwd.band_spec(Nq, Nk, _v.normalize_causal(causal), _v.normalize_window(window))
    plan = _bwd.plan_backward(Nq, Nk, G, spec, tiles.bwd_key_tile(D), rows)
    return _bwd.plan_hbm_bytes(B, Hq, Hkv, Nq, Nk, D, itemsize, plan, spec, q_lens=q_lens,
                               kv_lens=kv_lens)
