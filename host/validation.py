"""Input validation shared by every host entry point (NumPy API, PyTorch wrappers, references).

Every check raises :class:`TypeError` (wrong kind of object or dtype) or :class:`ValueError`
(wrong rank, shape or value) with a message that names the argument, shows what was given and
says what is allowed, e.g.::

    ValueError: k: expected shape (B, Hkv, Nk, D) with B=2 and D=64 matching q, got (2, 4, 100, 32)

Nothing here casts, truncates or pads: a validator either accepts its argument as it is or
raises. The normalizers (:func:`normalize_causal`, :func:`normalize_window`,
:func:`check_lengths`, :func:`check_scale`, ...) return the canonical form of an option that
was accepted.

Arrays may be NumPy arrays (``ml_dtypes.bfloat16`` included) or ``torch.Tensor`` objects; torch
is never imported here, tensors are recognized by their type's module. Array *values* are not
inspected (that would cost a pass over the data) except for small integer and boolean control
inputs (lengths, tree masks) and scalars.

The kernels' limits :data:`MAX_HEAD_DIM` and :data:`MAX_DECODE_TOKENS` are re-exported from their
home, ``nki_kernels/tiles.py`` (plain Python, no NKI import).
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from nki_kernels import tiles as _tiles

# --------------------------------------------------------------------------------------------
# Limits and vocabularies
# --------------------------------------------------------------------------------------------

#: Largest head dimension D the attention kernels accept, 256 (FlashAttention's limit too).
MAX_HEAD_DIM = _tiles.FWD_MAX_HEAD_DIM

#: Largest number T of new tokens per sequence in one decode call, 128 (one partition tile of
#: the query).
MAX_DECODE_TOKENS = _tiles.PMAX

#: Dtypes the kernels take for floating-point inputs (all inputs of one call share one dtype).
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))

#: Dtypes the float64 references accept (everything is upcast to float64 inside).
REFERENCE_DTYPES = FLOAT_DTYPES + (np.dtype(np.float64),)

#: Dtype of the log-sum-exp statistics returned by the forward kernel and taken by the backward.
LSE_DTYPE = np.dtype(np.float32)

#: Causal alignments (see docs/semantics.md).
CAUSAL_TOP_LEFT = "top_left"
CAUSAL_BOTTOM_RIGHT = "bottom_right"
CAUSAL_MODES = (CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT)
#: What ``causal=True`` means in the NumPy API (FlashAttention's convention).
CAUSAL_TRUE = CAUSAL_BOTTOM_RIGHT

#: Window bound meaning "unbounded on that side".
WINDOW_UNBOUNDED = -1

#: ``approximate`` values of GELU (``torch.nn.functional.gelu``).
GELU_EXACT = "none"
GELU_TANH = "tanh"
GELU_APPROXIMATIONS = (GELU_EXACT, GELU_TANH)

_REPR_LIMIT = 60
_INT_DTYPE_NAMES = frozenset(
    ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
)


# --------------------------------------------------------------------------------------------
# Result records
# --------------------------------------------------------------------------------------------


class AttentionShape(NamedTuple):
    """Sizes of a validated attention call: q ``(B, Hq, Nq, D)``, k/v ``(B, Hkv, Nk, D)``."""

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int

    @property
    def group(self) -> int:
        """Query heads per kv head, ``Hq // Hkv`` (query head h reads kv head ``h // group``)."""
        return self.Hq // self.Hkv


class DecodeInputs(NamedTuple):
    """A validated decode call: sizes plus the canonical ``cache_lens`` and ``tree_mask``.

    ``cache_lens`` is a fresh int64 array ``(B,)``; ``tree_mask`` is a fresh bool array ``(T, T)``
    or None.
    """

    B: int
    Hq: int
    Hkv: int
    T: int
    S_max: int
    D: int
    cache_lens: np.ndarray
    tree_mask: Optional[np.ndarray]

    @property
    def group(self) -> int:
        """Query heads per kv head, ``Hq // Hkv``."""
        return self.Hq // self.Hkv


class PagedCache(NamedTuple):
    """A validated paged KV cache (``block_table`` given): page pools
    ``(num_blocks, Hkv, page_size, D)`` and the canonical ``block_table``, a fresh int32 array
    ``(B, max_blocks)``."""

    num_blocks: int
    page_size: int
    max_blocks: int
    block_table: np.ndarray


class LinearGeluShape(NamedTuple):
    """Sizes of a validated ``GELU(x @ w + b)``: x ``(M, K)``, w ``(K, N)``, b ``(N,)``."""

    M: int
    K: int
    N: int
    approximate: str


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _is_torch_tensor(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "shape") and hasattr(
        x, "dtype"
    )


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or _is_torch_tensor(x)


def _shape(x) -> Tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def dtype_name(dtype_or_array) -> str:
    """Name of a NumPy/ml_dtypes/torch dtype, or of an array's dtype: ``"bfloat16"``, ...

    torch dtypes print as ``torch.bfloat16``; the ``torch.`` prefix is dropped so NumPy and torch
    arrays are described, and compared, by the same names.
    """
    dt = getattr(dtype_or_array, "dtype", dtype_or_array)
    if isinstance(dt, np.dtype):
        return dt.name
    text = str(dt)
    return text[len("torch."):] if text.startswith("torch.") else text


def _names(dtypes: Sequence) -> str:
    return ", ".join(dtype_name(d) for d in dtypes)


def describe(value) -> str:
    """Short description of a non-array value for error messages: ``'abc' (str)``.

    The repr is cut to 60 characters so that a huge object never floods a message.
    """
    text = repr(value)
    if len(text) > _REPR_LIMIT:
        text = text[: _REPR_LIMIT - 3] + "..."
    return f"{text} ({type(value).__name__})"


