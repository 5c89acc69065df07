"""Standard attention that writes S and P to HBM (Algorithm 0 of the FlashAttention paper): the
baseline the flash kernel is compared to.

Three kernels, each a round trip through HBM, launched one after the other by
``host.attention_unfused``::

    1. S = scale * Q K^T  (+ causal mask)   attention_scores_kernel   read Q, K;  write S
    2. P = softmax(S)  row-wise              fused.softmax.softmax_kernel  read S;  write P
    3. O = P V                               attention_pv_kernel       read P, V;  write O

One source for both NKI namespaces (``nki.*`` on trn2/trn3, ``neuronxcc.nki`` on trn1), written
against :mod:`nki_kernels.port`; every loop over key blocks, query tiles, key tiles and P chunks
is a compiled loop, so the program does not grow with Nq, Nk or the head count.

Layouts: q ``(B, Hq, Nq, D)``, k and v ``(B, Hkv, Nk, D)``, S and P ``(B, Hq, Nq, Nk)``, o
``(B, Hq, Nq, D)``; GQA with ``G = Hq // Hkv``. Kernels 1 and 3 walk the grid ``(B, Hkv, G)``:
point ``(b, hk, g)`` is query head ``h = hk * G + g``, which reads kv head ``hk``
(docs/semantics.md). Legacy launches them on that SPMD grid (a point per program,
``nl.program_id``); 0.7 launches ``kernel[lnc]`` only, so there the points are one compiled loop
over ``B * Hkv * G`` inside a single program (``port.for_programs``; launch on :func:`grid`).
S and P are stored in the score dtype (q's dtype, as PyTorch's eager math would); matmul operands
run in ``mm_dtype``.

Masking (``causal_offset``): key j is visible to query i when ``j <= i + causal_offset``
(0 for "top_left", ``Nk - Nq`` for "bottom_right"); masked scores are written as fp32.min
(``MASKED_SCORE``; -inf once rounded to bf16/fp16) while S leaves PSUM, so masking adds no HBM
pass. The diagonal of a score tile at queries ``q0..``, keys ``k0..`` is offset by
``q0 - k0 + causal_offset``, a runtime value (loop indices): legacy masks with one GpSimdE
``affine_select`` whose predicate takes it; 0.7's ``affine_select`` takes compile-time offsets
only, so there a ``(128, ceil(Nq/128) + ceil(Nk/128) - 1)`` fp32 table of per-row bounds is made
once per launch (one ``iota``) and each tile is one VectorE ``range_select`` (NeuronCore-v3+)
against the column of ``(q0 - k0) / 128`` (``port.DiagonalMask``). A row with no visible key
(bottom_right with Nq > Nk) gets P = 0 and O = 0 (the softmax's ``zero_masked_rows``).

HBM traffic with K^T and V resident (``tiles.unfused_attention_blocks``), per query head, with
``s`` the input itemsize and ``s_S`` the score itemsize::

    s (Nq D + Nk D) + s_S Nq Nk          kernel 1 (Q, K; S)
    s_S (Nq Nk + Nq Nk)                  kernel 2 (S; P), rows resident on chip
    s_S Nq Nk + s (Nk D + Nq D)          kernel 3 (P, V; O)

i.e. ``s (2 Nq D + 2 Nk D) + 4 s_S Nq Nk`` -- the paper's ``8 N d + 8 N^2`` for 2-byte elements
and ``Nq = Nk = N``. A K^T block smaller than Nk makes kernel 1 read Q once per block; V that does
not fit makes kernel 3 read V once per 128-query tile.
"""
from nki_kernels import port, tiles
from nki_kernels.fused._onchip import (PMAX, for_tiles, load_rows_transposed,
                                        matmul_accumulate)
from nki_kernels.port import nl

#: Fill value of masked scores: the most negative finite fp32 (-inf after rounding to bf16/fp16).
MASKED_SCORE = tiles.FP32_MIN


def _dtype(name):
    """The NKI dtype called ``name`` ("float32", "bfloat16", "float16")."""
    return getattr(nl, name)


