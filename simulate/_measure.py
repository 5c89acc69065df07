"""``simulate.measure()``: exact IO counts and modeled engine time for the kernels launched
inside it (our addition; ``nki.profile`` keeps its original meaning).

Usage::

    with simulate.measure(target="trn2") as m:
        kernel(a, b)
    m.hbm_bytes_read, m.engine_cycles["tensor"], m.modeled_seconds, print(m.report())

``target`` (trn1/trn2, optional) overrides the kernels' ``platform_target`` for everything
(capacity checks, nc_version, costs). All numbers are exact and deterministic.
"""

from __future__ import annotations

from collections import Counter

from . import _hw, _launch, _runtime


class Measurement:
    """Aggregate over every kernel launched while the context is active.

    Attributes (all aggregated over ``kernels``, the per-launch ``LaunchRecord`` list):
    ``hbm_bytes_read``, ``hbm_bytes_written`` (exact bytes moved between HBM and on-chip
    memory, masked-out elements excluded), ``per_tensor`` (name -> {"read", "written"}),
    ``dma_transfers`` (DMA instructions), ``dma_bytes_per_partition`` (per transfer: contiguous
    HBM-side bytes per partition), ``dma_chunks`` / ``dma_average_chunk_bytes`` (descriptors:
    runs contiguous on both sides within a partition), ``dma_efficiency`` (bytes at the full
    DMA rate over the modeled transfer time), ``instructions`` (engine -> count; engines ``tensor``,
    ``vector``, ``scalar``, ``gpsimd``, ``dma``), ``engine_cycles`` (compute engine -> cycles),
    ``engine_seconds`` (engine incl. ``dma`` -> modeled seconds),
    ``peak_sbuf_bytes_per_partition``, ``peak_psum_bytes_per_partition``, ``peak_psum_banks``,
    ``modeled_seconds`` = (lower, upper): per kernel lower = max over engines (perfect overlap),
    upper = sum over engines (fully serial); summed over kernels.
    """

    def __init__(self, target=None, compiled_loop_overlap=None):
        self.target = None if target is None else _hw.get_target(target).name
        # None: inherit (outer measure, else the default: overlap); see _sched.Scheduler.barrier
        self.compiled_loop_overlap = compiled_loop_overlap
        self.kernels = []

    def __enter__(self):
        _runtime._measures.append(self)
        return self

    def __exit__(self, *exc):
        try:
            _runtime._measures.remove(self)
        except ValueError:
            pass
        return False

    def _add(self, rec):
        self.kernels.append(rec)

    # -- aggregates -------------------------------------------------------------------------------
    @property
    def api(self):
        """Front end(s) of the measured launches: "nki" (the nki.* API, NKI 0.7), "legacy"
        (neuronxcc.nki), "legacy+nki" when both ran, "" when nothing ran. ``apis`` gives the
        set."""
        return "+".join(sorted(self.apis))

    @property
    def apis(self):
        return {getattr(k, "api", "legacy") for k in self.kernels}

    @property
    def hbm_bytes_read(self):
        return sum(k.hbm_bytes_read for k in self.kernels)

    @property
    def hbm_bytes_written(self):
        return sum(k.hbm_bytes_written for k in self.kernels)

    @property
    def benchmark_seconds(self):
        """What a device benchmark (neuron-bench, ``nki.benchmark``) would report: the
        scheduled estimate plus the fitted per-launch overhead of the measurement
        (``_hw.BENCH_OVERHEAD_NS``). Compare published latencies with this, device time with
        :attr:`estimated_seconds`."""
        return self.estimated_seconds + len(self.kernels) * _hw.BENCH_OVERHEAD_NS * 1e-9

    @property
    def spill_refills(self):
        """Spilled on-chip units loaded back (``simulate.spill``; 0 for a kernel within capacity)."""
        return sum(k.spill_refills for k in self.kernels)

    @property
    def spill_hbm_bytes(self):
        """HBM bytes the modeled spills moved, out and back (not in ``hbm_bytes_read/written``)."""
        return sum(k.spill_hbm_bytes for k in self.kernels)

    @property
    def per_tensor(self):
        out = {}
        for k in self.kernels:
            for name, d in k.per_tensor.items():
                o = out.setdefault(name, {"read": 0, "written": 0})
                o["read"] += d["read"]
                o["written"] += d["written"]
        return out

    @property
    def dma_transfers(self):
        return sum(k.dma_transfers for k in self.kernels)

    @property
    def dma_bytes_per_partition(self):
        out = []
        for k in self.kernels:
            out.extend(k.dma_bytes_per_partition)
        return out

    @property
    def dma_chunks(self):
        """DMA descriptors: contiguous chunks moved (DMA transposes excluded)."""
        return sum(k.dma_chunks for k in self.kernels)

    @property
    def dma_average_chunk_bytes(self):
        """Bytes per chunk over the chunked DMAs (0 without any)."""
        n = self.dma_chunks
        return sum(k.dma_chunked_bytes for k in self.kernels) / n if n else 0.0

    @property
    def dma_efficiency(self):
        """Modeled DMA efficiency: bytes / bandwidth over the modeled transfer time (per-chunk
        overheads and transpose rates included, the fixed per-DMA costs excluded); 1.0 = every
        byte at the full DMA rate."""
        move = sum(k.dma_move_seconds for k in self.kernels)
        return sum(k.dma_data_seconds for k in self.kernels) / move if move else 1.0

    @property
    def dma_bytes_histogram(self):
        return Counter(self.dma_bytes_per_partition)

    @property
    def instructions(self):
        c = Counter()
        for k in self.kernels:
            c.update(k.instructions)
        return dict(c)

    @property
    def engine_cycles(self):
        c = Counter()
        for k in self.kernels:
            c.update(k.engine_cycles)
        return dict(c)

    @property
    def engine_seconds(self):
        out = {e: 0.0 for e in _hw.ENGINES + ("dma",)}
        for k in self.kernels:
            for e, s in k.engine_seconds.items():
                out[e] += s
        return out

    @property
    def peak_sbuf_bytes_per_partition(self):
        return max((k.peak_sbuf_bytes_per_partition for k in self.kernels), default=0)

    @property
    def peak_psum_bytes_per_partition(self):
        return max((k.peak_psum_bytes_per_partition for k in self.kernels), default=0)

    @property
    def peak_psum_banks(self):
        return max((k.peak_psum_banks for k in self.kernels), default=0)

    @property
    def program_instructions_per_kernel(self):
        """Kernel name -> instructions of its compiled program (the largest over its launches):
        an ``affine_range``/``sequential_range`` body counted once, ``static_range`` and Python
        loops unrolled, one grid instance (every instance runs the same program)."""
        out = {}
        for k in self.kernels:
            out[k.name] = max(out.get(k.name, 0), k.program_instructions)
        return out

    @property
    def program_instructions(self):
        """Instructions of the compiled programs of the kernels launched, each kernel counted
        once (sum of :attr:`program_instructions_per_kernel`). Unlike :attr:`instructions`
        (what runs), this is what neuronx-cc has to compile; it must not grow with the
        problem size."""
        return sum(self.program_instructions_per_kernel.values())

    @property
    def estimated_seconds(self):
        """The scheduled estimate (simulate._sched): list scheduling of every launch's
        instruction stream over in-order engine queues and DMA queues with data dependencies,
        launches one after another. Between the bounds of :attr:`modeled_seconds`."""
        return sum(k.estimated_seconds for k in self.kernels)

    @property
    def modeled_seconds(self):
        lo = sum(k.modeled_seconds[0] for k in self.kernels)
        hi = sum(k.modeled_seconds[1] for k in self.kernels)
        return (lo, hi)

    # -- report -------------------------------------------------------------------------------------
    def report(self, file=None):
        """Readable table of the measurement; returned as a string (and printed to ``file``
        when given)."""
        lines = []
        lines.append("simulate.measure report (modeled; NOT hardware timings)")
        for i, k in enumerate(self.kernels):
            lo, hi = k.modeled_seconds
            lines.append(f"  [{i}] {k.name} grid={list(k.grid)} target={k.target}: "
                         f"HBM read {k.hbm_bytes_read} B, written {k.hbm_bytes_written} B, "
                         f"{k.dma_transfers} DMAs, program {k.program_instructions} "
                         f"instructions, modeled {lo * 1e6:.2f}..{hi * 1e6:.2f} us")
        lines.append(f"{'engine':<8} {'instr':>9} {'cycles':>14} {'seconds':>12}")
        ins = self.instructions
        cyc = self.engine_cycles
        sec = self.engine_seconds
        for e in _hw.ENGINES + ("dma",):
            c = cyc.get(e, "")
            c = f"{c:.0f}" if c != "" else "-"
            lines.append(f"{e:<8} {ins.get(e, 0):>9} {c:>14} {sec[e]:>12.3e}")
        lo, hi = self.modeled_seconds
        lines.append(f"program size {self.program_instructions} instructions (loop bodies "
                     f"once; executed {sum(ins.values())})")
        lines.append(f"HBM bytes read {self.hbm_bytes_read}, written {self.hbm_bytes_written}; "
                     f"DMA transfers {self.dma_transfers}")
        tgts = "/".join(sorted({k.target for k in self.kernels})) or "-"
        lines.append(f"DMA chunks {self.dma_chunks}, average chunk "
                     f"{self.dma_average_chunk_bytes:.0f} B; modeled DMA efficiency "
                     f"{100 * self.dma_efficiency:.1f} % of the {tgts} DMA rate "
                     f"(per-chunk overhead {_hw.DMA_CHUNK_OVERHEAD_BYTES} B)")
        if self.spill_refills:
            lines.append(f"spilled beyond capacity (modeled, UNCONFIRMED): {self.spill_refills} "
                         f"refills, {self.spill_hbm_bytes} B through HBM")
        lines.append(f"peak SBUF {self.peak_sbuf_bytes_per_partition} B/partition, peak PSUM "
                     f"{self.peak_psum_bytes_per_partition} B/partition "
                     f"({self.peak_psum_banks} banks)")
        lines.append(f"modeled time: {lo * 1e6:.3f} us (perfect overlap) .. {hi * 1e6:.3f} us "
                     f"(serial); scheduled estimate {self.estimated_seconds * 1e6:.3f} us")
        pt = self.per_tensor
        if pt:
            lines.append("per tensor (bytes): " + ", ".join(
                f"{n}: r={d['read']} w={d['written']}" for n, d in sorted(pt.items())))
        s = "\n".join(lines)
        if file is not None:
            print(s, file=file)
        return s

    def __repr__(self):
        lo, hi = self.modeled_seconds
        return (f"<Measurement kernels={len(self.kernels)} read={self.hbm_bytes_read} "
                f"written={self.hbm_bytes_written} modeled={lo:.3e}..{hi:.3e}s>")