def _is_int(value) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def check_int(name: str, value, *, minimum: Optional[int] = None,
              maximum: Optional[int] = None) -> int:
    """Check that ``value`` is an integer (not a bool, not a float) in ``[minimum, maximum]``.

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    value : int or numpy integer
    minimum, maximum : int, optional
        Inclusive bounds; None means unbounded.

    Returns
    -------
    int
        ``value`` as a Python int.
    """
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int, got {describe(value)}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        lo = "-inf" if minimum is None else str(minimum)
        hi = "inf" if maximum is None else str(maximum)
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value}")
    return value


def normalize_dtype(name: str, dtype, allowed: Sequence = FLOAT_DTYPES) -> np.dtype:
    """Turn a dtype given as a NumPy dtype, type, name or torch dtype into a ``numpy.dtype``.

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    dtype : numpy dtype, type, str or torch.dtype
        E.g. ``np.float32``, ``ml_dtypes.bfloat16``, ``"bfloat16"``, ``torch.float16``.
    allowed : sequence of numpy dtypes
        The accepted dtypes.

    Returns
    -------
    numpy.dtype
    """
    allowed = tuple(np.dtype(a) for a in allowed)
    by_name = {a.name: a for a in allowed}
    key = None
    if isinstance(dtype, str):
        key = dtype
    elif isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        key = np.dtype(dtype).name
    elif type(dtype).__module__.split(".")[0] == "torch":
        key = dtype_name(dtype)
    if key not in by_name:
        raise TypeError(f"{name}: expected one of {_names(allowed)}, got {describe(dtype)}")
    return by_name[key]


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------


def check_array(name: str, x, *, ndim: Optional[int] = None,
                dtypes: Optional[Sequence] = FLOAT_DTYPES, layout: Optional[str] = None):
    """Check that ``x`` is a NumPy array or torch tensor of rank ``ndim`` with an allowed dtype.

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    x : numpy.ndarray or torch.Tensor
    ndim : int, optional
        Required rank; None accepts any rank.
    dtypes : sequence of numpy dtypes, optional
        Allowed dtypes (compared by name, so torch dtypes match their NumPy namesakes); None
        accepts any dtype. Default :data:`FLOAT_DTYPES` (float32, bfloat16, float16).
    layout : str, optional
        Human-readable expected shape used in the rank error, e.g. ``"(B, Hq, Nq, D)"``.

    Returns
    -------
    x, unchanged.

    Raises
    ------
    TypeError
        ``x`` is not an array (lists are not converted), or its dtype is not allowed.
    ValueError
        ``x`` has the wrong rank.
    """
    if not _is_array(x):
        raise TypeError(f"{name}: expected a numpy.ndarray or torch.Tensor, got {describe(x)}")
    shape = _shape(x)
    if ndim is not None and len(shape) != ndim:
        expected = f"a {ndim}-D array" + (f" of shape {layout}" if layout else "")
        raise ValueError(
            f"{name}: expected {expected}, got a {len(shape)}-D array of shape {shape}"
        )
    if dtypes is not None:
        allowed = {dtype_name(d) for d in dtypes}
        if dtype_name(x) not in allowed:
            raise TypeError(
                f"{name}: dtype {dtype_name(x)} is not supported; allowed: {_names(dtypes)}"
            )
    return x


def _check_same_dtype(name: str, x, ref_name: str, ref) -> None:
    if dtype_name(x) != dtype_name(ref):
        raise TypeError(
            f"{name}: dtype {dtype_name(x)} does not match {ref_name}'s dtype {dtype_name(ref)}; "
            f"all inputs must share one dtype (cast explicitly before calling)"
        )


def _check_head_dim(name: str, shape, D: int, max_head_dim: Optional[int]) -> None:
    hi = "inf" if max_head_dim is None else str(max_head_dim)
    if D < 1 or (max_head_dim is not None and D > max_head_dim):
        raise ValueError(f"{name}: head dim D must be in [1, {hi}], got D={D} (shape {shape})")


def _check_dims_positive(name: str, shape, labels: Sequence[str]) -> None:
    for size, label in zip(shape, labels):
        if size < 1:
            raise ValueError(f"{name}: {label} must be >= 1, got {size} (shape {shape})")


def _check_kv_against_q(names, layout, length_label, qs, ks, vs, *, v_suffix=""):
    """K and V (named ``names``) agree with q's batch and head dim, with each other, and with
    the grouped-query rule; ``layout`` and ``length_label`` describe K in messages."""
    k_name, v_name = names
    B, D = qs[0], qs[3]
    if ks[0] != B or ks[3] != D:
        raise ValueError(
            f"{k_name}: expected shape {layout} with B={B} and D={D} matching q, got {ks}"
        )
    _check_dims_positive(k_name, ks, ("batch size B", "kv heads Hkv", length_label))
    if vs != ks:
        raise ValueError(
            f"{v_name}: expected the same shape as {k_name} {ks}{v_suffix}, got {vs}")
    _check_gqa(k_name, qs, ks)


def _check_gqa(kv_name: str, qs, ks) -> None:
    Hq, Hkv = qs[1], ks[1]
    if Hq % Hkv:
        raise ValueError(
            f"{kv_name}: Hkv={Hkv} kv heads must divide q's Hq={Hq} query heads (GQA: query head "
            f"h reads kv head h // (Hq // Hkv)); got q {qs} and {kv_name} {ks}"
        )


def _check_same_dtypes(q, **others) -> None:
    for name, x in others.items():
        _check_same_dtype(name, x, "q", q)


def _check_cache_dtypes(q, k_cache, v_cache, same_dtype: bool, cache_dtypes) -> None:
    """With ``same_dtype``: the caches in q's dtype, or (``cache_dtypes`` given: an FP8
    cache) in one dtype."""
    if not same_dtype:
        return
    if cache_dtypes is None:
        _check_same_dtypes(q, k_cache=k_cache, v_cache=v_cache)
    else:
        _check_same_dtype("v_cache", v_cache, "k_cache", k_cache)