def grid(B, Hq, Hkv, api):
    """The launch grid of kernels 1 and 3 traced through ``api`` (``port.launch_grid``)."""
    return port.launch_grid((B, Hkv, Hq // Hkv), api)


def _for_heads(Hq, Hkv, B, body):
    """``body(b, kv head, query head)`` for every query head (``port.for_programs`` over
    ``(B, Hkv, G)``)."""
    G = Hq // Hkv

    def program(b, hk, g):
        body(b, hk, hk * G + g)

    port.for_programs((B, Hkv, G), program)


def _causal_mask(Nq, Nk, causal_offset):
    """The moving diagonal of the causal mask (``port.DiagonalMask``), or None: a score tile
    at queries ``q0..``, keys ``k0..`` keeps key ``k0 + j`` for query ``q0 + p`` where
    ``j <= p + q0 - k0 + causal_offset``; tiles start at multiples of 128, so the offset is
    ``128 r + causal_offset`` with ``r = (q0 - k0) / 128`` in ``(-ceil(Nk/128), ceil(Nq/128))``."""
    if causal_offset is None:
        return None
    return port.DiagonalMask(PMAX, PMAX, 1 - tiles.ceil_div(Nk, PMAX), tiles.ceil_div(Nq, PMAX),
                             causal_offset)


def _score_tile(s, acc, b, h, qi, qsz, kt, ksz, scale, mask):
    """PSUM scores -> scale (and mask) -> S tile in HBM: queries ``qi * 128..``, keys
    ``kt * 128..``."""
    width = min(tiles.UNFUSED_KEY_TILE, s.shape[3])     # a key tile, or all of a shorter row
    s_t = nl.ndarray((PMAX, width), dtype=s.dtype, buffer=nl.sbuf)
    if mask is None:
        port.activation(s_t[0:qsz, 0:ksz], nl.copy, acc, scale=scale)
    else:
        scaled = nl.ndarray((PMAX, width), dtype=nl.float32, buffer=nl.sbuf)
        port.activation(scaled[0:qsz, 0:ksz], nl.copy, acc, scale=scale)
        mask.select(s_t[0:qsz, 0:ksz], scaled[0:qsz, 0:ksz], qi - kt)
    port.dma_copy(s[b, h, nl.ds(qi * PMAX, qsz), nl.ds(kt * PMAX, ksz)], s_t[0:qsz, 0:ksz])


@port.jit
def attention_scores_kernel(q, k, scale=1.0, causal_offset=None, mm_dtype="bfloat16",
                            s_dtype="bfloat16", kv_block=tiles.UNFUSED_KEY_TILE):
    """Kernel 1: ``S = scale * q @ k^T`` (masked) for every query head (launch on
    :func:`grid`).

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
    mm = _dtype(mm_dtype)
    s = nl.ndarray((B, Hq, Nq, Nk), dtype=_dtype(s_dtype), buffer=nl.shared_hbm)
    n_dt = tiles.ceil_div(D, PMAX)
    key_tile = tiles.UNFUSED_KEY_TILE
    mask = _causal_mask(Nq, Nk, causal_offset)

    def head(b, hk, h):
        def key_block(kb, kbs):
            kb0 = kb * kv_block
            # K^T of the block: head-dim tile dt of keys r.. at columns dt * kbs + r
            k_t = nl.ndarray((PMAX, n_dt * kbs), dtype=mm, buffer=nl.sbuf)
            for_tiles(kbs, PMAX, lambda r, rsz: load_rows_transposed(
                k, (b, hk), kb0 + r * PMAX, rsz, D, k_t, kbs, r * PMAX, load_dtype=mm))

            def query_tile(qi, qsz):
                q_t = nl.ndarray((PMAX, n_dt * PMAX), dtype=mm, buffer=nl.sbuf)
                load_rows_transposed(q, (b, h), qi * PMAX, qsz, D, q_t, PMAX, 0, load_dtype=mm)

                def key_tile_scores(ki, ksz):
                    acc = nl.ndarray((PMAX, key_tile), dtype=nl.float32, buffer=nl.psum)

                    def operands(dt, dsz):
                        return (q_t[0:dsz, nl.ds(dt * PMAX, qsz)],
                                k_t[0:dsz, nl.ds(dt * kbs + ki * key_tile, ksz)])

                    matmul_accumulate(acc[0:qsz, 0:ksz], D, PMAX, operands)
                    kt = kb * (kv_block // PMAX) + ki * (key_tile // PMAX)
                    _score_tile(s, acc[0:qsz, 0:ksz], b, h, qi, qsz, kt, ksz, scale, mask)

                for_tiles(kbs, key_tile, key_tile_scores)

            for_tiles(Nq, PMAX, query_tile)

        for_tiles(Nk, kv_block, key_block)

    _for_heads(Hq, Hkv, B, head)
    return s


@port.jit
def attention_pv_kernel(p, v, mm_dtype="bfloat16", o_dtype="bfloat16", v_resident=True):
    """Kernel 3: ``o = p @ v`` for every query head (launch on :func:`grid`).

    P tiles are transposed on TensorE (keys onto partitions: the contraction dim) and multiplied
    with V tiles (keys on partitions, D free) into a PSUM accumulator per 128-query tile.

    Parameters
    ----------
    p : (B, Hq, Nq, Nk); v : (B, Hkv, Nk, D), D <= 512
    mm_dtype, o_dtype : dtype names
    v_resident : bool
        Load V once per query head and keep it on chip; else load V tiles per query tile.

    Returns
    -------
    o : (B, Hq, Nq, D)
    """
    B, Hq, Nq, Nk = p.shape
    Hkv, D = v.shape[1], v.shape[3]
    mm = _dtype(mm_dtype)
    o = nl.ndarray((B, Hq, Nq, D), dtype=_dtype(o_dtype), buffer=nl.shared_hbm)
    chunk = tiles.UNFUSED_P_CHUNK
    per_chunk = chunk // PMAX
    p_width = min(chunk, Nk)                # one chunk, or all of a shorter row

    def head(b, hk, h):
        if v_resident:
            n_kt = tiles.ceil_div(Nk, PMAX)
            v_sb = nl.ndarray((PMAX, n_kt * D), dtype=mm, buffer=nl.sbuf)

            def load_v(kt, ksz):
                port.dma_copy(v_sb[0:ksz, nl.ds(kt * D, D)], v[b, hk, nl.ds(kt * PMAX, ksz), 0:D])

            for_tiles(Nk, PMAX, load_v)

        def query_tile(qi, qsz):
            q0 = qi * PMAX
            acc = nl.zeros((PMAX, D), dtype=nl.float32, buffer=nl.psum)

            def p_chunk(ci, cw):
                p_rows = nl.ndarray((PMAX, p_width), dtype=mm, buffer=nl.sbuf)
                port.dma_copy(p_rows[0:qsz, 0:cw], p[b, h, nl.ds(q0, qsz), nl.ds(ci * chunk, cw)])

                def piece(kt, j0, jsz, on_scalar):
                    """Keys kt*128.. of the chunk (offset j0): transpose P, then P^T V into
                    acc."""
                    tp = nl.ndarray((PMAX, PMAX), dtype=port.transpose_dtype(mm), buffer=nl.psum)
                    port.nc_transpose(tp[0:jsz, 0:qsz], p_rows[0:qsz, nl.ds(j0, jsz)])
                    p_t = nl.ndarray((PMAX, PMAX), dtype=mm, buffer=nl.sbuf)
                    if on_scalar:
                        port.activation(p_t[0:jsz, 0:qsz], nl.copy, tp[0:jsz, 0:qsz])
                    else:
                        port.tensor_copy(p_t[0:jsz, 0:qsz], tp[0:jsz, 0:qsz], engine="vector")
                    if v_resident:
                        v_t = v_sb[0:jsz, nl.ds(kt * D, D)]
                    else:
                        v_tile = nl.ndarray((PMAX, D), dtype=mm, buffer=nl.sbuf)
                        port.dma_copy(v_tile[0:jsz, 0:D], v[b, hk, nl.ds(kt * PMAX, jsz), 0:D])
                        v_t = v_tile[0:jsz, 0:D]
                    port.nc_matmul(acc[0:qsz, 0:D], p_t[0:jsz, 0:qsz], v_t, accumulate=None)

                def pair(pi, pw):
                    # the PSUM -> SBUF copies of P^T alternate between VectorE and ScalarE (idle
                    # otherwise in this kernel), halving the evacuation time
                    kt = ci * per_chunk + 2 * pi
                    piece(kt, pi * 2 * PMAX, min(PMAX, pw), False)
                    if pw > PMAX:
                        piece(kt + 1, pi * 2 * PMAX + PMAX, pw - PMAX, True)

                for_tiles(cw, 2 * PMAX, pair)

            for_tiles(Nk, chunk, p_chunk)
            o_t = nl.ndarray((PMAX, D), dtype=o.dtype, buffer=nl.sbuf)
            port.tensor_copy(o_t[0:qsz, 0:D], acc[0:qsz, 0:D], engine="vector")
            port.dma_copy(o[b, h, nl.ds(q0, qsz), 0:D], o_t[0:qsz, 0:D])

        for_tiles(Nq, PMAX, query_tile)

    _for_heads(Hq, Hkv, B, head)
    return o
