"""Standard attention that writes S and P to HBM (Algorithm 0 of the FlashAttention paper): the
baseline the flash kernel is compared to.

Three kernels, each a round trip through HBM, launched one after the other by
``host.attention_unfused``::

    1. S = scale * Q K^T  (+ causal mask)   attention_scores_kernel   read Q, K;  write S
    2. P = softmax(S)  row-wise              fused.softmax.softmax_kernel  read S;  write P
    3. O = P V                               attention_pv_kernel       read P, V;  write O

Layouts: q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)``, S and P ``(B, Hq, Nq, Nk)``, o
``(B, Hq, Nq, D)``; GQA with ``G = Hq // Hkv``. Kernels 1 and 3 run on the SPMD grid
``(B, Hkv, G)``: program ``(b, hk, g)`` is query head ``h = hk * G + g``, which reads kv head
``hk`` (docs/semantics.md), all index arithmetic affine. S and P are stored in the score dtype
(q's dtype, as PyTorch's eager math would); matmul operands run in ``mm_dtype``.

Masking (``causal_offset``): key j is visible to query i when ``j <= i + causal_offset``
(0 for "top_left", ``Nk - Nq`` for "bottom_right"); masked scores are written as fp32.min (-inf
once rounded to bf16/fp16) while S leaves PSUM, so masking adds no HBM pass. A row with no
visible key (bottom_right with Nq > Nk) gets P = 0 and O = 0 (the softmax's
``zero_masked_rows``).

HBM traffic with K^T and V resident (``tiles.unfused_attention_blocks``), per query head, with
``s`` the input itemsize and ``s_S`` the score itemsize::

    s (Nq D + Nk D) + s_S Nq Nk          kernel 1 (Q, K; S)
    s_S (Nq Nk + Nq Nk)                  kernel 2 (S; P), rows resident on chip
    s_S Nq Nk + s (Nk D + Nq D)          kernel 3 (P, V; O)

i.e. ``s (2 Nq D + 2 Nk D) + 4 s_S Nq Nk`` -- the paper's ``8 N d + 8 N^2`` for 2-byte elements
and ``Nq = Nk = N``. A K^T block smaller than Nk makes kernel 1 read Q once per block; V that does
not fit makes kernel 3 read V once per 128-query tile.
"""
from nki_kernels import tiles
from nki_kernels.fused._onchip import (PMAX, for_tiles, load_rows_transposed,
                                        matmul_accumulate)
from nki_kernels.nki import nisa, nki, nl

_DTYPES = {"float32": nl.float32, "bfloat16": nl.bfloat16, "float16": nl.float16}
#: Fill value of masked scores: the most negative finite fp32 (-inf after rounding to bf16/fp16).
MASKED_SCORE = float(nl.fp32.min)


def _heads(Hq, Hkv):
    """(b, kv head, query head) of the current program on the (B, Hkv, G) grid."""
    G = Hq // Hkv
    b = nl.program_id(0)
    hk = nl.program_id(1)
    h = hk * G + nl.program_id(2)
    return b, hk, h


def _score_tile(s, acc, b, h, q0, qsz, k0, ksz, scale, causal_offset):
    """PSUM scores -> scale (and mask) -> S tile in HBM."""
    if causal_offset is None:
        s_t = nisa.activation(op=nl.copy, data=acc, scale=scale, dtype=s.dtype)
    else:
        scaled = nisa.activation(op=nl.copy, data=acc, scale=scale, dtype=nl.float32)
        i_q, i_k = nl.mgrid[0:qsz, 0:ksz]
        # visible: k0 + i_k <= q0 + i_q + causal_offset
        s_t = nisa.affine_select(pred=(q0 + i_q + causal_offset - k0 - i_k >= 0),
                                 on_true_tile=scaled, on_false_value=MASKED_SCORE,
                                 dtype=s.dtype)
    nl.store(s[b, h, nl.ds(q0, qsz), nl.ds(k0, ksz)], value=s_t)


