"""Kernel contexts, SPMD grids and on-chip memory accounting (launching is ``_launch``).

A kernel runs eagerly as ordinary Python inside a *kernel context* (one per grid instance),
kept on a thread-local stack. Every nl/nisa API call goes through :func:`enter`, which

* raises err_nki_api_outside_of_nki_kernel when no kernel is running,
* bumps the context's instruction sequence number, and
* *commits* the previous API call's result tile if it is still alive: results are first
  "pending" so that ``dst[...] = nl.exp(x)`` / ``psum += nisa.nc_matmul(...)`` write straight
  into ``dst`` (as the compiler does) without the temporary ever counting against SBUF/PSUM.

Memory accounting: a committed SBUF tensor adds its bytes per partition to the instance's live
total, a PSUM tensor its banks (blocks x ceil(bytes per block / 2 KiB)); ``Storage.__del__``
(CPython refcounting ~ compiler liveness) releases them. Overflows raise RuntimeError.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
import weakref

import numpy as np

from . import _hw, _sched, _spill
from ._cost import LaunchRecord, ceil_div
from ._errors import nki_error, hw_error, fmt_shape

_tls = threading.local()


def _stack():
    try:
        return _tls.stack
    except AttributeError:
        _tls.stack = []
        return _tls.stack


def in_kernel():
    return bool(_stack())


def current():
    st = _stack()
    if not st:
        raise nki_error("err_nki_api_outside_of_nki_kernel", "runtime",
                        "calling NKI API outside of NKI kernels is not supported.")
    return st[-1]


def enter(keep=None):
    """Entry of every NKI API call: returns the current context (see module doc). The pending
    result is committed unless it is ``keep`` (about to be written straight into a destination)."""
    try:
        ctx = _tls.stack[-1]
    except (AttributeError, IndexError):
        current()
        raise
    ctx.seq += 1
    ctx.last_charge = None
    rec = ctx.rec
    rec.sched.boundary(rec.core, ctx.no_reorder > 0)
    p = ctx.pending
    if p is not None and p is not keep:
        ctx.pending = None
        commit(ctx, p._st)
    return ctx


# ---------------------------------------------------------------------------------------------
# memory accounting
# ---------------------------------------------------------------------------------------------
def commit(ctx, st):
    """Account a live on-chip storage; raises RuntimeError on SBUF/PSUM overflow."""
    if st.acct or st.ctx is not ctx:
        return
    if st.copy_out:               # a TensorE result the compiler copies out to SBUF
        ctx.rec.add("vector", st.copy_out)
        st.copy_out = 0
    if st.pinned:                 # direct allocation: placed (and checked) by language.Placed
        st.acct = True
        return
    buf = st.buffer
    spill = ctx.space is not None
    if buf == "sbuf":
        live = ctx.sbuf_live + st.bpp
        cap = ctx.tgt.sbuf_bytes_per_partition
        if spill and live + ctx.space.spill_sbuf > cap and _spill.admit(ctx, st):
            st.acct = True
            _note_iteration_alloc(ctx, st)
            return
        if live > cap:
            raise hw_error(
                "runtime",
                f"SBUF capacity exceeded: allocating tensor '{st.name}' "
                f"({fmt_shape(st.arr.shape)} {st.di.name}, {st.bpp} bytes per partition) "
                f"needs {live} bytes per partition of live SBUF, but {ctx.tgt.name} has "
                f"{cap} bytes per partition (live SBUF tensors are counted until they are "
                f"garbage collected; free tiles you no longer need or use smaller tiles).")
        ctx.sbuf_live = live
        if live > ctx.peak_sbuf:
            ctx.peak_sbuf = live
        st.acct = True
        if spill:
            _spill.track(ctx, st)
        _note_iteration_alloc(ctx, st)
    elif buf == "psum":
        banks = ctx.psum_banks + st.banks
        if spill and banks > _hw.PSUM_NUM_BANKS and _spill.admit(ctx, st):
            st.acct = True
            _note_iteration_alloc(ctx, st)
            return
        if banks > _hw.PSUM_NUM_BANKS:
            raise hw_error(
                "runtime",
                f"stack overflow: required psum banks {banks} exceeds available psum banks "
                f"{_hw.PSUM_NUM_BANKS} (allocating PSUM tensor '{st.name}' "
                f"{fmt_shape(st.arr.shape)} {st.di.name} which needs {st.banks} bank(s) of "
                f"{_hw.PSUM_BANK_BYTES} bytes per partition).")
        ctx.psum_banks = banks
        ctx.psum_live += st.bpp
        if ctx.psum_live > ctx.peak_psum:
            ctx.peak_psum = ctx.psum_live
        if banks > ctx.peak_banks:
            ctx.peak_banks = banks
        st.acct = True
        if spill:
            _spill.track(ctx, st)
        _note_iteration_alloc(ctx, st)


def _note_iteration_alloc(ctx, st):
    """Attribute an accounted storage to the iteration of the innermost loop it was allocated
    in (an allocation is accounted at the next API call, which may be inside a loop entered
    after it)."""
    if not st.aloops or st.reduce_loops:
        return
    uid = st.aloops[-1]
    for state in reversed(ctx.loops):
        if state.uid == uid:
            state.allocs.append(weakref.ref(st))
            return


def end_iteration(state):
    """A loop body is a block scope (err_local_variable_used_out_of_scope): the on-chip tiles
    accounted during the iteration that just ended are dead, whatever Python still references
    (the compiler's allocator reuses their space for the next iteration)."""
    for ref in state.allocs:
        st = ref()
        if st is not None and st.acct:
            release(st)
            st.acct = False
            st.expired = (state.file, state.line)
    state.allocs.clear()


def release(st):
    ctx = st.ctx
    if st.pinned:
        return
    if ctx.space is not None and _spill.forget(ctx, st):
        if st.buffer == "psum" and _sched.ACTIVE is not None:
            _sched.ACTIVE.free_banks(st)
        return
    if st.buffer == "sbuf":
        ctx.sbuf_live -= st.bpp
    else:
        ctx.psum_banks -= st.banks
        ctx.psum_live -= st.bpp
        if _sched.ACTIVE is not None:
            _sched.ACTIVE.free_banks(st)


# ---------------------------------------------------------------------------------------------
# contexts
# ---------------------------------------------------------------------------------------------
class Launch:
    """State shared by all grid instances of one kernel launch."""

    def __init__(self, func, tgt, grid_sizes, rec, opts):
        self.func = func
        codes = set()
        f = func
        while f is not None and len(codes) < 16:      # follow functools.wraps chains
            c = getattr(f, "__code__", None)
            if c is not None:
                codes.add(c)
            f = getattr(f, "__wrapped__", None)
        self.codes = codes
        self.tgt = tgt
        self.grid = grid_sizes
        self.rec = rec
        self.opts = opts
        self.shared = []          # shared_hbm storages in creation order
        self.params = {}          # name -> Storage
        self.immutable_writes = []  # names of immutable params written
        self.instance = 0


class Ctx:
    """One grid instance's kernel context."""

    def __init__(self, launch, pid):
        self.launch = launch
        self.tgt = launch.tgt
        self.rec = launch.rec
        self.pid = pid
        self.grid = launch.grid
        self.seq = 0
        self.pending = None
        # cost formula of the current instruction's result, (engine, fn, n) or ("dma", ...):
        # lets a direct write into a larger / strided destination be re-costed (_tensor.assign)
        self.last_charge = None
        self.loop_depth = 0
        self.loops = []
        self.no_reorder = 0         # depth of no_reorder regions (loop directives, with-blocks)
        self.sbuf_live = 0
        self.psum_banks = 0
        self.psum_live = 0
        self.peak_sbuf = 0
        self.peak_psum = 0
        self.peak_banks = 0
        # on-chip units in LRU order when allocations may spill beyond capacity (_spill)
        self.space = _spill.Space(pid) if _spill.is_spill() else None
        self.shared_idx = 0
        self.hbm_idx = 0
        self.created_shared = False
        self.rng = np.random.default_rng(0)
        self.loop_reduce = {}
        # ScalarE / VectorE per-partition accumulation registers (activation reduce_cmd,
        # range_select / select_reduce). One value per partition.
        self.act_acc = np.zeros(_hw.NUM_PARTITIONS, np.float32)
        self.vec_acc = np.full(_hw.NUM_PARTITIONS, -np.inf, np.float32)


# ---------------------------------------------------------------------------------------------
# grids
# ---------------------------------------------------------------------------------------------
class NC:
    """``nl.nc(n)``: a grid dimension distributed over ``n`` physical NeuronCores (trn2)."""

    def __init__(self, n):
        self.n = int(n)

    def __mul__(self, k):
        return SpmdDim(self, k)

    __rmul__ = __mul__

    @property
    def size(self):
        return self.n

    @property
    def cores(self):
        return self.n

    def __int__(self):
        return self.n

    def __index__(self):
        return self.n

    def __repr__(self):
        return f"nc({self.n})"

    def __eq__(self, other):
        return isinstance(other, NC) and other.n == self.n

    def __hash__(self):
        return hash(("nc", self.n))


class SpmdDim:
    """``nl.spmd_dim(a, b)``: one grid dimension of size a*b (either factor may be nl.nc)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    @property
    def size(self):
        return _dim_size(self.a) * _dim_size(self.b)

    @property
    def cores(self):
        return max(_dim_cores(self.a), 1) * max(_dim_cores(self.b), 1)

    def __int__(self):
        return self.size

    def __index__(self):
        return self.size

    def __repr__(self):
        return f"spmd_dim({self.a!r}, {self.b!r})"

    def __eq__(self, other):
        return isinstance(other, SpmdDim) and (other.a, other.b) == (self.a, self.b)

    def __hash__(self):
        return hash(("spmd_dim", self.a, self.b))


def _dim_size(d):
    if isinstance(d, (NC, SpmdDim)):
        return d.size
    return int(d)


def _dim_cores(d):
    if isinstance(d, (NC, SpmdDim)):
        return d.cores
    return 1


def core_of(grid, pid):
    """Physical core of grid point ``pid``: the index along the ``nl.nc(n)`` dimension (or the
    nc factor of an ``nl.spmd_dim``: ``spmd_dim(a, b)`` numbers its points ``i_a * size(b) +
    i_b``); 0 without one. Several nc dimensions combine row-major."""
    core = 0
    for d, i in zip(grid, pid):
        if isinstance(d, NC):
            core = core * d.n + i
        elif isinstance(d, SpmdDim):
            ia, ib = divmod(i, _dim_size(d.b))
            for f, j in ((d.a, ia), (d.b, ib)):
                if isinstance(f, (NC, SpmdDim)) and f.cores > 1:
                    core = core * f.cores + (j % f.cores)
    return core


def resolve_grid(grid, tgt):
    if not isinstance(grid, tuple):
        grid = (grid,)
    sizes = []
    for d in grid:
        if isinstance(d, (NC, SpmdDim)):
            if d.cores > 1 and not tgt.multi_core_spmd:
                raise nki_error("err_multi_cores_spmd_not_supported", "runtime",
                                f"SPMD grid with multi neuron cores is not supported on "
                                f"{tgt.name}")
        elif not isinstance(d, (int, np.integer)) or isinstance(d, bool):
            raise TypeError(f"SPMD grid dimensions must be ints, nl.nc(n) or nl.spmd_dim(...), "
                            f"got {d!r}")
        s = _dim_size(d)
        if s < 1:
            raise ValueError(f"SPMD grid dimensions must be >= 1, got {s}")
        sizes.append(s)
    return tuple(sizes)


# ---------------------------------------------------------------------------------------------
# launching
# ---------------------------------------------------------------------------------------------
_measures = []        # active simulate.measure() objects, innermost last
# program_size() tracing: run the first grid instance and every NKI loop body once (as the
# compiler traces the kernel), outputs discarded
_trace = {"on": False}
# text-only runs (:func:`text_only`) in progress: instructions count in the program size, their
# effects are discarded
_text_only = {"depth": 0}
_progress_hooks = []  # active simulate.progress() callbacks: f(instances_done, instances_total)
_cpu_note_shown = [False]


def compiled_loop_overlap():
    """The innermost measure's ``compiled_loop_overlap`` setting, else True (the default
    assumption: iterations of a compiled loop overlap as unrolled copies do)."""
    for m in reversed(_measures):
        if m.compiled_loop_overlap is not None:
            return bool(m.compiled_loop_overlap)
    return True


def resolve_target(opts):
    for m in reversed(_measures):
        if m.target is not None:
            return _hw.get_target(m.target)
    pt = opts.get("platform_target")
    if pt:
        return _hw.get_target(pt)
    env = os.environ.get(_hw.TARGET_ENV_VAR)
    if env:
        return _hw.get_target(env)
    return _hw.get_target(_hw.DEFAULT_TARGET)


def kernel_frame_ok(ctx, depth):
    """True when the frame ``depth`` levels up is the kernel function's own frame."""
    codes = ctx.launch.codes
    if not codes:
        return True
    f = sys._getframe(depth + 1)
    return f.f_code in codes