def _check_new_tokens(qs, max_new_tokens: Optional[int]) -> None:
    T = qs[2]
    hi = "inf" if max_new_tokens is None else str(max_new_tokens)
    if T < 1 or (max_new_tokens is not None and T > max_new_tokens):
        raise ValueError(
            f"q: T (new tokens per sequence) must be in [1, {hi}], got T={T} (shape {qs})"
        )


def _check_cache_lens(cache_lens, B: int, T: int, upper: int, upper_name: str) -> np.ndarray:
    """``cache_lens``: required, ``T <= value <= upper`` (the cache already holds the T new
    tokens); returns the canonical int64 array."""
    if cache_lens is None:
        raise TypeError(
            f"cache_lens: required, a (B,) = ({B},) integer array with T <= value <= {upper_name}"
        )
    lens = check_lengths("cache_lens", cache_lens, B, upper, upper_name=upper_name)
    short = np.flatnonzero(lens < T)
    if short.size:
        idx = int(short[0])
        raise ValueError(
            f"cache_lens: each value must be in [T={T}, {upper_name}={upper}] (the cache already "
            f"holds the T new tokens), got {int(lens[idx])} at index {idx}"
        )
    return lens


def check_attention_inputs(q, k, v, *, dtypes: Optional[Sequence] = FLOAT_DTYPES,
                           same_dtype: bool = True,
                           max_head_dim: Optional[int] = MAX_HEAD_DIM) -> AttentionShape:
    """Validate q, k, v of a prefill attention call.

    Parameters
    ----------
    q : array (B, Hq, Nq, D)
    k, v : arrays (B, Hkv, Nk, D)
        Same shape; ``Hq % Hkv == 0``; ``B, Hq, Hkv, Nq, Nk >= 1``; ``1 <= D <= max_head_dim``.
    dtypes : sequence of numpy dtypes, optional
        Allowed dtypes, default float32/bfloat16/float16.
    same_dtype : bool
        Require q, k, v to share one dtype (the kernels' rule: a mixed call is an error, not a
        silent cast). The references relax this.
    max_head_dim : int or None
        Upper bound of D, default :data:`MAX_HEAD_DIM`; None for no bound.

    Returns
    -------
    AttentionShape
    """
    check_array("q", q, ndim=4, dtypes=dtypes, layout="(B, Hq, Nq, D)")
    check_array("k", k, ndim=4, dtypes=dtypes, layout="(B, Hkv, Nk, D)")
    check_array("v", v, ndim=4, dtypes=dtypes, layout="(B, Hkv, Nk, D)")
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    B, Hq, Nq, D = qs
    _check_dims_positive("q", qs, ("batch size B", "query heads Hq", "query length Nq"))
    _check_head_dim("q", qs, D, max_head_dim)
    _check_kv_against_q(("k", "v"), "(B, Hkv, Nk, D)", "key length Nk", qs, ks, vs,
                        v_suffix=" (B, Hkv, Nk, D)")
    Hkv, Nk = ks[1], ks[2]
    if same_dtype:
        _check_same_dtypes(q, k=k, v=v)
    return AttentionShape(B, Hq, Hkv, Nq, Nk, D)


def check_attention_backward_inputs(do, q, k, v, o=None, lse=None, *,
                                    dtypes: Optional[Sequence] = FLOAT_DTYPES,
                                    lse_dtypes: Optional[Sequence] = (LSE_DTYPE,),
                                    same_dtype: bool = True,
                                    max_head_dim: Optional[int] = MAX_HEAD_DIM) -> AttentionShape:
    """Validate the inputs of an attention backward call.

    Parameters
    ----------
    do : array (B, Hq, Nq, D)
        Gradient of the output; same shape (and, with ``same_dtype``, dtype) as q.
    q, k, v : arrays
        As in :func:`check_attention_inputs`.
    o : array (B, Hq, Nq, D), optional
        Forward output; same shape (and dtype) as q.
    lse : array (B, Hq, Nq), optional
        Forward log-sum-exp; dtype in ``lse_dtypes`` (default float32 only).

    Returns
    -------
    AttentionShape
    """
    dims = check_attention_inputs(q, k, v, dtypes=dtypes, same_dtype=same_dtype,
                                  max_head_dim=max_head_dim)
    qs = _shape(q)
    for name, x in (("do", do), ("o", o)):
        if x is None and name == "o":
            continue
        check_array(name, x, ndim=4, dtypes=dtypes, layout="(B, Hq, Nq, D)")
        if _shape(x) != qs:
            raise ValueError(f"{name}: expected the same shape as q {qs}, got {_shape(x)}")
        if same_dtype:
            _check_same_dtype(name, x, "q", q)
    if lse is not None:
        check_array("lse", lse, ndim=3, dtypes=lse_dtypes, layout="(B, Hq, Nq)")
        if _shape(lse) != qs[:3]:
            raise ValueError(
                f"lse: expected shape (B, Hq, Nq) = {qs[:3]} matching q, got {_shape(lse)}"
            )
    return dims


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def normalize_causal(causal) -> Optional[str]:
    """Canonical causal mode: None, ``"top_left"`` or ``"bottom_right"``.

    ``None``/``False`` -> None (no causal mask); ``True`` -> :data:`CAUSAL_TRUE`
    (``"bottom_right"``, FlashAttention's convention); the two strings are returned as they are.
    Anything else (other strings, ints such as 1) is rejected.
    """
    if causal is None or causal is False or causal is np.False_:
        return None
    if causal is True or causal is np.True_:
        return CAUSAL_TRUE
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return causal
    allowed = "None, False, True (= 'bottom_right'), 'top_left' or 'bottom_right'"
    if isinstance(causal, str):
        raise ValueError(f"causal: expected {allowed}, got {causal!r}")
    raise TypeError(f"causal: expected {allowed}, got {describe(causal)}")


