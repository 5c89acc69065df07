"""Cost formulas (hardware-and-limits.md §1-§3, "Estimated instruction cost" notes of the ISA
docs) and the per-launch recorder.

Cycle formulas (N = free elements per partition the instruction writes; for element-wise
instructions that is the data operand's size, or the destination's when the result is written
straight into a larger, broadcast destination -- see ``charge``):

=========================  ===========================================================
TensorE nc_matmul          max(min(64, M_stationary), N_moving), x4 if an operand is fp32
TensorE transpose          max(P, min(64, F))
ScalarE activation         max(64, N); +64 when the reduction is read out (reduce_res)
VectorE 1-input            max(64, N)
VectorE tensor_tensor      max(64, 2N); N if an operand is in PSUM or both are bf16 in SBUF
VectorE tensor_reduce      max(64, N); N/2 for bf16 in and out with add/max
VectorE reciprocal         max(64, 8N)
VectorE 2-pass ops         scalar_tensor_tensor, tensor_tensor_scan: max(64, 2N)
trn2 VectorE perf mode     tensor_copy / tensor_scalar on 16-bit float data: N/4 SBUF->SBUF,
                           N/2 with one side in PSUM
GpSimd                     max(64, N); iota / affine_select: N + 150
DMA                        (bytes + 256 B x chunks) / DMA bandwidth + 81.25 ns per DMA
                           instruction; a chunk = a run contiguous on both sides within one
                           partition (see _dma.py); DMA transposes: bytes / (bandwidth x rate)
=========================  ===========================================================
"""

from __future__ import annotations

from collections import Counter

from . import _hw
from ._errors import hw_error
from ._sched import Scheduler

MIN_II = _hw.MIN_II_CYCLES


def ii(c):
    """Apply the MIN_II floor."""
    return c if c > MIN_II else MIN_II


def matmul_cycles(m_stationary, n_moving, any_fp32):
    c = max(min(_hw.MM_MIN_STATIONARY_CYCLES, m_stationary), n_moving)
    return c * _hw.MM_FP32_FACTOR if any_fp32 else c


def pe_transpose_cycles(p, f):
    return max(p, min(_hw.MM_MIN_STATIONARY_CYCLES, f))


def act_cycles(n, reduce=False):
    return ii(n) + (_hw.ACT_REDUCE_EXTRA_CYCLES if reduce else 0)


def tensor_tensor_cycles(n, a_psum, b_psum, both_bf16_sbuf):
    if a_psum or b_psum or both_bf16_sbuf:
        return ii(n)
    return ii(2 * n)


def tensor_scalar_cycles(tgt, n, in_psum, out_psum, in16, out16):
    """tensor_scalar / tensor_copy; trn2 perf mode for 16-bit float data."""
    c = n
    if tgt.vector_perf_mode and in16 and out16:
        if not in_psum and not out_psum:
            c = n / 4.0
        else:
            c = n / 2.0
    return ii(c)


def act_copy_cycles(tgt, n, in16, out16):
    """ScalarE tensor_copy / tensor_scalar: NC-v4's 2x mode for 16-bit data (``Target.
    scalar_perf_mode``), else the activation formula."""
    if tgt.scalar_perf_mode and in16 and out16:
        return ii(n / 2.0)
    return act_cycles(n)


def vector_exp_cycles(tgt, n):
    """NC-v4 ``nisa.exponential`` on VectorE: ``Target.vector_exp_speedup`` times ScalarE's exp
    throughput (one element per ScalarE cycle), in VectorE cycles: n * vector_clock /
    (speedup * scalar_clock), MIN_II floor. ``speedup`` 0 means the target lacks the
    instruction (the caller refuses it)."""
    clk = tgt.clock_hz
    return ii(n * clk["vector"] / (tgt.vector_exp_speedup * clk["scalar"]))


def charge(ctx, engine, cycles_fn, n):
    """Record one instruction of ``cycles_fn(n)`` cycles, ``n`` = free elements per partition
    it writes, and keep the formula so that a direct write of its result into a larger
    (broadcast) destination is charged for the elements written there (_tensor.assign)."""
    ctx.rec.add(engine, cycles_fn(n))
    ctx.last_charge = (engine, cycles_fn, n)


def tensor_reduce_cycles(n, bf16_in_out_addmax):
    return ii(n / 2.0 if bf16_in_out_addmax else n)


def gpsimd_cycles(n, start=False):
    return ii(n + (_hw.GPSIMD_START_CYCLES if start else 0))