def cpu_note(what):
    if not _cpu_note_shown[0]:
        _cpu_note_shown[0] = True
        warnings.warn(f"nki.{what}: no Neuron device here; the kernel ran on the nki-flash CPU "
                      "simulator (simulate/). Outputs are simulated; timings are modeled.",
                      RuntimeWarning, stacklevel=3)


def psum_banks_for(shape, pdim, itemsize):
    """(blocks, bytes per partition of a block, banks) of a PSUM tensor allocated whole."""
    nblocks, fb = _spill.geometry(shape, pdim, itemsize)
    return nblocks, fb, nblocks * max(1, ceil_div(fb, _hw.PSUM_BANK_BYTES))


def is_text_only() -> bool:
    """Whether kernel code runs for its program text only (:func:`text_only`): writes into
    tensors and registers are dropped and state-dependent checks (accumulation groups) skipped."""
    return _text_only["depth"] > 0


@contextlib.contextmanager
def text_only(ctx):
    """Run a block of kernel code for its program text only: the body of a compiled loop
    (``nl.fori_loop``/``nl.while_loop``) whose runtime trip count is 0. The compiler emits that
    body whatever the count ("a single copy of the body is generated and the hardware iterates
    over it at runtime", NKI dynamic-loops page), so its instructions count in the program size
    (``LaunchRecord.count_program``: under the same first-iteration rule as any other); nothing
    else is kept -- engine time, DMA bytes and the scheduled estimate go to a throwaway record,
    tensor and register writes are dropped (:func:`is_text_only`), and the context's
    accumulation registers, random state, ``loop_reduce`` accumulators and pending result are
    restored. Tiles it allocates are allocated (the program holds them) and released with the
    iteration."""
    real = ctx.rec
    shadow = LaunchRecord(real.name, ctx.tgt, real.grid)
    shadow.api, shadow.core, shadow.ctx = real.api, real.core, ctx
    shadow.count_program = real.count_program
    saved = (ctx.act_acc.copy(), ctx.vec_acc.copy(), ctx.rng.bit_generator.state,
             dict(ctx.loop_reduce), ctx.pending, ctx.last_charge)
    sched = _sched.ACTIVE
    ctx.rec = shadow
    _sched.ACTIVE = shadow.sched if sched is not None else None
    _text_only["depth"] += 1
    try:
        yield
    finally:
        _text_only["depth"] -= 1
        _sched.ACTIVE = sched
        ctx.rec = real
        ctx.act_acc, ctx.vec_acc = saved[0], saved[1]
        ctx.rng.bit_generator.state = saved[2]
        ctx.loop_reduce = saved[3]
        ctx.pending, ctx.last_charge = saved[4], saved[5]
