"""Tile constants and block-size choice from the SBUF/PSUM budget: the one home of the kernels'
numbers.

Kernels take their block sizes as compile-time arguments chosen here by the host, so a kernel
never hard-codes a magic number and a benchmark can force a smaller block. Each kernel family has
its own clearly separated section below; shared hardware limits come first.

Sources: reference/nki-api-spec.md §1 (``nl.tile_size`` values, SBUF/PSUM sizes) and
reference/hardware-and-limits.md §3.
"""
from __future__ import annotations

# ============================================================================================
# Shared hardware limits (both generations; nl.tile_size)
# ============================================================================================

#: Partitions of SBUF and PSUM (``nl.tile_size.pmax``): the partition dim of every tile, the
#: matmul contraction tile and the TensorE transpose edge.
PMAX = 128
#: fp32 elements per partition of one PSUM bank (``nl.tile_size.psum_fmax``, 2 KiB).
PSUM_FMAX = 512
#: Largest free size of a matmul's stationary operand (``gemm_stationary_fmax``).
GEMM_STATIONARY_FMAX = 128
#: Largest free size of a matmul's moving operand (``gemm_moving_fmax``).
GEMM_MOVING_FMAX = 512
#: PSUM banks per partition.
PSUM_BANKS = 8
#: SBUF bytes per partition a kernel may use, per target: capacity minus the 16 KiB the compiler
#: reserves (trn1 192 KiB, trn2 224 KiB).
SBUF_USABLE_BYTES = {"trn1": 192 * 1024 - 16 * 1024, "trn2": 224 * 1024 - 16 * 1024}


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


# ============================================================================================
# Fused kernels and the unfused baselines (issue #6): nki_kernels/fused/*, attention/unfused.py
# ============================================================================================
#
# Budgets are per partition and fit trn1 (the smaller SBUF), so one choice runs on both
# generations; the rest of SBUF is left for scratch tiles and the compiler's double buffering.

#: SBUF bytes per partition the fused kernels plan their resident blocks into.
FUSED_SBUF_BUDGET = 128 * 1024

# -- GELU(x @ W + b) -------------------------------------------------------------------------
#: Output columns per PSUM accumulator of linear_gelu (one PSUM bank of fp32).
LINEAR_N_TILE = PSUM_FMAX
#: Narrowest W column block (also the moving size below which TensorE stops gaining, §1: a
#: matmul costs max(min(64, M), N_moving) cycles, so narrower blocks only add instructions).
LINEAR_MIN_N_BLOCK = 128
#: Largest x-row block kept resident (transposed) per pass over W.
LINEAR_MAX_M_BLOCK = 4096
#: Largest x columns loaded by one DMA (bytes per partition): big transfers amortize the DMA
#: fixed cost (hardware-and-limits.md §3, >= 2 KiB per partition).
LINEAR_X_LOAD_BYTES = 16 * 1024
#: Columns per tile of the element-wise kernels of the unfused pipeline (bias add, GELU).
ELEMENTWISE_COLS = 2048