def normalize_window(window) -> Optional[Tuple[int, int]]:
    """Canonical sliding window: None or ``(left, right)`` Python ints, each ``>= -1``.

    ``-1`` (:data:`WINDOW_UNBOUNDED`) means unbounded on that side; ``(-1, -1)`` is no window
    and normalizes to None. A tuple or list of exactly two ints is accepted (numpy integers too;
    bools and floats are rejected).
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)):
        raise TypeError(
            f"window: expected None or a (left, right) pair of ints (-1 = unbounded), "
            f"got {describe(window)}"
        )
    if len(window) != 2:
        raise ValueError(
            f"window: expected a (left, right) pair of ints (-1 = unbounded), got "
            f"{len(window)} values {tuple(window)!r}"
        )
    out = []
    for side, value in zip(("left", "right"), window):
        if not _is_int(value):
            raise TypeError(f"window: {side} must be an int >= -1, got {describe(value)}")
        if value < WINDOW_UNBOUNDED:
            raise ValueError(
                f"window: {side} must be >= -1 (-1 = unbounded), got {int(value)}"
            )
        out.append(int(value))
    if out == [WINDOW_UNBOUNDED, WINDOW_UNBOUNDED]:
        return None
    return (out[0], out[1])


def check_lengths(name: str, lens, batch: int, upper: int, *,
                  upper_name: Optional[str] = None) -> Optional[np.ndarray]:
    """Validate per-sequence lengths (``q_lens``, ``kv_lens``, ``cache_lens``).

    Parameters
    ----------
    name : str
        Argument name used in error messages.
    lens : None, 1-D integer numpy array, integer torch tensor, or list/tuple of ints
        One length per sequence. Floats and bools are rejected (no silent cast).
    batch : int
        Required length B.
    upper : int
        Largest allowed value (values must lie in ``[0, upper]``).
    upper_name : str, optional
        Name of ``upper`` in messages, e.g. ``"Nk"``.

    Returns
    -------
    numpy.ndarray of int64, shape (B,), or None
        A fresh copy; None when ``lens`` is None.
    """
    if lens is None:
        return None
    if isinstance(lens, (list, tuple)):
        for idx, value in enumerate(lens):
            if not _is_int(value):
                raise TypeError(
                    f"{name}: expected integers, got {describe(value)} at index {idx}"
                )
        arr = np.array([int(x) for x in lens], dtype=object).reshape(len(lens))
    elif _is_array(lens):
        dname = dtype_name(lens)
        if dname not in _INT_DTYPE_NAMES:
            raise TypeError(f"{name}: expected an integer array, got dtype {dname}")
        if _is_torch_tensor(lens):
            lens = lens.detach().cpu().numpy()
        arr = lens
    else:
        raise TypeError(
            f"{name}: expected None, a 1-D integer array or a list of ints, got {describe(lens)}"
        )
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D array of length B={batch}, got shape {arr.shape}")
    if arr.shape[0] != batch:
        raise ValueError(
            f"{name}: expected length B={batch} (one per sequence), got length {arr.shape[0]}"
        )
    bad = np.flatnonzero((arr < 0) | (arr > upper))
    if bad.size:
        idx = int(bad[0])
        bound = f"{upper_name}={upper}" if upper_name else str(upper)
        raise ValueError(
            f"{name}: values must be in [0, {bound}], got {int(arr[idx])} at index {idx}"
        )
    return np.array(arr, dtype=np.int64, copy=True)


class Packing(NamedTuple):
    """Validated offsets of packed variable-length sequences (:func:`check_packing`): int32
    ``(S + 1,)`` copies, the kernels' inputs."""

    cu_q: np.ndarray
    cu_k: np.ndarray

    @property
    def num_seqs(self) -> int:
        return self.cu_q.shape[0] - 1


def check_cu_seqlens(name: str, cu, total: int, total_name: str) -> np.ndarray:
    """Validate the offsets ``cu`` of packed sequences: a 1-D int32 array (NumPy or torch) of
    length ``S + 1 >= 2``, ``cu[0] == 0``, non-decreasing (a sequence may be empty),
    ``cu[-1] == total`` (``total_name`` in messages). Returns an int32 copy."""
    if not _is_array(cu):
        raise TypeError(f"{name}: expected a 1-D int32 array of sequence offsets, got "
                        f"{describe(cu)}")
    dname = dtype_name(cu)
    if dname != "int32":
        raise TypeError(f"{name}: expected dtype int32 (the kernels' offsets, device data), got "
                        f"{dname}")
    if _is_torch_tensor(cu):
        cu = cu.detach().cpu().numpy()
    arr = np.asarray(cu)
    if arr.ndim != 1 or arr.shape[0] < 2:
        raise ValueError(f"{name}: expected shape (num_seqs + 1,) with num_seqs >= 1, got shape "
                         f"{arr.shape}")
    if int(arr[0]) != 0:
        raise ValueError(f"{name}: must start at 0, got {int(arr[0])}")
    drop = np.flatnonzero(np.diff(arr.astype(np.int64)) < 0)
    if drop.size:
        idx = int(drop[0]) + 1
        raise ValueError(f"{name}: offsets must be non-decreasing, got {int(arr[idx])} at index "
                         f"{idx} after {int(arr[idx - 1])}")
    if int(arr[-1]) != total:
        raise ValueError(f"{name}: must end at {total_name}={total}, got {int(arr[-1])}")
    return np.array(arr, dtype=np.int32, copy=True)


