"""Float64 NumPy references: the truth every kernel of nki-flash is tested against.

Every function upcasts its floating-point inputs (float16, ml_dtypes.bfloat16, float32, float64;
NumPy arrays or torch tensors) to float64 and computes exactly what docs/semantics.md specifies,
in the plainest form (materialized score and probability matrices). Nothing here is tiled or
approximated, except :func:`attention_baseline_lowp` and
:func:`attention_backward_baseline_lowp`, which deliberately reproduce a *plain low-precision*
implementation for the tolerance rule of the tests.

Notation (all functions):

- q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)``, ``G = Hq // Hkv`` query heads per kv head;
  query head ``h`` reads kv head ``h // G``.
- ``S = scale * q @ k^T`` ``(B, Hq, Nq, Nk)``; ``M`` the visibility mask (True = visible) from
  :func:`attention_mask`; ``P = softmax(S where M else -inf)`` row-wise;
  ``o = P @ v``; ``lse = log(sum_j exp(S_ij) over visible j)`` (natural log).
- A row with no visible key has ``P = 0``, ``o = 0`` and ``lse = -inf`` (never NaN, no warning).

Also here: the LSE merge of split results, GELU(x @ w + b), softmax, the paged-cache conversions
(:func:`paged_to_contiguous`, :func:`contiguous_to_paged`), the error/tolerance helpers of the
tests and the HBM IO-count formulas used by tests and the CLI.
"""
from __future__ import annotations

import math
from typing import Tuple

import ml_dtypes
import numpy as np

from host import block_sparse as _bs
from host.validation import (
    CAUSAL_TOP_LEFT,
    FLOAT_DTYPES,
    GELU_EXACT,
    GELU_TANH,
    LSE_DTYPE,
    REFERENCE_DTYPES,
    WINDOW_UNBOUNDED,
    NO_SCORE_MODS,
    ScoreMods,
    check_array,
    check_attention_backward_inputs,
    check_attention_inputs,
    check_decode_inputs,
    check_dropout,
    check_int,
    check_lengths,
    check_linear_gelu_inputs,
    check_merge_inputs,
    check_paged_decode_inputs,
    check_scale,
    check_score_mods,
    check_softmax_input,
    check_tree_mask,
    describe,
    normalize_causal,
    normalize_dtype,
    normalize_gelu_approximate,
    normalize_window,
)

# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

#: Factor of the tolerance rule: a kernel may err at most this many times the plain
#: low-precision implementation (FlashAttention's test rule; docs/semantics.md).
TOLERANCE_FACTOR = 2.0
#: Absolute floor of the tolerance when the matmul operand precision is float32.
ATOL_FLOOR_FP32 = 1e-5
#: Absolute floor of the tolerance when the matmul operand precision is bf16 or fp16.
ATOL_FLOOR_LOWP = 1e-3

#: Bytes of one LSE element in HBM (LSE is always float32).
LSE_ITEMSIZE = LSE_DTYPE.itemsize

#: Coefficient of the cubic term in the tanh approximation of GELU.
GELU_TANH_CUBIC = 0.044715
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_2 = math.sqrt(2.0)
_erf = np.frompyfunc(math.erf, 1, 1)


# --------------------------------------------------------------------------------------------
# Conversion helpers
# --------------------------------------------------------------------------------------------


def _f64(x) -> np.ndarray:
    """Upcast a NumPy array or torch tensor of any float dtype to a float64 NumPy array (exact)."""
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _expand_kv(x: np.ndarray, group: int) -> np.ndarray:
    """(B, Hkv, N, D) -> (B, Hkv * group, N, D) with query head h reading kv head h // group."""
    return np.repeat(x, group, axis=1)


