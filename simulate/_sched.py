"""The scheduled cost model: list scheduling of a launch's instruction stream.

``modeled_seconds`` gives two bounds (every engine busy at once; everything in series). The
estimate here sits between them: each instruction starts when its engine's in-order queue is
free *and* its inputs are ready, so the time includes the stalls a real schedule has.

Model (constants in ``_hw``, each with its source or marked fitted):

* **Instructions.** Every NKI API call is one instruction (a call that charges two engines --
  a TensorE result the compiler copies out of PSUM -- is two, the second depending on the
  first). Its duration is the cost formula of ``_cost`` on its engine's clock plus a fixed
  issue cost (``SCHED_ISSUE_NS``).
* **Queues.** Compute engines run their instructions one at a time, in program order except
  that an instruction whose inputs are ready may fill an idle gap among the engine's last
  ``SCHED_REORDER_WINDOW`` gaps (the compiler's static scheduling moves independent
  instructions -- e.g. of the next iteration of an ``affine_range`` loop -- earlier; 0 is a
  strict in-order queue). DMAs go to ``DMA_QUEUES_PER_NC`` queues
  (the earliest free takes the next DMA), share the NeuronCore's DMA bandwidth (a transfer
  occupies it for its bytes, the per-chunk overhead and its share of the fixed cost,
  ``DMA_FIXED_NS_PER_INSTRUCTION``, exactly as in the bound) and complete a fixed latency
  (``DMA_FIXED_LATENCY_NS``) after their data.
* **Dependencies** through the bytes instructions touch: read after write, write after read,
  write after write, tracked per storage on byte ranges of the free dims (a slice of a tile is
  independent of a disjoint slice; partitions are not told apart) -- for HBM tensors on the
  flat byte range -- and per NeuronCore: instances on different cores of one launch are
  independent programs with no ordering between them (an indirect write covers its whole
  tensor here, which would otherwise order two cores' disjoint writes). An input written by another engine (or a DMA) pays a semaphore latency
  (``SCHED_SYNC_NS``).
* **Rotating buffers.** A tile allocated inside a loop gets a fresh buffer each iteration in
  the simulator; the compiler instead rotates ``SCHED_BUFFERS`` buffers per allocation site, so
  a new tile cannot be written before the tile ``SCHED_BUFFERS`` allocations back at the same
  site was last used (write-after-read across iterations).
* **Cores.** Each NeuronCore (``nl.nc`` grid dimensions, LNC=2) has its own engines and DMA
  queues; the estimate is the latest finish over cores. Grid instances on one core run one
  after another in program order, overlapping only where dependencies allow.

Not modeled: trn1's PSUM access restrictions, SBUF bank conflicts, instruction fetch, the
compiler's own reordering beyond the in-order queues, DMA queue affinity.
"""
from __future__ import annotations

import heapq
import sys
import weakref

import numpy as np

from . import _hw

_SIM_DIR = __file__.rsplit("/", 1)[0]

#: The scheduler of the launch running now (set by ``_runtime.launch``), or None: the hooks
#: in ``_tensor`` record into it.
ACTIVE = None