def linear_gelu_blocks(M: int, K: int, N: int, mm_itemsize: int, *,
                       budget: int = FUSED_SBUF_BUDGET, max_m_block: int = LINEAR_MAX_M_BLOCK):
    """Block sizes of the x-resident GELU(x @ W + b) kernel, or None when K is too long for it.

    The kernel keeps ``block_m`` rows of x transposed in SBUF (``ceil(K/128) * block_m`` operand
    elements per partition) and streams W in column blocks of ``block_n`` (``ceil(K/128) *
    block_n`` per partition, double-buffered). W is read ``ceil(M / block_m)`` times, so
    ``block_n`` (512, 256 or 128: TensorE time per output column is the same for any moving
    size >= 64) is the widest that reaches the fewest passes, and ``block_m`` is as large as
    the budget then allows (up to M rounded up to 128).

    Returns
    -------
    (block_m, block_n) or None
        None: not even a 128-row block fits; the caller uses the streaming kernel.
    """
    kt = ceil_div(K, PMAX)
    m_needed = ceil_div(M, PMAX) * PMAX
    n_cap = ceil_div(N, PMAX) * PMAX
    best = None
    for block_n in (LINEAR_N_TILE, 256, LINEAR_MIN_N_BLOCK):
        block_n = min(block_n, n_cap)
        room = budget - 2 * kt * block_n * mm_itemsize
        rows = (room // (kt * mm_itemsize)) // PMAX * PMAX if room > 0 else 0
        if rows < PMAX:
            continue
        block_m = min(rows, m_needed, max_m_block)
        passes = ceil_div(M, block_m)
        if best is None or passes < best[0]:   # fewest passes over W, then the widest block_n
            best = (passes, block_m, block_n)
    return None if best is None else best[1:]


# -- row softmax -------------------------------------------------------------------------------
#: Columns per streamed chunk of a long softmax row (bf16: 4 KiB per partition per DMA).
SOFTMAX_CHUNK = 2048
#: Largest chunk a caller may force: its fp32 working set (input, exponentials, output, 12 bytes
#: per column) stays within SOFTMAX_RESIDENT_BYTES.
SOFTMAX_MAX_CHUNK = 8192
#: Per-partition bytes of the working set (input, fp32 exponentials, output) under which a whole
#: row tile stays on chip and is read from HBM once.
SOFTMAX_RESIDENT_BYTES = 96 * 1024
#: Lower clamp of the running row max: keeps exp(x - m) finite (no -inf - -inf) for rows that
#: are entirely -inf. Any finite fp32 below every real score works; this is nl.fp32.min.
SOFTMAX_M_FLOOR = -3.4028234663852886e38
#: A row whose max is below this had no visible entry (masked with fp32.min or -inf); the
#: attention softmax writes zeros for it.
SOFTMAX_MASKED_ROW_MAX = -1.0e38
#: Lower clamp of the row sum l before 1/l: with exp() == 0 everywhere, 0 * (1/l) stays 0.
SOFTMAX_L_FLOOR = 1.0e-30


def softmax_plan(C: int, in_itemsize: int, out_itemsize: int, chunk=None):
    """Columns per chunk of the row softmax and whether a row tile is resident (read once).

    Parameters
    ----------
    C : row length
    chunk : int, optional
        Force this chunk size (a row of at most ``chunk`` columns is resident); None chooses
        from :data:`SOFTMAX_RESIDENT_BYTES`.

    Returns
    -------
    (chunk, resident)
    """
    if chunk is None:
        per_col = in_itemsize + 4 + out_itemsize
        if C * per_col <= SOFTMAX_RESIDENT_BYTES:
            return C, True
        return SOFTMAX_CHUNK, False
    return chunk, C <= chunk


# -- standard (unfused) attention, Algorithm 0 --------------------------------------------------
#: Keys per S tile written by the score kernel (one PSUM bank of fp32 scores).
UNFUSED_KEY_TILE = PSUM_FMAX
#: Keys per P row chunk loaded by the PV kernel (transposed on chip in 128-key pieces).
UNFUSED_P_CHUNK = 2048


def unfused_attention_blocks(Nk: int, D: int, mm_itemsize: int, *,
                             budget: int = FUSED_SBUF_BUDGET):
    """Key block of the score kernel and V residency of the PV kernel.

    The score kernel keeps K^T for ``kv_block`` keys on chip (``ceil(D/128) * kv_block``
    elements per partition) and reads Q once per key block; the PV kernel keeps all of V on chip
    (``ceil(Nk/128) * D`` elements per partition) when it fits half the budget, else streams V
    once per 128-query tile.

    Returns
    -------
    (kv_block, v_resident)
    """
    dt = ceil_div(D, PMAX)
    half = budget // 2
    kv_block = max(UNFUSED_KEY_TILE, (half // (dt * mm_itemsize)) // UNFUSED_KEY_TILE
                   * UNFUSED_KEY_TILE)
    kv_block = min(kv_block, ceil_div(Nk, UNFUSED_KEY_TILE) * UNFUSED_KEY_TILE)
    v_resident = ceil_div(Nk, PMAX) * D * mm_itemsize <= half
    return kv_block, v_resident


# ============================================================================================
# Attention backward (issue #4): nki_kernels/attention/backward.py
# ============================================================================================
#
# The backward kernel keeps the query-side state of as many query rows as fit in SBUF (one
# *pass*) and streams K/V once per pass in key tiles. Per resident query tile of 128 rows and
# per partition it holds Q and dO ([128, D], operand dtype), Q^T and dO^T ([D chunk, 128] per
# 128-wide D chunk), the fp32 dQ accumulator ([128, D]) and two fp32 row statistics (D_i and
# the exp bias -LSE_i).

#: Fill value of masked (causal / window) scaled scores before the exp: nl.fp32.min, whose exp
#: is exactly 0 for any finite LSE.
BWD_MASK_FILL = -3.4028234663852886e38
#: An LSE below this marks a row with no visible key (the forward writes -inf there).
BWD_LSE_NO_KEY = -1.0e30
#: Exp bias of such a row is ``BWD_EXP_BIAS_NO_KEY - BWD_LSE_NO_KEY = -1e30`` (instead of
#: ``-LSE = +inf``), so its recomputed P is exactly 0 and every intermediate stays finite.
BWD_EXP_BIAS_NO_KEY = -2.0e30
#: Where dQ accumulates across key tiles: on chip (the design) or in an fp32 HBM scratch (the
#: atomics analogue, kept for measurement).
BWD_DQ_ACCUMULATE_MODES = ("sbuf", "hbm")
#: Per-partition bytes kept free for everything that is not resident query-side state (K/V
#: tiles, P, dS and temporaries, double-buffered) on top of the computed working set.
BWD_SBUF_SLACK = 4 * 1024


def bwd_key_tile(D: int) -> int:
    """Keys per K/V tile of the backward: the most 128-key blocks whose fp32 dK (and dV)
    accumulators ``[128 keys, D]`` share one PSUM bank per partition (512 keys for D <= 128,
    256 for D <= 256). dK_j and dV_j then use one bank each for the whole inner loop."""
    return PMAX * max(1, PSUM_FMAX // max(D, PMAX))


def bwd_slot_bytes(D: int, op_itemsize: int, dq_on_chip: bool = True) -> int:
    """SBUF bytes per partition of one resident 128-row query tile (see the section note)."""
    d_chunks = ceil_div(D, PMAX)
    natural = 2 * D * op_itemsize                 # Q, dO  [128, D]
    transposed = 2 * d_chunks * PMAX * op_itemsize  # Q^T, dO^T  [D chunk, 128]
    dq = 4 * D if dq_on_chip else 0               # fp32 dQ accumulator
    return natural + transposed + dq + 2 * 4      # + D_i, -LSE_i (fp32)


def bwd_working_bytes(D: int, op_itemsize: int, in_itemsize: int = 4) -> int:
    """SBUF bytes per partition of the backward's non-resident tiles: the current and the next
    K/V tile (K [keys, D] blocks, K^T and V^T [D chunk, keys]), per visit P, dS, dP - D
    ([128, keys], operand dtype), the fp32 masked scores, one dS^T block, and load/store
    temporaries ([128, D] in the input dtype and fp32)."""
    key_tile = bwd_key_tile(D)
    d_chunks = ceil_div(D, PMAX)
    kv_tile = (key_tile // PMAX) * D * op_itemsize + 2 * d_chunks * key_tile * op_itemsize
    visit = 3 * key_tile * op_itemsize + 4 * key_tile + PMAX * op_itemsize
    temps = 2 * D * in_itemsize + 2 * 4 * D
    return 2 * kv_tile + visit + temps + BWD_SBUF_SLACK


def bwd_rows_per_pass(D: int, op_itemsize: int, target: str, *, dq_on_chip: bool = True,
                      in_itemsize: int = 4) -> int:
    """Query rows (summed over the heads of a GQA group) whose state fits SBUF in one pass, a
    multiple of 128 (at least 128). A call with ``G * Nq`` at most this runs in a single pass,
    reading every input once; longer ones take ``ceil(G * Nq / rows)`` passes over K/V."""
    room = SBUF_USABLE_BYTES[target] - bwd_working_bytes(D, op_itemsize, in_itemsize)
    return PMAX * max(1, room // bwd_slot_bytes(D, op_itemsize, dq_on_chip))