def _sum_groups(x: np.ndarray, Hkv: int) -> np.ndarray:
    """(B, Hq, N, D) -> (B, Hkv, N, D): sum the gradients of the query heads of each kv group."""
    B, Hq, N, D = x.shape
    return x.reshape(B, Hkv, Hq // Hkv, N, D).sum(axis=2)


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------


def _infer_batch(*lens) -> int:
    """Batch size implied by the first 1-D lengths argument given (1 if none is)."""
    for x in lens:
        if x is not None and np.ndim(x) == 1:
            return len(x)
    return 1


def attention_mask(nq, nk, *, batch=None, causal=None, window=None, q_lens=None,
                   kv_lens=None, rows=None) -> np.ndarray:
    """Visibility mask of prefill attention (True = key j is visible to query i).

    Parameters
    ----------
    nq, nk : int
        Padded query and key lengths Nq, Nk (>= 1).
    batch : int, optional
        Batch size B. Default: the length of ``q_lens``/``kv_lens`` when given, else 1.
    causal : None, False, True, "top_left" or "bottom_right"
        ``True`` means ``"bottom_right"``.
    window : None or (left, right)
        Sliding window; -1 = unbounded on that side.
    q_lens, kv_lens : (B,) ints, optional
        Valid query / key lengths per sequence, in ``[0, Nq]`` / ``[0, Nk]``.
    rows : 1-D ints in [0, Nq), optional
        Only these query rows (a sampled check of a long sequence); default all.

    Returns
    -------
    numpy.ndarray of bool, shape (B, Nq, Nk) (or (B, len(rows), Nk))

    Notes
    -----
    With ``nq_b = q_lens[b]`` (or Nq), ``nk_b = kv_lens[b]`` (or Nk) and the alignment offset
    ``off = 0`` for top_left, ``nk_b - nq_b`` otherwise (bottom_right, and a window without a
    causal mask), key j is visible to query i iff all of:

    - ``i < nq_b`` and ``j < nk_b``;
    - causal: ``j <= i + off``;
    - window ``(left, right)``: ``j >= i + off - left`` unless left = -1, and
      ``j <= i + off + right`` unless right = -1 (with a causal mask the causal bound also
      applies, so the effective right bound is ``min(right, 0)``).
    """
    nq = check_int("nq", nq, minimum=1)
    nk = check_int("nk", nk, minimum=1)
    causal = normalize_causal(causal)
    window = normalize_window(window)
    if batch is None:
        batch = _infer_batch(q_lens, kv_lens)
    batch = check_int("batch", batch, minimum=1)
    q_valid = check_lengths("q_lens", q_lens, batch, nq, upper_name="Nq")
    k_valid = check_lengths("kv_lens", kv_lens, batch, nk, upper_name="Nk")
    q_valid = np.full(batch, nq, np.int64) if q_valid is None else q_valid
    k_valid = np.full(batch, nk, np.int64) if k_valid is None else k_valid

    i = _rows(rows, nq).reshape(1, -1, 1)
    j = np.arange(nk).reshape(1, 1, nk)
    nq_b = q_valid.reshape(batch, 1, 1)
    nk_b = k_valid.reshape(batch, 1, 1)
    off = np.zeros_like(nq_b) if causal == CAUSAL_TOP_LEFT else nk_b - nq_b
    diag = i + off  # the key aligned with query i

    visible = (i < nq_b) & (j < nk_b)
    if causal is not None:
        visible = visible & (j <= diag)
    if window is not None:
        left, right = window
        if left != WINDOW_UNBOUNDED:
            visible = visible & (j >= diag - left)
        if right != WINDOW_UNBOUNDED:
            visible = visible & (j <= diag + right)
    return np.broadcast_to(visible, (batch, i.shape[1], nk)).copy()


def _rows(rows, nq: int) -> np.ndarray:
    """Validated query-row subset (int64), or every row."""
    if rows is None:
        return np.arange(nq)
    arr = np.asarray(rows)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ValueError(f"rows: expected a non-empty 1-D integer array, got {describe(rows)}")
    if arr.min() < 0 or arr.max() >= nq:
        raise ValueError(f"rows: values must be in [0, Nq={nq}), got {int(arr.min())}.."
                         f"{int(arr.max())}")
    return arr.astype(np.int64)


def decode_mask(T, cache_len, S_max, tree_mask=None) -> np.ndarray:
    """Visibility mask of one sequence in decode (True = new token t sees cache position j).

    Parameters
    ----------
    T : int
        Number of new tokens (>= 1).
    cache_len : int
        Valid cache length, ``T <= cache_len <= S_max``; the new tokens sit at positions
        ``cache_len - T .. cache_len - 1``.
    S_max : int
        Cache capacity.
    tree_mask : bool array (T, T), optional
        ``tree_mask[t, u]``: new token t sees new token u (speculative decoding). Its diagonal
        must be True. Default: causal among the new tokens (``u <= t``).

    Returns
    -------
    numpy.ndarray of bool, shape (T, S_max)
        Row t is True at every committed position ``j < cache_len - T`` and at new position
        ``cache_len - T + u`` when ``u <= t`` (or ``tree_mask[t, u]``); False from ``cache_len`` on.
    """
    T = check_int("T", T, minimum=1)
    S_max = check_int("S_max", S_max, minimum=1)
    cache_len = check_int("cache_len", cache_len, minimum=T, maximum=S_max)
    among_new = check_tree_mask(tree_mask, T)
    if among_new is None:
        among_new = np.tril(np.ones((T, T), dtype=bool))
    committed = cache_len - T
    mask = np.zeros((T, S_max), dtype=bool)
    mask[:, :committed] = True
    mask[:, committed:cache_len] = among_new
    return mask


# --------------------------------------------------------------------------------------------
# Attention core
# --------------------------------------------------------------------------------------------


def _masked_softmax(s: np.ndarray, mask: np.ndarray, sink=None) -> Tuple[np.ndarray, np.ndarray]:
    """Row softmax of ``s`` over visible entries, in ``s``'s float dtype.

    Returns ``(p, lse)``; rows with no visible entry get ``p = 0`` and ``lse = -inf``, without
    NaN or floating-point warnings (masked entries never reach ``exp``). ``sink`` (broadcast to
    ``s[..., :1]``) adds ``exp(sink)`` to every row's denominator: an attention sink, a logit
    that takes probability mass but has no value; then a row without visible keys has
    ``p = 0`` and ``lse = sink``.
    """
    neg_inf = s.dtype.type(-np.inf)
    s_vis = np.where(mask, s, neg_inf)
    m = s_vis.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    # A row "has a key" when some entry is visible and its max is not -inf; a NaN or +inf
    # max keeps the row live so that non-finite inputs propagate as NaN instead of vanishing.
    has_key = np.any(mask, axis=-1, keepdims=True) & ~np.isneginf(m)
    if sink is not None:
        has_key = has_key | np.isfinite(m)
    m_safe = np.where(has_key, m, 0)
    e = np.exp(np.where(mask, s_vis - m_safe, neg_inf))
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(np.where(has_key, sink - m_safe, neg_inf))
    l_safe = np.where(has_key, l, 1)
    p = e / l_safe
    lse = np.where(has_key, m_safe + np.log(l_safe), neg_inf)[..., 0]
    return p, lse


def _query_positions(dims, causal, q_lens, kv_lens) -> np.ndarray:
    """(B, 1, Nq, 1) key-aligned position i' of every query (the diagonal of the causal mask:
    ``i`` for top_left, ``i + kv_len - q_len`` otherwise)."""
    causal = normalize_causal(causal)
    q_valid = check_lengths("q_lens", q_lens, dims.B, dims.Nq, upper_name="Nq")
    k_valid = check_lengths("kv_lens", kv_lens, dims.B, dims.Nk, upper_name="Nk")
    nq_b = np.full(dims.B, dims.Nq) if q_valid is None else q_valid
    nk_b = np.full(dims.B, dims.Nk) if k_valid is None else k_valid
    off = np.zeros(dims.B) if causal == CAUSAL_TOP_LEFT else (nk_b - nq_b)
    return (np.arange(dims.Nq)[None, :] + off[:, None]).astype(np.float64)[:, None, :, None]


def _modify_scores(s: np.ndarray, mods: ScoreMods, qpos: np.ndarray):
    """Soft-capping then the ALiBi bias on scaled scores ``s`` (B, Hq, Nq, Nk).

    Returns ``(s', dcap)`` where ``dcap = ds'/ds`` of the soft-cap (``1 - tanh^2(s / c)``), or
    None without soft-capping. ``qpos`` is the (B, 1, Nq, 1) aligned query position.
    """
    dcap = None
    if mods.softcap is not None:
        t = np.tanh(s / mods.softcap)
        s = mods.softcap * t
        dcap = 1.0 - t * t
    if mods.alibi_slopes is not None:
        kpos = np.arange(s.shape[-1], dtype=np.float64)
        slopes = mods.alibi_slopes[:, :, None, None]
        s = s - slopes * np.abs(qpos - kpos)
    return s, dcap


def _sink(mods: ScoreMods):
    return None if mods.sinks is None else mods.sinks[None, :, None, None]


def _prefill_masks(dims, causal, window, q_lens, kv_lens, block_mask=None,
                   rows=None) -> np.ndarray:
    """(B, 1 or Hq, Nq, Nk) visibility mask for a validated attention call (only ``rows`` of
    the queries when given); a block-sparse pattern (see :mod:`host.block_sparse`) removes the
    keys of its inactive blocks."""
    mask = attention_mask(dims.Nq, dims.Nk, batch=dims.B, causal=causal, window=window,
                          q_lens=q_lens, kv_lens=kv_lens, rows=rows)[:, None]
    sparsity = _bs.check_block_mask(block_mask, dims.B, dims.Hq, dims.Nq, dims.Nk)
    if sparsity is not None:
        mask = mask & np.take(_bs.expand(sparsity.dense, dims.Nq, dims.Nk),
                              _rows(rows, dims.Nq), axis=-2)
    return mask


def _dropout_factor(dims, dropout_p, dropout_mask):
    """``Z / (1 - p)`` as float64 ``(B, Hq, Nq, Nk)`` (Z = the keep mask), or None without
    dropout.

    The references take the keep mask the kernel used (its debug output): the hardware's
    generator is not reproduced here, only its effect.
    """
    p, _ = check_dropout(dropout_p, 0)  # the reference needs no seed: it takes the mask
    if dropout_mask is None:
        if p > 0.0:
            raise ValueError(
                f"dropout_mask: required when dropout_p > 0 (got dropout_p={p}): the reference "
                "applies exactly the keep mask the kernel used"
            )
        return None
    want = (dims.B, dims.Hq, dims.Nq, dims.Nk)
    check_array("dropout_mask", dropout_mask, ndim=4, dtypes=(np.dtype(bool),),
                layout="(B, Hq, Nq, Nk)")
    if tuple(dropout_mask.shape) != want:
        raise ValueError(
            f"dropout_mask: expected shape (B, Hq, Nq, Nk) = {want}, got "
            f"{tuple(dropout_mask.shape)}"
        )
    keep = np.asarray(_f64(dropout_mask))
    return keep / (1.0 - p)


def _scores(q: np.ndarray, k_exp: np.ndarray, scale: float) -> np.ndarray:
    return scale * np.einsum("bhid,bhjd->bhij", q, k_exp)


def attention_forward(q, k, v, *, scale=None, causal=None, window=None, q_lens=None,
                      kv_lens=None, block_mask=None, dropout_p=0.0, dropout_mask=None,
                      softcap=None, alibi_slopes=None, sinks=None, rows=None
                      ) -> Tuple[np.ndarray, np.ndarray]:
    """Exact attention forward in float64.

    Parameters
    ----------
    q : array (B, Hq, Nq, D)
    k, v : arrays (B, Hkv, Nk, D), ``Hq % Hkv == 0``
        Any float dtype (mixed dtypes allowed); upcast to float64.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    causal, window, q_lens, kv_lens :
        As in :func:`attention_mask`.
    block_mask : optional
        A block-sparse pattern (:func:`host.block_sparse.check_block_mask`): keys of inactive
        128 x 128 blocks are not visible.
    dropout_p : float in [0, 1)
        Dropout probability; with ``dropout_p > 0`` (or a mask given) ``o`` uses the dropped
        probabilities ``P * Z / (1 - p)`` while ``lse`` stays that of the undropped softmax
        (FlashAttention appendix, Algorithm 2).
    dropout_mask : bool array (B, Hq, Nq, Nk), optional
        The keep mask Z (True = kept); required when ``dropout_p > 0``.
    softcap, alibi_slopes, sinks : optional
        Score modifiers (:func:`host.validation.check_score_mods`). With sinks, a row without
        visible keys has ``o = 0`` and ``lse = sink``; a padding row (past its ``q_lens``) keeps
        ``lse = -inf``.
    rows : 1-D ints, optional
        Compute only these query rows (outputs ``(B, Hq, len(rows), ...)``): an exact check of
        a sample of a sequence too long for the full score matrix.

    Returns
    -------
    o : float64 (B, Hq, Nq, D)
        ``o_i = sum_j P_ij v_j`` with ``P = softmax_j(scale * q_i . k_j)`` over visible j;
        0 for rows without a visible key.
    lse : float64 (B, Hq, Nq)
        ``log sum_j exp(scale * q_i . k_j)`` over visible j; -inf for rows without one.
    """
    dims = check_attention_inputs(q, k, v, dtypes=REFERENCE_DTYPES, same_dtype=False,
                                  max_head_dim=None)
    scale = check_scale(scale, dims.D)
    mask = _prefill_masks(dims, causal, window, q_lens, kv_lens, block_mask, rows)
    drop = _dropout_factor(dims, dropout_p, dropout_mask)
    mods = check_score_mods(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
    q64, k64, v64 = _f64(q), _expand_kv(_f64(k), dims.group), _expand_kv(_f64(v), dims.group)
    qpos = _query_positions(dims, causal, q_lens, kv_lens)
    if rows is not None:    # np.take keeps C order (fancy indexing would not)
        sel = _rows(rows, dims.Nq)
        q64, qpos = np.take(q64, sel, axis=2), np.take(qpos, sel, axis=2)
        drop = None if drop is None else np.take(drop, sel, axis=2)
    s, _ = _modify_scores(_scores(q64, k64, scale), mods, qpos)
    p, lse = _masked_softmax(s, mask, _sink(mods))
    if mods.sinks is not None and q_lens is not None:
        # a padding query row is not a row: lse = -inf as without sinks
        pad = np.arange(dims.Nq)[None, :] >= np.asarray(q_lens, dtype=np.int64)[:, None]
        lse = np.where(np.take(pad, _rows(rows, dims.Nq), axis=1)[:, None, :], -np.inf, lse)
    if drop is not None:
        p = p * drop
    return p @ v64, lse


def _varlen_rows(cu_seqlens_q, cu_seqlens_k):
    """``(seq, cu_k)``: each packed row's sequence, the last one starting at or before it
    (empty sequences start where the next one does), and the key offsets as int64."""
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    return (np.searchsorted(cu_q, np.arange(cu_q[-1]), side="right") - 1,
            np.asarray(cu_seqlens_k, dtype=np.int64))


def varlen_diagonal(cu_seqlens_q, cu_seqlens_k, causal=None) -> np.ndarray:
    """int64 ``(total_q,)``: the packed key aligned with each packed row, ``i + off`` with the
    row's sequence's alignment (bottom_right, also without causal: ``off = cu_k[s+1] -
    cu_q[s+1]``; top_left: ``cu_k[s] - cu_q[s]``) -- the diagonal of its band and the origin
    of its ALiBi distances."""
    seq, cu_k = _varlen_rows(cu_seqlens_q, cu_seqlens_k)
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    i = np.arange(cu_q[-1])
    if normalize_causal(causal) == CAUSAL_TOP_LEFT:
        return i - cu_q[seq] + cu_k[seq]
    return i - cu_q[seq + 1] + cu_k[seq + 1]


def varlen_mask(cu_seqlens_q, cu_seqlens_k, *, causal=None, window=None) -> np.ndarray:
    """Visibility mask ``(total_q, total_k)`` of packed sequences (True = key j visible to
    query i): sequence s owns rows ``[cu_q[s], cu_q[s+1])`` and keys ``[cu_k[s], cu_k[s+1])``
    (offsets as validated by :func:`host.validation.check_cu_seqlens`); each row sees only its
    own sequence's keys, where :func:`attention_mask`'s causal and window rules apply with the
    sequence's own lengths (bottom_right: ``off = nk_s - nq_s``; top_left: 0)."""
    window = normalize_window(window)
    seq, cu_k = _varlen_rows(cu_seqlens_q, cu_seqlens_k)
    j = np.arange(cu_k[-1])[None, :]
    k0, k1 = cu_k[seq][:, None], cu_k[seq + 1][:, None]
    diag = varlen_diagonal(cu_seqlens_q, cu_seqlens_k, causal)[:, None]
    causal = normalize_causal(causal)
    visible = (j >= k0) & (j < k1)
    if causal is not None:
        visible &= j <= diag
    if window is not None:
        left, right = window
        if left != WINDOW_UNBOUNDED:
            visible &= j >= diag - left
        if right != WINDOW_UNBOUNDED:
            visible &= j <= diag + right
    return visible


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=None,
                             window=None, softcap=None, alibi_slopes=None, sinks=None
                             ) -> Tuple[np.ndarray, np.ndarray]:
    """Exact attention forward of packed sequences in float64: q ``(1, Hq, total_q, D)``, k, v
    ``(1, Hkv, total_k, D)``, the offsets ``(S + 1,)``; the mask of :func:`varlen_mask`; the
    score modifiers ``softcap``, ``alibi_slopes`` ``(Hq,)`` and ``sinks`` ``(Hq,)`` as
    :func:`attention_forward`'s, per sequence (ALiBi's distance ``|j - diag_i|`` from the
    row's aligned key, :func:`varlen_diagonal`). Returns ``o`` float64 ``(1, Hq, total_q,
    D)`` (0 for rows without a visible key) and ``lse`` float64 ``(1, Hq, total_q)`` (-inf
    there; with sinks the head's sink)."""
    dims = check_attention_inputs(q, k, v, dtypes=REFERENCE_DTYPES, same_dtype=False,
                                  max_head_dim=None)
    scale = check_scale(scale, dims.D)
    mods = check_score_mods(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
    mask = varlen_mask(cu_seqlens_q, cu_seqlens_k, causal=causal, window=window)
    q64, k64, v64 = _f64(q), _expand_kv(_f64(k), dims.group), _expand_kv(_f64(v), dims.group)
    qpos = varlen_diagonal(cu_seqlens_q, cu_seqlens_k, causal)[None, None, :, None]
    s, _ = _modify_scores(_scores(q64, k64, scale), mods, qpos)
    p, lse = _masked_softmax(s, mask[None, None], _sink(mods))
    return p @ v64, lse


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """``(query rows, keys)`` slices of the packed sequences with both."""
    for s in range(len(cu_seqlens_q) - 1):
        rq = slice(int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]))
        rk = slice(int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1]))
        if rq.stop > rq.start and rk.stop > rk.start:
            yield rq, rk


