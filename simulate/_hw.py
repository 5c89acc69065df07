"""The single table of hardware and cost-model constants, per target generation.

Every number the simulator uses for limits, capacities or costs lives here, with the tag of the
document it comes from (tags as in ``reference/hardware-and-limits.md`` [HL] and
``reference/nki-api-spec.md`` [SPEC]; "(derived)" = worked out from tagged numbers; "(choice)" =
a modelling decision of this simulator, documented in ``docs/simulator.md``).

Targets: ``trn1`` (= ``inf2`` = ``gen2``, NeuronCore-v2) and ``trn2`` (= ``gen3``, NeuronCore-v3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

# --------------------------------------------------------------------------------------------
# Limits shared by both generations
# --------------------------------------------------------------------------------------------
NUM_PARTITIONS = 128            # SBUF/PSUM partitions; nl.tile_size.pmax   [SPEC §1, D26 TC#1]
PSUM_FMAX = 512                 # fp32 elements per PSUM bank partition      [SPEC §1, D26 TC#2]
GEMM_STATIONARY_FMAX = 128      # nc_matmul stationary free size             [SPEC §1, D26 TC#3]
GEMM_MOVING_FMAX = 512          # nc_matmul moving free size                 [SPEC §1, D26 TC#3]
BN_STATS_FMAX = 512             # bn_stats free size                         [SPEC §1, D26 nisa.bn_stats]
PSUM_BANK_BYTES = 2048          # bytes per partition of one PSUM bank       [SPEC §1, D26 arch; LIB]
PSUM_NUM_BANKS = 8              # PSUM banks per partition                   [SPEC §1, D26 arch; LIB]
PE_TRANSPOSE_MAX = 128          # TensorE transpose tile edge                [SPEC §1, D26 nc_transpose]
VECTOR_TRANSPOSE_MAX = 32       # VectorE transpose tile edge                [SPEC §1, D26 nc_transpose]
PE_TILE_GRANULE = 32            # nc_matmul tile_position/tile_size multiple [SPEC §9.1]
MAX8_MIN_ELEMS = 8              # max8 / nc_find_index8 / nc_match_replace8 [SPEC §9.24]
MAX8_MAX_ELEMS = 16384          #   elements per partition range             [SPEC §9.24]
LOCAL_GATHER_GROUP = 16         # GpSimd partitions per core                 [SPEC §9.23, HL §2]
LOCAL_GATHER_MAX_INDICES = 4096 # indices per GpSimd core                    [SPEC §9.23]
STREAM_SHUFFLE_QUADRANT = 32    # nc_stream_shuffle partitions per quadrant  [SPEC §9.25]
FP32_MIN = -3.4028234663852886e38  # nl.fp32.min, bit pattern 0xff7fffff    [SPEC §1]
# Start-partition rule for compute-engine accesses [SPEC §1, D26 arch "accessing SBUF/PSUM"]:
# (max partitions spanned, allowed start partitions)
START_PARTITION_RULES = ((32, (0, 32, 64, 96)), (64, (0, 64)), (128, (0,)))

# Cost-model constants shared by both generations [HL §1-§3, ISA "Estimated instruction cost"]
MIN_II_CYCLES = 64              # minimum initiation interval, Vector/Scalar/GpSimd instructions
MM_MIN_STATIONARY_CYCLES = 64   # nc_matmul: max(min(64, M_stationary), N_moving)
MM_FP32_FACTOR = 4              # fp32 matmul operands run 4 passes           [HL §1]
ACT_REDUCE_EXTRA_CYCLES = 64    # reading the reduce registers out (reduce_res) [HL §2]
RECIPROCAL_FACTOR = 8           # VectorE reciprocal 8N                       [HL §2]
GPSIMD_START_CYCLES = 150       # iota / affine_select start cost             [HL §2]
DYNAMIC_COPY_MIN_II = 600       # tensor_copy_dynamic_src/dst MIN_II          [HL §2]
DMA_QUEUES_PER_NC = 16          # DMA engines per NeuronCore                  [HL §3]
DMA_FIXED_LATENCY_NS = 1300.0   # descriptor + semaphore latency per transfer [HL §3 DMA]
# (choice) the fixed latency is paid per DMA *instruction* but 16 queues work in parallel, so a
# stream of independent DMAs pays ~1300/16 = 81.25 ns each on the DMA "engine" time line.
DMA_FIXED_NS_PER_INSTRUCTION = DMA_FIXED_LATENCY_NS / DMA_QUEUES_PER_NC
#: nki.isa.dma_compute: "The max number of source tensors in srcs is 16" (NKI 0.7 stub)
DMA_COMPUTE_MAX_SRCS = 16

# -- the scheduled estimate (simulate._sched) ------------------------------------------------
#: Semaphore wait when an instruction's input was written by another engine or a DMA: "~100
#: extra cycles when instructions depend on each other back to back" [HL §2 fixed overheads,
#: PERF Opt #5], at 1.4 GHz.
SCHED_SYNC_NS = 100 / 1.4
#: Fixed issue cost per instruction on its engine, on top of the cost formula (which already
#: has the 64-cycle MIN_II floor). FITTED: to the trn2 MFU of AWS's fully optimized matmul
#: tutorial kernel at 2048^3 bf16 (docs/simulator.md, "Calibration").
SCHED_ISSUE_NS = 0.0
#: Idle gaps per engine an independent instruction may be moved back into (the compiler's
#: scheduling window; 0 = strictly in program order). FITTED (docs/simulator.md,
#: "Calibration").
SCHED_REORDER_WINDOW = 8
#: What a device benchmark adds to a kernel's device time, per launch: neuron-bench (behind
#: ``nki.benchmark``) measures a NEFF's end-to-end latency in a loop, "not only the device
#: latency" (nki.benchmark docs). FITTED: least squares on log(modeled / measured) over the 21
#: fit-set points (N <= 2048) of AWS's attention tutorial measured on trn1
#: (docs/simulator.md, "Calibration"); 0-20 us scanned, 7.6 us best (18 of 21 within 25 %).
#: Added by ``Measurement.benchmark_seconds`` and ``nki.benchmark``, not to the estimate.
BENCH_OVERHEAD_NS = 7600.0
#: Buffers the compiler rotates per tile allocation site inside loops (double buffering).
#: GUESS: the NKI docs describe multi-buffering of loop-local tiles without a number.
SCHED_BUFFERS = 2
# Per-descriptor (per contiguous chunk) DMA overhead, expressed as bytes of transfer time.
# (derived, UNCONFIRMED) [HL §3 "DMA efficiency rules"]: a DMA moving contiguous chunks of c
# bytes reaches an efficiency of c / (c + 256): 50 % at 256 B ("< 256 B per partition: badly
# overhead-bound"), 80 % at 1 KiB and 89 % at 2 KiB ("256 B - 2 KiB: below peak; >= 2 KiB the
# minimum recommended"), 94 % at 4 KiB and 97 % at 8 KiB ("full rate" from 4 KiB). The guide gives
# only these thresholds; 256 B is the value that puts the knee at the guide's 256 B boundary.
# A chunk is the innermost run that is contiguous on BOTH sides of the transfer within one
# partition (SBUF partitions are separate address ranges, so a chunk never spans partitions);
# gathers/scatters (index tiles) move one chunk per row.
DMA_CHUNK_OVERHEAD_BYTES = 256

# Program size: the instructions of the compiled kernel (an affine_range/sequential_range body
# once, static_range and Python loops unrolled).
#: neuronx-cc refuses a program above this many instructions: "[XTP002] Number of instructions
#: (8658944) is over the threshold (5000000)" (aws-neuron-sdk issues #987 and #819).
PROGRAM_INSTRUCTION_LIMIT = 5_000_000
#: Above this size the simulator warns. Compile time and memory grow with the unrolled
#: instruction count: aws-neuron-sdk #1374 reports hours and tens of GB around 1e5 unrolled
#: iterations. The threshold itself is a guess (the figure issue 11 asks for), not an AWS number.
PROGRAM_INSTRUCTION_WARN = 50_000


@dataclass(frozen=True)
class Target:
    """Per-generation constants. All clocks in Hz, bandwidths in bytes/second."""

    name: str                     # canonical name: "trn1" or "trn2"
    nc_version: int               # nisa.nc_version value: 2 (gen2) or 3 (gen3)
    sbuf_bytes_per_partition: int # SBUF capacity per partition
    sbuf_reserved_bytes: int      # compiler-reserved SBUF per partition
    clock_hz: Dict[str, float]    # engine -> clock
    dma_bytes_per_s: float        # DMA throughput per NeuronCore (the DMA guide's table)
    hbm_share_bytes_per_s: float  # alternative: chip HBM bandwidth / NCs (not used in the model)
    load_transpose_rate: float    # fraction of DMA throughput reached by load_transpose2d
    dma_transpose_hbm_rate: float # fraction for dma_transpose HBM -> SBUF
    dma_transpose_sbuf_rate: float  # fraction for dma_transpose SBUF -> SBUF
    vector_perf_mode: bool        # trn2 VectorE 2x/4x perf modes for 16-bit data
    multi_core_spmd: bool         # nl.nc(n) grid dimensions allowed
    gen3_features: bool           # range_select, hwdge, double_row_gen3, bf16 PSUM transposes
    notes: Dict[str, str] = field(default_factory=dict)
    # ScalarE's 2x mode for 16-bit copy / tensor_scalar (NC-v4: "256 BF16/FP16/FP8 for
    # copy/tensor_scalar, 128 other") [HL §2 ARCH3]
    scalar_perf_mode: bool = False
    # nisa.exponential on VectorE, as a multiple of ScalarE's exp throughput (0: the target has
    # no such instruction). NC-v4: 4x [HL §2 ARCH3; nki-today.md §4]
    vector_exp_speedup: float = 0.0
    # 8-bit float formats the target computes in (names of _dtypes' registry) [nki-today.md §4]
    fp8_dtypes: tuple = ("float8_e4m3", "float8_e5m2")

    @property
    def total_available_sbuf_size(self) -> int:
        return self.sbuf_bytes_per_partition - self.sbuf_reserved_bytes

    @property
    def tensor_peak_flops(self) -> float:
        """Dense bf16 TensorE peak, FLOP/s: a 128 x 128 array doing one multiply-add per cell per
        cycle (92, 79 and 79 TFLOPS per core on trn1, trn2 and trn3) [HL §1]."""
        return NUM_PARTITIONS * NUM_PARTITIONS * 2 * self.clock_hz["tensor"]


TRN1 = Target(
    name="trn1",
    nc_version=2,
    sbuf_bytes_per_partition=196608,   # 192 KiB [SPEC §1, D26 arch; I1060 "196608"]
    sbuf_reserved_bytes=16384,         # 16 KiB  [SPEC §1, D26 compiler/sbuf.py]
    clock_hz={                         # [SPEC §1, HL §1-§2 ARCH1]
        "tensor": 2.8e9, "vector": 1.12e9, "scalar": 1.4e9, "gpsimd": 1.4e9,
    },
    dma_bytes_per_s=272e9,             # 17 B/ns per NC, DMA guide table [HL §3]
    hbm_share_bytes_per_s=410e9,       # 820 GB/s / 2 NCs (derived) [HL §3]
    # (choice) NC-v2 load_transpose2d moves one 2-4 byte element per descriptor element, i.e. it
    # is in the "< 256 B per partition, badly overhead bound" regime of the DMA guide; we model it
    # at 1/8 of the DMA throughput ("much lower DMA bandwidth", HL §1; factor UNCONFIRMED).
    load_transpose_rate=1.0 / 8.0,
    dma_transpose_hbm_rate=1.0 / 8.0,  # (choice) no DMA-transpose hardware on v2: same as above
    dma_transpose_sbuf_rate=1.0 / 8.0,
    vector_perf_mode=False,
    multi_core_spmd=False,
    gen3_features=False,
    notes={"dma": "272 GB/s = DMA table; 410 GB/s = HBM share (not used)"},
)

TRN2 = Target(
    name="trn2",
    nc_version=3,
    sbuf_bytes_per_partition=229376,   # 224 KiB [SPEC §1, DHEAD trainium2_arch]
    sbuf_reserved_bytes=16384,         # UNCONFIRMED for v3; same 16 KiB as v2 (choice)
    clock_hz={                         # [SPEC §1, HL §1-§2 ARCH2]
        "tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9,
    },
    dma_bytes_per_s=368e9,             # 23 B/ns per NC, DMA guide table [HL §3]
    hbm_share_bytes_per_s=362.5e9,     # 2.9 TB/s / 8 NCs (derived) [HL §3]
    # v3 has DMA-transpose hardware: HBM->SBUF up to 90 %, SBUF->SBUF up to 50 % [HL §1 ARCH2]
    load_transpose_rate=0.9,
    dma_transpose_hbm_rate=0.9,
    dma_transpose_sbuf_rate=0.5,
    vector_perf_mode=True,
    multi_core_spmd=True,
    gen3_features=True,
    notes={"dma": "368 GB/s = DMA table; 362.5 GB/s = HBM share (not used)"},
)

TRN3 = Target(
    name="trn3",
    nc_version=4,
    sbuf_bytes_per_partition=262144,   # 256 KiB: 32 MiB / 128 partitions [HL §3 ARCH3]
    sbuf_reserved_bytes=16384,         # UNCONFIRMED for v4; same 16 KiB as v2 (choice)
    clock_hz={                         # [HL §2 ARCH3]; tensor: 79 TFLOPS / (128 x 128 x 2)
        "tensor": 2.4e9, "vector": 1.2e9, "scalar": 1.2e9, "gpsimd": 1.2e9,
    },
    dma_bytes_per_s=528e9,             # 33 B/ns per NC, DMA guide table; 16 x 38.4 GB/s [HL §3]
    hbm_share_bytes_per_s=612.5e9,     # 4.9 TB/s / 8 NCs (derived) [HL §3]
    load_transpose_rate=0.9,           # (choice) v4 keeps v3's DMA-transpose hardware rates
    dma_transpose_hbm_rate=0.9,
    dma_transpose_sbuf_rate=0.5,
    vector_perf_mode=True,             # 512 BF16/FP16/FP8 elements per cycle [HL §2 ARCH3]
    multi_core_spmd=True,
    gen3_features=True,
    notes={"dma": "528 GB/s = DMA table; 612.5 GB/s = HBM share (not used)"},
    scalar_perf_mode=True,
    vector_exp_speedup=4.0,
    # OCP E4M3 (max 448) and E5M2; E8M0 block scales for MXFP8 (trn3 pages, nki-today.md §4)
    fp8_dtypes=("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"),
)

TARGETS = {"trn1": TRN1, "inf2": TRN1, "gen2": TRN1, "trn2": TRN2, "gen3": TRN2,
           "trn3": TRN3, "gen4": TRN3}
DEFAULT_TARGET = "trn2"               # (choice, per issue #2)
TARGET_ENV_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"

ENGINES = ("tensor", "vector", "scalar", "gpsimd")  # compute engines; DMA is tracked as "dma"


def get_target(name) -> Target:
    """Resolve a target name (trn1/inf2/gen2, trn2/gen3, trn3/gen4; case-insensitive) to its
    table row."""
    if isinstance(name, Target):
        return name
    key = str(name).strip().lower()
    if key not in TARGETS:
        raise ValueError(
            f"Unknown platform target {name!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[key]
