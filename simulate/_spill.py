"""On-chip tensors beyond capacity: allocation by liveness and spilling, as neuronx-cc does it.

AWS's legacy kernels allocate more SBUF/PSUM than the hardware has and still compile and run:
the attention tutorial's ``qk`` PSUM tensor of ``(N/128, N/512)`` blocks (v3, 1 GiB at N =
16K), v4-v8's eight 2 KiB score blocks plus an output bank at N = 4096, v11's PSUM tensors
indexed by every query tile (nki-samples 6905a68, measured on trn1 at 512-16K). What AWS
documents (NKI Block Dimension Migration Guide, "What are block dimensions?"): a block
dimension is logical; "the compiler analyzes the memory dependency and allocates physical
address to each tiles", so "the physical tiles may not be alive in the memory
simultaneously". Nothing AWS publishes says what happens when even the live tiles do not fit;
the measured times say it is not free (v3 grows 4.2-5.2x per doubling of N, v11 jumps 25x from
8K to 16K where its SBUF tensors pass trn1's 192 KiB per partition).

The model (each point UNCONFIRMED, docs/simulator.md "Allocation beyond capacity"):

* **Units.** An on-chip tensor is one unit; a tensor with block dimensions that does not fit
  as a whole is allocated block by block: a block takes its space (PSUM: its banks) at its first
  access, not at the declaration.
* **Eviction by liveness.** The compiler sees the whole program; an eager simulator does not.
  So a launch that runs out of space runs twice: the first run records when every unit is
  accessed from its first shortage on (the runs are identical before it), the second evicts, when a unit needs space that is not free, the unit whose next
  access is furthest away (none: it is dead and costs nothing) among those not used by the
  current instruction and not directly allocated -- what an allocator that knows every
  access does (Belady's choice). Only the second run is measured and returned.
* **Spill and refill.** An evicted unit that is accessed again (other than by a write that
  overwrites it whole) was spilled: it is charged, at that access, a store to its spill
  location and, where needed, a load back. PSUM spills to SBUF while SBUF has room beside the
  live tensors: one VectorE copy out (the engine the compiler's PSUM copies use here), after
  which engines read it there; only a write brings it back into a bank (a copy back unless the
  write overwrites it whole). Without room PSUM spills to HBM (the copy plus a DMA each way
  and the copy back); SBUF spills to HBM (a DMA each way). Each is a dependency of the access.

Kernels of this package must not rely on it (a project rule: whatever the compiler does beyond
the hardware's capacity is slow): ``set_spill(False)`` / ``NKI_SIM_SPILL=0`` turns it off and
overflowing allocations raise, as the package's tests run. On by default, so that AWS's code
runs unchanged; a launch that spilled warns once with :class:`SpillWarning`.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import warnings
import weakref

from . import _hw, _sched

ENV_VAR = "NKI_SIM_SPILL"
DOC_BLOCKS = ("https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/nki/"
              "nki_block_dimension_migration_guide.html")

_state = {"on": os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")}


class SpillWarning(UserWarning):
    """A launch allocated beyond SBUF/PSUM capacity and ran on the modeled spilling."""


def is_spill() -> bool:
    """Whether allocations beyond capacity spill (True) or raise (False)."""
    return _state["on"]


def set_spill(flag: bool) -> bool:
    """Turn spilling on or off; returns the previous setting."""
    old = _state["on"]
    _state["on"] = bool(flag)
    return old


@contextlib.contextmanager
def spill(flag: bool = True):
    """``with simulate.spill(False): ...`` runs the block with overflowing allocations raising."""
    old = set_spill(flag)
    try:
        yield
    finally:
        set_spill(old)


class _Unit:
    """A tensor, or one block of a block-by-block tensor, competing for on-chip space."""

    __slots__ = ("st", "block", "fb", "span", "size", "resident", "spilled_to", "out_paid",
                 "seq", "written", "key")

    def __init__(self, st, block, key):
        self.st = weakref.ref(st)
        self.block = block          # block index, or None for the whole tensor
        _, self.fb, self.span = _units_of(st)   # bytes per partition: dtype's, backing array's
        # SBUF: bytes per partition; PSUM: banks (a tensor allocated whole: as it was accounted)
        self.size = (unit_size(st, self.fb) if st.lazy
                     else st.banks if st.buffer == "psum" else st.bpp)
        self.resident = True
        self.spilled_to = None      # where an evicted unit's data went: "sbuf" / "hbm"
        self.out_paid = False       # its spill copy was charged (PSUM units living in SBUF)
        self.seq = -1               # the API call that last touched it
        self.written = False
        self.key = key              # (pid, allocation number, block): the same in both runs


#: The accesses recorded by a launch's first run, (pid, allocation number, block) -> API call
#: numbers in order, while its second run is under way; None otherwise (``_launch``).
ORACLE = None


class Space:
    """One grid instance's units (see the module docstring)."""

    def __init__(self, pid):
        self.pid = pid
        self.units = {}             # (id(storage), block) -> _Unit
        # the units holding space in each memory: resident ones, and (in "sbuf") PSUM units
        # spilled into SBUF -- the eviction candidates, without scanning every unit
        self.holding = {"sbuf": {}, "psum": {}}
        self.spill_sbuf = 0         # bytes per partition of PSUM units spilled into SBUF
        self.allocs = 0             # units' storages numbered in allocation order
        self.trace = {}             # key -> API call numbers of its accesses (first run)
        self.evicted = False        # space was short: the launch runs again with the trace