def _alloc_site():
    """(file, line) of the kernel statement allocating a tile: the first frame outside the
    simulator."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SIM_DIR):
        f = f.f_back
    return (f.f_code.co_filename, f.f_lineno) if f is not None else None


class _Access:
    """Recorded accesses of one storage: writes ``(lo, hi, end, engine)`` and reads ``(lo,
    hi, end)`` since they were last superseded, and a floor (rotating buffers)."""

    __slots__ = ("w", "r", "floor", "last", "ring")

    def __init__(self):
        self.w = []
        self.r = []
        self.floor = 0.0
        self.last = 0.0          # end of the latest access (for the next buffer of the site)
        self.ring = None         # the allocation site's ring it is in, if any


_CAP = 24


def _squash(lst, n):
    """Keep lists short: fold the oldest half into one conservative entry."""
    if len(lst) <= _CAP:
        return
    half = lst[:_CAP // 2]
    lo = min(e[0] for e in half)
    hi = max(e[1] for e in half)
    end = max(e[2] for e in half)
    merged = (lo, hi, end) if n == 3 else (lo, hi, end, half[-1][3])
    lst[:_CAP // 2] = [merged]


def _ptr(a):
    return a.__array_interface__["data"][0]


def _range(t):
    """Byte range ``(lo, hi)`` a view covers in its storage: within one partition for on-chip
    tiles (free dims only), on the flat buffer for HBM tensors. Static fancy views (mgrid /
    ``nl.ds`` of loop indices) get the bounding box of their index arrays; dynamic (indirect)
    views and anything unknown the whole storage."""
    st = t._st
    arr = st.arr
    whole = (0, arr.nbytes or 1)
    v = t._v
    if arr.size == 0:
        return whole
    try:
        if v is not None:
            base, los, his = v, [0] * v.ndim, [n - 1 for n in v.shape]
            if any(n == 0 for n in v.shape):
                return 0, 0
        else:
            base, key = t._base, t._key
            if base is None or key is None or t._dyn is not None or len(key) != base.ndim:
                return whole
            los, his = [], []
            for k in key:
                if isinstance(k, slice):
                    idx = range(*k.indices(base.shape[len(los)]))
                    if len(idx) == 0:
                        return 0, 0
                    los.append(min(idx[0], idx[-1]))
                    his.append(max(idx[0], idx[-1]))
                else:
                    k = np.asarray(k)
                    if k.size == 0:
                        return 0, 0
                    # broadcast index arrays (mgrid, arange sums) repeat along zero-stride
                    # axes: reduce over one slice of those
                    k = k[tuple(slice(0, 1) if st == 0 else slice(None) for st in k.strides)]
                    los.append(int(k.min()))
                    his.append(int(k.max()))
        off = _ptr(base) - _ptr(arr)
    except (AttributeError, TypeError, ValueError):
        return whole
    pdim = st.pdim if st.buffer != "hbm" else None
    lo = hi = off
    for i, s in enumerate(base.strides):
        if pdim is not None and i == 0:
            continue
        if s < 0:
            return whole
        lo += los[i] * s
        hi += his[i] * s
    hi += base.itemsize
    if pdim is not None and arr.ndim and arr.strides[0]:
        row = arr.strides[0]
        shift = (lo // row) * row
        lo, hi = lo - shift, hi - shift
    return lo, hi


class Scheduler:
    """Online list scheduler of one launch (see the module docstring)."""

    def __init__(self, tgt):
        self.tgt = tgt
        self.acc = weakref.WeakKeyDictionary()      # Storage -> {core: _Access}
        self.sites = {}                              # alloc site -> list of _Access (ring)
        self.engine_free = {}                        # (core, engine) -> time
        self.gaps = {}                               # (core, engine) -> recent idle gaps
        self.dma_queues = {}                         # core -> heap of queue free times
        self.dma_bw_free = {}                        # core -> time
        self.core_end = {}                           # core -> latest finish
        self.cur = None                              # the open instruction
        self.core = 0
        self.last_end, self.last_engine = 0.0, "dma"  # the latest committed instruction

    # -- recording ------------------------------------------------------------------------------
    def boundary(self, core):
        """A new NKI API call begins: close the open instruction."""
        self._commit()
        self.core = core
        self.cur = {"reads": [], "writes": [], "engine": None, "dur": 0.0, "dma": None}

    def read(self, t):
        if self.cur is not None:
            lo, hi = _range(t)
            self.cur["reads"].append((t._st, lo, hi))

    def write(self, t):
        if self.cur is not None:
            lo, hi = _range(t)
            self.cur["writes"].append((t._st, lo, hi))

    def _charge(self, engine, seconds, dma=None):
        cur = self.cur
        if cur is None:
            return
        if cur["engine"] is not None:
            # a second instruction in one API call: depends on the first one's results
            first = cur
            self._commit()
            self.cur = cur = {"reads": list(first["writes"]), "writes": [], "engine": None,
                              "dur": 0.0, "dma": None}
        cur["engine"] = engine
        cur["dur"] = seconds
        cur["dma"] = dma

    def compute(self, engine, cycles):
        self._charge(engine, cycles / self.tgt.clock_hz[engine] + _hw.SCHED_ISSUE_NS * 1e-9)

    def dma(self, move_seconds):
        self._charge("dma", 0.0, dma=move_seconds)

    def rechunk(self, seconds):
        """The open DMA's transfer time grew by ``seconds`` (re-chunked destination)."""
        if self.cur is not None and self.cur["dma"] is not None:
            self.cur["dma"] += seconds

    def alloc(self, st):
        """A new on-chip storage: it reuses the buffer of the allocation ``SCHED_BUFFERS``
        back at the same site (rotating buffers)."""
        site = _alloc_site()
        a = _Access()
        self.acc[st] = {self.core: a}
        if site is None:
            return
        ring = self.sites.setdefault((self.core, site), [])     # buffers are per core
        if len(ring) >= _hw.SCHED_BUFFERS:
            a.floor = ring[-_hw.SCHED_BUFFERS].last
        ring.append(a)
        a.ring = ring
        if len(ring) > _hw.SCHED_BUFFERS:
            del ring[0]

    def direct(self, st):
        """An instruction's result written straight into a destination (``dst[...] =
        nisa.op(...)``): on the hardware it never had a buffer of its own, so it leaves its
        site's ring and carries no floor."""
        a = self.acc.get(st, {}).get(self.core)
        if a is not None and a.ring is not None:
            if a.ring and a.ring[-1] is a:
                a.ring.pop()
            a.ring = None
            a.floor = 0.0

    # -- scheduling -----------------------------------------------------------------------------
    def _access(self, st):
        """The current core's record of ``st``: grid instances on different NeuronCores are
        independent programs (no ordering between them; their writes to a shared HBM tensor
        must be disjoint), so dependencies are tracked per core."""
        per_core = self.acc.get(st)
        if per_core is None:
            per_core = self.acc[st] = {}
        a = per_core.get(self.core)
        if a is None:
            a = per_core[self.core] = _Access()
        return a

    def _commit(self):
        cur, self.cur = self.cur, None
        if cur is None:
            return
        if cur["engine"] is None:
            if cur["writes"]:
                self._forward(cur)
            return
        engine, core = cur["engine"], self.core
        sync = _hw.SCHED_SYNC_NS * 1e-9
        ready = 0.0
        for st, lo, hi in cur["reads"]:
            for wlo, whi, wend, weng in self._access(st).w:
                if wlo < hi and lo < whi:
                    t = wend + (sync if weng != engine else 0.0)
                    if t > ready:
                        ready = t
        for st, lo, hi in cur["writes"]:
            a = self._access(st)
            if a.floor > ready:
                ready = a.floor
            for wlo, whi, wend, weng in a.w:
                if wlo < hi and lo < whi and wend > ready:
                    ready = wend
            for rlo, rhi, rend in a.r:
                if rlo < hi and lo < rhi and rend > ready:
                    ready = rend
        if cur["dma"] is None:
            end = self._place((core, engine), ready, cur["dur"])
        else:
            q = self.dma_queues.get(core)
            if q is None:
                q = self.dma_queues[core] = [0.0] * _hw.DMA_QUEUES_PER_NC
            qfree = heapq.heappop(q)
            start = max(ready, qfree)
            # the transfer holds the core's DMA bandwidth for its bytes plus the per-DMA
            # share of the fixed cost (as in the bound), and completes the latency later
            data = (max(start, self.dma_bw_free.get(core, 0.0)) + cur["dma"]
                    + _hw.DMA_FIXED_NS_PER_INSTRUCTION * 1e-9)
            self.dma_bw_free[core] = data
            end = data + _hw.DMA_FIXED_LATENCY_NS * 1e-9
            heapq.heappush(q, end)
        if end > self.core_end.get(core, 0.0):
            self.core_end[core] = end
        self.last_end, self.last_engine = end, engine
        for st, lo, hi in cur["reads"]:
            a = self._access(st)
            a.r.append((lo, hi, end))
            _squash(a.r, 3)
            if end > a.last:
                a.last = end
        for st, lo, hi in cur["writes"]:
            a = self._access(st)
            # entries inside this write are superseded (later accesses wait for it)
            a.w = [e for e in a.w if not (lo <= e[0] and e[1] <= hi)]
            a.r = [e for e in a.r if not (lo <= e[0] and e[1] <= hi)]
            a.w.append((lo, hi, end, engine))
            _squash(a.w, 4)
            if end > a.last:
                a.last = end

    def _forward(self, cur):
        """A write without an instruction of its own: an instruction's result assigned into a
        destination (``dst[...] = nisa.op(...)``, a separate API entry in the simulator). The
        destination is written when the producer of what is read finishes, by that engine."""
        # the producer: the instruction just committed (the pending result is always the
        # latest one's), or the last writer of what the assignment reads
        end, engine = self.last_end, self.last_engine
        for st, lo, hi in cur["reads"]:
            for wlo, whi, wend, weng in self._access(st).w:
                if wlo < hi and lo < whi and wend >= end:
                    end, engine = wend, weng
        for st, lo, hi in cur["writes"]:
            a = self._access(st)
            a.w = [e for e in a.w if not (lo <= e[0] and e[1] <= hi)]
            a.w.append((lo, hi, end, engine))
            _squash(a.w, 4)
            if end > a.last:
                a.last = end

    def _place(self, key, ready, dur):
        """Start an instruction at ``ready`` or later on engine ``key``: in the earliest idle
        gap among the engine's last ``SCHED_REORDER_WINDOW`` gaps that fits it (the compiler
        moving independent instructions earlier), else after the engine's last instruction.
        Returns its end."""
        free = self.engine_free.get(key, 0.0)
        gaps = self.gaps.get(key)
        if gaps:
            for i, (g0, g1) in enumerate(gaps):
                st = g0 if g0 > ready else ready
                if st + dur <= g1:
                    repl = []
                    if st > g0:
                        repl.append((g0, st))
                    if st + dur < g1:
                        repl.append((st + dur, g1))
                    gaps[i:i + 1] = repl
                    return st + dur
        start = ready if ready > free else free
        if start > free and _hw.SCHED_REORDER_WINDOW:
            gaps = self.gaps.setdefault(key, [])
            gaps.append((free, start))
            if len(gaps) > _hw.SCHED_REORDER_WINDOW:
                del gaps[0]
        self.engine_free[key] = start + dur
        return start + dur

    def finish(self):
        """Close the stream; the estimate in seconds (latest finish over the cores). The
        per-storage records are dropped; later calls record nothing."""
        self._commit()
        self.acc = weakref.WeakKeyDictionary()
        self.sites = {}
        return max(self.core_end.values(), default=0.0)


__all__ = ["Scheduler"]