def measure(target=None, compiled_loop_overlap=None):
    """Context manager recording every kernel launched inside it (see module doc).
    ``compiled_loop_overlap``: whether the scheduled estimate lets work of one iteration of a
    compiled loop (``nl.fori_loop`` / ``nl.while_loop``, NKI 0.7) overlap the next one's
    (True, the default) or puts a barrier between iterations (False). AWS does not document
    which the compiler does (nki-today.md §2); docs/simulator.md gives our kernels both ways."""
    return Measurement(target, compiled_loop_overlap)


def program_size(kernel, *args, **kwargs) -> int:
    """Instructions in the compiled program of one launch of ``kernel`` (``kernel[grid]`` or a
    jit kernel) on these arguments, without executing the launch: the first grid instance runs
    with every ``affine_range``/``sequential_range`` body traced once, as neuronx-cc traces the
    kernel (``static_range`` and Python loops run in full: they are unrolled program text).
    Equal to ``measure().program_instructions`` of a full run, at the cost of one loop
    iteration each; computed values are discarded (they are not the kernel's results)."""
    if hasattr(kernel, "grid") and hasattr(kernel, "kernel"):       # kernel[grid]
        func, grid, opts = kernel.kernel.func, kernel.grid, kernel.kernel.opts
    elif hasattr(kernel, "func") and hasattr(kernel, "opts"):        # @nki.jit kernel
        # (an nki.* kernel[lnc] carries its grid)
        func, grid, opts = kernel.func, tuple(getattr(kernel, "grid", ()) or ()), kernel.opts
    elif callable(kernel):
        func, grid, opts = kernel, (), {}
    else:
        raise TypeError(f"program_size expects a kernel, got {type(kernel).__name__}")
    m = Measurement()
    _runtime._trace["on"] = True
    try:
        with m:
            _launch.launch(func, grid, args, kwargs, opts)
    finally:
        _runtime._trace["on"] = False
    return m.program_instructions