def check_packing(cu_seqlens_q, cu_seqlens_k, B: int, Nq: int, Nk: int) -> Optional[Packing]:
    """Validate packed-sequence offsets (both or neither given) against q ``(1, Hq, total_q,
    D)`` and k ``(1, Hkv, total_k, D)``; None when neither is given."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_q" if cu_seqlens_q is None else "cu_seqlens_k"
        raise ValueError(f"{missing}: packed sequences need both cu_seqlens_q and cu_seqlens_k, "
                         f"got only the other")
    if B != 1:
        raise ValueError(f"q: packed sequences (cu_seqlens_q given) take batch 1, q (1, Hq, "
                         f"total_q, D); got batch {B}")
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, Nq, "total_q")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, Nk, "total_k")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_k: expected the shape of cu_seqlens_q {cu_q.shape} (one "
                         f"offset per sequence boundary), got {cu_k.shape}")
    return Packing(cu_q, cu_k)


def check_scale(scale, D: int) -> float:
    """Softmax scale: ``1 / sqrt(D)`` when None, otherwise a finite real number (any sign).

    Parameters
    ----------
    scale : None, int or float (Python or NumPy)
        Bools, strings, complex numbers and arrays are rejected.
    D : int
        Head dimension, for the default.

    Returns
    -------
    float
    """
    if scale is None:
        return 1.0 / math.sqrt(D)
    is_real = isinstance(scale, (numbers.Real, np.floating, np.integer))
    if isinstance(scale, (bool, np.bool_)) or not is_real:
        raise TypeError(f"scale: expected None or a finite real number, got {describe(scale)}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite real number, got {value}")
    return value


class ScoreMods(NamedTuple):
    """Validated score modifiers of an attention call (all optional; see docs/semantics.md).

    Applied in this order to ``s = scale * q . k``: soft-capping ``c * tanh(s / c)``, then the
    ALiBi bias ``-slope_h * |i' - j|`` (i' = the query position aligned to the keys, as for the
    causal mask), then the visibility mask; the softmax denominator also counts
    ``exp(sink_h)`` (a learned attention sink that contributes no value).
    """

    softcap: Optional[float]  # c > 0, or None
    alibi_slopes: Optional[np.ndarray]  # float64 (B or 1, Hq), or None
    sinks: Optional[np.ndarray]  # float64 (Hq,), or None

    @property
    def any(self) -> bool:
        return self.softcap is not None or self.alibi_slopes is not None or self.sinks is not None


NO_SCORE_MODS = ScoreMods(None, None, None)


def _small_float_array(name: str, x, layout: str) -> np.ndarray:
    check_array(name, x, dtypes=REFERENCE_DTYPES, layout=layout)
    arr = np.asarray(x.detach().cpu().float().numpy() if _is_torch_tensor(x) else x,
                     dtype=np.float64)
    if not np.isfinite(arr).all():
        idx = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{name}: values must be finite, got {arr[idx]} at index {idx}")
    return arr


def check_score_mods(softcap, alibi_slopes, sinks, B: int, Hq: int) -> ScoreMods:
    """Validate the score modifiers of an attention call.

    Parameters
    ----------
    softcap : None or a finite real number > 0
        Logit soft-capping (Gemma 2): scores become ``c * tanh(s / c)``. 0 and None mean off.
    alibi_slopes : None or float array (Hq,) or (B, Hq)
        ALiBi slope per query head (and optionally per sequence), finite, any sign.
    sinks : None or float array (Hq,)
        Learned attention-sink logit per query head (gpt-oss), finite.
    B, Hq : int
        Batch size and query heads of the call.

    Returns
    -------
    ScoreMods
    """
    cap = None
    if softcap is not None:
        is_real = isinstance(softcap, (numbers.Real, np.floating, np.integer))
        if isinstance(softcap, (bool, np.bool_)) or not is_real:
            raise TypeError(f"softcap: expected None or a real number > 0, got {describe(softcap)}")
        value = float(softcap)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"softcap: expected a finite number > 0 (or 0/None for off), "
                             f"got {value}")
        cap = value if value > 0 else None
    slopes = None
    if alibi_slopes is not None:
        slopes = _small_float_array("alibi_slopes", alibi_slopes, "(Hq,) or (B, Hq)")
        if slopes.shape not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes: expected shape (Hq,) = ({Hq},) or (B, Hq) = "
                             f"({B}, {Hq}), got {slopes.shape}")
        slopes = slopes.reshape(-1, Hq)
    sink = None
    if sinks is not None:
        sink = _small_float_array("sinks", sinks, "(Hq,)")
        if sink.shape != (Hq,):
            raise ValueError(f"sinks: expected shape (Hq,) = ({Hq},), got {sink.shape}")
    return ScoreMods(cap, slopes, sink)


#: Largest dropout seed: seeds are non-negative int32 values (they travel to the device as an
#: int32 tensor).
MAX_DROPOUT_SEED = 2**31 - 1


def check_dropout(dropout_p, seed) -> Tuple[float, Optional[int]]:
    """Dropout probability and seed of an attention call.

    Parameters
    ----------
    dropout_p : int or float in [0, 1)
        Probability of zeroing each attention probability (kept ones are scaled by
        ``1 / (1 - dropout_p)``). 1 is refused: every probability would be dropped and the
        rescale is undefined (PyTorch returns zeros there; a caller who wants zeros should not
        call attention).
    seed : None or int in [0, 2**31 - 1]
        Generator seed; required when ``dropout_p > 0`` (the NumPy API has no global generator),
        A seed given with ``dropout_p == 0`` is accepted and has no effect.

    Returns
    -------
    (float, int or None)
    """
    is_real = isinstance(dropout_p, (numbers.Real, np.floating, np.integer))
    if isinstance(dropout_p, (bool, np.bool_)) or not is_real:
        raise TypeError(f"dropout_p: expected a real number in [0, 1), got {describe(dropout_p)}")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {p}")
    if seed is not None:
        seed = check_int("seed", seed, minimum=0, maximum=MAX_DROPOUT_SEED)
    elif p > 0.0:
        raise ValueError(
            f"seed: required when dropout_p > 0 (got dropout_p={p}); pass an int in "
            f"[0, {MAX_DROPOUT_SEED}] so the backward can regenerate the same mask"
        )
    return p, seed


# --------------------------------------------------------------------------------------------
# Decode, fused ops, merge
# --------------------------------------------------------------------------------------------


def check_tree_mask(tree_mask, T: int) -> Optional[np.ndarray]:
    """Validate a speculative-decoding tree mask: bool ``(T, T)`` with an all-True diagonal.

    ``tree_mask[t, u]`` says whether new token t sees new token u. Entries above the diagonal
    are taken as given (no triangularity is imposed). Returns a fresh NumPy bool copy, or None.
    """
    if tree_mask is None:
        return None
    check_array("tree_mask", tree_mask, ndim=2, dtypes=None, layout="(T, T)")
    if dtype_name(tree_mask) != "bool":
        raise TypeError(
            f"tree_mask: expected dtype bool, got {dtype_name(tree_mask)} "
            f"(no implicit cast; pass mask.astype(bool) or mask != 0)"
        )
    if _shape(tree_mask) != (T, T):
        raise ValueError(
            f"tree_mask: expected shape (T, T) = ({T}, {T}) matching q's T, got {_shape(tree_mask)}"
        )
    if _is_torch_tensor(tree_mask):
        tree_mask = tree_mask.detach().cpu().numpy()
    mask = np.array(tree_mask, dtype=bool, copy=True)
    missing = np.flatnonzero(~np.diagonal(mask))
    if missing.size:
        t = int(missing[0])
        raise ValueError(
            f"tree_mask: the diagonal must be all True (every new token sees itself), "
            f"got False at [{t}, {t}]"
        )
    return mask


def check_decode_inputs(q, k_cache, v_cache, cache_lens, tree_mask=None, *,
                        dtypes: Optional[Sequence] = FLOAT_DTYPES, same_dtype: bool = True,
                        max_head_dim: Optional[int] = MAX_HEAD_DIM,
                        max_new_tokens: Optional[int] = MAX_DECODE_TOKENS,
                        cache_dtypes: Optional[Sequence] = None) -> DecodeInputs:
    """Validate a decode call.

    Parameters
    ----------
    q : array (B, Hq, T, D)
        The T new tokens' queries, ``1 <= T <= max_new_tokens`` (default 128).
    k_cache, v_cache : arrays (B, Hkv, S_max, D)
        Same shape; ``Hq % Hkv == 0``; the cache already holds the new tokens.
    cache_lens : (B,) ints
        Valid cache length per sequence, ``T <= cache_lens[b] <= S_max``. Required.
    tree_mask : bool array (T, T), optional
        See :func:`check_tree_mask`.
    cache_dtypes : sequence of dtypes, optional
        The caches' allowed dtypes when they differ from q's (an FP8 cache,
        :func:`check_fp8_cache`: then K and V share one dtype); None: ``dtypes`` and, with
        ``same_dtype``, q's dtype.

    Returns
    -------
    DecodeInputs
    """
    check_array("q", q, ndim=4, dtypes=dtypes, layout="(B, Hq, T, D)")
    cd = dtypes if cache_dtypes is None else cache_dtypes
    check_array("k_cache", k_cache, ndim=4, dtypes=cd, layout="(B, Hkv, S_max, D)")
    check_array("v_cache", v_cache, ndim=4, dtypes=cd, layout="(B, Hkv, S_max, D)")
    qs, ks, vs = _shape(q), _shape(k_cache), _shape(v_cache)
    B, Hq, T, D = qs
    _check_dims_positive("q", qs, ("batch size B", "query heads Hq"))
    _check_new_tokens(qs, max_new_tokens)
    _check_head_dim("q", qs, D, max_head_dim)
    _check_kv_against_q(("k_cache", "v_cache"), "(B, Hkv, S_max, D)", "cache size S_max",
                        qs, ks, vs)
    Hkv, S_max = ks[1], ks[2]
    _check_cache_dtypes(q, k_cache, v_cache, same_dtype, cache_dtypes)
    lens = _check_cache_lens(cache_lens, B, T, S_max, "S_max")
    mask = check_tree_mask(tree_mask, T)
    return DecodeInputs(B, Hq, Hkv, T, S_max, D, lens, mask)


#: Every 8-bit float format a cache could be given in (any target's; NumPy/ml_dtypes names,
#: which torch's ``float8_e5m2`` / ``float8_e4m3fn`` share).
FP8_DTYPE_NAMES = ("float8_e4m3", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                   "float8_e5m2fnuz", "float8_e3m4", "float8_e8m0fnu")


def check_fp8_cache(k_cache, v_cache, formats: Sequence[str], target) -> Optional[str]:
    """The format of an FP8 KV cache, or None when ``k_cache`` is not an 8-bit float array.

    Parameters
    ----------
    k_cache, v_cache : arrays
    formats : sequence of str
        The 8-bit float formats the target defines for a cache
        (``nki_kernels.tiles.DECODE_FP8_CACHE_DTYPES``).
    target : str or None
        The target's name for the message (None: not known to the host).

    Raises
    ------
    TypeError
        ``k_cache`` is an 8-bit float format the target does not define (never cast), or
        ``v_cache`` is not in ``k_cache``'s format.
    """
    if not _is_array(k_cache) or dtype_name(k_cache) not in FP8_DTYPE_NAMES:
        return None
    name = dtype_name(k_cache)
    where = "this device (target unknown: set NEURON_PLATFORM_TARGET_OVERRIDE)" \
        if target is None else target
    if name not in formats:
        raise TypeError(f"k_cache: dtype {name} is not an FP8 KV-cache format of {where}; "
                        f"allowed there: {', '.join(formats)}")
    if not _is_array(v_cache) or dtype_name(v_cache) != name:
        got = dtype_name(v_cache) if _is_array(v_cache) else describe(v_cache)
        raise TypeError(f"v_cache: dtype {got} does not match k_cache's FP8 format {name}; an "
                        f"FP8 cache holds K and V in one format")
    return name


def check_kv_scales(k_scale, v_scale, Hkv: int, fp8: Optional[str],
                    cache_dtype: str) -> Optional[np.ndarray]:
    """The dequantization scales of an FP8 KV cache, per kv head: ``(Hkv, 2)`` float32
    ``(k_scale, v_scale)`` (None for a cache that is not FP8, which takes no scales).

    Parameters
    ----------
    k_scale, v_scale : real number, or array (Hkv,) (NumPy or torch)
        ``k = k_cache * k_scale[h]``, ``v = v_cache * v_scale[h]`` for kv head h (a number: the
        same for every head). Finite and > 0 as float32, the precision the kernel applies them
        in (a value float32 rounds to 0 or inf is an error, not a cast).
    Hkv : int
    fp8 : str or None
        The cache's FP8 format (:func:`check_fp8_cache`), None: not an FP8 cache.
    cache_dtype : str
        The cache's dtype name, for the messages.
    """
    given = (("k_scale", k_scale), ("v_scale", v_scale))
    if fp8 is None:
        for name, s in given:
            if s is not None:
                raise ValueError(f"{name}: only an FP8 cache takes scales; k_cache is "
                                 f"{cache_dtype}, got {name}={describe(s)}")
        return None
    cols = []
    for name, s in given:
        if s is None:
            raise ValueError(f"{name}: an FP8 cache (k_cache {fp8}) needs k_scale and v_scale "
                             f"(a number > 0, or one per kv head, shape ({Hkv},)); got None")
        if _is_array(s):
            check_array(name, s, dtypes=REFERENCE_DTYPES)
            if _shape(s) != (Hkv,):
                raise ValueError(f"{name}: expected a number or an array of shape ({Hkv},) "
                                 f"(one per kv head), got shape {_shape(s)}")
            arr = np.asarray(s.detach().cpu().double().numpy() if _is_torch_tensor(s) else s,
                             dtype=np.float64)
        elif isinstance(s, (numbers.Real, np.floating, np.integer)) and \
                not isinstance(s, (bool, np.bool_)):
            arr = np.full(Hkv, float(s))
        else:
            raise TypeError(f"{name}: expected a number > 0 or an array ({Hkv},), got "
                            f"{describe(s)}")
        f32 = arr.astype(np.float32)
        bad = ~(np.isfinite(f32) & (f32 > 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name}: scales must be finite and > 0 (in float32), got "
                             f"{float(arr[i])} for kv head {i}")
        cols.append(f32)
    return np.stack(cols, axis=1)


def check_paged_decode_inputs(q, k_cache, v_cache, cache_lens, block_table, tree_mask=None, *,
                              page_size_min: int = 1,
                              dtypes: Optional[Sequence] = FLOAT_DTYPES, same_dtype: bool = True,
                              max_head_dim: Optional[int] = MAX_HEAD_DIM,
                              max_new_tokens: Optional[int] = MAX_DECODE_TOKENS,
                              cache_dtypes: Optional[Sequence] = None
                              ) -> Tuple[DecodeInputs, PagedCache]:
    """Validate a decode call over a paged KV cache.

    Parameters
    ----------
    q : array (B, Hq, T, D)
        As in :func:`check_decode_inputs`.
    k_cache, v_cache : arrays (num_blocks, Hkv, page_size, D)
        Page pools of one shape; ``page_size`` a power of two >= ``page_size_min``.
    cache_lens : (B,) ints
        ``T <= cache_lens[b] <= max_blocks * page_size``. Required.
    block_table : integer array (B, max_blocks)
        Logical block i of sequence b is page ``block_table[b, i]``. The blocks a sequence uses,
        ``i < ceil(cache_lens[b] / page_size)``, must name pages in ``[0, num_blocks)``; entries
        past them are never read and may hold anything (e.g. -1). Pages may be shared.
    tree_mask : bool array (T, T), optional
    page_size_min : int
        Smallest allowed page (the kernels': ``tiles.DECODE_PAGE_SIZE_MIN``).
    cache_dtypes : sequence of dtypes, optional
        As in :func:`check_decode_inputs`.

    Returns
    -------
    (DecodeInputs, PagedCache)
        ``DecodeInputs.S_max`` is the logical capacity ``max_blocks * page_size``.
    """
    check_array("q", q, ndim=4, dtypes=dtypes, layout="(B, Hq, T, D)")
    layout = "(num_blocks, Hkv, page_size, D) (a page pool, since block_table is given)"
    cd = dtypes if cache_dtypes is None else cache_dtypes
    check_array("k_cache", k_cache, ndim=4, dtypes=cd, layout=layout)
    check_array("v_cache", v_cache, ndim=4, dtypes=cd, layout=layout)
    qs, ks, vs = _shape(q), _shape(k_cache), _shape(v_cache)
    B, Hq, T, D = qs
    _check_dims_positive("q", qs, ("batch size B", "query heads Hq"))
    _check_new_tokens(qs, max_new_tokens)
    _check_head_dim("q", qs, D, max_head_dim)
    if ks[3] != D:
        raise ValueError(
            f"k_cache: expected page pool shape (num_blocks, Hkv, page_size, D) with D={D} "
            f"matching q, got {ks}"
        )
    _check_dims_positive("k_cache", ks, ("num_blocks", "kv heads Hkv", "page_size"))
    if vs != ks:
        raise ValueError(f"v_cache: expected the same shape as k_cache {ks}, got {vs}")
    num_blocks, Hkv, page_size = ks[0], ks[1], ks[2]
    if page_size < page_size_min or page_size & (page_size - 1):
        raise ValueError(
            f"k_cache: page_size (dim 2) must be a power of two >= {page_size_min}, got "
            f"{page_size} (shape {ks})"
        )
    _check_gqa("k_cache", qs, ks)
    _check_cache_dtypes(q, k_cache, v_cache, same_dtype, cache_dtypes)
    if not _is_array(block_table):
        raise TypeError(
            f"block_table: expected a (B, max_blocks_per_seq) = ({B}, ...) integer numpy.ndarray "
            f"or torch.Tensor, got {describe(block_table)}"
        )
    bname = dtype_name(block_table)
    if bname not in _INT_DTYPE_NAMES:
        raise TypeError(
            f"block_table: expected an integer dtype (int32 or int64), got dtype {bname} (no "
            f"implicit cast)"
        )
    bs = _shape(block_table)
    if len(bs) != 2 or bs[0] != B or bs[1] < 1:
        raise ValueError(
            f"block_table: expected shape (B, max_blocks_per_seq) with B={B} matching q and "
            f"max_blocks_per_seq >= 1, got {bs}"
        )
    if _is_torch_tensor(block_table):
        block_table = block_table.detach().cpu().numpy()
    table = np.array(block_table, dtype=np.int64, copy=True)
    max_blocks = bs[1]
    capacity = max_blocks * page_size
    lens = _check_cache_lens(cache_lens, B, T, capacity, "max_blocks_per_seq * page_size")
    used = -(-lens // page_size)
    in_use = np.arange(max_blocks)[None, :] < used[:, None]
    bad = np.argwhere(in_use & ((table < 0) | (table >= num_blocks)))
    if bad.size:
        b, i = (int(x) for x in bad[0])
        raise ValueError(
            f"block_table: entry [{b}, {i}] = {int(table[b, i])} is not a page of k_cache; "
            f"sequence {b} uses blocks 0..{int(used[b]) - 1} (cache_lens[{b}]={int(lens[b])}, "
            f"page_size={page_size}), each must be in [0, num_blocks={num_blocks})"
        )
    # entries past a sequence's blocks are never read; kept as given when they fit in int32
    fits = (table >= np.iinfo(np.int32).min) & (table <= np.iinfo(np.int32).max)
    table = np.where(in_use | fits, table, -1).astype(np.int32)
    mask = check_tree_mask(tree_mask, T)
    return (DecodeInputs(B, Hq, Hkv, T, capacity, D, lens, mask),
            PagedCache(num_blocks, page_size, max_blocks, table))


def normalize_gelu_approximate(approximate) -> str:
    """``approximate`` of GELU: ``"none"`` (erf) or ``"tanh"``, as in torch.nn.functional.gelu."""
    if not isinstance(approximate, str):
        raise TypeError(f"approximate: expected 'none' or 'tanh', got {describe(approximate)}")
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return approximate


def check_linear_gelu_inputs(x, w, b, approximate: str = GELU_EXACT, *,
                             dtypes: Optional[Sequence] = FLOAT_DTYPES,
                             same_dtype: bool = True) -> LinearGeluShape:
    """Validate ``GELU(x @ w + b)``.

    Parameters
    ----------
    x : array (M, K)
    w : array (K, N)
    b : array (N,)
        Required (pass zeros for no bias).
    approximate : {"none", "tanh"}

    Returns
    -------
    LinearGeluShape
    """
    check_array("x", x, ndim=2, dtypes=dtypes, layout="(M, K)")
    check_array("w", w, ndim=2, dtypes=dtypes, layout="(K, N)")
    check_array("b", b, ndim=1, dtypes=dtypes, layout="(N,)")
    xs, ws, bs = _shape(x), _shape(w), _shape(b)
    _check_dims_positive("x", xs, ("rows M", "features K"))
    M, K = xs
    if ws[0] != K:
        raise ValueError(f"w: expected shape (K, N) with K={K} matching x's last dim, got {ws}")
    _check_dims_positive("w", ws, ("K", "output features N"))
    N = ws[1]
    if bs != (N,):
        raise ValueError(f"b: expected shape (N,) = ({N},) matching w's last dim, got {bs}")
    if same_dtype:
        _check_same_dtype("w", w, "x", x)
        _check_same_dtype("b", b, "x", x)
    return LinearGeluShape(M, K, N, normalize_gelu_approximate(approximate))


def check_softmax_input(x, *, dtypes: Optional[Sequence] = FLOAT_DTYPES) -> Tuple[int, int]:
    """Validate the input of the row softmax: a 2-D array ``(M, N)`` with ``M, N >= 1``.

    Returns
    -------
    (M, N)
    """
    check_array("x", x, ndim=2, dtypes=dtypes, layout="(M, N)")
    xs = _shape(x)
    _check_dims_positive("x", xs, ("rows M", "row length N"))
    return xs


def check_merge_inputs(o_parts, lse_parts, *, dtypes: Optional[Sequence] = REFERENCE_DTYPES,
                       check_values: bool = True) -> Tuple[int, ...]:
    """Validate partial attention results to be merged by log-sum-exp.

    Parameters
    ----------
    o_parts : array (S, ..., D)
        Normalized partial outputs of S splits.
    lse_parts : array (S, ...)
        Their log-sum-exps; shape ``o_parts.shape[:-1]``.
    check_values : bool
        Reject NaN and +inf in ``lse_parts`` (-inf marks an empty split and is allowed).

    Returns
    -------
    tuple
        ``o_parts.shape``.
    """
    check_array("o_parts", o_parts, dtypes=dtypes)
    check_array("lse_parts", lse_parts, dtypes=dtypes)
    os_, ls = _shape(o_parts), _shape(lse_parts)
    if len(os_) < 2:
        raise ValueError(
            f"o_parts: expected an array of shape (S, ..., D) with at least 2 dims, got shape {os_}"
        )
    if os_[0] < 1:
        raise ValueError(f"o_parts: the number of splits S must be >= 1, got shape {os_}")
    if ls != os_[:-1]:
        raise ValueError(
            f"lse_parts: expected shape {os_[:-1]} (o_parts' shape without its last dim), got {ls}"
        )
    if check_values:
        lse = lse_parts.detach().cpu().double().numpy() if _is_torch_tensor(lse_parts) else \
            np.asarray(lse_parts, dtype=np.float64)
        bad = np.argwhere(np.isnan(lse) | (lse == np.inf))
        if bad.size:
            where = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"lse_parts: values must be finite or -inf (an empty split), "
                f"got {lse[where]} at {where}"
            )
    return os_
