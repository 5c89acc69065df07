"""Tile constants and block-size choice from the SBUF/PSUM budget: the one home of the kernels'
numbers.

Kernels take their block sizes as compile-time arguments chosen here by the host, so a kernel
never hard-codes a magic number and a benchmark can force a smaller block. Each kernel family has
its own clearly separated section below; shared hardware limits come first.

Sources: reference/nki-api-spec.md §1 (``nl.tile_size`` values, SBUF/PSUM sizes) and
reference/hardware-and-limits.md §3.
"""
from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Tuple

# ============================================================================================
# Shared hardware limits (both generations; nl.tile_size)
# ============================================================================================

#: Partitions of SBUF and PSUM (``nl.tile_size.pmax``): the partition dim of every tile, the
#: matmul contraction tile and the TensorE transpose edge.
PMAX = 128
#: Integers below this are exact in fp32 (engines compute in fp32): bound of index arithmetic a
#: kernel does on chip in fp32 (the nki.* forward's dropout unit numbers).
FP32_EXACT_INT = 2 ** 24
#: fp32 elements per partition of one PSUM bank (``nl.tile_size.psum_fmax``, 2 KiB).
PSUM_FMAX = 512
#: Largest free size of a matmul's stationary operand (``gemm_stationary_fmax``).
GEMM_STATIONARY_FMAX = 128
#: Largest free size of a matmul's moving operand (``gemm_moving_fmax``).
GEMM_MOVING_FMAX = 512
#: The most negative finite fp32 (``nl.fp32.min``): a fill whose exp is exactly 0 for any finite
#: shift and that stays finite through fp32 arithmetic.
FP32_MIN = -3.4028234663852886e38
#: SBUF bytes per partition a kernel may use, per target: capacity minus the 16 KiB the compiler
#: reserves (trn1 192 KiB, trn2 224 KiB).
SBUF_USABLE_BYTES = {"trn1": 192 * 1024 - 16 * 1024, "trn2": 224 * 1024 - 16 * 1024}
#: SBUF bytes per partition the forward plans into: 90 % of capacity, leaving the compiler's
#: allocator headroom beyond its reservation (issue "kernels that compile and run": peak SBUF
#: at most 90 %).
FWD_SBUF_BUDGET_BYTES = {"trn1": 192 * 1024 * 9 // 10, "trn2": 224 * 1024 * 9 // 10}


#: Edge of one block of a block-sparse attention pattern (query rows x keys), the paper's
#: Br x Bc (FlashAttention section 3.3) at the NeuronCore's natural tile: one partition tile of
#: queries by 128 keys. Kernels may work on coarser key blocks internally.
BLOCK_SPARSE_TILE = PMAX
#: Most loop bodies (classes) a block-sparse kernel sorts its rows into: rows (query tiles, or
#: key blocks in the backward) are ordered by their count of active blocks and cut into at most
#: this many runs, each a loop whose trip count is the largest count of the run (padding slots
#: are masked). The program size is bounded by it, whatever N; the waste is what the cut leaves.
BSP_MAX_CLASSES = 16


#: First position the block-sparse tables write for a padding slot (a slot past a row's
#: count): beyond every sequence, so the slot's gathers are skipped and its scores masked by
#: the same comparisons as positions past the length. Exact in fp32 (the tables are fp32), so
#: sequences are limited to BSP_PAD_FIRST - 256 positions.
BSP_PAD_FIRST = 1 << 22
#: Key blocks per online-softmax step of the block-sparse forward over a query tile's own
#: slots (gathered per tile): 4 x 128 keys = one PSUM bank of fp32 scores, so the step's fixed
#: work (row max, rescale, P^T copies) is shared by four blocks. Longer steps lose more than
#: they share here, the per-tile gathers being the DMA queues' load (trn2 estimate, N = 4096,
#: D = 128, bf16, s = 1/2, index form: 4 / 8 / 16 blocks 314.4 / 328.3 / 323.9 us).
BSP_STEP_BLOCKS = 4
#: Keys per K/V load piece of the block-sparse forward's resident K/V (nki.*,
#: :func:`bsp_fwd_kv_resident`; the dense forward's FWD_KV_LOAD_BLOCK is 2048): every query
#: tile waits for the whole of K^T and V (its blocks are runtime offsets), so the load opens
#: the kernel with the engines idle, and smaller pieces let the V guard of one piece run
#: while the next is loading. Scheduled estimate, trn2 through nki.*, N = 4096, D = 128,
#: bf16, index form, s = 1/32 / 1/8: 2048 keys 47.4 / 60.5 us, 1024 42.2 / 56.0 (with the
#: group's software pipelining and batched finalize, attention/block_sparse.py).
BSP_FWD_KV_LOAD_BLOCK = 1024
#: Key blocks per own-slot step when K/V of an instance fit in SBUF
#: (:func:`bsp_fwd_kv_resident`): under nki.* the steps then read resident K/V in place, so
#: nothing per tile is gathered and the longest step (four PSUM banks of scores, as
#: BSP_SHARED_STEP_BLOCKS) shares the step's fixed softmax work best; legacy, which still
#: gathers, takes the same steps (the same outputs). Scheduled estimate, trn2, N = 4096,
#: D = 128, bf16, index form, every block active: 4 / 16 blocks 293.5 / 241.1 us.
BSP_RESIDENT_STEP_BLOCKS = 16
#: Key blocks per step over the slots a group of query tiles shares (gathered once per group,
#: ``host.block_sparse.kernel_tables``): 16 x 128 keys, four PSUM banks of scores (one score
#: tile per bank), so the step's fixed softmax work is shared by up to sixteen blocks, as the
#: dense forward shares it over its 2048-key blocks (trn2 estimate, N = 4096, D = 128, bf16,
#: compile-time form, every block active: 4 / 8 / 16 blocks 445.0 / 423.9 / 389.0 us; s = 1/2:
#: 237.7 / 227.2 / 203.5 us; 32 was refused by the simulator, an access out of bounds, not
#: pursued). A class with fewer shared slots takes a shorter step.
BSP_SHARED_STEP_BLOCKS = 16
#: Keys per online-softmax step of the packed variable-length forward
#: (``attention/varlen.py``): one PSUM bank of fp32 scores per query head, as BSP_STEP_BLOCKS.
VARLEN_STEP_KEYS = BSP_STEP_BLOCKS * PMAX
#: Query tiles of the packed variable-length forward that share one sweep of keys (the union
#: of their rows' ranges): each step's K/V gather, K^T transposes and V guard serve all of
#: them. VARLEN_GROUP_TILES x 128 = VARLEN_STEP_KEYS rows, so a long causal sequence issues
#: the same score tiles as with one tile per sweep.
VARLEN_GROUP_TILES = VARLEN_STEP_KEYS // PMAX
#: Kv heads one loop body of the packed variable-length forward serves (when they divide
#: Hkv): their tiles share the group's setup (row bounds, sweep, step count) and their
#: independent chains let the engines overlap one head's DMA waits with the other's work.
VARLEN_KV_HEADS = 2
#: Most (query tile, query head) slots of one such loop body: their Q^T, ``[o_acc | l]`` and
#: statistics stay in SBUF through the sweep (~0.8 KiB per partition each at D = 128), and
#: the body is unrolled over them, so this bounds both SBUF and the program size.
VARLEN_MAX_SLOTS = 16
#: Fraction of the packed forward's P^T PSUM -> SBUF copies on ScalarE: half without a score
#: modifier that transforms the scores, all of them with soft-capping or ALiBi (their
#: instructions load VectorE: ALiBi's add, the range select reading an SBUF tile). Measured,
#: not modeled: ``benchmarks/varlen.py --mods`` on trn2 (8 causal sequences of 512, Hq = Hkv
#: = 8, D = 128), all copies on ScalarE model ALiBi at 685.8 us against 892.4 with half,
#: soft-capping 611.8 against 640.2, but the plain call at 642.3 against 634.1.
VARLEN_ACT_SHARE = 0.5
VARLEN_MODS_ACT_SHARE = 1.0
#: The packed forward's share under nki.* (no transforming modifier): VectorE is its busiest
#: engine there (its range select and row max per score tile). Measured, not modeled: the
#: same trn2 case, scheduled estimate (packed only) at shares 0.5 / 0.625 / 0.65 / 0.7 / 0.75
#: / 0.8 / 0.875: 634.1 / 602.3 / 602.3 / 584.9 / 590.8 / 592.2 / 603.5 us (VectorE busy
#: 442.3 -> 429.5, ScalarE 300.4 -> 320.9 at 0.7). Legacy keeps VARLEN_ACT_SHARE: trn1 at
#: 0.75 models 6593.6 against 6410.7 us. The backward's recompute keeps VARLEN_ACT_SHARE
#: (not measured with this one).
VARLEN_NKI_ACT_SHARE = 0.7
#: Query tiles of one class processed together by the block-sparse forward (a loop body): their
#: softmax chains interleave step by step, as the dense forward's groups do
#: (FWD_RESIDENT_Q_GROUP), so the engines have independent work while one tile waits; each
#: group boundary leaves the engines waiting on the next group's first loads. Scheduled
#: estimate, trn2 through nki.* (resident K/V), N = 4096, D = 128, bf16, bool mask: 4 / 8 / 16
#: tiles, every block active 265.4 / 241.1 / 256.6 us, s = 1/16 85.7 / 80.2 / 95.6 us.
BSP_GROUP_TILES = 8
#: The block-sparse forward's key-block window's group sizes the host tries, largest first
#: (``host.block_sparse.window_plan``): smaller groups need fewer blocks at once and so evict
#: less, at the cost of fewer tiles sharing each group's waits. 64K, D = 128, bf16, random
#: s = 1/16, a window of 318 blocks: 2277 / 2065 / 1994 / 1968 key-block gathers at 8 / 4 /
#: 2 / 1 (the dense forward: 2048).
BSP_WINDOW_GROUPS = (BSP_GROUP_TILES, 4, 2, 1)
#: How many query tiles' softmax back halves (P^T, PV, the accumulator update) the
#: block-sparse forward's step keeps pending while it issues the next tiles' scores and
#: fronts (:func:`bsp_pipeline_depth`; ``attention/block_sparse.py``): each tile's chain
#: crosses every engine, and the engines run in program order. Scheduled estimate, trn2
#: through nki.*, N = 4096, bf16, index form, fixed_density (step width W = 32 s blocks, at
#: most 16), depth 1 / 2 / 3 / 4 / 5 / 6 / 7 (us): D = 128 s = 1/32 (W = 1) 40.3 / 38.7 /
#: 37.8 / 37.1 / 36.4 / 34.9 / 35.3; s = 1/16 (W = 2) 44.9 / - / - / 38.7 / 38.6 / - / 39.5;
#: s = 1/8 (W = 4) 55.0 / 52.7 / 51.7 / 51.5 / 52.7 / - / 55.4; s = 1/4 (W = 8) 79.8 / 74.3
#: / 73.2 / 71.8; s = 1/2 (W = 16) 114.5 / 115.0; s = 1 (W = 16) 197.2 / 198.4; D = 64 s =
#: 1/32 29.4 / - / - / 27.0 / - / 26.5, s = 1/8 49.9 / - / - / 44.9 / - / 47.4.
BSP_PIPELINE_DEPTH = 4
#: ... with steps of one key block (the shortest chains' engine time)
BSP_PIPELINE_DEPTH_ONE_BLOCK = 6
#: ... with steps of two key blocks: re-measured with the values-first K/V load, the direct
#: Q^T and the finalize's ScalarE share, s = 1/16 depth 3 / 4 / 5: 37.3 / 37.8 / 36.1 us
BSP_PIPELINE_DEPTH_TWO_BLOCKS = 5
#: Most key blocks of P (bf16, [128, 128] each) the pending back halves hold in SBUF: 8 KiB
#: per partition, within BSP_FWD_WORK_BYTES beside the measured working set.
BSP_PIPELINE_BLOCKS = 32


def bsp_pipeline_depth(width: int) -> int:
    """Back halves the block-sparse forward keeps pending in a step of ``width`` key blocks
    (:data:`BSP_PIPELINE_DEPTH`): 1 from BSP_RESIDENT_STEP_BLOCKS blocks on, at most
    :data:`BSP_PIPELINE_BLOCKS` blocks of P."""
    if width >= BSP_RESIDENT_STEP_BLOCKS:
        return 1
    depth = {1: BSP_PIPELINE_DEPTH_ONE_BLOCK, 2: BSP_PIPELINE_DEPTH_TWO_BLOCKS}.get(
        width, BSP_PIPELINE_DEPTH)
    return max(1, min(depth, BSP_PIPELINE_BLOCKS // width))


#: Share of a group's query tiles whose output scaling (``o_acc / l``, forward.finalize)
#: runs on ScalarE, the rest on GpSimd: the group's finalize otherwise queues eight [128, D]
#: GpSimd instructions ahead of the next group's first softmax steps. trn2 through nki.*,
#: N = 4096, D = 128, index form, values-first K/V load, tiles of a group of 8 on ScalarE
#: 0 / 2 / 4 / 6: s = 1/16 37.9 / 38.0 / 37.9 / 38.5 us, s = 1/32 34.1 / 33.5 / 33.2 / 34.1;
#: before the values-first load, 0 / 4 / 8: s = 1/32 34.9 / 34.1 / 35.8, band+strided 51.5 /
#: 50.8 / 51.1.
BSP_FINALIZE_ACT_SHARE = 0.5
#: Most key blocks of a step whose first accumulator update (a copy of PV out of PSUM, the
#: tile's first step: ``forward.fold_update`` ``first``) the block-sparse forward puts on
#: ScalarE; longer steps put it on VectorE. Scheduled estimate, trn2 through nki.*, N = 4096,
#: bf16, index form, fixed_density, share of a group's tiles copying on ScalarE 0 / 0.25 /
#: 0.5 / 0.75 / 1 (us): D = 128 s = 1/32 (one-block steps) 30.8 / 30.0 / 29.5 / 29.2 / 28.8;
#: s = 1/8 (four) 47.5 / 48.9 / 50.4 / 52.6 / 52.1; s = 1/16 (0 / 0.5 / 1) 34.9 / 35.1 / 35.6;
#: s = 1/4 (0 / 1) 68.9 / 69.2; s = 1/2 109.5 / 110.3; D = 64 s = 1/32 24.4 / 23.7.
BSP_FIRST_COPY_ACT_MAX_BLOCKS = 1
#: Most slots of a block-sparse forward class (natural order, NeuronCore-v3+) whose groups
#: store LSE as ``[tiles, 128]`` rows (a TensorE transpose and a ScalarE copy out of PSUM,
#: then 512-byte rows) instead of ``[128, tiles]`` columns (one 4-byte DMA descriptor per row):
#: the DMA queues are the busiest at low density. Scheduled estimate, trn2 through nki.*,
#: N = 4096, D = 128, bf16, index form, fixed_density, rows / columns (us): s = 1/16 34.9 /
#: 35.3, 1/8 47.5 / 48.0, 1/4 68.9 / 67.9, 1/2 109.5 / 110.1, s = 1 191.7 / 190.9; s = 1/32
#: before the first-step copy 31.1 / 32.8.
BSP_LSE_ROWS_MAX_SLOTS = 4
#: SBUF bytes per partition the block-sparse forward needs beside resident K/V and the
#: per-slot tables, counted generously: a group's query state, score and P tiles, the mask
#: tiles, a group's held outputs (natural order), the P tiles of the back halves a step keeps
#: pending (BSP_PIPELINE_BLOCKS). Measured peak (simulate.measure, trn2, bf16): N = 4096,
#: D = 128 every block active 33.8 KiB with 16.6 KiB of K/V, i.e. 17.2 KiB beside them at
#: 32 slots; 34.3 KiB (35080 bytes, 17.7 KiB beside) with the held outputs; with the pending
#: back halves 39448 bytes at s = 1/4 (21.9 KiB beside; 38924 at s = 1)
#: (NKI_FLASH_API=nki benchmarks/block_sparse.py --n 4096 --d 64 128 --min-density 32
#: --passes fwd).
BSP_FWD_WORK_BYTES = 24 * 1024
#: fp32 ``[128, trip]`` tables one query tile of the block-sparse forward keeps through its
#: sweep (the meta row broadcast, key thresholds, band columns, block numbers, ...), counted
#: generously.
BSP_FWD_SLOT_TABLES = 10


#: Slots of a class of the block-sparse forward's query tiles from which its P^T transposes
#: take the device's full DMA share (:data:`FWD_NKI_P_DMA_SHARE`, resident K/V only: the DMA
#: queues gather nothing); a class of ``trip`` slots takes ``trip / BSP_P_DMA_FULL_SLOTS`` of
#: it (:func:`bsp_p_dma_share`): a short sweep cannot hide a DMA transpose's completion
#: latency (simulate._hw DMA_FIXED_LATENCY_NS) behind other tiles' work. Scheduled estimate,
#: trn2, N = 4096, D = 128, bf16, fixed_density (trip = 128 s / 4), DMA share 0 / 0.25 / 0.5 /
#: 0.75 / 1: s = 1/2 184.8 / 154.4 / 158.3 / 145.5 / 171.0 us; s = 1/4 106.3 / 105.1 / 100.3
#: / 116.3 / -; s = 1/16 73.7 / 73.7 / 79.7 / 79.7 / 79.7; s = 1 (0.5 / 0.75) 276.4 / 235.9.
BSP_P_DMA_FULL_SLOTS = 16


#: The most padding slots, as a share of its active blocks, with which a bool block mask's
#: query tiles stay in natural order in one class of the largest count under nki.* with
#: resident K/V (``host.block_sparse.launch_tables`` ``keep_order``): plain loads and stores
#: of their rows (no indirect scatters, which the scheduler orders one after the other)
#: against masked padding slots (one ScalarE instruction per slot and their matmuls and
#: softmax work); more padding, and the tiles are sorted into tight classes. Scheduled
#: estimate, trn2 through nki.*, N = 4096, D = 128, bf16, band+strided (8.5 % padding):
#: sorted 77.3 us, natural 69.6 us. The threshold itself is a choice (not measured).
BSP_NATURAL_MAX_PADDING = 0.25


def bsp_p_dma_share(share: float, trip: int) -> float:
    """The P^T DMA-transpose share of a block-sparse forward class of ``trip`` slots: ``min(
    share, trip / BSP_P_DMA_FULL_SLOTS)``."""
    return min(float(share), trip / BSP_P_DMA_FULL_SLOTS)


def bsp_fwd_kv_resident(Nk: int, D: int, mm_itemsize: int, trip: int) -> bool:
    """Whether the block-sparse forward keeps K^T and ``[V | 1 | flag]`` of one (batch, kv
    head) in SBUF, whole 128-key blocks and one block of zeros (the padding slots'; nki.*,
    trn2's budget :data:`FWD_SBUF_BUDGET_BYTES`):
    when they fit beside :data:`BSP_FWD_WORK_BYTES` and the tables of a group of
    :data:`BSP_GROUP_TILES` query tiles of ``trip`` slots."""
    nkb = ceil_div(Nk, PMAX) + 1
    kv = fwd_d_passes(D) * nkb * PMAX * mm_itemsize + nkb * (D + 2) * mm_itemsize
    tables = BSP_GROUP_TILES * BSP_FWD_SLOT_TABLES * 4 * max(1, trip)
    return kv + BSP_FWD_WORK_BYTES + tables <= FWD_SBUF_BUDGET_BYTES["trn2"]



#: SBUF bytes per partition per query tile of a block-sparse forward super-group beside the
#: dense forward's query state (:func:`fwd_q_state_bytes`): the score statistics' columns,
#: its Q gather indices and first row (``attention/block_sparse._supergroup``), counted
#: generously.
BSP_SG_TILE_EXTRA_BYTES = 64
#: fp32 ``[128, U]`` tables of a super-group's union of key blocks (its row on every
#: partition, positions, bounds, gather rows, the padding columns or key thresholds).
BSP_SG_UNION_TABLES = 7
#: SBUF bytes per partition per query tile of a masked super-group: its step's keep flags and
#: mask values (fp32 columns of ``[step, tiles]`` tiles), counted with a margin.
BSP_SG_MASK_TILE_BYTES = 16
#: The most idle tile slots (past a run of identical block sets, or super-groups a (b, h)
#: does not need) the host accepts in a super-group plan, as a share of the real query tiles:
#: an idle slot costs a tile's whole sweep (``host.block_sparse.supergroup_tables``). A
#: choice, not measured.
BSP_SG_MAX_IDLE = 0.125

#: The most (tile, block) pairs a masked super-group plan may compute, as a multiple of the
#: pattern's active pairs (every tile of a masked super-group computes every block of its
#: union, masking the ones not its own), before the host takes sparse super-groups instead
#: (each tile computes only its own blocks, in sub-steps of up to 8 read at runtime offsets,
#: at a higher cost per pair). Scheduled estimate, trn2 through nki.*, N = 8192, D = 128,
#: bf16, random patterns (benchmarks/block_sparse.py's, seed 1), one super-group of 64 tiles
#: over 64 key blocks, K/V forced past SBUF: masked 936.3 us at every density (4096 pairs),
#: sparse 356.7 / 473.8 / 697.0 us at s = 1/8 / 1/4 / 1/2 (517 / 1029 / 2061 pairs, about
#: 0.22 us a pair from s = 1/4 on): they would cross at about 3170 pairs, 4096 / 3170 = 1.29.
BSP_SG_SPARSE_PAIR_COST = 1.3


def bsp_fwd_supergroup_tiles(D: int, mm_itemsize: int, in_itemsize: int, trip: int,
                             masked: bool = False, own: bool = False) -> int:
    """Query tiles of one super-group of the block-sparse forward (nki.*, K/V not resident,
    ``attention/block_sparse._supergroup``): as many as the dense forward's streaming regime
    keeps on chip (:func:`choose_forward_tiles`: each tile's Q^T and ``[o_acc | l]``, its
    statistics and finished output, :func:`fwd_q_state_bytes` + :data:`BSP_SG_TILE_EXTRA_BYTES`,
    ``masked``: + :data:`BSP_SG_MASK_TILE_BYTES`), beside :data:`BSP_FWD_WORK_BYTES` (the step's
    gathered blocks, scores and P tiles; doubled for fp32 operands, as the window's) and the
    union's tables (:data:`BSP_SG_UNION_TABLES` of ``trip`` slots, the table's ``U``), in
    trn2's budget :data:`FWD_SBUF_BUDGET_BYTES`; at least 1. D = 128, bf16, U = 528 (N = 64K):
    151 tiles (N = 64K then runs 4 super-groups of 128, the dense forward's 4 passes), masked
    149; D = 64: 233. Measured (simulate.measure, trn2, D = 128, bf16, U = 528, one step of
    16 blocks): peak 179202 bytes per partition at 151 tiles (exact), 176886 at 149
    (masked), within the budget's 206438. ``own`` (sparse super-groups: a smaller state per
    tile, a step of :data:`BSP_SG_OWN_STEP_BLOCKS` blocks): 138 tiles at D = 128,
    bf16, U = 576 (N = 64K: 4 super-groups of 128), peak 171460 (one step of 64 blocks);
    the 64K benchmark's random s = 1/8: 163380."""
    tables = BSP_SG_UNION_TABLES * 4 * (2 + max(1, trip))
    per_tile = fwd_q_state_bytes(D, mm_itemsize, in_itemsize) + BSP_SG_TILE_EXTRA_BYTES
    if masked:
        per_tile += BSP_SG_MASK_TILE_BYTES
    work = BSP_FWD_WORK_BYTES * mm_itemsize // 2
    if own:
        # a tile keeps Q^T (one [128, 128] per D pass), [o_acc | l | flag], its statistics
        # and its finished output (finalize stages the super-group's at once). The peak
        # measured at D <= 128 with bf16 inputs (D = 128: 171460 of 206438 at 138 tiles)
        # shows the other terms' margin holding the output; past D = 128 or with fp32
        # inputs the output is counted in full (fp32 inputs, bf16 matmuls, D = 160 / 192:
        # 227692 / 228940 bytes at 73 / 53 tiles without it, past the budget)
        wide = D > PMAX or in_itemsize > 2
        per_tile = (fwd_d_passes(D) * PMAX * mm_itemsize + (D + 2) * 4
                    + (D * in_itemsize if wide else 0) + BSP_SG_TILE_EXTRA_BYTES)
        work += BSP_SG_OWN_STEP_BLOCKS * bsp_sg_step_block_bytes(D, mm_itemsize, in_itemsize)
    free = FWD_SBUF_BUDGET_BYTES["trn2"] - work - tables
    return max(1, free // per_tile)


#: Key blocks per step of a sparse super-group (``host.block_sparse.
#: sparse_supergroup_tables``, ``attention/block_sparse._own_blocks``): wider than
#: :data:`BSP_SHARED_STEP_BLOCKS`, so that a query tile finds more of its own blocks in a
#: step and its sub-steps are fuller (one online-softmax update per sub-step of
#: :data:`BSP_SG_OWN_WIDTHS` blocks).
BSP_SG_OWN_STEP_BLOCKS = 64


def bsp_sg_step(width: int, own: bool) -> int:
    """Key blocks per step of a super-group whose union table row has ``width`` (``U``)
    slots: :data:`BSP_SHARED_STEP_BLOCKS` (sparse super-groups, ``own``:
    :data:`BSP_SG_OWN_STEP_BLOCKS`), or the pattern's bound M if smaller (the host's
    ``U = (M // W + 1) W``, ``host.block_sparse.union_width``, is at least two steps, so
    ``U // 2`` finds M again)."""
    return min(BSP_SG_OWN_STEP_BLOCKS if own else BSP_SHARED_STEP_BLOCKS, width // 2)
#: The widths of a sparse super-group's sub-steps, in key blocks: a tile's own blocks of a
#: step run in ``n // 8`` sub-steps of 8 (two PSUM banks of scores), then at most one each of
#: 4, 2 and 1 for the rest (runtime trip counts of 0 or 1), so no slot is padding and nothing
#: is masked. Each width a halving of the one before. Scheduled estimate, trn2 through nki.*,
#: N = 16384, D = 128, bf16, random s = 1/8 / 1/4 (seed 1), K/V forced past SBUF, one
#: super-group of 128 tiles, steps of 64 blocks: (4, 2, 1) 1189.3 / 1855.7 us, (8, 4, 2, 1)
#: 1096.1 / 1550.8; with no P^T transposes on the DMA engines (4, 2, 1) 1141.3 / 1895.0,
#: (8, 4, 2, 1) 1099.2 / 1709.0, (16, 8, 4, 2, 1) 1100.4 / 1746.0.
BSP_SG_OWN_WIDTHS = (8, 4, 2, 1)


def bsp_sg_step_block_bytes(D: int, mm_itemsize: int, in_itemsize: int) -> int:
    """SBUF bytes per partition of one key block of a super-group step: K rows as loaded
    (``in_itemsize``), K^T per head-dim pass and ``[V | 1 | flag]`` (matmul dtype)."""
    return (D * in_itemsize + fwd_d_passes(D) * PMAX * mm_itemsize
            + (D + 2) * mm_itemsize)


def bsp_sg_own_layout(step: int):
    """``(sections, columns)`` of a sparse super-group's per (step, tile) row (``host.
    block_sparse.sparse_supergroup_tables``): the trip count of each width of
    :data:`BSP_SG_OWN_WIDTHS` up to ``step`` (one column each), then per width a section of
    the blocks' positions in the step; ``sections`` lists ``(width, first column)``: the
    first width's section holds ``step // width`` sub-steps, each later one as many as the
    remainder left by the width before can need."""
    widths = [w for w in BSP_SG_OWN_WIDTHS if w <= step]
    col = len(widths)
    sections = []
    for i, w in enumerate(widths):
        most = step // w if i == 0 else (widths[i - 1] - 1) // w
        sections.append((w, col))
        col += most * w
    return tuple(sections), col


#: SBUF bytes per partition of the block-sparse forward's key-block window (nki.*, K/V not
#: resident, ``host.block_sparse.window_tables``) beside its blocks, the per-slot tables and
#: :data:`BSP_FWD_WORK_BYTES`: one block's staging while it is gathered into the window (K
#: rows, K^T, ``[V | 1 | flag]``, its table entry and row indices) and what the window path
#: holds beyond the work bytes (fitted to the peaks measured at
#: :data:`BSP_FWD_WINDOW_PLAIN_SLOT_TABLES`, with a margin).
BSP_FWD_WINDOW_STAGE_BYTES = 6 * 1024
#: SBUF bytes per partition per window block of a group's load row (``window_loads``: the
#: row on every partition, its positions, the blocks' gather rows and bounds: about five
#: 4-byte tables of the window's width; read from ``attention/block_sparse._load_window``).
BSP_FWD_WINDOW_LOAD_TABLE_BYTES = 20


#: Key blocks the block-sparse forward's window gathers per step of its load loop
#: (``attention/block_sparse._load_window``): their K and V rows issued together, one guard
#: and one PSUM tile of K^T transposes for them, so that a group's gathers overlap each other
#: instead of each block's chain waiting for the one before. Scheduled estimate, trn2 through
#: nki.*, D = 128, bf16, bool mask, K/V forced past SBUF, 1 / 2 / 4 / 8 blocks: N = 8192
#: band+strided 130.0 / 125.8 / 128.1 / 138.9 us, fixed_density s = 1/16 195.2 / 196.0 /
#: 198.5 / 206.5; N = 16384 (1 / 2) band+strided 269.6 / 242.0, s = 1/16 531.5 / 531.5.
BSP_WINDOW_LOAD_BLOCKS = 2


#: fp32 ``[trip]`` tables per query tile the block-sparse forward's window path keeps where
#: nothing but its padding slots is masked (no causal or local band, lengths, score modifier
#: or dropout, whole key blocks: the group's meta rows and window positions; the padding
#: rows are ``[trip, tiles, 128]``), counted with a margin. Measured (simulate.measure, trn2,
#: D = 128, bf16, 16 query tiles of 259 slots (256 common) at Nk = 64K, a window of 283
#: blocks): peak 189532 bytes per partition, 42988 beside the window, where a group of 53
#: slots and 317 blocks had 38832 (this module's :func:`bsp_fwd_window_blocks` covers both
#: with :data:`BSP_FWD_WINDOW_STAGE_BYTES` and :data:`BSP_FWD_WINDOW_LOAD_TABLE_BYTES`);
#: with a causal band, both lengths, ALiBi and dropout 38.6 KB more at 259 slots (peak
#: 228120, over the budget: those launches keep :data:`BSP_FWD_SLOT_TABLES`).
BSP_FWD_WINDOW_PLAIN_SLOT_TABLES = 3


def bsp_fwd_window_blocks(D: int, mm_itemsize: int, trip: int, plain: bool = False) -> int:
    """Key blocks the block-sparse forward's window holds in SBUF (nki.*, where K/V of a
    (batch, kv head) are not resident, :func:`bsp_fwd_kv_resident`): as many whole blocks of
    K^T and ``[V | 1 | flag]`` as fit, with one block of zeros (the padding slots'), beside
    :data:`BSP_FWD_WORK_BYTES`, the tables of a group of ``trip`` slots
    (:data:`BSP_FWD_WINDOW_PLAIN_SLOT_TABLES` per tile where the launch is ``plain``: only
    padding slots masked; else :data:`BSP_FWD_SLOT_TABLES`), a group's load row
    (:data:`BSP_FWD_WINDOW_LOAD_TABLE_BYTES` per block) and one block's staging
    (:data:`BSP_FWD_WINDOW_STAGE_BYTES`), in trn2's budget :data:`FWD_SBUF_BUDGET_BYTES`
    (the resident budget's formula). 0 when not even one fits. Measured (simulate.measure,
    trn2, D = 128, bf16, Nk = 64K): a full window of a group of 8 query tiles of up to 53
    random key blocks (317 blocks, plain) peaks at 202920 bytes per partition, of 16 tiles of
    259 slots (280 blocks, plain) at 187984, within the 206438 of the budget."""
    per_block = (fwd_d_passes(D) * PMAX * mm_itemsize + (D + 2) * mm_itemsize
                 + BSP_FWD_WINDOW_LOAD_TABLE_BYTES)
    per_tile = BSP_FWD_WINDOW_PLAIN_SLOT_TABLES if plain else BSP_FWD_SLOT_TABLES
    tables = BSP_GROUP_TILES * per_tile * 4 * max(1, trip)
    # the working set and staging were fitted at bf16; fp32 operands (mixed_precision=False)
    # double them (measured: D = 128, trip 40, a full window of 162 blocks peaked at 229364
    # bytes per partition with them unscaled, 22926 over the budget)
    fixed = (BSP_FWD_WORK_BYTES + BSP_FWD_WINDOW_STAGE_BYTES) * mm_itemsize // 2
    free = FWD_SBUF_BUDGET_BYTES["trn2"] - fixed - tables
    return max(0, free // per_block - 1)

#: Edge of the query x key unit a dropout mask is generated in: every unit draws its keep bits
#: from a generator seeded by (seed, batch, head, query unit, key unit), so the mask does not
#: depend on the kernel's own tiling, its loop order or the core that runs the unit.
DROPOUT_UNIT = PMAX
#: Dropout units are numbered ``((b Hq + h) ceil(Nq/128) + query tile) ceil(Nk/128) + key unit``
#: and the RNG of a unit is seeded with ``seed + unit`` (an int32 add on chip), so the kernels
#: take the seed modulo 2^30 and need fewer than 2^30 units per launch.
DROPOUT_SEED_MOD = 1 << 30


def dropout_units(B: int, Hq: int, Nq: int, Nk: int) -> int:
    """Number of 128 x 128 dropout units of a launch (see ``DROPOUT_SEED_MOD``)."""
    return B * Hq * ceil_div(Nq, DROPOUT_UNIT) * ceil_div(Nk, DROPOUT_UNIT)


def unrolled(start: int, stop: Optional[int] = None, step: int = 1) -> Tuple[int, ...]:
    """The integers of ``range(start, stop, step)`` as a tuple, for trace-time Python in kernel
    code: loops the tracer unrolls (head-dim passes, chunks of a tile, heads of a group) and
    lists of compile-time sizes or tiles. Kernel code does not call ``range()``: neuronx-cc
    rewrites every ``range(...)`` inside a kernel into ``nl.sequential_range(...)``
    (nki.language.sequential_range, Notes), whose index is a traced value and whose body is
    compiled once."""
    if stop is None:
        start, stop = 0, start
    start, stop, step = int(start), int(stop), int(step)
    if step <= 0:
        raise ValueError(f"unrolled: step must be a positive int, got {step}")
    count = max(0, ceil_div(stop - start, step))
    return tuple(itertools.islice(itertools.count(start, step), count))


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
#: Per-partition bytes of the working set (input, exponentials, output) under which a whole row
#: tile stays on chip and is read from HBM once (bf16: rows up to 16384 columns).
SOFTMAX_RESIDENT_BYTES = 96 * 1024
#: Lower clamp of the running row max: keeps exp(x - m) finite (no -inf - -inf) for rows that
#: are entirely -inf. Any finite fp32 below every real score works; this is nl.fp32.min.
SOFTMAX_M_FLOOR = FP32_MIN
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
        # input, exp(x - m) (fp32 for fp32 output, else the output dtype), output
        per_col = in_itemsize + (4 if out_itemsize == 4 else out_itemsize) + out_itemsize
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
BWD_MASK_FILL = FP32_MIN
#: An LSE below this marks a row with no visible key (the forward writes -inf there).
BWD_LSE_NO_KEY = -1.0e30
#: Exp bias of such a row is ``BWD_EXP_BIAS_NO_KEY - BWD_LSE_NO_KEY = -1e30`` (instead of
#: ``-LSE = +inf``), so its recomputed P is exactly 0 and every intermediate stays finite.
BWD_EXP_BIAS_NO_KEY = -2.0e30
#: Where dQ accumulates across key tiles: on chip (the design) or in an fp32 HBM scratch (the
#: atomics analogue, kept for measurement).
BWD_DQ_ACCUMULATE_MODES = ("sbuf", "hbm")
#: How dS is transposed for dQ = dS K (keys onto partitions), per target: "pe" = TensorE
#: transposes of 128 x 128 blocks plus PSUM -> SBUF copies (one more PE pass per score); "dma" =
#: one SBUF -> SBUF ``nisa.dma_transpose`` of all blocks of a visit on the otherwise idle DMA
#: queues (trn2: 50 % of DMA throughput, ~0.8 us per 128 x 512 scores, under TensorE's 1.07 us;
#: trn1 has no DMA-transpose hardware). "pe" on both: AWS's own kernels disable the SBUF -> SBUF
#: DMA transpose by default as not yet stable (nki-samples 0898a77 ``transpose_p_local``), so it
#: is opt-in here until documentation says otherwise.
BWD_DS_TRANSPOSE = {"trn1": "pe", "trn2": "pe"}
#: With PE transposes: dS^T blocks per visit whose PSUM -> SBUF copy runs on ScalarE (the others
#: on VectorE), balancing ScalarE (exp and dP - D) against VectorE (dS multiply, dQ add).
BWD_ACT_EVAC_BLOCKS = {"trn1": 1, "trn2": 1}
#: Spans the K/V tiles of a causal or windowed backward are split into: each span's loops cover
#: only the resident query slots its keys can reach (compile-time ranges), so the band's fully
#: masked triangle is skipped at span granularity with a program whose size does not grow with N.
BWD_K_SPANS = 16
#: SBUF bytes per partition the backward plans into: 90 % of capacity, as the forward's.
BWD_SBUF_BUDGET_BYTES = {"trn1": 192 * 1024 * 9 // 10, "trn2": 224 * 1024 * 9 // 10}
#: Per-partition bytes of one input tensor's rows moved by one DMA of the backward (a run of
#: whole 128-row tiles: 8 tiles for bf16 D = 128): every DMA pays a fixed cost (81.25 ns, about
#: 30 KB of transfer time on trn2), so Q, dO, O, LSE and dQ move several tiles per DMA, and K, V,
#: dK, dV a whole key tile. The run's dO/O temporaries fit in ``BWD_SBUF_SLACK``.
BWD_GROUP_BYTES = 2048
#: Per-partition bytes kept free for everything that is not resident query-side state (K/V
#: tiles, P, dS and temporaries, double-buffered) on top of the computed working set.
BWD_SBUF_SLACK = 4 * 1024


def bwd_key_tile(D: int, ds_transpose: str = "pe", transforms: int = 0) -> int:
    """Keys per K/V tile of the backward: ``128 * 2^transforms`` keys (``transforms``: how many
    score transforms run, soft-capping and ALiBi), at most the most 128-key blocks whose fp32
    dK (and dV) accumulators ``[128 keys, D]`` share one PSUM bank per partition (512 keys for
    D <= 128, 256 for D <= 256), which ``ds_transpose="dma"`` always takes (one DMA transpose
    per visit, whose fixed cost wants many blocks).

    Why: a visit (128 query rows x one key tile) is a dependent chain -- S, exp, dP, dS, its
    transposes, dQ -- and two rotating buffers per tile let only a few visits overlap, so
    short visits keep TensorE busiest; but the score transforms add per-score instructions on
    ScalarE, VectorE and GpSimd, whose fixed costs favour wider visits once those engines are
    the busy ones. Scheduled estimates, trn2, N = 4096, D = 128, keys 128 / 256 / 512 (us):
    plain 480.7 / 548.0 / 575.7 (causal 285.1 / 310.1 / 352.1; trn1 445.5 / 503.5 / 560.7),
    softcap 591.3 / 561.4 / 586.8, ALiBi 638.7 / 571.6 / 773.9, both (and sinks) 899.1 /
    848.4 / 753.9. D = 64 and 256 favour the short tile likewise."""
    widest = PMAX * max(1, PSUM_FMAX // max(D, PMAX))
    if ds_transpose == "dma":
        return widest
    return min(widest, PMAX << transforms)


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
    key_tile = bwd_key_tile(D, "dma")     # the wider of the two modes' tiles
    d_chunks = ceil_div(D, PMAX)
    kv_tile = (key_tile // PMAX) * D * op_itemsize + 2 * d_chunks * key_tile * op_itemsize
    visit = 3 * key_tile * op_itemsize + 4 * key_tile + PMAX * op_itemsize
    temps = 2 * D * in_itemsize + 2 * 4 * D
    return 2 * kv_tile + visit + temps + BWD_SBUF_SLACK


def bwd_rows_per_pass(D: int, op_itemsize: int, target: str, *, dq_on_chip: bool = True,
                      in_itemsize: int = 4) -> int:
    """Query rows (summed over the heads of a GQA group) whose state fits SBUF in one pass, a
    multiple of 128 (at least 128), within ``BWD_SBUF_BUDGET_BYTES`` (90 % of SBUF). A call with
    ``G * Nq`` at most this runs in a single pass, reading every input once; longer ones take
    :func:`bwd_passes` passes over K/V."""
    room = BWD_SBUF_BUDGET_BYTES[target] - bwd_working_bytes(D, op_itemsize, in_itemsize)
    return PMAX * max(1, room // bwd_slot_bytes(D, op_itemsize, dq_on_chip))


#: Query tiles staged (and their dQ written) per loop body by the block-sparse backward, each
#: with its own buffers: four tiles' loads in flight, so the phase is not one DMA latency
#: per tile (N = 4096, D = 128, s = 1/8, trn2: see README "Block-sparse attention").
BSP_BWD_STAGE_TILES = 4


#: SBUF bytes per partition of the block-sparse backward's working set beside its staged query
#: tiles (a K/V block, a pair's tiles, the tables; rotating buffers), per byte of the matmul
#: dtype: ``[plain, with score modifiers, dropout or lengths]``. Measured peak minus the staged
#: bytes (``simulate.measure``, trn2, N = 1024, G = 2, D = 64 / 128 / 256, index form): bf16
#: 3.1 / 3.5 / 5.0 KB plain, 8.0 / 8.3 / 9.6 KB with softcap, ALiBi, sinks, dropout, causal
#: and both lengths; fp32 4.8 / 5.6 / 8.1 and 9.6 / 10.4 / 13.0 KB.
BSP_BWD_WORKING_BYTES = (3 * 1024, 5 * 1024)


def bsp_bwd_chunk_bytes(G: int, slots: int, D: int, op_itemsize: int, extras: bool,
                       chunked: bool) -> int:
    """SBUF bytes per partition of a chunk of the block-sparse backward
    (``attention/block_sparse_bwd.py``) staging ``slots`` query tiles of each of the ``G`` heads
    of a kv group: ``G (slots + 1)`` tiles (one zero tile per head) of ``bwd_slot_bytes`` each
    (the dense backward's resident slot), the working set (``BSP_BWD_WORKING_BYTES``;
    ``extras``: score modifiers, dropout or lengths) and, with several chunks (``chunked``),
    the fp32 dK/dV partial sums read back from HBM (two ``[128, D]`` tiles, double-buffered)."""
    staged = G * (slots + 1) * bwd_slot_bytes(D, op_itemsize)
    working = BSP_BWD_WORKING_BYTES[int(extras)] * op_itemsize
    return staged + working + (2 * 2 * 4 * D if chunked else 0)


def bsp_bwd_chunks(G: int, Nq: int, D: int, op_itemsize: int, target: str,
                   extras: bool) -> Tuple[int, int]:
    """``(chunks, slots)``: the block-sparse backward splits the ``ceil(Nq / 128)`` query tiles
    of a kv group into chunks of ``slots`` consecutive tiles per head (the last chunk holds the
    rest, at least one) whose :func:`bsp_bwd_chunk_bytes` fit ``BWD_SBUF_BUDGET_BYTES`` (90 %
    of SBUF), as few as may be and balanced. One chunk: 16K rows at D = 128 on trn2.
    ``(0, 0)`` when not even one tile per head fits."""
    budget = BWD_SBUF_BUDGET_BYTES[target]
    n_tiles = ceil_div(Nq, PMAX)
    if bsp_bwd_chunk_bytes(G, n_tiles, D, op_itemsize, extras, False) <= budget:
        return 1, n_tiles
    fixed = bsp_bwd_chunk_bytes(G, 0, D, op_itemsize, extras, True)
    most = (budget - fixed) // (G * bwd_slot_bytes(D, op_itemsize))
    if most < 1:
        return 0, 0
    slots = ceil_div(n_tiles, ceil_div(n_tiles, most))
    return ceil_div(n_tiles, slots), slots


def check_chunk_tiles(chunk_tiles, n_tiles: int) -> None:
    """Refuse a block-sparse backward chunk size (query tiles per chunk) that is not an int in
    ``[1, n_tiles]``, naming the argument."""
    if (isinstance(chunk_tiles, bool) or not isinstance(chunk_tiles, numbers.Integral)
            or not 1 <= chunk_tiles <= n_tiles):
        raise ValueError(f"chunk_tiles: expected an int in [1, {n_tiles}] (query tiles per "
                         f"chunk), got {chunk_tiles!r}")


def bwd_passes(G: int, Nq: int, rows_per_pass: int) -> Tuple[int, int]:
    """``(P, slots)``: passes over K/V and resident 128-row query tiles per head and pass, for
    ``G`` query heads per kv head. Pass p holds tiles ``t P + p`` (t < slots) of every head; the
    slots are balanced so that at most ``P - 1`` of the ``P * slots`` tiles are padding."""
    n_tiles = ceil_div(Nq, PMAX)
    most = max(1, rows_per_pass // (PMAX * G))
    passes = ceil_div(n_tiles, most)
    return passes, ceil_div(n_tiles, passes)


# ============================================================================================
# Flash attention forward (issue #3): nki_kernels/attention/forward.py
# ============================================================================================
#
# Per (batch, kv head) the kernel keeps, per partition: K^T (head dim on partitions, one
# [<=128, Nk] tile per 128-wide head-dim pass) and V (Nk/128 blocks of [128 keys, D]) when they
# fit ("resident": every K/V byte read once for all query heads of the group), else a 2048-key
# chunk of them that streams past a group of resident query tiles. Per query tile of 128 rows:
# Q^T ([D pass, 128], scaled), the fp32 running output o_acc [128, D] and m_i, l_i.

#: Query rows per tile: one query per partition; Q^T [D, 128] is the stationary operand of S.
FWD_Q_TILE = PMAX
#: Keys per score tile: 128 x 512 scores of S = Q K^T are one matmul into one PSUM bank.
FWD_K_TILE = PSUM_FMAX
#: Keys per PV contraction: P^T chunk [128 keys, 128 queries] (stationary) x V [128 keys, D].
FWD_V_CHUNK = PMAX
#: Keys per online-softmax update (4 PSUM banks of scores). Each update costs ~8 instructions
#: on (P, 1) statistics of >= 64 cycles (MIN_II) and one rescale of o_acc; 2048 keys amortise
#: them to < 10 % of the per-score work (AWS flash_fwd's "large tile" is also 2048).
FWD_SOFTMAX_BLOCK = 4 * FWD_K_TILE
#: 128-key chunks of P^T per PSUM tile (one bank) and per PSUM -> SBUF copy: 4 copies of 512
#: columns per softmax block, fine enough to balance them between ScalarE and VectorE.
FWD_PT_CHUNKS = 4
#: Keys per K/V DMA: 16 blocks of 128 keys (4 KiB per partition for bf16 D = 128, the DMA
#: guide's full-rate size).
FWD_KV_LOAD_BLOCK = 2048
#: Keys per streamed K/V chunk when K/V does not stay resident.
FWD_KV_CHUNK = FWD_SOFTMAX_BLOCK
#: Spans of query tiles per head when a causal or window band is active: each span sweeps
#: only the union of its rows' key ranges (compile-time loop bounds), so a causal kernel
#: computes about (1 + 1/FWD_Q_SPANS) / 2 of the full score matrix; the program holds one copy
#: of the loop nest per span (constant in N).
FWD_Q_SPANS = 16
#: Fewest query tiles per span (with fewer tiles, fewer spans) when the band's spans cover
#: all query tiles (not the edges of a sliding window): a span's tiles are the independent
#: online-softmax chains a group interleaves, and a span of one or two tiles leaves the engines
#: waiting on each other's latencies (nki.*: on the DMA transposes of P), more than the
#: masked keys a longer span sweeps cost. Scheduled estimate, trn2, one core, bf16, causal,
#: FWD_Q_SPANS = 16, 1 / 2 / 4 / 8 tiles (N = 2048: 16 / 8 / 4 / 2 spans; N = 4096: - / 16 /
#: 8 / 4): nki.* N = 2048 D = 64 62.2 / 57.5 / 56.1 / -, D = 128 72.8 / 64.3 / 61.9 / -;
#: N = 4096 D = 128 - / 165.2 / 161.5 / 157.6 us; legacy D = 128 N = 2048 77.0 / 69.5 / 72.3
#: / -, N = 4096 - / 202.6 / 199.7 / 214.6 us (8 would make legacy worse at N = 4096). With
#: FWD_MASKED_P_DMA_SHARE = 0 (below), nki.* trn2 N = 4096 D = 128: 4 / 8 tiles 155.3 / 164.4.
#: Both namespaces plan alike, so their outputs stay equal bit for bit.
FWD_MIN_SPAN_TILES = 4
#: Fewest spans FWD_MIN_SPAN_TILES may leave; below it spans of one tile, as without it: with
#: few spans a span sweeps much more of the masked triangle (1 / (2 spans) of the square).
#: Scheduled estimate, N = 1024 causal D = 128 (8 tiles), spans of 1 / 2 / 4 tiles: legacy
#: trn2 26.8 / 26.9 / 29.2 us, trn1 25.2 / 25.6 / 27.1; nki.* trn2 32.1 / 25.8 / 25.1 (legacy
#: must not get worse: 1 tile). N = 2048 (4 spans of 4) and above meet it.
FWD_MIN_Q_SPANS = 4
#: Query tiles per group (per kv group, all heads together) with resident K/V: their online
#: softmax chains are interleaved in the loop nest (key blocks outer, tiles inner), so every
#: engine has independent work while one tile waits on another engine. 8 tiles: the scheduled
#: estimate at N = 4096 D = 128 falls from 2.2x to 1.6x the perfect-overlap bound (1, 2, 4, 8:
#: 404, 348, 319, 303 us on trn2, on the scheduler of 2026-11-25); the state is ~0.8 KiB per
#: tile per partition.
FWD_RESIDENT_Q_GROUP = 8
#: Query tiles whose first half of a key block (scores, row max, exp) is issued before any of
#: their second halves (P^T, P V, the accumulator update): each engine's in-order queue then
#: holds a run of independent instructions instead of one tile's chain (the scheduled
#: estimate, simulate._sched: forward N = 4096 trn2 308.6 -> 266.5 us on the scheduler of
#: 2026-11-25; on 2026-11-26's, with PSUM banks, 8 is still best: 284.5 us against 287.6,
#: 305.6 and 351.6 for 4, 2 and 1). Each staged tile keeps its P of one softmax block in SBUF
#: until its second half.
FWD_STAGE_SLOTS = 8
#: Under nki.* (NKI 0.7: trn2, trn3), the share of P^T chunk groups the DMA engines transpose
#: SBUF -> SBUF (``ForwardTiles.p_dma_transpose_share``), per target. AWS's production NKI 0.7
#: forward transposes all of its P that way (nki-library ``attention_cte``, "Perform DMA
#: transpose": one ``dma_transpose`` per 512 keys). On trn2 three groups in four, the fourth on
#: TensorE, balance the DMA queues (SBUF -> SBUF at half the DMA rate) against TensorE and the
#: ScalarE/VectorE PSUM copies; trn3's faster DMA takes them all. Scheduled estimate, one core,
#: D = 128, bf16, stage 2, shares 0.5 / 0.75 / 1.0: trn2 N = 4096 260.0 / 217.7 / 245.5 us,
#: causal 179.6 / 167.8 / 177.2, N = 2048 76.3 / 67.9 / 76.9, N = 8192 991.7 / 799.8 / 892.1;
#: trn3 N = 4096 239.1 / 210.1 / 187.2. Legacy keeps 0: AWS's legacy flash_fwd left its
#: DMA-transpose path disabled as not yet stable (nki-samples 0898a77 ``transpose_p_local``).
FWD_NKI_P_DMA_SHARE = {"trn2": 0.75, "trn3": 1.0}
#: The same share under attention dropout: all of P on the DMA engines on trn2 too, whose DMA
#: then has room (the draw keeps VectorE and ScalarE busier than the DMA queues) and whose
#: TensorE transposes would need PSUM copies on those two engines. Scheduled estimate, trn2,
#: N = 4096, D = 128, bf16, p = 0.1, shares 0.5 / 0.75 / 1.0: 279.9 / 277.4 / 253.0 us (DMA
#: busy 135.5 / 186.3 / 237.1 us; with the row-max bias on GpSimd 291.1 / 264.8 / 258.2; both
#: before ScalarE's row maxima came first in a block, 249.0 with 1.0).
FWD_NKI_DROPOUT_P_DMA_SHARE = 1.0
#: The DMA transposes' share of P^T in the blocks of a band's masked regions (the keys around
#: the diagonal, where only some rows of a span see the keys): at most this, whatever the
#: target's share. These blocks end each span's sweep, where its tiles' chains have less left
#: to overlap the DMA transposes' completion latency (1.3 us, simulate._hw
#: DMA_FIXED_LATENCY_NS) with. Before masked blocks were swept per tile and joined with the
#: unmasked region's partial last block (forward.sweep_slots, forward._joins), 0 was best (trn2
#: N = 2048 D = 64 52.3 us against 56.1 at the target's share, D = 128 59.3 / 61.9; N = 4096
#: D = 128 155.3 / 161.5; trn3 133.9 / 137.4). Now, scheduled estimate, one core, bf16,
#: causal, shares 0.25 / 0.375 / 0.5 / 0.625 / 0.75 / 1.0: trn2 N = 4096 D = 128 125.7 /
#: 123.7 / 119.4 / 118.1 / 119.6 / 119.6 us (0: 133.6); 0.5 / 0.625 / 0.75: trn2 N = 2048 D =
#: 64 39.3 / 38.8 / 39.1, D = 128 41.1 / 40.7 / 41.5, N = 8192 417.6 / 414.7 / 415.5; trn3
#: N = 4096 102.7 / 102.1 / 100.7.
FWD_MASKED_P_DMA_SHARE = 0.625
#: Staged query tiles under nki.* with those DMA transposes (trn2, share 0.75: stage 2 against
#: 1, 4, 8: N = 4096 217.7 / 218.3 / 218.7 / 239.8 us; N = 8192 799.8 / 799.5 / 808.7 / 853.2;
#: N = 2048 67.9 / 67.2 / 67.0 / 75.6; causal 4096 167.8 / 172.6 / 167.8 / 167.8; trn3, share
#: 1.0: N = 4096 187.2 / 187.7 / 187.2 / 214.3).
FWD_NKI_STAGE_SLOTS = 2
#: Staged query tiles under nki.* with a causal or window band: a band's span holds few tiles
#: (FWD_MIN_SPAN_TILES) and its group sweeps them all together, so staging the whole group
#: gives each engine's queue every tile's independent chain (the scores wait on PSUM banks
#: instead, which the scheduler models). Scheduled estimate, one core, bf16, D = 128, with
#: keys loaded span by span and masked regions swept per tile (forward.sweep_slots), stage 2
#: against 4: trn2 causal N = 4096 132.5 / 128.3 us, trn3 116.0 / 108.1; with the unmasked
#: partial blocks joined to them (forward._joins) and FWD_MASKED_P_DMA_SHARE = 0.625: trn2
#: N = 4096 124.4 / 118.1, N = 2048 45.3 / 40.7, trn3 N = 4096 110.9 / 102.1. Without a band
#: stage 4 would cost trn2 N = 4096 208.1 -> 209.5 (FWD_NKI_STAGE_SLOTS stays 2 there).
FWD_NKI_BAND_STAGE_SLOTS = 4
#: Under dropout through nki.* on NeuronCore-v3+, the share of score tiles whose row max ScalarE
#: takes (``activation_reduce`` of -s with ``reduce_op`` minimum; NKI 0.7 stub: "On NeuronCore-v2,
#: the reduce_op must be nl.add", so v3+ reduces with max/min too) instead of VectorE, which also
#: draws every dropout mask (``nisa.dropout`` is VectorE only) and binds the forward; per target.
#: Counted in 512-key tiles, so the share moves in quarters of a 2048-key block (ScalarE's tiles
#: first). Scheduled estimate, N = 4096, D = 128, bf16, p = 0.1, shares 0.5 / 0.75 / 1.0 (with
#: the P^T of FWD_NKI_DROPOUT_P_DMA_SHARE, the bias on VectorE and the preloaded query rows):
#: trn2 266.5 / 249.0 / 284.1 us (VectorE 235.9 / 201.7 / 167.6 busy, ScalarE 186.0 / 216.7 /
#: 247.5), causal 191.9 / 194.5; trn3 217.7 / 248.2 (its VectorE runs at 1.2 GHz). Before the
#: exp's row sums were chained in ScalarE's registers (one readout per block), trn2 0 / 0.25 /
#: 0.5 / 0.75 gave 328.6 / 300.3 / 278.2 / 302.7. Without dropout VectorE does not bind (share
#: 0.25 there: 217.7 -> 224.6 us): 0. With the seeds charged to VectorE (2026-11-28, the 0.7
#: stub's PRNG), trn2 shares 0.5 / 0.75 / 1.0: 319.6 / 286.6 / 284.1 us (the bias on GpSimd:
#: 318.1 / 285.6 / 288.0); kept at 0.75, the measurements above being from before.
#: Since 2026-11-28 (issue 24 item 6) the share is counted over every block a query-tile
#: group's program text folds (forward.GroupState.max_split), so a share between quarters
#: alternates the blocks' splits (0.875: 4 tiles on ScalarE in one block, 3 in the next).
#: Scheduled estimate, N = 4096, D = 128, bf16, p = 0.1, shares 0.75 / 0.8125 / 0.875 / 0.9375 /
#: 1.0: trn2 281.8 / 275.4 / 264.7 / 268.2 / 274.8 us (VectorE 268.9 / 260.4 / 251.9 / 243.3 /
#: 234.8 busy, ScalarE 211.6 / 219.3 / 227.0 / 234.7 / 242.3); 0.625 / 0.6875 / 0.75 / 0.8125:
#: trn3 240.0 / 235.7 / 240.8 / 250.2 (0.5: 253.2). At the chosen shares against the old (0.75,
#: trn3 0.5): trn2 N = 2048 79.9 -> 76.2, N = 8192 1069.0 -> 1008.3; trn3 N = 2048 72.1 -> 68.4,
#: N = 8192 967.6 -> 895.3; block-sparse (s = 1/8, N = 4096) trn2 101.4 -> 99.0, trn3 86.9 ->
#: 86.3; packed (3 sequences, 4096 rows) unchanged.
FWD_NKI_DROPOUT_MAX_ACT_SHARE = {"trn2": 0.875, "trn3": 0.6875}
#: The same share with a causal or window band (``MaskSpec.has_diag``), each block split alone
#: (a band's blocks vary in width). Scheduled estimate, causal, N = 4096, D = 128, bf16, p = 0.1,
#: shares 0.5 / 0.75 / 1.0: trn2 181.6 / 173.2 / 180.4 us, trn3 152.1 / 161.3 / 169.1 (counted
#: over the group instead, the best: trn2 0.6875 174.0, trn3 0.5625 153.3).
FWD_NKI_DROPOUT_BAND_MAX_ACT_SHARE = {"trn2": 0.75, "trn3": 0.5}
#: Under dropout through nki.* on NeuronCore-v3+, the share of the P^T PSUM -> SBUF copies on
#: ScalarE (``ForwardTiles.act_evac_share`` when that is None; the rest on VectorE). With
#: FWD_NKI_DROPOUT_P_DMA_SHARE = 1 only masked regions (FWD_MASKED_P_DMA_SHARE) have copies; the
#: formula of :func:`fwd_act_evac_share` would put them all on ScalarE (it counts every row max
#: on VectorE). Scheduled estimate, causal, N = 4096, D = 128, p = 0.1, shares 0 / 0.25 / 0.5 /
#: 1.0: trn2 195.1 / 193.5 / 192.2 / 196.0 us, trn3 172.4 / 170.7 / 172.5 / 172.0 (before
#: ScalarE's row maxima came first in a block; with that order 0.5 gives trn2 194.5).
FWD_NKI_DROPOUT_ACT_EVAC_SHARE = 0.5
#: Largest head dim: S contracts it in passes of 128 (two passes max); PV writes D <= 512 fp32.
FWD_MAX_HEAD_DIM = 2 * PMAX
#: Keys per instruction when building a [1, n] key-mask row (iota + compare).
FWD_ROW_FMAX = 8192

# -- numeric sentinels (exact powers of two) ----------------------------------------------------
#: Added to masked scores (softmax units, after the scale) by a matmul ``MASK_NEG x indicator``
#: accumulated into the score PSUM tile. Finite in bf16 and fp32: a -inf could meet another -inf
#: in ``exp(s - m)`` and give NaN (seed 001).
FWD_MASK_NEG = -(2.0 ** 100)
#: Floor of the running max m_i. Real scores lie above it (|scale q.k| < 7.9e28); masked ones lie
#: below MASK_NEG / 2, so ``exp(masked - m_i) = exp(<= -2^99) = 0`` exactly and a row whose keys
#: are all masked ends with l_i = 0 and o_acc = 0 (never NaN).
FWD_M_FLOOR = -(2.0 ** 96)
#: Floor of l_i before log and reciprocal: hardware log is valid on [2^-64, 2^64] (nki-api-spec
#: §8.3). Visible rows have l_i >= 1 (their max term is exp(0)); fully masked rows (l_i = 0) get
#: LSE = -inf and O = 0 from an explicit select, never from log(0).
FWD_L_FLOOR = 2.0 ** -60

#: Softmax scales folded into the exp activation (``exp(scale s - scale m)``, S unscaled in PSUM):
#: in this range the masks' margin survives the scaling (``scale * 2^99 >= 2^75``) and nothing
#: overflows fp32 (``scale * 2^102 < 2^127``). Other scales (tiny, huge, zero or negative) are
#: multiplied into Q^T instead (one more bf16 rounding of the scores' operand).
FWD_FOLD_SCALE_RANGE = (2.0 ** -24, 2.0 ** 24)
#: Largest |sink| and |ALiBi slope| the kernels take: for every exp scale ``u`` of the fold
#: range ``|sink| / u <= 2^56`` and an ALiBi bias ``|slope| / u * N <= 2^76`` (N < 2^20), both far
#: from the running max's floor ``M_FLOOR = -2^96`` and the masks' ``-2^100`` (``score_mods``).
#: Derived from those margins, not measured; real sinks and slopes are O(1-10).
SCORE_MOD_ABS_MAX = 2.0 ** 32

# -- engine balance -----------------------------------------------------------------------------
#: Engine clocks (Hz) of ScalarE and VectorE, and VectorE's cycles per element of a 16-bit
#: PSUM -> SBUF copy (trn2 perf mode: 2 elements/cycle), used to balance the P^T copies
#: (hardware-and-limits.md §1-§2; the ISA docs' "estimated instruction cost").
FWD_ACT_HZ = {"trn1": 1.4e9, "trn2": 1.2e9}
FWD_DVE_HZ = {"trn1": 1.12e9, "trn2": 0.96e9}
FWD_DVE_COPY16_CYCLES = {"trn1": 1.0, "trn2": 0.5}
#: Minimum cycles of one ScalarE/VectorE instruction (MIN_II).
FWD_MIN_II = 64


def fwd_act_evac_share(target: str, *, score_cols: int, blocks: int, rescales: int,
                       q_tiles: int, evac_cols: int, D: int, dropout: bool = False,
                       act_extra: float = 0.0, dve_extra: float = 0.0,
                       dve_cycles: float = 0.0) -> float:
    """Fraction of the P^T PSUM -> SBUF copies to issue on ScalarE so that ScalarE and VectorE
    finish together, from the kernel's own (compile-time) schedule.

    Per score column (of a 128-row tile) VectorE reads S once for the row max and ScalarE
    computes one exp; per key block VectorE does one min-reduction and ScalarE alpha (GpSimd
    scales the bias); VectorE adds each block's PV (D + 1 columns read from PSUM) into the SBUF
    accumulator ``[o_acc | l]`` that GpSimd rescaled (``rescales`` of them); per query tile
    ScalarE copies Q^T out of PSUM and computes log l and the LSE, VectorE does two small
    write-back instructions (GpSimd the rest). A copied column costs ScalarE 1 cycle and
    VectorE 1 (trn1) or 1/2 (trn2, 16-bit perf mode).

    Parameters are totals over the schedule of one kernel instance: ``score_cols`` columns of
    score tiles, ``blocks`` key blocks (``rescales`` of them not a tile's first), ``q_tiles``
    query tiles, ``evac_cols`` P^T columns copied. ``dropout``: VectorE also draws the keep
    mask (``nisa.dropout``, one cycle per score column), so more copies go to ScalarE.
    ``act_extra``, ``dve_extra``: more ScalarE / VectorE cycles per score column (the score
    modifiers, ``score_mods.engine_extra``); ``dve_cycles``: more VectorE cycles in all (the
    forward's non-finite value guard).
    """
    if evac_cols <= 0:
        return 0.5
    ii = FWD_MIN_II
    dve = score_cols + blocks * ii + rescales * max(ii, D + 1) + q_tiles * 2 * ii
    if dropout:
        dve += score_cols
    dve += dve_extra * score_cols + dve_cycles
    act = score_cols * (1.0 + act_extra) + blocks * ii + q_tiles * (PMAX + 2 * ii)
    f_act, f_dve, r_dve = FWD_ACT_HZ[target], FWD_DVE_HZ[target], FWD_DVE_COPY16_CYCLES[target]
    # (dve + (1 - a) E r_dve) / f_dve == (act + a E) / f_act
    share = ((dve + evac_cols * r_dve) * f_act - act * f_dve) / (
        evac_cols * (f_dve + r_dve * f_act))
    return min(1.0, max(0.0, share))


#: Target assumed when the host does not know it: trn1 has the smaller SBUF, so a tiling that
#: fits it fits trn2 too.
FWD_DEFAULT_TARGET = "trn1"


@dataclass(frozen=True)
class ForwardTiles:
    """Compile-time tiling of the flash attention forward kernel (hashable kernel argument).

    Attributes
    ----------
    q_tile, k_tile, v_chunk, softmax_block, kv_load_block : int
        See :data:`FWD_Q_TILE` and the other ``FWD_*`` constants of the same names.
    kv_resident : bool
        True: K^T and V of one (batch, kv head) are loaded once and stay in SBUF for every query
        tile of its heads. False: K/V stream in ``kv_chunk``-key chunks, once per group of
        ``q_group`` query tiles.
    kv_chunk : int
        Keys per streamed chunk (a multiple of ``softmax_block``); unused when resident.
    q_group : int
        Query tiles (over the query heads of one kv head) whose Q^T, o_acc, m_i, l_i stay in SBUF
        during one K/V pass. 1 when K/V is resident (nothing to amortise).
    act_evac_share : float or None
        Fraction of the P^T PSUM evacuations issued on ScalarE (the rest on VectorE); None: the
        kernel balances the two engines from its schedule (:func:`fwd_act_evac_share`).
    p_dma_transpose_share : float
        trn2 only (ignored on trn1): fraction of the P^T chunk groups transposed SBUF -> SBUF by
        the DMA engines (``nisa.dma_transpose``, up to 50 % of DMA bandwidth on trn2) instead of
        TensorE + a PSUM copy. :func:`choose_forward_tiles` picks the target's
        :data:`FWD_NKI_P_DMA_SHARE` under nki.* (as AWS's NKI 0.7 ``attention_cte`` does) and
        0 under legacy (AWS's legacy flash_fwd kept its DMA-transpose path disabled pending
        stabilisation).
    target : str
        "trn1" or "trn2": the generation whose SBUF the K/V residency was sized for.
    stage : int
        Query tiles staged together (:data:`FWD_STAGE_SLOTS`): their scores, max and exp of a
        key block are issued before their P V; each keeps one softmax block of P in SBUF
        (:func:`fwd_stage_bytes`). 1: every tile's block is issued whole.
    q_preload : bool
        Every query row of the program is loaded into a buffer of its own
        (:func:`fwd_q_preload_bytes` of SBUF) a group ahead of its use, instead of each
        group loading its own tiles when it begins (a group's loads of 128-row tiles of
        256-byte rows take longer than its first steps need).
    span_tiles : int
        Fewest query tiles per span of a causal or window band (:data:`FWD_MIN_SPAN_TILES`;
        fewer spans when there are fewer tiles).
    """

    q_tile: int = FWD_Q_TILE
    k_tile: int = FWD_K_TILE
    v_chunk: int = FWD_V_CHUNK
    softmax_block: int = FWD_SOFTMAX_BLOCK
    kv_load_block: int = FWD_KV_LOAD_BLOCK
    kv_resident: bool = True
    kv_chunk: int = FWD_KV_CHUNK
    q_group: int = 1
    act_evac_share: Optional[float] = None
    p_dma_transpose_share: float = 0.0
    target: str = FWD_DEFAULT_TARGET
    stage: int = 1
    q_preload: bool = False
    span_tiles: int = FWD_MIN_SPAN_TILES

    def __post_init__(self):
        if not 1 <= self.q_tile <= PMAX:
            raise ValueError(f"q_tile: expected 1..{PMAX}, got {self.q_tile}")
        if self.v_chunk != PMAX:
            raise ValueError(f"v_chunk: expected {PMAX}, got {self.v_chunk}")
        if self.k_tile % self.v_chunk or not 0 < self.k_tile <= PSUM_FMAX:
            raise ValueError(f"k_tile: expected a multiple of {self.v_chunk} up to {PSUM_FMAX}, "
                             f"got {self.k_tile}")
        if self.softmax_block % self.k_tile or not 1 <= self.softmax_block // self.k_tile <= 4:
            raise ValueError(f"softmax_block: expected 1 to 4 times k_tile={self.k_tile}, got "
                             f"{self.softmax_block}")
        if self.kv_chunk % self.softmax_block:
            raise ValueError(f"kv_chunk: expected a multiple of softmax_block="
                             f"{self.softmax_block}, got {self.kv_chunk}")
        if self.kv_load_block % self.v_chunk or self.kv_load_block < self.v_chunk:
            raise ValueError(f"kv_load_block: expected a multiple of {self.v_chunk}, got "
                             f"{self.kv_load_block}")
        if self.q_group < 1:
            raise ValueError(f"q_group: expected >= 1, got {self.q_group}")
        if self.stage < 1:
            raise ValueError(f"stage: expected >= 1, got {self.stage}")
        if self.span_tiles < 1:
            raise ValueError(f"span_tiles: expected >= 1, got {self.span_tiles}")
        if self.act_evac_share is not None and not 0.0 <= self.act_evac_share <= 1.0:
            raise ValueError(f"act_evac_share: expected None or a fraction in [0, 1], got "
                             f"{self.act_evac_share}")
        if not 0.0 <= self.p_dma_transpose_share <= 1.0:
            raise ValueError(f"p_dma_transpose_share: expected a fraction in [0, 1], got "
                             f"{self.p_dma_transpose_share}")
        if self.target not in SBUF_USABLE_BYTES:
            raise ValueError(f"target: expected one of {sorted(SBUF_USABLE_BYTES)}, got "
                             f"{self.target!r}")


def fwd_d_passes(D: int) -> int:
    """Contraction passes of S = Q K^T over the head dim (128 partitions each): 1 or 2."""
    return ceil_div(D, PMAX)


def fwd_kv_bytes(Nk: int, D: int, mm_itemsize: int) -> int:
    """SBUF bytes per partition of ``Nk`` keys of K^T and V at matmul precision.

    K^T is ``fwd_d_passes(D)`` tiles ``[<=128, Nk]``; V is ``ceil(Nk/128)`` blocks ``[128, D]``
    side by side in the free dim (plus its ones column, counted by the working set's slack).
    """
    kt = fwd_d_passes(D) * Nk * mm_itemsize
    vv = ceil_div(Nk, PMAX) * D * mm_itemsize
    return kt + vv


def fwd_working_bytes(D: int, in_itemsize: int, mm_itemsize: int, tiles: ForwardTiles,
                      masks: bool = True) -> int:
    """SBUF bytes per partition of the forward's transient buffers, counted generously.

    K/V DMA staging in the input dtype; the query load and its transpose; P and P^T of one
    softmax block (twice, so one block can be copied while the next is produced); the (P, 1)
    statistics; the normalised output; with masks, an allowance for the band's working tiles
    (the SBUF copies of boundary score tiles selected at the band's edges; under nki.* also
    the iota and predicate tiles of each selection and the distance-column table,
    ``4 (ceil(Nq / 128) + ceil(Nk / 128) + 1)`` bytes: within it up to N ~ 260K).
    """
    staging = 2 * (tiles.kv_load_block // PMAX) * D * max(in_itemsize, mm_itemsize)
    q_load = D * in_itemsize + fwd_d_passes(D) * PMAX * mm_itemsize
    p_blocks = 2 * 2 * tiles.softmax_block * mm_itemsize
    stats = 16 * 4 * 4
    out = 2 * D * 4
    mask_cache = (12 * tiles.k_tile * 2 + 2 * tiles.k_tile * 4 + PMAX * 2) if masks else 0
    return staging + q_load + p_blocks + stats + out + mask_cache


def fwd_length_table_bytes(Nq: int, Nk: int, group: int, D: int = FWD_MAX_HEAD_DIM, *,
                           q_lens: bool = False, kv_lens: bool = False,
                           q_tile: int = FWD_Q_TILE) -> int:
    """SBUF bytes per partition of the forward's runtime-length state, kept for the whole
    program: the index tables (4 bytes per column: one column per query tile of the group or
    per 128-key block) -- gather, scatter (rotated rows) and validity of the
    ``G ceil(Nq / q_tile)`` query tiles, gather rows of the ``ceil(Nk / 128)`` key blocks -- and
    with ``kv_lens`` the edge key that fills padding keys (``[128, D]``, input dtype). Counted
    generously: fp32 for the edge key, and the temporaries of building the larger table (rows,
    positions, validity, shift, out-of-bounds push: 5 tables)."""
    q_cols = group * ceil_div(Nq, q_tile) if q_lens else 0
    k_cols = ceil_div(Nk, PMAX) if kv_lens else 0
    edge = 4 * D if kv_lens else 0
    return 4 * (3 * q_cols + k_cols + 5 * max(q_cols, k_cols)) + edge


def fwd_stage_bytes(stage: int, tiles: "ForwardTiles", mm_itemsize: int) -> int:
    """SBUF bytes per partition of ``stage`` staged query tiles: P of one softmax block each,
    plus their alpha and (dropout) row sums."""
    return stage * (tiles.softmax_block * mm_itemsize + 2 * 4) if stage > 1 else 0


def fwd_q_preload_bytes(Nq: int, group: int, D: int, in_itemsize: int,
                        q_tile: int = FWD_Q_TILE) -> int:
    """SBUF bytes per partition of every query row of a (batch, kv head) program: ``G
    ceil(Nq / q_tile)`` tiles of D values in the input dtype (``ForwardTiles.q_preload``)."""
    return group * ceil_div(Nq, q_tile) * D * in_itemsize


def fwd_q_state_bytes(D: int, mm_itemsize: int, out_itemsize: int = 4) -> int:
    """SBUF bytes per partition of one query tile's state: Q^T, o_acc (fp32), m_i and l_i, and
    its finished output (o in the output dtype and the fp32 lse), which waits in SBUF until the
    next group of query tiles stores it."""
    return fwd_d_passes(D) * PMAX * mm_itemsize + 4 * D + 2 * 4 + out_itemsize * D + 4


def choose_forward_tiles(Nq: int, Nk: int, D: int, group: int, in_itemsize: int,
                         mm_itemsize: int, *, target: Optional[str] = None,
                         sbuf_bytes: Optional[int] = None, kv_lens: bool = False,
                         masks: bool = True, q_lens: bool = False,
                         api: str = "legacy", device: Optional[str] = None,
                         dropout: bool = False, band: bool = False) -> "ForwardTiles":
    """Pick the forward tiling from the SBUF budget.

    Parameters
    ----------
    Nq, Nk, D : int
        Query length, key length, head dim.
    group : int
        Query heads per kv head (G).
    in_itemsize, mm_itemsize : int
        Bytes per element of the inputs and of the matmul operands.
    target : "trn1" or "trn2", optional
        Default :data:`FWD_DEFAULT_TARGET` (trn1: its tiling also fits trn2).
    sbuf_bytes : int, optional
        Override of the usable SBUF bytes per partition (tests force the streaming regime with it).
    kv_lens, masks, q_lens : bool
        Key lengths are given; some mask is active (mask indicator cache); query lengths are
        given (the lengths' index tables, :func:`fwd_length_table_bytes`).
    api : "legacy" or "nki"
        The namespace the kernel traces through: under nki.* the P^T transposes are shared
        with the DMA engines (:data:`FWD_NKI_P_DMA_SHARE` of ``device``) and at most
        :data:`FWD_NKI_STAGE_SLOTS` query tiles are staged.
    device : "trn2", "trn3" or None
        The generation the launch runs on (nki.* only; None or another: trn2's share).
    dropout : bool
        Attention dropout is on: under nki.* the share is :data:`FWD_NKI_DROPOUT_P_DMA_SHARE`.
    band : bool
        A causal or window band is active: under nki.* up to :data:`FWD_NKI_BAND_STAGE_SLOTS`
        query tiles are staged.

    Returns
    -------
    ForwardTiles
        Resident K/V when ``fwd_kv_bytes(Nk) + working + one query tile's state`` fits;
        otherwise 2048-key chunks and the largest ``q_group`` that fits next to one chunk (each
        extra group costs one more pass over K/V, :func:`forward_hbm_bytes`).
    """
    target = FWD_DEFAULT_TARGET if target is None else str(target)
    if target not in SBUF_USABLE_BYTES:
        raise ValueError(f"target: expected one of {sorted(SBUF_USABLE_BYTES)}, got {target!r}")
    budget = FWD_SBUF_BUDGET_BYTES[target] if sbuf_bytes is None else int(sbuf_bytes)
    if api not in ("legacy", "nki"):
        raise ValueError(f"api: expected 'legacy' or 'nki', got {api!r}")
    nki = api == "nki"
    share = FWD_NKI_P_DMA_SHARE.get(device, FWD_NKI_P_DMA_SHARE["trn2"]) if nki else 0.0
    if nki and dropout:
        share = FWD_NKI_DROPOUT_P_DMA_SHARE
    base = ForwardTiles(target=target, p_dma_transpose_share=share)
    slots = ((FWD_NKI_BAND_STAGE_SLOTS if band else FWD_NKI_STAGE_SLOTS) if nki
             else FWD_STAGE_SLOTS)
    work = fwd_working_bytes(D, in_itemsize, mm_itemsize, base, masks=masks)
    work += fwd_length_table_bytes(Nq, Nk, group, D, q_lens=q_lens, kv_lens=kv_lens)
    state = fwd_q_state_bytes(D, mm_itemsize, in_itemsize)
    kv = fwd_kv_bytes(Nk, D, mm_itemsize)
    n_tiles = group * ceil_div(Nq, FWD_Q_TILE)

    def staged(tiles, left):
        # the most staged tiles (up to the group's) whose P fits what the group leaves
        stage = min(slots, tiles.q_group)
        while stage > 1 and fwd_stage_bytes(stage, tiles, mm_itemsize) > left:
            stage -= 1
        return replace(tiles, stage=int(stage))

    if kv + work + state <= budget:
        # resident K/V: a group of query tiles interleaves independent softmax chains (the
        # scheduled estimate, simulate._sched, shows one tile's chain leaves engines waiting)
        fit = (budget - kv - work) // state
        t = replace(base, q_group=int(max(1, min(FWD_RESIDENT_Q_GROUP, n_tiles, fit))))
        t = staged(t, budget - kv - work - t.q_group * state)
        left = (budget - kv - work - t.q_group * state
                - fwd_stage_bytes(t.stage, t, mm_itemsize))
        return replace(t, q_preload=fwd_q_preload_bytes(Nq, group, D, in_itemsize) <= left)
    # two chunks: the next one loads while the current one is in use
    room = budget - work - 2 * fwd_kv_bytes(base.kv_chunk, D, mm_itemsize)
    q_group = max(1, min(n_tiles, room // state)) if room > 0 else 1
    t = replace(base, kv_resident=False, q_group=int(q_group))
    return staged(t, room - q_group * state)


def forward_kv_passes(Nq: int, group: int, tiles: "ForwardTiles") -> int:
    """Passes over K/V per (batch, kv head) without a band: 1 resident, else one per group of
    query tiles (:func:`fwd_group_passes`, about ``G ceil(Nq/128) / q_group``)."""
    if tiles.kv_resident:
        return 1
    return fwd_group_passes(Nq, group, tiles)


def fwd_group_passes(Nq: int, group: int, tiles: "ForwardTiles") -> int:
    """Groups of query tiles per (batch, kv head) in the streaming regime: a group holds the
    same ``max(1, q_group // G)`` consecutive query tiles of each of the G heads, and the
    partial last tile (Nq % q_tile rows) is a group of its own (each group shape is one NKI
    loop body)."""
    per_head = max(1, tiles.q_group // group)
    full, tail = Nq // tiles.q_tile, Nq % tiles.q_tile
    return ceil_div(full, per_head) + (1 if tail else 0)


def fwd_valid_lengths(lens, B: int, N: int):
    """Per-sequence valid lengths for the byte counts: None when the array is not given
    (``None``/``False``), ``[N] * B`` for ``True`` (given, every position valid), else the B
    given values as ints."""
    if lens is None or lens is False:
        return None
    if lens is True:
        return [N] * B
    vals = [int(n) for n in lens]
    if len(vals) != B or any(not 0 <= n <= N for n in vals):
        raise ValueError(f"lengths: expected B={B} values in [0, {N}], got {vals}")
    return vals


def forward_hbm_bytes(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, itemsize: int,
                      tiles: "ForwardTiles", *, kv_lens=None, q_lens=None,
                      cache_itemsize: Optional[int] = None) -> Tuple[int, int]:
    """HBM bytes ``(read, written)`` of the forward kernel without causal/window masks.

    Derivation. One grid instance per (batch b, kv head g) serves the ``G = Hq / Hkv`` query heads
    of g. Each query tile is loaded once (``G Nq D`` elements per instance) and its output written
    once (``G Nq D`` elements and ``G Nq`` fp32 LSE values). K and V (``Nk D`` elements each) are
    read once per *pass*:

    - resident: one pass, K^T and V stay on chip for every query tile. The total is then the IO
      lower bound ``itemsize * 2 (Hq Nq + Hkv Nk) D + 4 Hq Nq`` per batch.
    - streaming: the ``T = G ceil(Nq / 128)`` query tiles of an instance go in groups of
      ``q_group`` whose Q^T, o_acc, m_i, l_i stay on chip while all of K/V streams past in
      2048-key chunks, so K/V is read ``P ~ T / q_group`` times (:func:`fwd_group_passes`).
      ``q_group`` is what the SBUF budget M (bytes per partition) leaves after one K/V chunk and
      the working buffers, divided by the per-tile state (``~256 + 4 D`` bytes): ``q_group *
      128 = Theta(M / d)`` query rows per pass, so the K/V traffic ``P * 2 Nk d = Theta(Nq d /
      M) * Nk d = Theta(N^2 d^2 / M)`` - Theorem 2 of the FlashAttention paper (seed 004), in
      FlashAttention-2's loop order (queries outer, keys inner), which never writes partial
      outputs back to HBM.

    Lengths. ``kv_lens``/``q_lens`` are the per-sequence valid lengths (a sequence of B ints;
    ``True`` = given with every position valid; None = not given). The kernel gathers rows and
    keys with DMAs that skip padding, so the reads are proportional to the *valid* lengths:
    ``Nq``, ``Nk`` above become ``q_lens[b]``, ``kv_lens[b]`` for sequence b (the pass count
    stays that of the padded shape: it is compiled). Each given length array adds one int32
    (4 bytes) per instance, and ``kv_lens`` one more row of k (the *edge key* that fills the
    padding keys on chip, ``forward.edge_key_fill``) per instance whose ``kv_lens[b] > 0``.
    Writes cover every row, padding included (o = 0, LSE = -inf).
    FP8 cache (``cache_itemsize`` 1, :func:`fwd_cache_bytes`; None: k and v in ``itemsize``):
    K/V, the edge key included, at 1 byte per element, plus the kv head's 8 bytes of
    ``(k_scale, v_scale)`` per instance.
    Causal/window masks only lower the counts (skipped query tiles and chunks):
    ``nki_kernels.attention.forward.plan_hbm_bytes`` counts those from the kernel's own
    schedule. One core per instance (``lnc=1``, or LNC=2 sharing whole instances): when the
    two cores of LNC=2 split an instance's query tiles (the kernel's ``lnc`` 2, an odd number
    of instances) each reads K/V into its own SBUF, ``plan_hbm_bytes(..., lnc=2)``.

    Returns
    -------
    (read, written) : tuple of int
    """
    group = Hq // Hkv
    passes = forward_kv_passes(Nq, group, tiles)
    q_valid = fwd_valid_lengths(q_lens, B, Nq)
    k_valid = fwd_valid_lengths(kv_lens, B, Nk)
    read = 0
    for b in unrolled(B):
        nq = Nq if q_valid is None else q_valid[b]
        nk = Nk if k_valid is None else k_valid[b]
        cs, scales = fwd_cache_bytes(itemsize, cache_itemsize)
        per_instance = itemsize * group * nq * D + cs * passes * 2 * nk * D + scales
        per_instance += 4 * (int(k_valid is not None) + int(q_valid is not None))
        per_instance += D * cs if k_valid is not None and nk > 0 else 0
        read += Hkv * per_instance
    return read, B * Hq * Nq * (D * itemsize + 4)


def fwd_cache_bytes(itemsize: int, cache_itemsize: Optional[int]) -> Tuple[int, int]:
    """``(bytes per K/V element, bytes of scales per instance)`` the forward reads: ``(itemsize,
    0)``, or for an FP8 cache (``cache_itemsize`` 1) ``(1, 8)``: the kv head's float32
    ``(k_scale, v_scale)``, one DMA per program (``forward.kv_scale_columns``)."""
    if cache_itemsize is None:
        return itemsize, 0
    if cache_itemsize != 1:
        raise ValueError(f"cache_itemsize: None (the inputs' itemsize) or 1 (an FP8 cache), "
                         f"got {cache_itemsize!r}")
    return 1, 8


def fwd_mm_dtype_name(in_dtype_name: str, mixed_precision: bool) -> str:
    """Matmul operand precision (docs/semantics.md "Precision"): bf16/fp16 inputs keep theirs;
    fp32 inputs run in bf16 with ``mixed_precision`` and in fp32 without."""
    if in_dtype_name == "float32":
        return "bfloat16" if mixed_precision else "float32"
    return in_dtype_name


def fwd_itemsize(dtype_name: str) -> int:
    """Bytes per element of ``float32``, ``bfloat16`` or ``float16``."""
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype_name]


# ============================================================================================
# Decode: split-KV flash decoding (issue #5): nki_kernels/attention/decode.py
# ============================================================================================
#
# Vocabulary (decode.py explains the design): a *key row* is ``n`` consecutive cache positions
# of one kv head -- one partition's contiguous ``n * D`` slice of a K or V DMA; a *split* is
# ``split_rows`` key rows of the committed prefix handled by one program of the split kernel;
# the query rows of one kv head (``G * T`` of them, GQA-packed) are processed in *row tiles*,
# and ``pack`` copies of a row tile share the 128 partitions of the score tile, each copy
# scoring a different subset of the split's keys.

#: Largest ``B * Hkv * S_max`` the decode kernels address: their int32 row indices push skipped
#: rows out of bounds by adding a power of two above the cache size (and must stay < 2^31).
DECODE_MAX_CACHE_POSITIONS = 1 << 29

#: 8-bit float formats of an FP8 KV cache per target, as each defines them: trn1 and trn2 the
#: IEEE-style E4M3 (max 240, ``ml_dtypes.float8_e4m3``) and E5M2; trn3 the OCP E4M3 (max 448,
#: ``float8_e4m3fn``) and E5M2 (nki-today.md section 4; the simulator's ``Target.fp8_dtypes``,
#: whose E8M0 is a block-scale format, not data). On a device whose target the host does not
#: know (no ``NEURON_PLATFORM_TARGET_OVERRIDE``) only the format every target shares.
DECODE_FP8_CACHE_DTYPES = {"trn1": ("float8_e4m3", "float8_e5m2"),
                           "trn2": ("float8_e4m3", "float8_e5m2"),
                           "trn3": ("float8_e4m3fn", "float8_e5m2"),
                           None: ("float8_e5m2",)}

#: Largest key row n. n positions of D=128 bf16 are ``256 n`` bytes per partition per DMA; 32
#: gives 8 KiB, above the 4 KiB at which DMA reaches full rate (hardware-and-limits.md §3). n is
#: the largest power of two <= this that divides the cache capacity S_max.
DECODE_KEY_ROW_MAX = 32
#: The key row's limit with a K^T cache (``k_layout="bhds"``) whose longest committed prefix
#: fills a split of DECODE_KT_SPLIT_KEYS (:func:`decode_transposed_key_row`): K is then read
#: in whole split windows, so n only sets the V rows (16 KiB at n=64, D=128, bf16: half the
#: descriptors and gathers of 32) and the tails' slots and window rows. Hq=32 Hkv=8 on trn2 (a
#: throwaway script calling ``host.flash_decode(k_layout="bhds")``): B=1 S=131072 1602.3 us
#: at 32, 1585.9 at 64; but B=64 S=2048, whose 512 tails weigh more than its splits, 2477.3
#: at 32 and 2564.1 at 64.
DECODE_KT_KEY_ROW_MAX = 64
#: A K^T cache's (``k_layout="bhds"``) key-row pieces the split kernel addresses with int32:
#: ``B Hkv D S_max / n`` rows of ``n`` positions (the tails' view), plus a push past them that
#: must stay below 2^31.
DECODE_MAX_KT_ROWS = 1 << 30
#: Score columns per partition of one split: four PSUM banks of fp32 (with the transients of
#: the row max at most 7 of the 8 banks are live). All scores of a split stay in PSUM until its
#: max is known, so a split's softmax needs no online rescaling.
DECODE_SCORE_COLS = 4 * PSUM_FMAX
#: SBUF bytes per partition for the split kernel's two resident K^T / V buffer pairs (in the
#: matmul dtype): one split is computed while the next one is gathered.
DECODE_KV_BUDGET = 64 * 1024
#: Most work items (splits) one program of the split kernel streams through its two buffers
#: (per kv head it runs).
DECODE_ITEMS_PER_PROGRAM = 32
#: SBUF bytes per partition a split-kernel program may hold for the query rows of its steps
#: (``row tiles x steps x D`` values, budgeted at 4 bytes): it bounds the steps (work items x
#: kv heads) one program streams.
DECODE_QUERY_BUDGET = 64 * 1024
#: Additive bias of an invalid key's score (and of a new token a tree/causal mask hides), in
#: already-scaled score units: exp(s - max) of such a key is exactly 0 in fp32. Finite, so a
#: split with no valid key computes finite numbers (it is marked dead by DECODE_DEAD_MAX), and
#: representable in bf16 (the dtype of the mask matmul).
DECODE_MASK_BIAS = -1.0e30
#: A (scaled) split max below this means the split saw no valid key: its partial LSE is -inf.
DECODE_DEAD_MAX = -1.0e29
#: Automatic split sizing rounds the key rows needed up to ``m * 2**e`` with ``m`` in
#: ``{B, ..., 2B - 1}`` for this B: at most 1/B of padding, and the kernel (whose split count and
#: size are compile-time) is recompiled only when the longest sequence crosses a bucket --
#: B times per doubling of the length, not every token.
DECODE_BUCKETS_PER_OCTAVE = 4
#: Split size (in cache positions) the automatic sizing aims at, and the smallest it makes for
#: a batch: below it the per-split setup (packed queries, index math, the merge's partial)
#: outweighs the split's own work; above it the pipeline of a program fills and drains slower
#: (its first gather and its last split's compute are not overlapped). Used for a batch: a
#: sequence's last split is partly past its length, so larger splits waste more there (lengths
#: 3000, 9000, 17000 on trn2 LNC=2: 286.8 us at 4096, 311.4 at 8192; ``python
#: benchmarks/decode.py --targets trn2 --lnc 2 --lens 3000 9000 17000``).
DECODE_MIN_SPLIT_KEYS = 4096
#: The split size the automatic sizing aims at for a single sequence (batch 1). With a program
#: streaming many steps the pipeline fills once per program, so the per-step costs dominate.
#: B=1 Hq=32 Hkv=8 S=32768 D=128 bf16, nki.* (``python benchmarks/decode.py --paged
#: --page-size 256 --lnc 1 2``; with the first gathers issued before the query loads and each
#: step's V gather before its stores, about 1 us of it): estimate on trn2 456.6 -> 442.9 us
#: contiguous (4096 -> 8192), 468.5 -> 454.4 paged, LNC=2 240.1 -> 235.4 / 247.5 -> 242.5; trn1
#: 577.1 -> 566.7 / 588.6 -> 575.1 (``--num-splits 16``, splits of 2048: 656.9 us on trn2).
#: But Hq=8 Hkv=1 S=16384 (``--hq 8 --hkv 1 --seq 16384 --lnc 1``) models 52.0 us against
#: 50.3 at 4096: a short single sequence loses a little.
DECODE_SINGLE_SEQUENCE_SPLIT_KEYS = 8192
#: The split size the automatic sizing aims at with a K^T cache (``k_layout="bhds"``), any
#: batch: its splits have no K transposes, so a batch's kernel is bound by its K/V DMAs
#: (fewer, larger ones pay less fixed cost and fewer descriptors) rather than its engines.
#: B=8 S=16384 Hq=32 Hkv=8 on trn2 (a throwaway script calling ``host.flash_decode``):
#: 1800.5 us at 4096, 1662.3 at 8192.
DECODE_KT_SPLIT_KEYS = 8192
#: Largest split (in key rows) whose skipped rows are zeroed by DMA from a zero row in HBM
#: (``decode._gather_rows``) rather than by copying a zero tile over the whole K and V tiles on
#: VectorE each step. A short split's engine fill costs as much as a long one's per tile (the
#: tile is all partitions x ``n D``), so it weighs most on a batch of short sequences, which is
#: bound by its engines; a long split's kernel is bound by DMA, where each fill DMA adds its
#: fixed cost. Hq=32 Hkv=8 D=128 bf16, trn2 nki.* (``python benchmarks/nkilib_side_by_side.py
#: /tmp/nkilib-tkg --kernel tkg --decode BxS``): B=64 S=2048 (64-row splits) by DMA, VectorE
#: 3360 -> 2233 us (that change alone); B=1 S=131072 (256-row splits) zeroing every K/V tile
#: by DMA (with the other per-step savings of 2026-11-28) 1646.0 -> 1678.9 us estimate, with
#: the engine fill 1638.8; B=8 S=16384 (128-row splits), engine fill: 1856.0 -> 1808.8.
DECODE_DMA_ZERO_FILL_MAX_ROWS = 64
#: Share of the split kernel's K^T PSUM -> SBUF copies (one per staging bank of transposed
#: keys, ``decode._transpose_keys``) on ScalarE, the rest on VectorE, per target (NeuronCore-v3+
#: VectorE copies 16-bit data out of PSUM at 2 elements per cycle). Measured, trn2 nki.*
#: scheduled estimates: FP8 e5m2 cache, B=1 S=32768 (engine-bound; ``python
#: benchmarks/decode.py --kv-dtype float8_e5m2 --targets trn2 --lnc 1``) at shares 0.25 / 0.5
#: / 0.75 / 1.0: 371.6 / 345.9 / 352.3 / 392.0 us; B=16 S=2048 Hq=32 Hkv=8 bf16 (a throwaway
#: script calling ``host.flash_decode``) 825.3 -> 800.7 us at 0.5 before the tails ran beside
#: the splits, 634.7 -> 634.3 after; B=8 S=16384 (DMA-bound) 1790.1 us at 1.0. trn1 (trn3:
#: the trn2 value, not measured) keeps them on ScalarE: its VectorE has no 2x mode.
DECODE_KT_ACT_SHARE = {"trn1": 1.0, "trn2": 0.5, "trn3": 0.5}
#: Smallest batch whose tails the nki.* split kernel runs beside its splits
#: (:func:`decode_tails_per_program`). A single sequence's tails are a few short chains that
#: run first, under the chunk program's headers, for free: B=1 Hq=32 Hkv=8 S=32768 on trn2
#: (``python benchmarks/decode.py --targets trn2 --lnc 1``) models 431.4 us that way and 445.4
#: with the tail beside each kv head's first split. At B=64 S=2048 the 512 tails run first took
#: 885 us of 3276 (VectorE-bound, the DMA queues 40% busy); beside the splits the kernel models
#: 2509.2 (``python benchmarks/nkilib_side_by_side.py /tmp/nkilib --kernel tkg --decode
#: 64x2048``, with the other changes of that entry in CHANGELOG.md).
DECODE_TAILS_BESIDE_SPLITS_MIN_BATCH = 2
#: Passes over a split's packed score columns (VectorE max, ScalarE exp, VectorE P^T copy): the
#: packing factor trades them (split positions / pack columns) against zero-filling the packed
#: queries (pack * 128 columns), so pack ~ sqrt(passes * split positions / 128).
DECODE_SCORE_PASSES = 3
#: Query rows per program of the merge kernel (one partition tile).
DECODE_MERGE_ROWS = PMAX
#: SBUF bytes per partition the merge kernel may plan for its S = num_splits + 1 partial slots
#: (fp32 o and lse per slot, plus a masked copy of each: 8 (D + 1) bytes per slot). Fits trn1's
#: usable 176 KiB at ~73%, leaving the allocator headroom.
DECODE_MERGE_SBUF_BUDGET = 128 * 1024
#: Lower clamp of the merge's max LSE: a finite shift (nl.fp32.min) even for a row whose every
#: partial is empty, so exp(-inf - shift) = 0 instead of NaN.
DECODE_MERGE_M_FLOOR = FP32_MIN
#: Lower clamp of the merge's weight sum before 1/sum (0 * 1/floor stays 0).
DECODE_MERGE_L_FLOOR = 1.0e-30
#: Smallest page of a paged KV cache (``block_table``). Pages are powers of two: the key row
#: ``n = min(page_size, DECODE_KEY_ROW_MAX)`` then divides the page, so a key row never straddles
#: two pages and stays one contiguous ``n * D`` slice of the pool (one DMA descriptor per
#: partition). Below 16 positions a row is under 4 KiB at D=128 in 16-bit dtypes, the size at
#: which DMA stops reaching full rate (hardware-and-limits.md §3).
DECODE_PAGE_SIZE_MIN = 16

#: ``host.api.flash_attention_with_kvcache`` runs the split-KV decode kernels for T new tokens
#: per sequence up to :func:`kvcache_decode_max_tokens`, the prefill forward over the cache
#: (``kv_lens`` gathers, paged through the block table) for more: the decode kernels win while
#: T <= 64 or the G T query rows of a kv head stay within 192. From the trn2 scheduled
#: estimates of both kernels on the same calls (one core, 8192 cached positions, D = 128,
#: ``benchmarks/kvcache.py --threshold``): decode / prefill us at G = 1: T = 64 226 / 422,
#: T = 128 353 / 427; G = 2: T = 96 253 / 262, T = 128 289 / 266; G = 4: T = 64 149 / 184,
#: T = 72 192 / 186; G = 8: T = 64 529 / 553, T = 72 621 / 556.
KVCACHE_DECODE_MAX_TOKENS = 64
KVCACHE_DECODE_MAX_ROWS = 192
#: The paged forward (``forward.paged_key_rows``) finds a key's page and offset in fp32: its
#: positions (below twice the logical capacity ``max_blocks * page_size``) and table indices
#: (below ``2 B max_blocks + 128``) stay under 2^22, where ``masks.int_mod``'s floor is exact.
FWD_PAGED_INDEX_LIMIT = 2 ** 22


def kvcache_decode_max_tokens(group: int) -> int:
    """The largest T the decode kernels run in ``flash_attention_with_kvcache`` for ``group``
    query heads per kv head (at most ``PMAX``, the decode kernels' limit)."""
    return min(PMAX, max(KVCACHE_DECODE_MAX_TOKENS, KVCACHE_DECODE_MAX_ROWS // group))


class DecodeTiles(NamedTuple):
    """Compile-time tiling of one decode call (``decode_tiles``)."""

    key_row: int          #: n, consecutive positions per partition per K/V DMA (divides S_max)
    row_tile: int         #: query rows (g, t) per row tile, <= 128
    pack: int             #: copies of a row tile packed on the partitions of the score tile
    split_rows: int       #: key rows per split of the committed prefix
    num_splits: int       #: splits of the committed prefix (0: no key row is ever full)
    max_split_rows: int   #: the SBUF/PSUM limit split_rows was chosen under
    #: most steps (work items x kv heads) per split-kernel program (decode_max_steps)
    max_steps: int = DECODE_ITEMS_PER_PROGRAM

    @property
    def split_keys(self) -> int:
        """Cache positions per split."""
        return self.key_row * self.split_rows


def _pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def decode_key_row(S_max: int, k_transposed: bool = False) -> int:
    """Key row n: the largest power of two <= DECODE_KEY_ROW_MAX (a K^T cache:
    DECODE_KT_KEY_ROW_MAX) dividing S_max."""
    most = DECODE_KT_KEY_ROW_MAX if k_transposed else DECODE_KEY_ROW_MAX
    n = 1
    while n * 2 <= most and S_max % (n * 2) == 0:
        n *= 2
    return n


def decode_transposed_key_row(S_max: int, longest_prefix: int) -> int:
    """Key row n of a K^T cache: :func:`decode_key_row` up to DECODE_KT_KEY_ROW_MAX when the
    longest committed prefix (``max(cache_lens) - T``) fills a split of DECODE_KT_SPLIT_KEYS
    positions, else up to DECODE_KEY_ROW_MAX (short sequences: the tails dominate)."""
    return decode_key_row(S_max, k_transposed=longest_prefix >= DECODE_KT_SPLIT_KEYS)


def decode_paged_key_row(page_size: int) -> int:
    """Key row n of a paged cache: ``min(page_size, DECODE_KEY_ROW_MAX)`` (page_size a power of
    two), so that n divides the page."""
    return min(int(page_size), DECODE_KEY_ROW_MAX)


def decode_row_packing(rows: int, key_row: int) -> Tuple[int, int]:
    """``(row_tile, max_pack)`` for ``rows = G * T`` query rows per kv head.

    Rows beyond 128 go in 128-row tiles (pack 1). A smaller row tile can be replicated up to
    ``max_pack`` times down the partitions -- the largest power of two with
    ``pack * rows <= 128`` that divides the key row n -- so the exp, max and sum passes over the
    scores use ``pack`` times more engine lanes (the PR133 failure mode of decode is a
    Vector-bound kernel, not HBM). :func:`decode_pack` picks the factor for a split size.
    """
    if rows >= PMAX:
        return PMAX, 1
    pack = min(_pow2_floor(PMAX // rows), key_row)
    return rows, pack


def decode_pack(rows: int, key_row: int, split_rows: int) -> int:
    """Packing factor for a split of ``split_rows`` key rows: the power of two nearest
    ``sqrt(DECODE_SCORE_PASSES * split_positions / 128)``, at most ``max_pack`` and at least
    what keeps the score columns within DECODE_SCORE_COLS."""
    _, max_pack = decode_row_packing(rows, key_row)
    least = 1
    while least < max_pack and key_row // least * split_rows > DECODE_SCORE_COLS:
        least *= 2
    ideal = math.sqrt(DECODE_SCORE_PASSES * key_row * split_rows / PMAX)
    pack = 1
    while pack * 2 <= max_pack and abs(math.log2(pack * 2 / ideal)) < abs(
            math.log2(pack / ideal)):
        pack *= 2
    return max(least, pack)


def decode_max_split_rows(rows: int, D: int, mm_itemsize: int, key_row: int) -> int:
    """Largest split (in key rows) whose scores fit DECODE_SCORE_COLS and whose K^T + V, twice
    (two buffers), fit DECODE_KV_BUDGET; a multiple of 128 or a power of two below 128."""
    _, pack = decode_row_packing(rows, key_row)
    sub_rows = key_row // pack               # key-row positions scored by each packed copy
    by_psum = DECODE_SCORE_COLS // sub_rows
    per_key_row = 2 * key_row * ceil_div(D, PMAX) * PMAX * mm_itemsize // PMAX
    by_sbuf = DECODE_KV_BUDGET // max(1, 2 * per_key_row)        # two buffer pairs
    return _round_split_rows_down(max(1, min(by_psum, by_sbuf)))


def _round_split_rows_down(rows: int) -> int:
    return rows // PMAX * PMAX if rows >= PMAX else _pow2_floor(rows)


def _round_split_rows_up(rows: int) -> int:
    if rows > PMAX // 2:
        return ceil_div(rows, PMAX) * PMAX
    return 1 << max(0, (int(rows) - 1).bit_length())


def decode_bucket(rows: int) -> int:
    """Round ``rows`` up to ``m * 2**e``, ``m`` in ``[DECODE_BUCKETS_PER_OCTAVE, 2x)``."""
    b = DECODE_BUCKETS_PER_OCTAVE
    if rows <= b:
        return max(0, int(rows))
    step = 1 << max(0, (int(rows) - 1).bit_length() - b.bit_length())
    return ceil_div(rows, step) * step


def decode_max_steps(rows: int, row_tile: int, D: int) -> int:
    """Most steps (work items x kv heads) one split-kernel program runs: its query rows,
    ``ceil(rows / row_tile) * steps * D`` values per partition, fit DECODE_QUERY_BUDGET."""
    return max(1, DECODE_QUERY_BUDGET // (ceil_div(rows, row_tile) * D * 4))


def decode_work_items(count: int, max_steps: int = DECODE_ITEMS_PER_PROGRAM):
    """``(total, per_program)``: the split kernel's work list of ``count`` real items is
    padded to ``total`` (``decode_bucket(count)`` rounded up to whole programs) and run
    ``per_program`` items per program (1 or even, at most DECODE_ITEMS_PER_PROGRAM and
    ``max_steps``, chosen so the programs share the items evenly)."""
    items = max(1, decode_bucket(count))
    cap = max(1, min(DECODE_ITEMS_PER_PROGRAM, max_steps))
    if cap > 1:
        cap -= cap % 2
    programs = ceil_div(items, cap)
    per = ceil_div(items, programs)
    if per > 1 and per % 2:
        per += 1
    return programs * per, per


def decode_heads_per_program(Hkv: int, items: int, max_steps: int, cores: int = 1) -> int:
    """kv heads one split-kernel program runs (``items`` work items each): the largest
    divisor of Hkv with ``heads * items <= max_steps``, even or 1 when ``items`` is odd (the
    program's steps come in pairs). More heads per program means fewer programs, each of which
    pays its headers and fills and drains its pipeline once. With ``cores = 2`` (trn2 LNC=2)
    the head groups are kept even when Hkv allows, so the two cores take half of them each."""
    best = 1
    for hpp in unrolled(1, Hkv + 1):
        if Hkv % hpp or hpp * items > max_steps:
            continue
        if items % 2 and hpp > 1 and hpp % 2:
            continue
        if cores == 2 and Hkv % 2 == 0 and (Hkv // hpp) % 2:
            continue
        best = hpp
    return best


def decode_tails_per_program(B: int, chunks: int, items: int, *, api: str = "nki",
                             tree_mask: bool = False) -> int:
    """Tails (sequences, for each kv head of the program) each of the ``chunks`` chunk
    programs of a head group runs beside its first splits under nki.* (``decode._split_chunk``:
    the tail of sequence ``c K + j`` in step j, j < K, of chunk program c): ``K = B // chunks``
    at most ``items`` (the steps of one head), for a batch of at least
    DECODE_TAILS_BESIDE_SPLITS_MIN_BATCH sequences (else 0). The ``B - chunks K`` others run as
    tail programs of their own, first. 0 in legacy (``api``) and with a tree mask, which each
    tail program reads once (``host.api.flash_decode_hbm_bytes`` counts it)."""
    if api != "nki" or tree_mask or chunks == 0 or B < DECODE_TAILS_BESIDE_SPLITS_MIN_BATCH:
        return 0
    return min(items, B // chunks)


def decode_zero_by_dma(split_rows: int) -> bool:
    """Whether the split kernel zeroes a split's skipped K/V rows by DMA from a zero row
    (``split_rows <= DECODE_DMA_ZERO_FILL_MAX_ROWS``) rather than on the engines."""
    return split_rows <= DECODE_DMA_ZERO_FILL_MAX_ROWS


def decode_zero_row_cols(split_rows: int, key_row: int, D: int) -> int:
    """Columns of the split kernel's zero row, the source of its DMA zero fills
    (:func:`decode_zero_by_dma`): one key row of ``D`` per 128-row tile of a split."""
    return ceil_div(split_rows, PMAX) * key_row * D


def decode_max_splits(D: int) -> int:
    """Largest ``num_splits`` the merge kernel can hold at head dim D
    (DECODE_MERGE_SBUF_BUDGET over 8 (D + 1) bytes per partial slot, minus the tail slot)."""
    return max(1, DECODE_MERGE_SBUF_BUDGET // (8 * (D + 1)) - 1)


def _split_rows_dividing(line_rows: int, rs_max: int):
    """The legal split sizes (:func:`_round_split_rows_down`'s: powers of two below 128,
    multiples of 128) up to ``rs_max`` that divide ``line_rows``, ascending."""
    return [r for r in unrolled(1, rs_max + 1)
            if _round_split_rows_down(r) == r and line_rows % r == 0]


def decode_transposed_split(plan: "DecodeTiles", S_max: int, D: int, rows: int,
                            rows_needed: int, num_splits=None) -> "DecodeTiles":
    """``plan`` for a K^T cache ``(B, Hkv, D, S_max)`` (``k_layout="bhds"``): the split
    kernel reads a split's keys as one window of ``split_keys`` positions per head-dim row,
    a row of the view ``(B Hkv D S_max / split_keys, split_keys)``, so ``split_rows`` must
    divide the ``S_max / n`` key rows of a line. The automatic size becomes the largest legal
    divisor at most the planned one (more splits); a forced ``num_splits`` the smallest at
    least the planned one. ValueError when no divisor keeps the splits within
    :func:`decode_max_splits` or the size within ``max_split_rows``."""
    if plan.num_splits == 0:
        return plan
    line_rows = S_max // plan.key_row
    fits = _split_rows_dividing(line_rows, plan.max_split_rows)
    if num_splits is None:
        rs = max(r for r in fits if r <= plan.split_rows)
        ns = ceil_div(decode_bucket(rows_needed), rs)
        if ns > decode_max_splits(D):
            raise ValueError(
                f"k_cache: with k_layout='bhds' a split must divide the {line_rows} key rows "
                f"of {plan.key_row} positions of S_max={S_max}; the largest that fits, {rs} "
                f"rows, needs {ns} splits, above the merge's {decode_max_splits(D)} at D={D}; "
                f"use an S_max with a larger power-of-two factor")
    else:
        bigger = [r for r in fits if r >= plan.split_rows]
        if not bigger:
            raise ValueError(
                f"num_splits: {num_splits} splits need {plan.split_rows} key rows each, and "
                f"with k_layout='bhds' a split must also divide the {line_rows} key rows of "
                f"S_max={S_max} within {plan.max_split_rows} rows: none does; use another "
                f"num_splits or None")
        rs, ns = bigger[0], plan.num_splits
    return plan._replace(split_rows=rs, num_splits=ns,
                         pack=decode_pack(rows, plan.key_row, rs))


def decode_tiles(rows: int, D: int, S_max: int, mm_itemsize: int, rows_needed: int,
                 num_splits=None, batch: int = 1, key_row=None,
                 k_transposed: bool = False) -> DecodeTiles:
    """Tiling of a decode call.

    Parameters
    ----------
    rows : int
        Query rows per kv head, ``G * T``.
    D, S_max : int
        Head dim and cache capacity.
    mm_itemsize : int
        Bytes of the matmul operand dtype.
    rows_needed : int
        Full key rows of the longest committed prefix, ``max_b (cache_lens[b] - T) // n``
        (runtime lengths, not the capacity: FlashAttention issue #1000).
    num_splits : int, optional
        Force this many splits (>= 1); ``split_rows`` is then the smallest legal size covering
        ``rows_needed``. Raises ValueError when that exceeds the per-split limit.
    batch : int
        Sequences in the batch. The automatic size aims at DECODE_MIN_SPLIT_KEYS positions
        (small splits keep the programs' pipelines short to fill and drain;
        DECODE_SINGLE_SEQUENCE_SPLIT_KEYS for a single sequence). Each sequence runs
        only the splits its own length needs (the host's work list), so the longest sequence
        fixes the split *count* but a short one still costs one whole split: with a batch the
        size is at least ``rows_needed / (2 batch)``, bounding that padding by half the longest
        sequence; and at least ``rows_needed / decode_max_splits(D)``, the most partials the
        merge holds.

    key_row : int, optional
        Force the key row n (a paged cache: :func:`decode_paged_key_row`); default
        :func:`decode_key_row` of S_max.
    k_transposed : bool
        A K^T cache (``k_layout="bhds"``): the automatic size aims at DECODE_KT_SPLIT_KEYS
        (and the caller then makes it divide S_max, :func:`decode_transposed_split`).

    ``pack`` (:func:`decode_pack`) follows the split size.
    """
    n = decode_key_row(S_max) if key_row is None else int(key_row)
    row_tile, _ = decode_row_packing(rows, n)
    rs_max = decode_max_split_rows(rows, D, mm_itemsize, n)
    steps = decode_max_steps(rows, row_tile, D)
    if num_splits is None:
        if rows_needed <= 0:
            return DecodeTiles(n, row_tile, decode_pack(rows, n, 1), 1, 0, rs_max, steps)
        cover = decode_bucket(rows_needed)
        aim = (DECODE_KT_SPLIT_KEYS if k_transposed else
               DECODE_SINGLE_SEQUENCE_SPLIT_KEYS if batch == 1 else DECODE_MIN_SPLIT_KEYS)
        target = min(cover, ceil_div(aim, n))
        if batch > 1:
            target = max(target, ceil_div(cover, 2 * batch))
        # the merge holds at most decode_max_splits partials per row
        target = max(target, ceil_div(cover, decode_max_splits(D)))
        rs = min(rs_max, _round_split_rows_up(target))
        ns = ceil_div(cover, rs)
        rs = min(rs_max, _round_split_rows_up(ceil_div(cover, ns)))
        return DecodeTiles(n, row_tile, decode_pack(rows, n, rs), rs, ns, rs_max, steps)
    ns = int(num_splits)
    most = decode_max_splits(D)
    if ns > most:
        raise ValueError(
            f"num_splits: at most {most} splits at head dim D={D} (the merge kernel keeps "
            f"num_splits + 1 fp32 partials of D + 1 values per row on chip), got {ns}")
    rs = _round_split_rows_up(max(1, ceil_div(rows_needed, ns)))
    if rs > rs_max:
        need = ceil_div(rows_needed, rs_max)
        raise ValueError(
            f"num_splits: {ns} split(s) cannot hold the committed prefix of the longest sequence "
            f"({rows_needed * n} positions in key rows of {n}); each split holds at most "
            f"{rs_max * n} positions here, so num_splits must be >= {need} (or None)")
    return DecodeTiles(n, row_tile, decode_pack(rows, n, rs), rs, ns, rs_max, steps)