@nki.jit
def attention_scores_kernel(q, k, scale=1.0, causal_offset=None, mm_dtype="bfloat16",
                            s_dtype="bfloat16", kv_block=tiles.UNFUSED_KEY_TILE):
    """Kernel 1: ``S = scale * q @ k^T`` (masked) for one query head per program.

    Parameters
    ----------
    q : (B, Hq, Nq, D); k : (B, Hkv, Nk, D)
    scale : float
    causal_offset : int or None
        None = no mask; else key j visible to query i iff ``j <= i + causal_offset``.
    mm_dtype, s_dtype : dtype names
        Matmul operand dtype; dtype S is stored in.
    kv_block : int
        Keys whose K^T stays on chip while all query tiles pass (multiple of 512).

    Returns
    -------
    s : (B, Hq, Nq, Nk)
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    mm = _DTYPES[mm_dtype]
    cast = None if mm == q.dtype else mm
    s = nl.ndarray((B, Hq, Nq, Nk), dtype=_DTYPES[s_dtype], buffer=nl.shared_hbm)
    b, hk, h = _heads(Hq, Hkv)
    n_dt = tiles.ceil_div(D, PMAX)
    key_tile = tiles.UNFUSED_KEY_TILE

    def key_block(kb, kbs):
        kb0 = kb * kv_block
        # K^T of the block: head-dim tile dt of keys r.. at columns dt * kbs + r
        k_t = nl.ndarray((PMAX, n_dt * kbs), dtype=mm, buffer=nl.sbuf)
        for_tiles(kbs, PMAX, lambda r, rsz: load_rows_transposed(
            k, (b, hk), kb0 + r * PMAX, rsz, D, k_t, kbs, r * PMAX, load_dtype=cast))

        def query_tile(qi, qsz):
            q0 = qi * PMAX
            q_t = nl.ndarray((PMAX, n_dt * PMAX), dtype=mm, buffer=nl.sbuf)
            load_rows_transposed(q, (b, h), q0, qsz, D, q_t, PMAX, 0, load_dtype=cast)

            def key_tile_scores(ki, ksz):
                acc = nl.ndarray((PMAX, key_tile), dtype=nl.float32, buffer=nl.psum)

                def operands(dt, dsz):
                    return (q_t[0:dsz, nl.ds(dt * PMAX, qsz)],
                            k_t[0:dsz, nl.ds(dt * kbs + ki * key_tile, ksz)])

                matmul_accumulate(acc[0:qsz, 0:ksz], D, PMAX, operands)
                _score_tile(s, acc[0:qsz, 0:ksz], b, h, q0, qsz, kb0 + ki * key_tile, ksz,
                            scale, causal_offset)

            for_tiles(kbs, key_tile, key_tile_scores)

        for_tiles(Nq, PMAX, query_tile)

    for_tiles(Nk, kv_block, key_block)
    return s


@nki.jit
def attention_pv_kernel(p, v, mm_dtype="bfloat16", o_dtype="bfloat16", v_resident=True):
    """Kernel 3: ``o = p @ v`` for one query head per program.

    P tiles are transposed on TensorE (keys onto partitions: the contraction dim) and multiplied
    with V tiles (keys on partitions, D free) into a PSUM accumulator per 128-query tile.

    Parameters
    ----------
    p : (B, Hq, Nq, Nk); v : (B, Hkv, Nk, D), D <= 512
    mm_dtype, o_dtype : dtype names
    v_resident : bool
        Load V once per program and keep it on chip; else load V tiles per query tile.

    Returns
    -------
    o : (B, Hq, Nq, D)
    """
    B, Hq, Nq, Nk = p.shape
    Hkv, D = v.shape[1], v.shape[3]
    mm = _DTYPES[mm_dtype]
    cast_p = None if mm == p.dtype else mm
    cast_v = None if mm == v.dtype else mm
    o = nl.ndarray((B, Hq, Nq, D), dtype=_DTYPES[o_dtype], buffer=nl.shared_hbm)
    b, hk, h = _heads(Hq, Hkv)
    chunk = tiles.UNFUSED_P_CHUNK
    per_chunk = chunk // PMAX

    if v_resident:
        n_kt = tiles.ceil_div(Nk, PMAX)
        v_sb = nl.ndarray((PMAX, n_kt * D), dtype=mm, buffer=nl.sbuf)

        def load_v(kt, ksz):
            v_sb[0:ksz, nl.ds(kt * D, D)] = nl.load(v[b, hk, nl.ds(kt * PMAX, ksz), 0:D],
                                                    dtype=cast_v)

        for_tiles(Nk, PMAX, load_v)

    def query_tile(qi, qsz):
        q0 = qi * PMAX
        acc = nl.zeros((PMAX, D), dtype=nl.float32, buffer=nl.psum)

        def p_chunk(ci, cw):
            p_rows = nl.load(p[b, h, nl.ds(q0, qsz), nl.ds(ci * chunk, cw)], dtype=cast_p)

            def piece(kt, j0, jsz, on_scalar):
                """Keys kt*128.. of the chunk (offset j0): transpose P, then P^T V into acc."""
                tp = nl.ndarray((PMAX, PMAX), dtype=nl.float32, buffer=nl.psum)
                tp[0:jsz, 0:qsz] = nisa.nc_transpose(p_rows[0:qsz, nl.ds(j0, jsz)])
                if on_scalar:
                    p_t = nisa.activation(op=nl.copy, data=tp[0:jsz, 0:qsz], dtype=mm)
                else:
                    p_t = nisa.tensor_copy(tp[0:jsz, 0:qsz], dtype=mm,
                                           engine=nisa.vector_engine)
                if v_resident:
                    v_t = v_sb[0:jsz, nl.ds(kt * D, D)]
                else:
                    v_t = nl.load(v[b, hk, nl.ds(kt * PMAX, jsz), 0:D], dtype=cast_v)
                acc[0:qsz, 0:D] += nisa.nc_matmul(p_t, v_t)

            def pair(pi, pw):
                # the PSUM -> SBUF copies of P^T alternate between VectorE and ScalarE (idle
                # otherwise in this kernel), halving the evacuation time
                kt = ci * per_chunk + 2 * pi
                piece(kt, pi * 2 * PMAX, min(PMAX, pw), False)
                if pw > PMAX:
                    piece(kt + 1, pi * 2 * PMAX + PMAX, pw - PMAX, True)

            for_tiles(cw, 2 * PMAX, pair)

        for_tiles(Nk, chunk, p_chunk)
        o_t = nisa.tensor_copy(acc[0:qsz, 0:D], dtype=o.dtype, engine=nisa.vector_engine)
        nl.store(o[b, h, nl.ds(q0, qsz), 0:D], value=o_t)

    for_tiles(Nq, PMAX, query_tile)
    return o