def geometry(shape, pdim, itemsize):
    """(blocks, bytes per partition of one block) of an on-chip tensor of ``shape`` whose
    partition axis is ``pdim`` (the dims before it are block dims)."""
    nblocks = 1
    for s in shape[:pdim]:
        nblocks *= int(s)
    fb = itemsize
    for s in shape[pdim + 1:]:
        fb *= int(s)
    return nblocks, fb


def _units_of(st):
    """(blocks, bytes of a unit per partition in the tensor's dtype, the same in the backing
    array's bytes: what the scheduler's byte ranges count) of a storage; one unit per block of a
    block-by-block tensor, else one for the whole tensor."""
    nblocks, fb = geometry(st.arr.shape, st.pdim, st.di.itemsize)
    if not st.lazy:
        nblocks, fb = 1, nblocks * fb
    return nblocks, fb, fb // st.di.itemsize * st.arr.itemsize


def unit_size(st, fb):
    """Space one unit of ``fb`` bytes per partition takes: PSUM banks, or SBUF bytes."""
    if st.buffer == "psum":
        return max(1, -(-fb // _hw.PSUM_BANK_BYTES))
    return fb


def _live(ctx, buffer):
    if buffer == "psum":
        return ctx.psum_banks, _hw.PSUM_NUM_BANKS
    return ctx.sbuf_live + ctx.space.spill_sbuf, ctx.tgt.sbuf_bytes_per_partition


def _account(ctx, st, size, sign):
    if st.buffer == "psum":
        ctx.psum_banks += sign * size
        if ctx.psum_banks > ctx.peak_banks:
            ctx.peak_banks = ctx.psum_banks
    else:
        ctx.sbuf_live += sign * size
        if ctx.sbuf_live > ctx.peak_sbuf:
            ctx.peak_sbuf = ctx.sbuf_live


def make_room(ctx, buffer, need):
    """Evict units of ``buffer`` (SBUF: also move PSUM data spilled into SBUF on to HBM) until
    ``need`` more fits: in the second run the ones whose next access is furthest, in the first
    the least recently used. Returns False when it cannot (everything left is in use by this
    instruction or directly allocated)."""
    space = ctx.space
    live, cap = _live(ctx, buffer)
    if live + need <= cap:
        return True
    space.evicted = True
    cands = []
    held = space.holding[buffer]
    for key, u in list(held.items()):
        st = u.st()
        if st is None:
            del held[key]
            continue
        if u.seq != ctx.seq and not st.pinned:
            cands.append((u, st, key))
    if ORACLE is not None:                    # furthest next access first; dead ones first of all
        inf = float("inf")

        def next_use(c):
            seqs = ORACLE.get(c[0].key, ())
            i = bisect.bisect_left(seqs, ctx.seq)       # this call's own accesses count
            return seqs[i] if i < len(seqs) else inf
        cands.sort(key=next_use, reverse=True)
    else:                                      # least recently used first
        cands.sort(key=lambda c: c[0].seq)
    for u, st, key in cands:
        del held[key]
        if not u.resident:                     # PSUM data spilled into SBUF: on to HBM (its
            space.spill_sbuf -= u.fb           # spill is charged again, via HBM)
            u.spilled_to = "hbm"
            u.out_paid = False
            live, cap = _live(ctx, buffer)
            if live + need <= cap:
                return True
            continue
        u.resident = False
        u.out_paid = False
        _account(ctx, st, u.size, -1)
        if buffer == "psum":
            if ctx.sbuf_live + space.spill_sbuf + u.fb <= ctx.tgt.sbuf_bytes_per_partition:
                u.spilled_to = "sbuf"
                space.spill_sbuf += u.fb
                space.holding["sbuf"][key] = u
            else:
                u.spilled_to = "hbm"
        else:
            u.spilled_to = "hbm"
        live, cap = _live(ctx, buffer)
        if live + need <= cap:
            return True
    return False


def admit(ctx, st):
    """``st`` does not fit as a whole: place it as a tracked unit (making room), or, when it
    has block dimensions, block by block as its blocks are accessed. Returns False when it
    cannot be placed even so."""
    if geometry(st.arr.shape, st.pdim, st.di.itemsize)[0] > 1:
        st.lazy = True
        _number(ctx.space, st)
        if st.buffer == "psum" and _sched.ACTIVE is not None:
            _sched.ACTIVE.unbank(st)
        return True
    size = st.banks if st.buffer == "psum" else st.bpp
    if not make_room(ctx, st.buffer, size):
        return False
    _account(ctx, st, size, +1)
    if st.buffer == "psum":
        ctx.psum_live += st.bpp
    track(ctx, st)
    return True


def _number(space, st):
    if st.uid is None:
        st.uid = space.allocs
        space.allocs += 1
    return st.uid


def track(ctx, st):
    """An accounted whole tensor becomes an eviction candidate."""
    space = ctx.space
    u = _Unit(st, None, (space.pid, _number(space, st), None))
    u.seq = ctx.seq
    u.written = st.written
    space.units[(id(st), None)] = u
    space.holding[st.buffer][(id(st), None)] = u
    _record(space, u.key, ctx.seq)


def _record(space, key, seq):
    """Note an access for the second run. Only accesses from the first shortage on are kept:
    until then both runs are the same and nothing is evicted, and a unit with no access after
    it is dead (so a launch that never runs short records nothing)."""
    if ORACLE is None and space.evicted:
        seqs = space.trace.get(key)
        if seqs is None:
            space.trace[key] = [seq]
        elif seqs[-1] != seq:
            seqs.append(seq)


def touch(ctx, t, write):
    """An instruction of ``ctx`` reads or writes the on-chip view ``t``: bring its units in
    (refilling spilled ones) and mark them most recently used."""
    st = t._st
    space = ctx.space
    lo = hi = None                             # the view's bytes, in the backing array's
    if st.lazy:
        lo, hi = _sched._range(t)
        span = _units_of(st)[2]
        blocks = range(lo // span, (hi - 1) // span + 1) if hi > lo else ()
    else:
        u = space.units.get((id(st), None))
        if u is None:
            return
        if u.resident:                         # the common case: only its last access is noted
            _record(space, u.key, ctx.seq)
            u.seq = ctx.seq
            if write:
                u.written = True
            return
        blocks = (None,)
    for b in blocks:
        key = (id(st), b)
        u = space.units.get(key)
        if u is None:                          # a block's first access: it takes its space
            u = _Unit(st, b, (space.pid, st.uid, b))
            u.seq = ctx.seq
            if not make_room(ctx, st.buffer, u.size):
                _overflow(ctx, st, u.size)
            _account(ctx, st, u.size, +1)
            space.units[key] = u
            space.holding[st.buffer][key] = u
        elif not u.resident:
            u.seq = ctx.seq
            if lo is None:
                lo, hi = _sched._range(t)
            base = 0 if b is None else b * u.span
            whole = write and lo <= base and hi >= base + u.span
            if u.written and not whole and not u.out_paid:
                _spill_out(ctx, st, u)
                u.out_paid = True
            if write or u.spilled_to != "sbuf" or st.buffer != "psum":
                # back into its own memory (a PSUM unit in SBUF is read where it is)
                if not make_room(ctx, st.buffer, u.size):
                    _overflow(ctx, st, u.size)
                _account(ctx, st, u.size, +1)
                if u.spilled_to == "sbuf":
                    space.spill_sbuf -= u.fb
                    space.holding["sbuf"].pop(key, None)
                space.holding[st.buffer][key] = u
                if u.written and not whole:
                    _load_back(ctx, st, u)
                u.resident = True
                u.spilled_to = None
        _record(space, u.key, ctx.seq)
        u.seq = ctx.seq
        if write:
            u.written = True


def _spill_out(ctx, st, u):
    """Charge the store of an evicted unit to where it went, before the access needing it."""
    rec = ctx.rec
    rec.spill_refills += 1
    parts = int(st.arr.shape[st.pdim])
    lo = 0 if u.block is None else u.block * u.span
    if st.buffer == "psum":
        rec.side("vector", _copy_cycles(st, u.fb), st, lo, lo + u.span, read=True)
    if st.buffer == "sbuf" or u.spilled_to == "hbm":
        rec.side_dma(parts * u.fb, parts, st, lo, lo + u.span, read=True)


def _load_back(ctx, st, u):
    """Charge the load of a spilled unit back into its own memory."""
    rec = ctx.rec
    parts = int(st.arr.shape[st.pdim])
    lo = 0 if u.block is None else u.block * u.span
    if u.spilled_to == "hbm":
        rec.side_dma(parts * u.fb, parts, st, lo, lo + u.span, read=False)
    if st.buffer == "psum":
        rec.side("vector", _copy_cycles(st, u.fb), st, lo, lo + u.span, read=False)


def _copy_cycles(st, fb):
    return max(_hw.MIN_II_CYCLES, fb // st.di.itemsize)


def warn(rec, tgt):
    """Once per launch that spilled: say that its time rests on the modeled spilling."""
    warnings.warn(
        f"kernel '{rec.name}': its on-chip tensors exceed {tgt.name}'s SBUF or PSUM "
        f"({rec.spill_refills} spilled units reloaded, {rec.spill_hbm_bytes} B through HBM); "
        "the simulator models the compiler's spilling (UNCONFIRMED: docs/simulator.md, "
        "'Allocation beyond capacity'). simulate.set_spill(False) makes this an error.",
        SpillWarning, stacklevel=4)


def _overflow(ctx, st, size):
    from ._errors import hw_error, fmt_shape
    what = "psum banks" if st.buffer == "psum" else "SBUF bytes per partition"
    raise hw_error(
        "runtime",
        f"on-chip memory exhausted: tensor '{st.name}' {fmt_shape(st.arr.shape)} needs {size} "
        f"{what} and every other live unit is in use by the same instruction (spilling "
        "cannot make room).")


def forget(ctx, st):
    """``st`` died: its resident units give their space back; nothing of it stays tracked.
    Returns True when ``st`` was handled here (tracked or block by block)."""
    space = ctx.space
    if not (st.lazy or (id(st), None) in space.units):
        return False
    for b in (range(_units_of(st)[0]) if st.lazy else (None,)):
        key = (id(st), b)
        u = space.units.pop(key, None)
        if u is None:
            continue
        space.holding["sbuf"].pop(key, None)
        space.holding["psum"].pop(key, None)
        if u.resident:
            _account(ctx, st, u.size, -1)
        elif u.spilled_to == "sbuf":
            space.spill_sbuf -= u.fb
    if not st.lazy and st.buffer == "psum":
        ctx.psum_live -= st.bpp
    return True


__all__ = ["SpillWarning", "is_spill", "set_spill", "spill"]
