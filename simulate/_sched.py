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
  (``DMA_FIXED_LATENCY_NS``) after their data. The bandwidth is not taken in program order: a
  transfer that is ready may use bandwidth left idle before one issued earlier (the queues
  are independent), within the same window of recent idle gaps as the engines.
* **Dependencies** through the bytes instructions touch: read after write, write after read,
  write after write, tracked per storage on byte ranges of the free dims (a slice of a tile is
  independent of a disjoint slice; partitions are not told apart) -- for HBM tensors on the
  flat byte range -- and per NeuronCore: instances on different cores of one launch are
  independent programs with no ordering between them (an indirect write covers its whole
  tensor here, which would otherwise order two cores' disjoint writes). An input written by another engine (or a DMA) pays a semaphore latency
  (``SCHED_SYNC_NS``).
* **Results written into a destination** (``dst[...] = nisa.op(...)``, ``t[...] =
  nl.load(...)``): the instruction writes ``dst`` itself, so it also waits for the earlier
  reads and writes of the bytes of ``dst`` it overwrites and for ``dst``'s rotating buffer.
  (An instruction is placed when the next API call shows whether its result is assigned.)
* **Rotating buffers.** A tile allocated inside a loop gets a fresh buffer each iteration in
  the simulator; the compiler instead rotates ``SCHED_BUFFERS`` buffers per allocation site, so
  a new tile cannot be written before the tile ``SCHED_BUFFERS`` allocations back at the same
  site was last used (write-after-read across iterations). A site is a source line and the
  allocation's rank on that line within the current iteration of the innermost NKI loop:
  copies of a Python-unrolled loop are distinct program text with buffers of their own.
* **PSUM banks.** PSUM is ``PSUM_NUM_BANKS`` physical banks per core: a new PSUM tile takes
  as many free banks as it needs (those freed longest ago: a choice) and its first write
  waits until their previous tiles' last accesses end. A tile's banks are free when the
  simulator releases it (its iteration ended, or nothing refers to it). PSUM tiles do not
  use the rotating rings.
* **Compiled loops** (NKI 0.7 ``nl.fori_loop``/``nl.while_loop``): by default their
  iterations overlap like any instruction stream; ``simulate.measure(compiled_loop_overlap=
  False)`` puts a barrier between iterations instead (AWS does not document which holds).
* **no_reorder.** Instructions issued inside a ``no_reorder`` region (a loop with
  ``directives=ncc.no_reorder()``, or ``with ncc.no_reorder():``) run in program order on
  their engine: they never fill an earlier idle gap.
* **Cores.** Each NeuronCore (``nl.nc`` grid dimensions, LNC=2) has its own engines and DMA
  queues; the estimate is the latest finish over cores. Grid instances on one core run one
  after another in program order, overlapping only where dependencies allow.

Not modeled: trn1's PSUM access restrictions, SBUF bank conflicts, instruction fetch, the
compiler's own reordering beyond the in-order queues, DMA queue affinity.
"""
from __future__ import annotations

import bisect
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
    hi, end)`` since they were last superseded, and the buffer it reuses (rotating buffers):
    its first write waits until that buffer's last access ends."""

    __slots__ = ("w", "r", "preds", "last", "ring", "banks")

    def __init__(self):
        self.w = []
        self.r = []
        self.preds = ()          # the _Access(es) whose memory this one reuses: its first
        #                          write waits until their last access ends
        self.last = 0.0          # end of the latest access (for the next user of its memory)
        self.ring = None         # the allocation site's ring it is in, if any
        self.banks = None        # PSUM: [(core, bank, previous owner)] it occupies


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


def _gap_end(gap):
    return gap[1]


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
    lo = hi = off
    for i, s in enumerate(base.strides):
        if s < 0:
            return whole
        lo += los[i] * s
        hi += his[i] * s
    if st.buffer == "hbm" or not arr.ndim:
        return lo, hi + base.itemsize
    # on chip: the corners' offsets within their partition. The storage is C-ordered with the
    # partition axis ``pdim`` after any block dims; drop that axis from the corners' indices.
    return _in_partition(arr, st.pdim, lo), _in_partition(arr, st.pdim, hi) + base.itemsize


def _in_partition(arr, pdim, byte):
    """Byte offset within its partition of the element at ``byte`` of C-ordered ``arr``."""
    out, rest = 0, byte
    for i, (n, s) in enumerate(zip(arr.shape, arr.strides)):
        q, rest = divmod(rest, s) if s else (0, rest)
        if i != pdim:
            out = out * n + q
    return out * arr.itemsize


class Scheduler:
    """Online list scheduler of one launch (see the module docstring)."""

    def __init__(self, tgt):
        self.tgt = tgt
        self.acc = weakref.WeakKeyDictionary()      # Storage -> {core: _Access}
        self.sites = {}                              # alloc site -> list of _Access (ring)
        self.ranks = {}                              # (core, line) -> (iteration, rank)
        self.psum = {}                               # core -> [[owner _Access, free]] per bank
        self.engine_free = {}                        # (core, engine) -> time
        self.gaps = {}                               # (core, engine) -> recent idle gaps
        self.dma_queues = {}                         # core -> heap of queue free times
        self.core_end = {}                           # core -> latest finish
        self.cur = None                              # the open instruction
        self.held = None                             # the last instruction, not yet placed
        self.core = 0
        self.last_end, self.last_engine = 0.0, "dma"  # the latest committed instruction

    # -- recording ------------------------------------------------------------------------------
    def boundary(self, core, ordered=False):
        """A new NKI API call begins: close the open instruction. ``ordered``: the call is in a
        ``no_reorder`` region, where it may not move into an earlier idle gap."""
        self._commit()
        self.core = core
        self.cur = {"reads": [], "writes": [], "engine": None, "dur": 0.0, "dma": None,
                    "core": core, "ordered": ordered}

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
                              "dur": 0.0, "dma": None, "core": first["core"],
                              "ordered": first.get("ordered", False)}
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

    def alloc(self, st, iteration=None):
        """A new on-chip storage: it reuses the buffer of the allocation ``SCHED_BUFFERS``
        back at the same site (rotating buffers). ``iteration`` is the innermost NKI loop's
        (uid, iteration number), None outside NKI loops. A site is a source line and the
        allocation's rank among that line's allocations in the current iteration: the copies
        of a Python-unrolled loop (or a helper called twice) in one iteration are distinct
        program text with buffers of their own; outside NKI loops nothing rotates."""
        a = _Access()
        self.acc[st] = {self.core: a}
        if st.buffer == "psum":
            self._take_banks(a, getattr(st, "banks", 1))
            return
        site = _alloc_site()
        if site is None or iteration is None:
            return
        key = (self.core, site)
        seen = self.ranks.get(key)
        rank = seen[1] + 1 if seen is not None and seen[0] == iteration else 0
        self.ranks[key] = (iteration, rank)
        ring = self.sites.setdefault((self.core, site, rank), [])   # buffers are per core
        if len(ring) >= _hw.SCHED_BUFFERS:
            a.preds = (ring[-_hw.SCHED_BUFFERS],)
        ring.append(a)
        a.ring = ring
        if len(ring) > _hw.SCHED_BUFFERS:
            del ring[0]

    def _take_banks(self, a, n):
        """PSUM is 8 physical banks per core: a new PSUM tile takes ``n`` free banks (those
        freed longest ago, a choice) and its first write waits until their previous tiles'
        last accesses end."""
        banks = self.psum.get(self.core)
        if banks is None:
            banks = self.psum[self.core] = [[None, True] for _ in range(_hw.PSUM_NUM_BANKS)]
        order = sorted(range(len(banks)),
                       key=lambda b: (not banks[b][1],
                                      banks[b][0].last if banks[b][0] is not None else 0.0))
        taken = []
        for b in order[:max(1, min(n, len(banks)))]:
            prev = banks[b][0]
            taken.append((self.core, b, prev))
            banks[b] = [a, False]
        a.banks = taken
        a.preds = tuple(p for _, _, p in taken if p is not None)

    def free_banks(self, st):
        """A PSUM tile died: its banks are free, last used by it."""
        for a in self.acc.get(st, {}).values():
            for core, b, _ in a.banks or ():
                slot = self.psum[core][b]
                if slot[0] is a:
                    slot[1] = True
            a.banks = None

    def direct(self, st):
        """An instruction's result written straight into a destination (``dst[...] =
        nisa.op(...)``): on the hardware it never had a buffer of its own, so it leaves its
        site's ring and carries no floor."""
        if self.cur is not None:
            self.cur["src"] = st                     # the result this assignment forwards
        self.unbank(st)
        a = self.acc.get(st, {}).get(self.core)
        if a is not None and a.ring is not None:
            if a.ring and a.ring[-1] is a:
                a.ring.pop()
            a.ring = None
            a.preds = ()

    def unbank(self, st):
        """``st`` holds no banks of its own after all (a result written into a destination, or
        a PSUM tensor allocated block by block, ``_spill``): hand its banks back as they were."""
        a = self.acc.get(st, {}).get(self.core)
        if a is not None and a.banks:
            for core, b, prev in a.banks:
                slot = self.psum[core][b]
                if slot[0] is a:
                    self.psum[core][b] = [prev, True]
            a.banks = None
            a.preds = ()

    def side(self, engine, seconds, dma, st, lo, hi, read):
        """Place a compiler-inserted instruction now, outside the open API call: a spill
        (``read``: it reads bytes ``lo:hi`` of ``st``) or a refill (it writes them). The open
        call's accesses of those bytes then depend on it."""
        self._flush()
        ent = (st, lo, hi)
        self._place_instruction({"reads": [ent] if read else [], "writes": [] if read else [ent],
                                 "engine": engine, "dur": seconds, "dma": dma,
                                 "core": self.core}, engine, self.core)

    def barrier(self, core):
        """Nothing issued after this point starts before everything issued before it on
        ``core`` has finished (an iteration boundary of a compiled loop when the estimate
        assumes no overlap across its iterations): every engine, the DMA bandwidth and the
        queues restart at the core's latest finish, with no idle gaps left to fill."""
        self._commit()
        self._flush()
        t = self.core_end.get(core, 0.0)
        for key in list(self.engine_free):
            if key[0] == core:
                self.engine_free[key] = max(self.engine_free[key], t)
                self.gaps.pop(key, None)
        for e in ("tensor", "vector", "scalar", "gpsimd", "dma-bandwidth"):
            self.engine_free[(core, e)] = max(self.engine_free.get((core, e), 0.0), t)
        q = self.dma_queues.get(core)
        if q is not None:
            self.dma_queues[core] = [max(x, t) for x in q]

    def register_wait(self, t):
        """``nisa.register_load`` of the tile view ``t``: a dynamic loop bound (or while
        condition) is read by the engine sequencers that branch on it (the 2.33 stub,
        ``register_alloc``: "physical register allocation ... across the appropriate engine
        sequencers"; dynamic loops "compile to branching instructions executed by engine
        sequencers"), so nothing issued after it on any engine or DMA queue of the core starts
        before the value is written (plus the semaphore latency): the engines' free times
        and their idle gaps are cut at that time (earlier independent work may still fill
        the gaps after it, as at any compiled loop's iteration boundary). UNCONFIRMED (no
        cost is documented): every engine is assumed to take part; the load itself is
        charged no engine time."""
        self._commit()
        self._flush()
        core = self.core
        lo, hi = _range(t)
        ready = 0.0
        for wlo, whi, wend, _ in self._access(t._st).w:
            if wlo < hi and lo < whi:
                ready = max(ready, wend + _hw.SCHED_SYNC_NS * 1e-9)
        for e in ("tensor", "vector", "scalar", "gpsimd", "dma-bandwidth"):
            key = (core, e)
            self.engine_free[key] = max(self.engine_free.get(key, 0.0), ready)
            if key in self.gaps:
                self.gaps[key] = [(max(g0, ready), g1) for g0, g1 in self.gaps[key]
                                  if g1 > ready]
        q = self.dma_queues.get(core)
        if q is not None:
            self.dma_queues[core] = [max(x, ready) for x in q]

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
        """Close the open API call. An instruction is held until the next call shows whether
        its result is assigned straight into a destination (``dst[...] = nisa.op(...)``): the
        instruction then writes that destination itself, so it also waits for the
        destination's earlier readers and writers and for its rotating buffer."""
        cur, self.cur = self.cur, None
        if cur is None:
            return
        held = self.held
        if cur["engine"] is None:
            if not cur["writes"]:
                return
            src = cur.get("src")
            if held is not None and any(w[0] is src or any(r[0] is w[0] for r in cur["reads"])
                                        for w in held["writes"]):
                held["writes"].extend(cur["writes"])
                self._flush()
                return
            self._flush()
            self._forward(cur)
            return
        self._flush()
        self.held = cur

    def _flush(self):
        """Place the held instruction, if any."""
        cur, self.held = self.held, None
        if cur is None:
            return
        engine, core = cur["engine"], cur["core"]
        prev, self.core = self.core, core           # _access() keys by the instruction's core
        try:
            self._place_instruction(cur, engine, core)
        finally:
            self.core = prev

    def _place_instruction(self, cur, engine, core):
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
            for p in a.preds:
                if p.last > ready:
                    ready = p.last
            for wlo, whi, wend, weng in a.w:
                if wlo < hi and lo < whi and wend > ready:
                    ready = wend
            for rlo, rhi, rend in a.r:
                if rlo < hi and lo < rhi and rend > ready:
                    ready = rend
        ordered = cur.get("ordered", False)
        if cur["dma"] is None:
            end = self._place((core, engine), ready, cur["dur"], ordered)
        else:
            q = self.dma_queues.get(core)
            if q is None:
                q = self.dma_queues[core] = [0.0] * _hw.DMA_QUEUES_PER_NC
            qfree = heapq.heappop(q)
            start = max(ready, qfree)
            # the transfer holds the core's DMA bandwidth for its bytes plus the per-DMA
            # share of the fixed cost (as in the bound), and completes the latency later
            # the core's DMA bandwidth is shared by its queues, not taken in program order: a
            # ready transfer may use bandwidth left idle before a transfer issued earlier
            data = self._place((core, "dma-bandwidth"), start, cur["dma"]
                               + _hw.DMA_FIXED_NS_PER_INSTRUCTION * 1e-9, ordered)
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

    def _place(self, key, ready, dur, ordered=False):
        """Start an instruction at ``ready`` or later on engine ``key``: in the earliest idle
        gap among the engine's last ``SCHED_REORDER_WINDOW`` gaps that fits it (the compiler
        moving independent instructions earlier), else after the engine's last instruction.
        ``ordered`` (a ``no_reorder`` region: "operations inside the block execute in program
        order", nki.language.no_reorder docs) never takes a gap. Returns its end."""
        free = self.engine_free.get(key, 0.0)
        gaps = self.gaps.get(key)
        if gaps and not ordered:
            # the gaps are disjoint and in time order (each opens at the engine's free time,
            # later than every earlier one ends), so those ending before ``ready`` -- most of
            # them in a long stream -- cannot hold the instruction: start at the first that
            # ends at or after it (a speed-up only: the same gap is taken)
            for i in range(bisect.bisect_left(gaps, ready, key=_gap_end), len(gaps)):
                g0, g1 = gaps[i]
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
        self._flush()
        self.acc = weakref.WeakKeyDictionary()
        self.sites = {}
        self.ranks = {}
        self.psum = {}
        return max(self.core_end.values(), default=0.0)


__all__ = ["Scheduler"]