class LaunchRecord:
    """Everything measured for one kernel launch (all grid instances together)."""

    def __init__(self, name, target, grid):
        self.name = name
        self.target = target.name
        self._tgt = target
        self.grid = tuple(grid)
        self.api = "legacy"                 # front end: "legacy" (neuronxcc.nki) or "nki" (0.7)
        self.instructions = Counter()       # engine -> count
        self.engine_cycles = Counter()      # compute engine -> cycles
        self.dma_seconds = 0.0
        self.dma_data_seconds = 0.0         # bytes / bandwidth (what a perfect DMA would take)
        self.dma_move_seconds = 0.0         # modeled transfer time without the fixed costs
        self.dma_chunks = 0                 # descriptors (contiguous chunks) of chunked DMAs
        self.dma_chunked_bytes = 0          # bytes moved by chunked DMAs (not transposes)
        self.dma_transfers = 0
        self.dma_bytes_per_partition = []   # contiguous bytes per partition, one per transfer
        self.hbm_bytes_read = 0
        self.hbm_bytes_written = 0
        self.spill_hbm_bytes = 0            # HBM bytes of compiler spills (_spill), both ways
        self.spill_refills = 0              # spilled on-chip units loaded back (_spill)
        self.per_tensor = {}                # name -> {"read": bytes, "written": bytes}
        self.peak_sbuf_bytes_per_partition = 0
        self.peak_psum_bytes_per_partition = 0
        self.peak_psum_banks = 0
        # Program size: instructions of the compiled program (see count_program).
        self.program_instructions = 0
        self.ctx = None                     # the grid instance running now (set by _runtime)
        # NeuronCores: an nl.nc(n) grid dimension spreads its instances over n physical cores
        # (trn2 LNC=2) that run in parallel; each core has its own engines and DMA queues
        self.core = 0                       # core of the grid instance running now
        self.core_cycles = {}               # core -> Counter(engine -> cycles)
        self.core_dma_seconds = Counter()   # core -> modeled DMA seconds
        # the scheduled estimate (simulate._sched): fed by every instruction, read at the end
        self.sched = Scheduler(target)
        self.estimated_seconds = 0.0

    # -- recording -----------------------------------------------------------------------------
    def count_program(self):
        """Count the instruction being recorded into the program size when it is program text:
        the first grid instance (every instance runs the same program), and inside
        ``affine_range``/``sequential_range`` loops only their first iteration (the compiler
        emits a loop body once); ``static_range`` iterations and Python loops are unrolled text.
        Raises at neuronx-cc's instruction limit."""
        ctx = self.ctx
        if ctx is not None:
            if ctx.launch.instance:
                return
            for s in ctx.loops:
                if not (s.first or s.static):
                    return
        self.program_instructions += 1
        if self.program_instructions > _hw.PROGRAM_INSTRUCTION_LIMIT:
            raise hw_error(
                "runtime",
                f"kernel '{self.name}': the compiled program exceeds "
                f"{_hw.PROGRAM_INSTRUCTION_LIMIT} instructions, neuronx-cc's limit ([XTP002] "
                "'Number of instructions is over the threshold'; aws-neuron-sdk #987). Loops "
                "over tiles must be nl.affine_range/nl.sequential_range, not Python loops or "
                "static_range, so that the body is emitted once.")

    def add(self, engine, cycles):
        self.sched.compute(engine, cycles)
        self.instructions[engine] += 1
        self.engine_cycles[engine] += cycles
        self.core_cycles.setdefault(self.core, Counter())[engine] += cycles
        self.count_program()

    def dma(self, nbytes, contiguous_bytes, chunks=None, rate=1.0, read=None, written=None,
            read_bytes=None, written_bytes=None, more_reads=()):
        """One DMA instruction moving ``nbytes`` in ``chunks`` contiguous chunks (descriptors):
        ``(nbytes + chunks * DMA_CHUNK_OVERHEAD_BYTES) / bandwidth`` + the fixed cost.
        ``chunks=None``: no per-chunk term (DMA transposes, modeled by ``rate`` instead).
        ``contiguous_bytes`` is the HBM-side contiguous bytes per partition (the
        ``dma_bytes_per_partition`` entry). ``read``/``written`` name the HBM tensors whose
        bytes are counted (``read_bytes``/``written_bytes``, default ``nbytes``);
        ``more_reads``: ``(name, bytes)`` of further HBM tensors read (``dma_compute``)."""
        self.sched.dma(self._dma_account(nbytes, contiguous_bytes, chunks, rate))
        if read is not None:
            rb = nbytes if read_bytes is None else read_bytes
            self.hbm_bytes_read += rb
            self.per_tensor.setdefault(read, {"read": 0, "written": 0})["read"] += rb
        for name, rb in more_reads:
            self.hbm_bytes_read += rb
            self.per_tensor.setdefault(name, {"read": 0, "written": 0})["read"] += rb
        if written is not None:
            wb = nbytes if written_bytes is None else written_bytes
            self.hbm_bytes_written += wb
            self.per_tensor.setdefault(written, {"read": 0, "written": 0})["written"] += wb

    def _dma_account(self, nbytes, contiguous_bytes, chunks, rate):
        """Count one DMA instruction in the totals and the bound; returns its transfer time
        without the fixed costs."""
        self.dma_transfers += 1
        self.instructions["dma"] += 1
        self.count_program()
        self.dma_bytes_per_partition.append(int(contiguous_bytes))
        bw = self._tgt.dma_bytes_per_s
        move = nbytes / (bw * rate)
        if chunks:
            self.dma_chunks += chunks
            self.dma_chunked_bytes += nbytes
            move += chunks * _hw.DMA_CHUNK_OVERHEAD_BYTES / bw
        self.dma_data_seconds += nbytes / bw
        self.dma_move_seconds += move
        self.dma_seconds += move + _hw.DMA_FIXED_NS_PER_INSTRUCTION * 1e-9
        self.core_dma_seconds[self.core] += move + _hw.DMA_FIXED_NS_PER_INSTRUCTION * 1e-9
        return move

    def side(self, engine, cycles, st, lo, hi, read):
        """A compiler-inserted compute instruction outside the running API call (a spill or
        refill copy, ``_spill``) on bytes ``lo:hi`` of ``st``."""
        self.instructions[engine] += 1
        self.engine_cycles[engine] += cycles
        self.core_cycles.setdefault(self.core, Counter())[engine] += cycles
        self.count_program()
        self.sched.side(engine, cycles / self._tgt.clock_hz[engine] + _hw.SCHED_ISSUE_NS * 1e-9,
                        None, st, lo, hi, read)

    def side_dma(self, nbytes, chunks, st, lo, hi, read):
        """A compiler-inserted DMA between on-chip ``st`` (bytes ``lo:hi`` per partition) and a
        spill area in HBM: ``read`` stores it out, else loads it back. Counted in
        ``spill_hbm_bytes``, not in the kernel's tensors' HBM bytes."""
        move = self._dma_account(nbytes, nbytes // max(1, chunks), chunks, 1.0)
        self.spill_hbm_bytes += nbytes
        self.sched.side("dma", 0.0, move, st, lo, hi, read)

    def dma_rechunk(self, old_chunks, new_chunks):
        """Correct the chunk count of the last DMA (a load written straight into a strided
        SBUF destination: the destination's runs limit the chunks)."""
        d = new_chunks - old_chunks
        if d:
            self.dma_chunks += d
            s = d * _hw.DMA_CHUNK_OVERHEAD_BYTES / self._tgt.dma_bytes_per_s
            self.sched.rechunk(s)
            self.dma_move_seconds += s
            self.dma_seconds += s
            self.core_dma_seconds[self.core] += s

    @property
    def dma_efficiency(self):
        """bytes / bandwidth over the modeled transfer time (fixed costs excluded)."""
        return self.dma_data_seconds / self.dma_move_seconds if self.dma_move_seconds else 1.0

    @property
    def dma_average_chunk_bytes(self):
        return self.dma_chunked_bytes / self.dma_chunks if self.dma_chunks else 0.0

    # -- derived ---------------------------------------------------------------------------------
    @property
    def engine_seconds(self):
        out = {e: self.engine_cycles.get(e, 0) / self._tgt.clock_hz[e] for e in _hw.ENGINES}
        out["dma"] = self.dma_seconds
        return out

    @property
    def cores(self):
        """Physical NeuronCores the launch used (> 1 only with an nl.nc grid dimension)."""
        return max(1, len(set(self.core_cycles) | set(self.core_dma_seconds)))

    @property
    def modeled_seconds(self):
        """(perfect overlap, serial) time of the launch: per core, the busiest engine and the
        sum of the engines; the cores of an nl.nc grid run in parallel (the slowest counts).
        One core: the totals of :attr:`engine_seconds`."""
        if self.cores == 1:
            s = self.engine_seconds.values()
            return (max(s), sum(s))
        lo = hi = 0.0
        for c in set(self.core_cycles) | set(self.core_dma_seconds):
            cyc = self.core_cycles.get(c, {})
            s = [cyc.get(e, 0) / self._tgt.clock_hz[e] for e in _hw.ENGINES]
            s.append(self.core_dma_seconds.get(c, 0.0))
            lo, hi = max(lo, max(s)), max(hi, sum(s))
        return (lo, hi)

    def summary(self):
        return {
            "name": self.name, "target": self.target, "grid": self.grid, "api": self.api,
            "hbm_bytes_read": self.hbm_bytes_read, "hbm_bytes_written": self.hbm_bytes_written,
            "dma_transfers": self.dma_transfers, "dma_chunks": self.dma_chunks,
            "dma_average_chunk_bytes": self.dma_average_chunk_bytes,
            "dma_efficiency": self.dma_efficiency, "instructions": dict(self.instructions),
            "engine_cycles": dict(self.engine_cycles), "engine_seconds": self.engine_seconds,
            "modeled_seconds": self.modeled_seconds, "cores": self.cores,
            "peak_sbuf_bytes_per_partition": self.peak_sbuf_bytes_per_partition,
            "peak_psum_bytes_per_partition": self.peak_psum_bytes_per_partition,
            "program_instructions": self.program_instructions,
        }


def ceil_div(a, b):
    return -(-a // b)


__all__ = ["LaunchRecord", "matmul_cycles", "act_cycles", "ii"]