def per_sequence(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """``(o, lse)`` float64 of a dense attention ``fn(q_s, k_s, v_s, **kwargs) -> (o, lse)``
    (:func:`attention_forward`, :func:`attention_baseline_lowp` with ``return_lse``) run on
    each packed sequence alone and packed back (q ``(1, Hq, total_q, D)``, k, v ``(1, Hkv,
    total_k, D)``); rows of a sequence without keys get ``(0, -inf)`` (with ``sinks`` in
    kwargs ``(0, sink)``: the sink is their only logit)."""
    o = np.zeros(q.shape, np.float64)
    sinks = kwargs.get("sinks")
    lse = np.full(q.shape[:3], -np.inf)
    if sinks is not None:
        lse[:] = np.asarray(sinks, np.float64)[None, :, None]
    for rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        o[:, :, rq], lse[:, :, rq] = fn(q[:, :, rq], k[:, :, rk], v[:, :, rk], **kwargs)
    return o, lse


def per_sequence_grads(fn, do, q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """``(dq, dk, dv)`` float64 of a dense attention backward ``fn(do_s, q_s, k_s, v_s,
    **kwargs)`` (:func:`attention_backward`, :func:`attention_backward_baseline_lowp`) run on
    each packed sequence alone and packed back (layouts of :func:`per_sequence`); rows and
    keys of sequences without keys or query rows get zeros. With ``sinks`` in kwargs also
    ``dsinks`` ``(Hq,)``, summed over the sequences (a row without keys has ``o = 0``: no
    share)."""
    dq = np.zeros(q.shape, np.float64)
    dk = np.zeros(k.shape, np.float64)
    dv = np.zeros(v.shape, np.float64)
    with_sinks = kwargs.get("sinks") is not None
    dsinks = np.zeros(q.shape[1], np.float64)
    for rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        out = fn(do[:, :, rq], q[:, :, rq], k[:, :, rk], v[:, :, rk], **kwargs)
        dq[:, :, rq], dk[:, :, rk], dv[:, :, rk] = out[:3]
        if with_sinks:
            dsinks += out[3]
    return (dq, dk, dv, dsinks) if with_sinks else (dq, dk, dv)


def _backward_from_p(p, do, q64, k64, v64, delta, scale, Hkv, drop=None, dcap=None):
    """Gradients of sum(o * do) given the probabilities P and ``delta_i = rowsum(dP_i * P_i)``.

    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``; dK and dV are summed over the query heads of each kv group. With
    dropout (``drop = Z / (1 - p)``, appendix Algorithm 4) ``dV = (P * drop)^T dO`` and
    ``dP = (dO V^T) * drop``; ``delta = rowsum(dO * O)`` with the dropped output O. With
    soft-capping, dS is multiplied by ``dcap = 1 - tanh^2(s / c)`` (the cap's derivative).
    """
    dv = np.swapaxes(p if drop is None else p * drop, -1, -2) @ do
    dp = do @ np.swapaxes(v64, -1, -2)
    if drop is not None:
        dp = dp * drop
    ds = p * (dp - delta[..., None])
    if dcap is not None:
        ds = ds * dcap
    dq = scale * (ds @ k64)
    dk = scale * (np.swapaxes(ds, -1, -2) @ q64)
    return dq, _sum_groups(dk, Hkv), _sum_groups(dv, Hkv)


def attention_backward(do, q, k, v, *, scale=None, causal=None, window=None, q_lens=None,
                       kv_lens=None, block_mask=None, dropout_p=0.0, dropout_mask=None,
                       softcap=None, alibi_slopes=None, sinks=None) -> Tuple[np.ndarray, ...]:
    """Exact gradients of ``sum(o * do)`` with respect to q, k, v, in float64.

    P is recomputed exactly from q and k (no saved statistics are used).

    Parameters
    ----------
    do : array (B, Hq, Nq, D)
        Gradient of the output.
    q, k, v, scale, causal, window, q_lens, kv_lens, block_mask, dropout_p, dropout_mask,
    softcap, alibi_slopes, sinks :
        As in :func:`attention_forward`.

    Returns
    -------
    dq : float64 (B, Hq, Nq, D)
    dk, dv : float64 (B, Hkv, Nk, D)
        Summed over the ``Hq // Hkv`` query heads of each kv group.
    dsinks : float64 (Hq,), only when ``sinks`` is given
        ``-sum_{b,i} exp(sink_h - lse_i) * delta_i``: a sink's probability times the row's
        ``-delta`` (the sink has no value, so its dP is 0).

    Notes
    -----
    ``dP = do v^T``, ``delta_i = sum_j P_ij dP_ij`` (= ``rowsum(do_i * o_i)``),
    ``dS = P * (dP - delta)``, ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T do``.
    Masked entries have ``P = 0``, so rows without a visible key (and rows past ``q_lens``)
    contribute nothing and get ``dq = 0``.
    """
    dims = check_attention_backward_inputs(do, q, k, v, dtypes=REFERENCE_DTYPES,
                                           same_dtype=False, max_head_dim=None)
    scale = check_scale(scale, dims.D)
    mask = _prefill_masks(dims, causal, window, q_lens, kv_lens, block_mask)
    drop = _dropout_factor(dims, dropout_p, dropout_mask)
    mods = check_score_mods(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
    q64, do64 = _f64(q), _f64(do)
    k64, v64 = _expand_kv(_f64(k), dims.group), _expand_kv(_f64(v), dims.group)
    s, dcap = _modify_scores(_scores(q64, k64, scale), mods,
                             _query_positions(dims, causal, q_lens, kv_lens))
    p, lse = _masked_softmax(s, mask, _sink(mods))
    dp = do64 @ np.swapaxes(v64, -1, -2)
    delta = np.sum(p * (dp if drop is None else dp * drop), axis=-1)
    grads = _backward_from_p(p, do64, q64, k64, v64, delta, scale, dims.Hkv, drop, dcap)
    return grads + _sink_grad(mods, lse, delta)


def _sink_grad(mods: ScoreMods, lse, delta) -> tuple:
    """``(dsinks,)`` when the call has sinks, else ``()``."""
    if mods.sinks is None:
        return ()
    live = np.isfinite(lse)
    p_sink = np.exp(np.where(live, _sink(mods)[..., 0] - np.where(live, lse, 0.0), -np.inf))
    return (-np.sum(p_sink * delta, axis=(0, 2)),)


def attention_backward_from_lse(do, q, k, v, o, lse, *, scale=None, causal=None, window=None,
                                q_lens=None, kv_lens=None, block_mask=None, dropout_p=0.0,
                                dropout_mask=None, softcap=None, alibi_slopes=None, sinks=None
                                ) -> Tuple[np.ndarray, ...]:
    """Attention gradients the way the flash backward computes them, from a given o and lse.

    Parameters
    ----------
    do, q, k, v : arrays
        As in :func:`attention_backward`.
    o : array (B, Hq, Nq, D)
        Forward output (e.g. a kernel's).
    lse : array (B, Hq, Nq)
        Forward log-sum-exp (natural log; e.g. a kernel's float32 LSE).
    scale, causal, window, q_lens, kv_lens, block_mask, dropout_p, dropout_mask, softcap,
    alibi_slopes, sinks :
        As in :func:`attention_forward` (with sinks, ``lse`` includes the sink's term).

    Returns
    -------
    dq, dk, dv (, dsinks) : float64
        As in :func:`attention_backward`.

    Notes
    -----
    ``delta_i = rowsum(do_i * o_i)`` and ``P_ij = exp(scale q_i . k_j - lse_i)`` for visible j,
    0 otherwise; rows with ``lse = -inf`` have ``P = 0`` and contribute nothing. With the
    exact o and lse this equals :func:`attention_backward`; with a kernel's o and lse it
    isolates the kernel's backward from the error of its forward statistics.
    """
    dims = check_attention_backward_inputs(do, q, k, v, o, lse, dtypes=REFERENCE_DTYPES,
                                           lse_dtypes=REFERENCE_DTYPES, same_dtype=False,
                                           max_head_dim=None)
    scale = check_scale(scale, dims.D)
    mask = _prefill_masks(dims, causal, window, q_lens, kv_lens, block_mask)
    drop = _dropout_factor(dims, dropout_p, dropout_mask)
    mods = check_score_mods(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
    q64, do64, o64, lse64 = _f64(q), _f64(do), _f64(o), _f64(lse)
    k64, v64 = _expand_kv(_f64(k), dims.group), _expand_kv(_f64(v), dims.group)
    row_ok = np.isfinite(lse64)[..., None]
    live = mask & row_ok
    lse_safe = np.where(row_ok, lse64[..., None], 0.0)
    s, dcap = _modify_scores(_scores(q64, k64, scale), mods,
                             _query_positions(dims, causal, q_lens, kv_lens))
    p = np.exp(np.where(live, s - lse_safe, -np.inf))
    delta = np.sum(do64 * o64, axis=-1)
    grads = _backward_from_p(p, do64, q64, k64, v64, delta, scale, dims.Hkv, drop, dcap)
    return grads + _sink_grad(mods, lse64, delta)


# --------------------------------------------------------------------------------------------
# Decode and merge
# --------------------------------------------------------------------------------------------


def paged_to_contiguous(k_pages, block_table, cache_lens) -> np.ndarray:
    """The contiguous cache ``(B, Hkv, max_blocks * page_size, D)`` a paged one stands for.

    Logical position p of sequence b is offset ``p % page_size`` of page
    ``block_table[b, p // page_size]`` of ``k_pages (num_blocks, Hkv, page_size, D)``. Only the
    blocks a sequence uses (``i < ceil(cache_lens[b] / page_size)``) are copied; the rest is 0.
    Keeps ``k_pages``' dtype. Inputs are not validated (see :func:`decode`).
    """
    pages = k_pages.detach().cpu().numpy() if hasattr(k_pages, "detach") else np.asarray(k_pages)
    table = np.asarray(block_table.detach().cpu().numpy() if hasattr(block_table, "detach")
                       else block_table, dtype=np.int64)
    lens = np.asarray(cache_lens, dtype=np.int64)
    _, Hkv, ps, D = pages.shape
    B, max_blocks = table.shape
    out = np.zeros((B, Hkv, max_blocks * ps, D), dtype=pages.dtype)
    for b in range(B):
        for i in range(-(-int(lens[b]) // ps)):
            out[b, :, i * ps:(i + 1) * ps] = pages[table[b, i]]
    return out


def contiguous_to_paged(caches, cache_lens, page_size: int, rng, *, spare: int = 0):
    """Scatter contiguous caches into shuffled page pools: the inverse of
    :func:`paged_to_contiguous`, for building test and benchmark inputs.

    Each cache of ``caches`` ``(B, Hkv, S_max, D)`` becomes a pool
    ``(used + spare, Hkv, page_size, D)`` of its dtype, where ``used`` is the number of blocks the
    sequences use (``ceil(cache_lens[b] / page_size)`` each); all pools share one block table
    ``(B, ceil(S_max / page_size))`` int32 whose unused entries are -1. Pages are placed in the
    order ``rng.permutation(used + spare)``; spare pages and the tail of a last page past S_max
    are zero. Returns ``(pools, block_table)``, pools a list in the order of ``caches``.
    """
    B, Hkv, S_max, D = caches[0].shape
    used = [-(-int(n) // page_size) for n in cache_lens]
    perm = rng.permutation(sum(used) + spare)
    pools = [np.zeros((sum(used) + spare, Hkv, page_size, D), c.dtype) for c in caches]
    table = np.full((B, -(-S_max // page_size)), -1, dtype=np.int32)
    j = 0
    for b in range(B):
        for i in range(used[b]):
            for pool, cache in zip(pools, caches):
                seg = cache[b, :, i * page_size:(i + 1) * page_size]
                pool[perm[j], :, :seg.shape[1]] = seg
            table[b, i] = perm[j]
            j += 1
    return pools, table


def _paged_as_contiguous(q, k_cache, v_cache, cache_lens, block_table, tree_mask):
    """Validate a paged decode call for the references and gather its caches."""
    check_paged_decode_inputs(q, k_cache, v_cache, cache_lens, block_table, tree_mask,
                              dtypes=REFERENCE_DTYPES, same_dtype=False, max_head_dim=None,
                              max_new_tokens=None)
    return (paged_to_contiguous(k_cache, block_table, cache_lens),
            paged_to_contiguous(v_cache, block_table, cache_lens))


def decode(q, k_cache, v_cache, *, cache_lens, scale=None, tree_mask=None, block_table=None,
           softcap=None, alibi_slopes=None, sinks=None) -> Tuple[np.ndarray, np.ndarray]:
    """Exact decode attention (T new tokens per sequence against a KV cache), in float64.

    Parameters
    ----------
    q : array (B, Hq, T, D)
        Queries of the T new tokens.
    k_cache, v_cache : arrays (B, Hkv, S_max, D)
        Caches that already hold the new tokens at ``cache_lens[b] - T .. cache_lens[b] - 1``.
    cache_lens : (B,) ints
        ``T <= cache_lens[b] <= S_max``.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    tree_mask : bool array (T, T), optional
        Visibility among the new tokens (diagonal True), shared by the batch; default causal.
    block_table : integer array (B, max_blocks), optional
        Paged cache: k_cache and v_cache are page pools ``(num_blocks, Hkv, page_size, D)``
        and logical block i of sequence b is page ``block_table[b, i]``; the result is that of
        the contiguous cache :func:`paged_to_contiguous` builds.
    softcap, alibi_slopes, sinks : optional
        Score modifiers as in :func:`attention_forward`; new token t sits at key position
        ``cache_lens[b] - T + t`` for the ALiBi distance.

    Returns
    -------
    o : float64 (B, Hq, T, D)
    lse : float64 (B, Hq, T)
        Attention over the positions of :func:`decode_mask`. Without a tree mask this equals
        ``attention_forward(q, k[:, :, :L], v[:, :, :L], causal="bottom_right")`` with
        ``L = cache_lens[b]`` for each sequence.
    """
    if block_table is not None:
        k_cache, v_cache = _paged_as_contiguous(q, k_cache, v_cache, cache_lens, block_table,
                                                tree_mask)
        return decode(q, k_cache, v_cache, cache_lens=cache_lens, scale=scale,
                      tree_mask=tree_mask, softcap=softcap, alibi_slopes=alibi_slopes,
                      sinks=sinks)
    inputs = check_decode_inputs(q, k_cache, v_cache, cache_lens, tree_mask,
                                 dtypes=REFERENCE_DTYPES, same_dtype=False, max_head_dim=None,
                                 max_new_tokens=None)
    scale = check_scale(scale, inputs.D)
    mask = np.stack([decode_mask(inputs.T, int(n), inputs.S_max, inputs.tree_mask)
                     for n in inputs.cache_lens])[:, None]
    mods = check_score_mods(softcap, alibi_slopes, sinks, inputs.B, inputs.Hq)
    q64 = _f64(q)
    k64 = _expand_kv(_f64(k_cache), inputs.group)
    v64 = _expand_kv(_f64(v_cache), inputs.group)
    qpos = (inputs.cache_lens[:, None] - inputs.T + np.arange(inputs.T)[None, :])
    s, _ = _modify_scores(_scores(q64, k64, scale), mods,
                          qpos.astype(np.float64)[:, None, :, None])
    p, lse = _masked_softmax(s, mask, _sink(mods))
    return p @ v64, lse


def quantize_cache(cache, dtype) -> Tuple[np.ndarray, np.ndarray]:
    """An FP8 KV cache of ``cache`` (a way to make one for tests, the CLI and benchmarks):
    ``(cache / scale[h]) in dtype, scale`` with the float32 ``scale`` ``(Hkv,)`` per kv head
    putting the head's largest magnitude at half the format's largest finite value (headroom
    for later tokens; an all-zero head gets scale 1).

    Parameters
    ----------
    cache : float array (B or num_blocks, Hkv, S_max or page_size, D)
    dtype : an 8-bit float dtype (e.g. ``ml_dtypes.float8_e5m2``)
    """
    dtype = np.dtype(dtype)
    values = np.asarray(cache).astype(np.float64)
    amax = np.abs(values).max(axis=(0, 2, 3))
    half = float(ml_dtypes.finfo(dtype).max) / 2
    scale = np.where(amax > 0, amax / half, 1.0).astype(np.float32)
    return (values / scale[None, :, None, None]).astype(dtype), scale


def dequantize_cache(cache, scale) -> np.ndarray:
    """The float64 values an FP8 KV cache stands for: ``cache * scale[h]`` for kv head h.

    Parameters
    ----------
    cache : array (B or num_blocks, Hkv, S_max or page_size, D), any float dtype (8-bit ones
        included)
    scale : number, or array (Hkv,)
        The cache's ``k_scale`` or ``v_scale`` (:func:`host.flash_decode`).

    Returns
    -------
    float64 array of ``cache``'s shape: what :func:`decode` takes as the exact cache.
    """
    values = np.asarray(cache).astype(np.float64)
    per_head = np.broadcast_to(np.asarray(scale, dtype=np.float64), (values.shape[1],))
    return values * per_head[None, :, None, None]


def merge_partials(o_parts, lse_parts) -> Tuple[np.ndarray, np.ndarray]:
    """Merge attention results computed over disjoint key splits (flash decoding, ring attention).

    Parameters
    ----------
    o_parts : array (S, ..., D)
        Normalized partial outputs of S splits (each ``P_s @ V_s`` with its own softmax).
    lse_parts : array (S, ...)
        Their log-sum-exps. ``-inf`` marks a split with no visible key; such a split contributes
        nothing (its o is ignored, even if NaN). NaN and +inf are rejected.

    Returns
    -------
    o : float64 (..., D)
        ``sum_s exp(lse_s - lse) o_s``; 0 where every split is empty.
    lse : float64 (...)
        ``log sum_s exp(lse_s)``; -inf where every split is empty.

    Notes
    -----
    The merge is exact and associative: merging the splits of any partition of the keys, in
    any grouping, gives the unsplit result.
    """
    check_merge_inputs(o_parts, lse_parts)
    o64, lse64 = _f64(o_parts), _f64(lse_parts)
    m = lse64.max(axis=0)
    has_key = np.isfinite(m)
    m_safe = np.where(has_key, m, 0.0)
    live = np.isfinite(lse64)
    w = np.exp(np.where(live, lse64 - m_safe, -np.inf))
    l = w.sum(axis=0)
    l_safe = np.where(has_key, l, 1.0)
    weighted = (w[..., None] * np.where(live[..., None], o64, 0.0)).sum(axis=0)
    o = weighted / l_safe[..., None]
    lse = np.where(has_key, m_safe + np.log(l_safe), -np.inf)
    return o, lse


# --------------------------------------------------------------------------------------------
# Fused element-wise references
# --------------------------------------------------------------------------------------------


def softmax(x, axis=-1) -> np.ndarray:
    """Softmax along ``axis`` in float64 (numerically stable, max-subtracted).

    Parameters
    ----------
    x : array of any float dtype and any rank >= 1
        Entries may be -inf (masked); a slice that is entirely -inf yields zeros. +inf and NaN
        entries give NaN in their slice.
    axis : int

    Returns
    -------
    float64 array, same shape as x
        ``exp(x_i - m) / sum_j exp(x_j - m)`` with ``m = max_j x_j``.
    """
    check_array("x", x, dtypes=REFERENCE_DTYPES)
    x64 = _f64(x)
    if x64.ndim == 0:
        raise ValueError("x: expected an array with at least 1 dim, got a 0-D array")
    x64 = np.moveaxis(x64, axis, -1)
    finite_or_nan = ~np.isneginf(x64)
    with np.errstate(invalid="ignore"):
        p, _ = _masked_softmax(x64, finite_or_nan)
    return np.moveaxis(p, -1, axis)


def online_softmax(x) -> np.ndarray:
    """Reference of the online (one-pass) softmax kernel: the exact row softmax of a 2-D array.

    Parameters
    ----------
    x : array (M, N), any float dtype

    Returns
    -------
    float64 (M, N)
        ``softmax(x, axis=-1)``. The kernel's streaming recurrence
        (``m' = max(m, x_j)``, ``l' = l exp(m - m') + exp(x_j - m')``) is exact in real
        arithmetic, so its reference is the exact softmax.
    """
    check_softmax_input(x, dtypes=REFERENCE_DTYPES)
    return softmax(x, axis=-1)


def gelu(x, approximate: str = GELU_EXACT) -> np.ndarray:
    """GELU in float64, as ``torch.nn.functional.gelu``.

    ``approximate="none"``: ``0.5 x (1 + erf(x / sqrt(2)))``;
    ``approximate="tanh"``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
    """
    approximate = normalize_gelu_approximate(approximate)
    x64 = _f64(x)
    if approximate == GELU_TANH:
        inner = _SQRT_2_OVER_PI * (x64 + GELU_TANH_CUBIC * x64 ** 3)
        return 0.5 * x64 * (1.0 + np.tanh(inner))
    return 0.5 * x64 * (1.0 + _erf(x64 / _SQRT_2).astype(np.float64))


def linear_gelu(x, w, b, *, approximate: str = GELU_EXACT) -> np.ndarray:
    """``GELU(x @ w + b)`` in float64.

    Parameters
    ----------
    x : array (M, K)
    w : array (K, N)
    b : array (N,)
    approximate : {"none", "tanh"}
        As in ``torch.nn.functional.gelu``.

    Returns
    -------
    float64 (M, N)
    """
    shape = check_linear_gelu_inputs(x, w, b, approximate, dtypes=REFERENCE_DTYPES,
                                     same_dtype=False)
    return gelu(_f64(x) @ _f64(w) + _f64(b), shape.approximate)


# --------------------------------------------------------------------------------------------
# Plain low-precision baselines (for the tolerance rule)
# --------------------------------------------------------------------------------------------


def _round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round float32 values to ``dtype`` (nearest even) and return them as float32 again."""
    return x.astype(dtype).astype(np.float32)


def _lowp_setup(q, k, v, dtype, out_dtype, scale, causal, window, q_lens, kv_lens, do=None,
                rows=None, block_mask=None):
    if do is None:
        dims = check_attention_inputs(q, k, v, dtypes=REFERENCE_DTYPES, same_dtype=False,
                                      max_head_dim=None)
    else:
        dims = check_attention_backward_inputs(do, q, k, v, dtypes=REFERENCE_DTYPES,
                                               same_dtype=False, max_head_dim=None)
    dtype = normalize_dtype("dtype", dtype, FLOAT_DTYPES)
    if out_dtype is not None:
        out_dtype = normalize_dtype("out_dtype", out_dtype, FLOAT_DTYPES)
    out_dtype = dtype if out_dtype is None else out_dtype
    scale = check_scale(scale, dims.D)
    mask = _prefill_masks(dims, causal, window, q_lens, kv_lens, block_mask, rows=rows)

    def rounded(x):
        # ml_dtypes rounds float64 to bfloat16 through float32 (a double rounding that differs
        # from a direct rounding only on exact ties of the float32 value, immaterial here).
        return _f64(x).astype(dtype).astype(np.float32)

    q32 = rounded(q) if rows is None else np.take(rounded(q), _rows(rows, dims.Nq), axis=2)
    k32 = _expand_kv(rounded(k), dims.group)
    v32 = _expand_kv(rounded(v), dims.group)
    do32 = None if do is None else rounded(do)
    return dims, dtype, out_dtype, scale, mask, q32, k32, v32, do32


def _lowp_probs(q32, k32, scale, mask, dtype, mods=NO_SCORE_MODS, qpos=None):
    """S rounded to dtype before and after scaling (and after each score modifier, computed in
    float32); P = softmax in float32 (with the sink), rounded to dtype."""
    s = _round_to(np.matmul(q32, np.swapaxes(k32, -1, -2)), dtype)
    s = _round_to(np.float32(scale) * s, dtype)
    if mods.softcap is not None:
        c = np.float32(mods.softcap)
        s = _round_to(c * np.tanh(s / c), dtype)
    if mods.alibi_slopes is not None:
        dist = np.abs(qpos - np.arange(s.shape[-1], dtype=np.float64))
        s = _round_to((s - mods.alibi_slopes[:, :, None, None] * dist).astype(np.float32), dtype)
    sink = None if mods.sinks is None else mods.sinks.astype(np.float32)[None, :, None, None]
    p, lse = _masked_softmax(s, mask, sink)
    return _round_to(p, dtype), lse


def attention_baseline_lowp(q, k, v, *, dtype, out_dtype=None, scale=None, causal=None,
                            window=None, q_lens=None, kv_lens=None, return_lse=False,
                            rows=None, dropout_p=0.0, dropout_mask=None, block_mask=None,
                            softcap=None, alibi_slopes=None, sinks=None):
    """Plain (unfused) attention in low precision: the baseline of the tolerance rule.

    Mimics PyTorch's eager math in ``dtype``:

    1. q, k, v rounded to ``dtype``;
    2. ``S = q @ k^T`` accumulated in float32, rounded to ``dtype``; ``S = scale * S`` rounded
       to ``dtype``; masked entries set to -inf;
    3. ``P = softmax(S)`` computed in float32 and rounded to ``dtype`` (LSE kept in float32);
    4. ``o = P @ v`` accumulated in float32 and rounded to ``out_dtype``.

    Parameters
    ----------
    q, k, v, scale, causal, window, q_lens, kv_lens, block_mask :
        As in :func:`attention_forward`.
    dtype : float32, bfloat16 or float16 (NumPy/ml_dtypes/torch dtype or name)
        Matmul operand precision of the kernel under test.
    out_dtype : optional
        Output precision (default ``dtype``); e.g. bfloat16 operands with float32 output for a
        float32 kernel with ``mixed_precision=True``.
    return_lse : bool
        Also return the float32 LSE of the rounded scores.
    rows : 1-D ints, optional
        Only these query rows (as in :func:`attention_forward`).
    dropout_p, dropout_mask :
        As in :func:`attention_forward`: P is multiplied by ``Z / (1 - p)`` (rounded to
        ``dtype``) before ``P @ v``.
    softcap, alibi_slopes, sinks :
        As in :func:`attention_forward`; the modified scores are rounded to ``dtype``.

    Returns
    -------
    o : float64 (B, Hq, Nq, D)
        The rounded output values, as float64.
    lse : float64 (B, Hq, Nq), only with ``return_lse``
    """
    dims, dtype, out_dtype, scale, mask, q32, k32, v32, _ = _lowp_setup(
        q, k, v, dtype, out_dtype, scale, causal, window, q_lens, kv_lens, rows=rows,
        block_mask=block_mask)
    mods = check_score_mods(softcap, alibi_slopes, sinks, dims.B, dims.Hq)
    qpos = _query_positions(dims, causal, q_lens, kv_lens)
    if rows is not None:
        qpos = np.take(qpos, _rows(rows, dims.Nq), axis=2)
    p, lse = _lowp_probs(q32, k32, scale, mask, dtype, mods, qpos)
    drop = _dropout_factor(check_attention_inputs(q, k, v, dtypes=REFERENCE_DTYPES,
                                                  same_dtype=False, max_head_dim=None),
                           dropout_p, dropout_mask)
    if drop is not None:
        if rows is not None:
            drop = np.take(drop, _rows(rows, q.shape[2]), axis=2)
        p = _round_to((p * drop).astype(np.float32), dtype)
    o = np.matmul(p, v32).astype(out_dtype).astype(np.float64)
    if return_lse:
        return o, lse.astype(np.float64)
    return o


def decode_baseline_lowp(q, k_cache, v_cache, *, cache_lens, dtype, out_dtype=None, scale=None,
                         tree_mask=None, return_lse=False, block_table=None, softcap=None,
                         alibi_slopes=None, sinks=None):
    """Plain decode attention in low precision: the baseline of the tolerance rule for decode.

    The same four steps as :func:`attention_baseline_lowp` (q, k, v rounded to ``dtype``; S
    rounded before and after scaling; P computed in float32 and rounded; ``P @ v`` rounded to
    ``out_dtype``), over the positions of :func:`decode_mask` (the committed prefix plus the
    new tokens allowed by causality or ``tree_mask``).

    Parameters
    ----------
    q, k_cache, v_cache, cache_lens, scale, tree_mask, block_table, softcap, alibi_slopes,
    sinks :
        As in :func:`decode`.
    dtype, out_dtype, return_lse :
        As in :func:`attention_baseline_lowp`.

    Returns
    -------
    o : float64 (B, Hq, T, D)
    lse : float64 (B, Hq, T), only with ``return_lse``
    """
    if block_table is not None:
        k_cache, v_cache = _paged_as_contiguous(q, k_cache, v_cache, cache_lens, block_table,
                                                tree_mask)
        return decode_baseline_lowp(q, k_cache, v_cache, cache_lens=cache_lens, dtype=dtype,
                                    out_dtype=out_dtype, scale=scale, tree_mask=tree_mask,
                                    return_lse=return_lse, softcap=softcap,
                                    alibi_slopes=alibi_slopes, sinks=sinks)
    inputs = check_decode_inputs(q, k_cache, v_cache, cache_lens, tree_mask,
                                 dtypes=REFERENCE_DTYPES, same_dtype=False, max_head_dim=None,
                                 max_new_tokens=None)
    dtype = normalize_dtype("dtype", dtype, FLOAT_DTYPES)
    out_dtype = dtype if out_dtype is None else normalize_dtype("out_dtype", out_dtype,
                                                                FLOAT_DTYPES)
    scale = check_scale(scale, inputs.D)
    mask = np.stack([decode_mask(inputs.T, int(n), inputs.S_max, inputs.tree_mask)
                     for n in inputs.cache_lens])[:, None]

    def rounded(x):
        return _f64(x).astype(dtype).astype(np.float32)

    q32 = rounded(q)
    k32 = _expand_kv(rounded(k_cache), inputs.group)
    v32 = _expand_kv(rounded(v_cache), inputs.group)
    mods = check_score_mods(softcap, alibi_slopes, sinks, inputs.B, inputs.Hq)
    qpos = (inputs.cache_lens[:, None] - inputs.T + np.arange(inputs.T)[None, :])
    p, lse = _lowp_probs(q32, k32, scale, mask, dtype, mods,
                         qpos.astype(np.float64)[:, None, :, None])
    o = np.matmul(p, v32).astype(out_dtype).astype(np.float64)
    if return_lse:
        return o, lse.astype(np.float64)
    return o


def attention_backward_baseline_lowp(do, q, k, v, *, dtype, out_dtype=None, scale=None,
                                     causal=None, window=None, q_lens=None, kv_lens=None
                                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Plain attention backward in low precision (PyTorch eager autograd in ``dtype``).

    Steps (matmuls accumulate in float32; "rounded" = rounded to ``dtype``):

    1. do, q, k, v rounded; S and P as in :func:`attention_baseline_lowp` (rounded);
    2. ``dv = P^T @ do`` (summed over each kv group in float32), rounded to ``out_dtype``;
    3. ``dP = do @ v^T`` rounded;
    4. ``dS = P * (dP - rowsum(P * dP))`` computed in float32, rounded (gradient of the scaled
       scores); ``dS = scale * dS`` rounded (gradient of ``q @ k^T``);
    5. ``dq = dS @ k``, ``dk = dS^T @ q`` (group-summed), rounded to ``out_dtype``.

    Returns
    -------
    dq : float64 (B, Hq, Nq, D)
    dk, dv : float64 (B, Hkv, Nk, D)
    """
    dims, dtype, out_dtype, scale, mask, q32, k32, v32, do32 = _lowp_setup(
        q, k, v, dtype, out_dtype, scale, causal, window, q_lens, kv_lens, do=do)
    p, _ = _lowp_probs(q32, k32, scale, mask, dtype)
    dv = _sum_groups(np.matmul(np.swapaxes(p, -1, -2), do32), dims.Hkv)
    dp = _round_to(np.matmul(do32, np.swapaxes(v32, -1, -2)), dtype)
    delta = np.sum(p * dp, axis=-1, keepdims=True)
    ds = _round_to(p * (dp - delta), dtype)
    ds = _round_to(np.float32(scale) * ds, dtype)
    dq = np.matmul(ds, k32)
    dk = _sum_groups(np.matmul(np.swapaxes(ds, -1, -2), q32), dims.Hkv)

    def out(x):
        return x.astype(out_dtype).astype(np.float64)

    return out(dq), out(dk), out(dv)


# --------------------------------------------------------------------------------------------
# Errors and tolerances
# --------------------------------------------------------------------------------------------


def max_abs_err(a, ref) -> float:
    """Largest absolute difference between ``a`` and ``ref`` (same shape, no broadcasting).

    Infinities of the same sign in the same place count as equal (e.g. LSE = -inf of fully
    masked rows); an infinity against anything else, and a NaN on either side, count as an
    infinite error. Empty arrays give 0.0.
    """
    a64, r64 = _f64(a), _f64(ref)
    if a64.shape != r64.shape:
        raise ValueError(f"a: expected the same shape as ref {r64.shape}, got {a64.shape}")
    if a64.size == 0:
        return 0.0
    same_inf = np.isinf(a64) & (a64 == r64)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a64 - r64)
    diff = np.where(same_inf, 0.0, diff)
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max())


def atol_floor(dtype) -> float:
    """Absolute floor of the tolerance for a matmul operand precision: 1e-5 fp32, else 1e-3."""
    dtype = normalize_dtype("dtype", dtype, FLOAT_DTYPES)
    return ATOL_FLOOR_FP32 if dtype == np.dtype(np.float32) else ATOL_FLOOR_LOWP


def tolerance(ref, baseline, *, floor: float) -> float:
    """Tolerance of the FlashAttention test rule: ``2 * max|baseline - ref| + floor``.

    Parameters
    ----------
    ref : array
        The float64 reference.
    baseline : array
        The plain low-precision implementation's result (e.g. :func:`attention_baseline_lowp`).
    floor : float
        Absolute floor (:func:`atol_floor`).
    """
    return TOLERANCE_FACTOR * max_abs_err(baseline, ref) + float(floor)


# --------------------------------------------------------------------------------------------
# HBM IO counts
# --------------------------------------------------------------------------------------------


def io_lower_bound_bytes(B, Hq, Hkv, Nq, Nk, D, itemsize, lse=True, *, q_lens=None,
                         kv_lens=None) -> int:
    """HBM bytes a fused attention forward cannot avoid: every input byte it needs read once,
    every output byte written once.

    Derivation: q ``B*Hq*Nq*D`` elements read, k and v ``B*Hkv*Nk*D`` each read, o ``B*Hq*Nq*D``
    written, all of ``itemsize`` bytes; the float32 LSE (``B*Hq*Nq`` x 4 bytes) written when
    ``lse``. GQA shares each kv head among its query heads, so k/v count once per kv head. With
    ``q_lens``/``kv_lens`` (a padded batch) only the valid query rows and keys need reading;
    o and LSE are written in full (padded rows get zeros and -inf).

    Returns
    -------
    int
        ``itemsize * (B Hq (Nq_read + Nq) D + 2 Hkv sum_b Nk_b D) + [lse] 4 B Hq Nq``.
    """
    B, Hq, Hkv, Nq, Nk, D, itemsize = (check_int(n, x, minimum=1) for n, x in zip(
        ("B", "Hq", "Hkv", "Nq", "Nk", "D", "itemsize"), (B, Hq, Hkv, Nq, Nk, D, itemsize)))
    q_valid = check_lengths("q_lens", q_lens, B, Nq, upper_name="Nq")
    k_valid = check_lengths("kv_lens", kv_lens, B, Nk, upper_name="Nk")
    q_read = B * Nq if q_valid is None else int(q_valid.sum())
    k_read = B * Nk if k_valid is None else int(k_valid.sum())
    q_and_o = Hq * (q_read + B * Nq) * D
    k_and_v = 2 * Hkv * k_read * D
    total = itemsize * (q_and_o + k_and_v)
    if lse:
        total += LSE_ITEMSIZE * B * Hq * Nq
    return total


def unfused_attention_bytes(N, d, itemsize=2, *, nk=None, score_itemsize=None) -> int:
    """HBM bytes of standard (unfused) attention for one head (the FlashAttention paper's count).

    Standard attention (Algorithm 0) runs three kernels, with ``Nq = N`` queries and ``Nk``
    keys (default ``Nk = N``):

    1. ``S = Q K^T``: read Q (``Nq d``) and K (``Nk d``), write S (``Nq Nk``);
    2. ``P = softmax(S)``: read S, write P (``2 Nq Nk``);
    3. ``O = P V``: read P (``Nq Nk``) and V (``Nk d``), write O (``Nq d``).

    Total: ``itemsize (2 Nq d + 2 Nk d) + score_itemsize 4 Nq Nk`` bytes, where
    ``score_itemsize`` (the element size of S and P, default ``itemsize``) — with 2-byte
    elements and ``Nq = Nk = N`` this is the seed's ``8 N d + 8 N^2``.

    Parameters
    ----------
    N : int
        Query length Nq.
    d : int
        Head dimension.
    itemsize : int
        Bytes per element of Q, K, V, O.
    nk : int, optional
        Key length Nk (default N).
    score_itemsize : int, optional
        Bytes per element of S and P (default ``itemsize``).

    Returns
    -------
    int
    """
    nq = check_int("N", N, minimum=1)
    d = check_int("d", d, minimum=1)
    itemsize = check_int("itemsize", itemsize, minimum=1)
    nk = nq if nk is None else check_int("nk", nk, minimum=1)
    score_itemsize = itemsize if score_itemsize is None else check_int(
        "score_itemsize", score_itemsize, minimum=1)
    qkvo_elements = 2 * nq * d + 2 * nk * d  # Q, O and K, V each once
    score_passes = 4  # write S, read S, write P, read P
    return itemsize * qkvo_elements + score_itemsize * score_passes * nq * nk
