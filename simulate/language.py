"""``neuronxcc.nki.language`` (``nl``) on the CPU.

Tiles are (P, F...) with the partition dim first (P <= 128); SBUF/PSUM tensors may carry block
dims before a ``par_dim``. Every function below must be called inside a running kernel.
Compute functions take SBUF/PSUM tiles (never HBM), compute in fp32 and round to the output
dtype; results are new SBUF tiles (``matmul``: PSUM) unless assigned into an existing tensor.
See docs/simulator.md for what is modeled and the spec sections cited in each docstring.
"""

from __future__ import annotations

import sys as _sys
from types import SimpleNamespace as _NS

import numpy as np
import ml_dtypes as _mld

from . import _cost, _deps, _dma, _dtypes, _hw, _ops, _runtime, _strict, _tensor
from ._dtypes import (float32, float16, bfloat16, float8_e4m3, float8_e5m2, tfloat32, int8,  # noqa: F401,E501 (public nl dtypes)
                      int16, int32, uint8, uint16, uint32, bool_, float32r, F32)
from ._errors import nki_error, hw_error, fmt_shape
from ._index import arange, mgrid, ds, eval_mask  # noqa: F401 (public nl names)
from ._runtime import enter, current, NC as _NC, SpmdDim as _SpmdDim
from ._tensor import (Tensor, Storage, tile_operand, make_result, new_onchip, check_partitions,
                      SBUF as _SBUF, PSUM as _PSUM, HBM as _HBM, SHARED_HBM as _SHARED,
                      fit_value, host_array)
from ._ops import free_size as _free



# =============================================================================================
# memory hierarchy / buffers (spec §3.1)
# =============================================================================================
class Buffer:
    """A buffer marker (``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.private_hbm``,
    ``nl.shared_hbm``; also returned by ``nki.compiler.sbuf.mod_alloc(...)`` etc.)."""

    def __init__(self, kind, name):
        self.kind = kind
        self.name = name

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *a, **k):       # nl.sbuf.auto_alloc()-style use
        return self

    def __eq__(self, other):
        # a tensor's ``.buffer`` is the memory kind as a string ("sbuf", "psum", "hbm",
        # "shared_hbm"); NKI 0.7 code compares it with the markers (``t.buffer == nl.sbuf``;
        # the stub types NkiTensor.buffer as ``MemoryRegion | str``)
        if isinstance(other, Buffer):
            return self.kind == other.kind
        if isinstance(other, str):
            return other in (self.kind, self.name)
        return NotImplemented

    def __hash__(self):
        return hash(self.kind)


class Placed(Buffer):
    """A direct-allocation marker (``ncc.sbuf/psum.mod_alloc`` or ``.alloc(func)``): where the
    tensor lives, in bytes per partition (SBUF) or banks (PSUM). See simulate.compiler."""

    def __init__(self, buf, *, base=0, tiles=None, func=None):
        super().__init__(buf.kind, buf.name)
        self.base = base
        self.tiles = None if tiles is None else tuple(int(t) for t in tiles)
        self.func = func

    def place(self, ctx, st, shape, pdim, itemsize):
        """Size the storage by its placement and check it against the capacity."""
        blocks = [int(s) for s in shape[:pdim]]
        tile_bytes = itemsize
        for s in shape[pdim + 1:]:
            tile_bytes *= int(s)
        psum = self.kind == _PSUM
        unit = -(-tile_bytes // _hw.PSUM_BANK_BYTES) if psum else tile_bytes
        if self.func is not None:
            slots = set()
            for idx in np.ndindex(*blocks) if blocks else [()]:
                addr = self.func(idx=tuple(int(i) for i in idx), pdim_size=int(shape[pdim]),
                                 fdim_size=tile_bytes)
                first = addr[0] if isinstance(addr, (tuple, list)) else addr
                slots.add(int(first) if psum else int(addr[-1] if isinstance(
                    addr, (tuple, list)) else addr))
            lo = sorted(slots)[0]
            hi = sorted(slots)[-1] + unit
            used = len(slots) * unit
        else:
            n = 1
            if self.tiles is not None:
                if len(self.tiles) > len(blocks) or any(
                        t < 1 or t > b for t, b in zip(self.tiles, blocks)):
                    raise ValueError(
                        f"mod_alloc tiles {self.tiles} do not fit the block dims {tuple(blocks)} "
                        f"of tensor '{st.name}' (each must be between 1 and its block dim)")
                for t in self.tiles:
                    n *= t
                for b in blocks[len(self.tiles):]:
                    n *= b
            else:
                for b in blocks:
                    n *= b
            lo = self.base
            used = n * unit
            hi = self.base + used
        cap = _hw.PSUM_NUM_BANKS if psum else ctx.tgt.sbuf_bytes_per_partition
        what = "banks" if psum else "bytes per partition"
        # the compiler traces an NKI loop body once, so a Python address counter advanced in
        # the body (AWS allocated SD attention) is read in the first iteration only
        traced = not [ls for ls in ctx.loops if not (ls.first or ls.static)]
        if traced and (lo < 0 or hi > cap):
            raise hw_error("runtime",
                           f"Allocated memory out of bound: tensor '{st.name}' "
                           f"{fmt_shape(shape)} is placed at {lo}..{hi} {what}, but "
                           f"{ctx.tgt.name} has {cap} {what}")
        st.pinned = True
        if psum:
            st.banks = used
            st.bpp = used * _hw.PSUM_BANK_BYTES
        else:
            st.bpp = used


sbuf = Buffer(_SBUF, "sbuf")
psum = Buffer(_PSUM, "psum")
private_hbm = Buffer(_HBM, "private_hbm")
hbm = private_hbm
shared_hbm = Buffer(_SHARED, "shared_hbm")


def _buffer_kind(buffer):
    if buffer is None:
        return _SBUF
    if isinstance(buffer, Buffer):
        return buffer.kind
    k = getattr(buffer, "kind", None)
    if k in (_SBUF, _PSUM, _HBM, _SHARED):
        return k
    if isinstance(buffer, str) and buffer in ("sbuf", "psum", "hbm", "shared_hbm",
                                              "private_hbm"):
        return _HBM if buffer == "private_hbm" else buffer
    raise TypeError(f"unknown buffer {buffer!r}; use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")


class par_dim(int):
    """``nl.par_dim(n)``: marks the partition dimension in a shape (dims before it are block
    dims)."""

    def __new__(cls, n):
        return int.__new__(cls, n)

    def __repr__(self):
        return f"par_dim({int(self)})"


# =============================================================================================
# constants
# =============================================================================================
class _TileSize:
    """``nl.tile_size``: hardware tile limits (spec §1)."""

    pmax = _hw.NUM_PARTITIONS
    psum_fmax = _hw.PSUM_FMAX
    gemm_stationary_fmax = _hw.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = _hw.GEMM_MOVING_FMAX
    bn_stats_fmax = _hw.BN_STATS_FMAX
    psum_num_banks = _hw.PSUM_NUM_BANKS

    @property
    def total_available_sbuf_size(self):
        """Usable SBUF bytes per partition of the active target (capacity minus the 16 KiB the
        compiler reserves; value UNCONFIRMED, spec §1)."""
        if _runtime.in_kernel():
            return current().tgt.total_available_sbuf_size
        return _runtime.resolve_target({}).total_available_sbuf_size


tile_size = _TileSize()
fp32 = _NS(min=np.float32(_hw.FP32_MIN), max=np.float32(-_hw.FP32_MIN))
# nl.bfp16.min is documented as bit pattern 0xff80, which is bf16 -inf (spec §1)
bfp16 = _NS(min=np.float32(-np.inf))


def finfo(dtype):
    """Like ``np.finfo`` for NKI float types (bf16/fp8 via ml_dtypes)."""
    di = _dtypes.info(dtype)
    if di.dt == tfloat32:
        return np.finfo(np.float32)
    return _mld.finfo(di.out_np)


def iinfo(dtype):
    return np.iinfo(_dtypes.info(dtype).out_np)


# =============================================================================================
# SPMD (spec §2.4)
# =============================================================================================
def program_id(axis):
    """Index of the current instance along ``axis`` of the launch grid (a Python int)."""
    ctx = current()
    axis = int(axis)
    if axis < 0 or axis >= len(ctx.grid):
        raise nki_error("err_program_id_axis_out_of_bounds", "index",
                        f"axis in `program_id` is out-of-bound(s) of the spmd launch grid: "
                        f"axis={axis}, grid rank={len(ctx.grid)}")
    return _strict.symbolic(ctx.pid[axis], f"nl.program_id({axis})")


def num_programs(axes=None):
    """Grid size along ``axes`` (int or tuple); the total instance count when omitted."""
    ctx = current()
    g = ctx.grid
    if axes is None:
        n = 1
        for s in g:
            n *= s
        return n
    if isinstance(axes, (tuple, list)):
        return tuple(g[int(a)] for a in axes)
    a = int(axes)
    if a >= len(g) or a < 0:
        raise nki_error("err_program_id_axis_out_of_bounds", "index",
                        f"axis in `num_programs` is out-of-bound(s) of the spmd launch grid: "
                        f"axis={a}, grid rank={len(g)}")
    return g[a]


def program_ndim():
    """Rank of the launch grid (0 for a launch without a grid)."""
    return len(current().grid)


def nc(n):
    """``nl.nc(n)``: a grid dimension spread over n physical NeuronCores (trn2 only)."""
    return _NC(n)


def spmd_dim(a, b):
    """One grid dimension of size a*b; either factor may be ``nl.nc(n)``."""
    return _SpmdDim(a, b)


# =============================================================================================
# loops (spec §6)
# =============================================================================================
def _loop(ctx, r, affine, depth=2, static=False, ordered=False):
    f = _sys._getframe(depth)
    state = _deps.LoopState(r.start, affine, f.f_code.co_filename, f.f_lineno, static)
    return _loop_gen(ctx, r, state, ordered)


def _no_reorder(directives):
    """Whether a loop's ``directives=`` holds ``ncc.no_reorder()`` (one or a sequence)."""
    ds = directives if isinstance(directives, (list, tuple)) else (directives,)
    return any(getattr(d, "name", None) == "no_reorder" for d in ds)


def _loop_gen(ctx, r, state, ordered=False):
    if _runtime._trace["on"] and not state.static:
        r = r[:1]                     # program_size(): the compiler traces a loop body once
    ctx.loop_depth += 1
    ctx.no_reorder += ordered
    ctx.loops.append(state)
    # strict mode: the index of an NKI loop is a traced value (static_range stays a Python int)
    what = None
    if _strict.is_strict() and not state.static:
        what = f"loop index '{state.var_name()}'"
    try:
        first = True
        n = 0
        for i in r:
            state.value = i
            state.first = first
            state.iter_no = n
            first = False
            n += 1
            yield i if what is None else _strict.SymbolicIndex(i, what, state.uid)
            _runtime.end_iteration(state)
    finally:
        ctx.loop_depth -= 1
        ctx.no_reorder -= ordered
        try:
            ctx.loops.remove(state)
        except ValueError:
            pass


def _nki_loop(api, args, affine, static=False, depth=3, directives=()):
    """An NKI loop over ``range(*args)`` (compile-time bounds); ``depth`` frames up from
    :func:`_loop` is the kernel line that opened it. ``directives``: ``ncc.no_reorder()``
    keeps the body's instructions in program order in the scheduled estimate."""
    _strict.check_bounds(api, args)
    return _loop(current(), _strict.builtin_range(*(int(a) for a in args)), affine, depth,
                 static, _no_reorder(directives))


def affine_range(*args, directives=(), **kwargs):
    """``range`` without loop-carried dependencies; yields Python ints (symbolic indices in
    strict mode). Other kwargs (``precise_schedule`` ...) are accepted and ignored."""
    return _nki_loop("affine_range", args, True, directives=directives)


def sequential_range(*args, directives=(), **kwargs):
    """``range`` with loop-carried dependencies allowed; yields Python ints (symbolic indices
    in strict mode)."""
    return _nki_loop("sequential_range", args, False, directives=directives)


def _python_range(*args):
    """Python ``range(...)`` in kernel code under strict mode: neuronx-cc rewrites it to
    ``sequential_range`` (see ``_strict.python_range_as``)."""
    return _nki_loop("range", args, False, depth=4)


def static_range(*args, directives=(), **kwargs):
    """Fully unrolled ``range``; yields Python ints (every iteration is program text)."""
    return _nki_loop("static_range", args, False, static=True, directives=directives)


def loop_reduce(x, op, loop_indices, *, dtype=None, mask=None, **kwargs):
    """``b = nl.loop_reduce(a, op=np.add, loop_indices=[k])``: ``b = op(b, a)`` accumulated
    across the listed loops. Keyed by call site and the iteration of every other enclosing loop;
    the accumulator restarts when every listed loop index is at its first iteration (simulator
    approximation of the compiler's rule). Writing the result out is not an output dependency
    on the listed loops."""
    ctx = enter()
    f = _sys._getframe(1)
    key = (f.f_code, f.f_lineno)
    o = _ops.binary_op(op, "loop_reduce")
    a, di = tile_operand(x, "loop_reduce", "x")
    odi = _ops.out_info(dtype, di)
    idx = loop_indices if isinstance(loop_indices, (list, tuple)) else [loop_indices]
    restart = True
    uids = []
    for k in idx:
        if isinstance(k, _strict.SymbolicIndex):
            st = next((s for s in ctx.loops if s.uid == k.loop), None)
        else:       # a plain int (strict mode off): the innermost loop at that value
            st = next((s for s in reversed(ctx.loops) if s.value == k), None)
        if st is not None:
            uids.append(st.uid)
            if not st.first:
                restart = False
    # one accumulator per iteration of every other enclosing loop (each is its own reduction)
    key = key + tuple((s.file, s.line, s.value) for s in ctx.loops if s.uid not in uids)
    acc = ctx.loop_reduce.get(key)
    m = eval_mask(mask, x.shape)
    if restart or acc is None or acc.shape != x.shape:
        arr = odi.round(np.array(_ops.to_f32(a), copy=True)) if odi.is_float else \
            odi.round(np.array(a, copy=True))
        # a rank-1 (P,) partition vector is stored as a (P, 1) column
        st = new_onchip(ctx, arr.reshape(arr.shape + (1,)) if arr.ndim == 1 else arr, odi,
                        _SBUF, 0, None, "loop_reduce")
        st.reduce_loops = tuple(uids)       # before commit: it outlives the iteration
        # not counted in SBUF: the compiler accumulates in the destination the result is
        # assigned to (AWS flash_attn_bwd keeps one per query tile, head and D tile)
        st.pinned = True
        _runtime.commit(ctx, st)
        acc = Tensor(st, st.arr[:, 0]) if arr.ndim == 1 else Tensor(st)
        ctx.loop_reduce[key] = acc
        ctx.rec.add("vector", _cost.ii(_free(x.shape)))
    else:
        res = _ops.apply_binary(o, _ops.to_f32(acc._read()), _ops.to_f32(a))
        acc._write(odi.round(np.asarray(res)), m)
        ctx.rec.add("vector", _cost.tensor_tensor_cycles(_free(x.shape), False, False, False))
    acc._st.written = True
    return acc


# =============================================================================================
# tensor creation (spec §3.2)
# =============================================================================================
def _norm_shape(shape):
    if isinstance(shape, _strict.INT_TYPES):
        shape = (shape,)
    shape = tuple(shape)
    for s in shape:
        if isinstance(s, _strict.SymbolicIndex):
            s._refuse("a tile shape (shapes are compile-time)")
    pdim = 0
    for i, s in enumerate(shape):
        if isinstance(s, par_dim):
            pdim = i
    return tuple(int(s) for s in shape), pdim


_name_counter = [0]


def _create(ctx, shape, dtype, buffer, name, fill, api, depth):
    shape, pdim = _norm_shape(shape)
    di = _dtypes.info(dtype if dtype is not None else float32)
    _dtypes.check_target(di, ctx.tgt, f"'{api}'")
    kind = _buffer_kind(buffer)
    L = ctx.launch
    if kind in (_HBM, _SHARED):
        if fill is not None:
            raise nki_error("err_hbm_tensor_with_init_value_not_supported", "syntax",
                            "Creating HBM tensor with init value is not supported.")
        if kind == _SHARED:
            if ctx.loop_depth > 0 or not _runtime.kernel_frame_ok(ctx, depth + 1):
                raise nki_error("err_shared_hbm_must_in_kernel_level", "runtime",
                                "shared_hbm buffer can only be created top level kernel scope "
                                f"(tensor '{name or api}' is created inside a loop or a helper "
                                "function)")
            ctx.created_shared = True
            i = ctx.shared_idx
            ctx.shared_idx += 1
            if i < len(L.shared):
                st = L.shared[i]
                if st.arr.shape != shape or st.di is not di:
                    raise RuntimeError(
                        f"SPMD instances created different shared_hbm tensors at position {i}: "
                        f"{fmt_shape(st.arr.shape)} {st.di.name} vs {fmt_shape(shape)} {di.name}")
                return Tensor(st)
            nm = name or f"shared_hbm_{i}"
        else:
            ctx.hbm_idx += 1
            nm = name or f"hbm_{ctx.hbm_idx - 1}"
        arr = np.full(shape, di.sentinel, di.backing)
        st = Storage(arr, di, kind, ctx, 0, nm)
        if kind == _SHARED:
            L.shared.append(st)
        return Tensor(st)
    arr = np.full(shape, di.sentinel if fill is None else fill, di.backing)
    if fill is not None:
        arr = di.round(arr)
    st = new_onchip(ctx, arr, di, kind, pdim, name or None, api)
    if kind == _PSUM:
        _tensor.new_groups(st, _tensor.PSUM_UNWRITTEN if fill is None else
                           _tensor.PSUM_ZERO if fill == 0 else _tensor.PSUM_FOREIGN)
        if fill not in (None, 0):
            st.foreign = f"'{api}'"
    if isinstance(buffer, Placed):
        buffer.place(ctx, st, shape, pdim, di.itemsize)
    if fill is not None:
        st.written = True
        n = 1
        for i, s in enumerate(shape):
            if i != pdim:
                n *= s
        ctx.rec.add("vector", _cost.ii(n))          # memset
    # Accounted at the next API call (like instruction results), i.e. after ``t = nl.zeros()``
    # has rebound ``t`` and released the previous iteration's tile -- compiler liveness.
    t = Tensor(st)
    ctx.pending = t
    return t


def ndarray(shape, dtype, *, buffer=None, name="", **kwargs):
    """Uninitialised tensor (floats hold NaN, ints the type's max, until written)."""
    ctx = enter()
    return _create(ctx, shape, dtype, buffer, name, None, "ndarray", 1)


def empty_like(a, dtype=None, *, buffer=None, name="", **kwargs):
    ctx = enter()
    return _create(ctx, a.shape, dtype if dtype is not None else a.dtype,
                   buffer, name, None, "empty_like", 1)


def zeros(shape, dtype, *, buffer=None, name="", **kwargs):
    ctx = enter()
    return _create(ctx, shape, dtype, buffer, name, 0, "zeros", 1)


def zeros_like(a, dtype=None, *, buffer=None, name="", **kwargs):
    ctx = enter()
    return _create(ctx, a.shape, dtype if dtype is not None else a.dtype, buffer, name, 0,
                   "zeros_like", 1)


def ones(shape, dtype, *, buffer=None, name="", **kwargs):
    ctx = enter()
    return _create(ctx, shape, dtype, buffer, name, 1, "ones", 1)


def full(shape, fill_value, dtype, *, buffer=None, name="", **kwargs):
    ctx = enter()
    return _create(ctx, shape, dtype, buffer, name, fill_value, "full", 1)


def shared_constant(constant, dtype=None, **kwargs):
    """An HBM constant built from a host NumPy array (cast to ``dtype``)."""
    ctx = enter()
    c = np.asarray(constant)
    di = _dtypes.info(dtype) if dtype is not None else _dtypes.host_info(c.dtype)
    arr = di.round(c.astype(np.float32)) if di.is_float else di.round(c)
    st = Storage(np.array(arr), di, _SHARED, ctx, 0, kwargs.get("name") or "shared_constant")
    st.written = True
    return Tensor(st)


def shared_identity_matrix(n, dtype=np.uint8, **kwargs):
    """An (n, n) identity matrix constant in HBM."""
    return shared_constant(np.identity(int(n)), dtype=dtype)


def rand(shape, dtype=np.float32, **kwargs):
    """Uniform [0, 1) tile from the context's deterministic RNG (seeded by random_seed)."""
    ctx = enter()
    shape, pdim = _norm_shape(shape)
    di = _dtypes.info(dtype)
    res = ctx.rng.random(shape, dtype=np.float32)
    ctx.rec.add("gpsimd", _cost.gpsimd_cycles(_free(shape)))
    return make_result(ctx, res, di, api="rand")


def random_seed(seed, *, mask=None, **kwargs):
    """Seed the RNG (a scalar or a 1-element tile)."""
    ctx = enter()
    if eval_mask(mask, (1, 1)) is False:
        return None
    if isinstance(seed, Tensor):
        v = seed._read()
        s = int(np.asarray(v).reshape(-1)[0])
    else:
        s = int(seed)
    ctx.rng = np.random.default_rng(s & 0xFFFFFFFF)
    # VectorE's queue: the seed writes the PRNG that nisa.dropout draws from on VectorE, and
    # the NKI 0.7 stub of nisa.set_rng_seed says that PRNG is "inside the Vector Engine"
    # (aws-neuron-sdk nki/api/nki/isa/__init__.py). Which queue issues the legacy
    # nl.random_seed is not documented: the same engine, a guess.
    ctx.rec.add("vector", _cost.ii(1))
    return None


# =============================================================================================
# data movement (spec §7)
# =============================================================================================
def _hbm_src(src, api, pname="src"):
    if type(src) is not Tensor:
        raise TypeError(f"'{pname}' of '{api}' must be an NKI tensor, got {type(src).__name__}")
    st = src._st
    if st.buffer not in (_HBM, _SHARED):
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand '{pname}' of '{api}' to be in address space 'hbm', "
                        f"but got a tile in '{st.buffer}' instead.")
    return st


def _check_dyn(t, api, allow):
    if t._dyn is None:
        return
    if not allow:
        raise nki_error("err_indirect_indices_are_not_supported_with_nki_api", "syntax",
                        f"cannot use indirect indexing access with the current NKI API for "
                        f"'{api}'")
    for d in t._dyn:
        k = t._key[d]
        tile = k.tile if isinstance(k, _tensor.DynExpr) else k
        # dims before d indexed by scalars are block dims, so d is the access's partition dim
        # (AWS vision.py resize_nearest gathers data[b, idx_tile, i_f])
        if any(not _tensor._is_int(t._key[j]) for j in range(d)):
            raise nki_error("err_indirect_indices_free_dim", "syntax",
                            "Indirect indexing on free dimension not supported, must be "
                            "partition dimension or block dimension.")
        if tile._st.buffer != _SBUF:
            raise nki_error("err_indirect_indices_sbuf", "syntax",
                            "Indirect indices tile must be on SBUF.")


def _out_shape(shape):
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return shape


def _contig(t, di):
    """Per-partition contiguous bytes of the HBM side of a DMA (the innermost run of
    consecutive device addresses within one partition's data)."""
    return _dma.contiguous_bytes(t, di.itemsize)


def load(src, *, mask=None, dtype=None, **kwargs):
    """HBM -> new SBUF tile of the (indexed) source's shape; first index = partition dim
    (<= 128); 1-D sources give (n, 1) tiles. ``dtype=`` casts. Masked-out elements are not
    read (and not counted as HBM traffic)."""
    ctx = enter()
    st = _hbm_src(src, "load")
    _check_dyn(src, "load", True)
    shape = src.shape
    oshape = _out_shape(shape)
    check_partitions(oshape, "load", "src")
    m = eval_mask(mask, shape)
    di = st.di
    odi = _dtypes.info(dtype) if dtype is not None else di
    if m is False:
        vals = np.full(oshape, odi.sentinel, odi.backing)
        cnt = 0
    else:
        vals = src._read(m)
        if odi is di or (odi is F32 and di.is_float):
            vals = np.array(vals, dtype=odi.backing, copy=True)   # a fresh SBUF tile
        else:
            vals = odi.round(vals)
        cnt = src._count(m)
        vals = vals.reshape(oshape)
    # chunks: the HBM view's runs (a fresh SBUF tile is contiguous per partition; a strided
    # SBUF destination of ``t[...] = nl.load(...)`` is accounted in _tensor.assign)
    hl = _dma.layout(src)
    ch = _dma.chunks(shape, [hl], m)
    ctx.rec.dma(cnt * di.itemsize, _contig(src, di), ch, read=st.name)
    mm = None if m is None else (m.reshape(oshape) if m is not False else False)
    ctx.last_charge = ("dma", hl, ch)
    return make_result(ctx, vals, odi, mm, tag="dma", api="load", rounded=True)


def _store_check_param(ctx, st):
    if st.param and not st.mutable:
        L = ctx.launch
        if L.opts.get("kernel_return") is False:
            return
        if ctx.created_shared:
            raise nki_error("err_cannot_update_immutable_parameter", "type",
                            f"Cannot update immutable parameter `{st.name}`")
        if st.name not in L.immutable_writes:
            L.immutable_writes.append(st.name)


def store(dst, value, *, mask=None, **kwargs):
    """Write an SBUF/PSUM tile (or a scalar) into an HBM tensor/view, casting to dst's dtype and
    broadcasting the value. Masked-out elements are not written."""
    ctx = enter()
    st = _hbm_src(dst, "store", "dst")
    _check_dyn(dst, "store", True)
    _store_check_param(ctx, st)
    dshape = dst.shape
    if type(value) is Tensor:
        vst = value._st
        if vst.expired is not None:
            _tensor._out_of_scope(vst, "store", "value")
        if vst.buffer in (_HBM, _SHARED):
            raise nki_error("err_unsupported_memory", "type",
                            "Expected operand 'value' of 'store' to be in address space "
                            "'psum|sbuf', but got a tile in 'hbm' instead.")
        if len(dshape) and dshape[0] > _hw.NUM_PARTITIONS or value.shape and \
                value.shape[0] > _hw.NUM_PARTITIONS:
            raise nki_error("err_num_partition_exceed_arch_limit", "value",
                            f"number of partitions in dst{fmt_shape(dshape)}, "
                            f"value{fmt_shape(value.shape)} of 'store' exceed architecture "
                            f"limitation of {_hw.NUM_PARTITIONS}.")
        vals = value._read()
        vdi = vst.di
        vshape = value.shape
    else:
        check_partitions(dshape, "store", "dst")
        vals = np.asarray(value)
        vdi = _dtypes.weak_scalar_info(value)
        vshape = ()
    # Only the store's own mask limits what is written: masked-out elements of a masked
    # compute/load result are garbage (NaN) in the tile and a store without a mask writes them.
    m = eval_mask(mask, dshape)
    if vshape != dshape:
        vals = fit_value(vals, vshape, dshape, "value")
    ddi = st.di
    if ddi is not vdi and not (ddi is F32 and vdi.is_float):
        vals = ddi.round(np.asarray(vals))
    cnt = 0
    ch = 0
    if m is not False:
        if ctx.loops:
            _deps.note_write(ctx, dst, m)
        dst._write(vals, m)
        cnt = dst._count(m)
        sides = [_dma.layout(dst)]
        if type(value) is Tensor:
            sides.append(_dma.to_shape(_dma.layout(value), vshape, dshape))
        ch = _dma.chunks(dshape, sides, m)
    st.written = True
    ctx.rec.dma(cnt * ddi.itemsize, _contig(dst, ddi), ch, written=st.name)
    return None


def load_transpose2d(src, *, mask=None, dtype=None, **kwargs):
    """HBM 2-D view [N, M] -> SBUF tile [M, N] (DMA transpose; M <= 128). On trn1 the DMA runs
    at a reduced rate (see _hw.TRN1.load_transpose_rate)."""
    ctx = enter()
    st = _hbm_src(src, "load_transpose2d")
    _check_dyn(src, "load_transpose2d", False)
    if len(src.shape) != 2:
        raise nki_error("err_exceed_max_supported_dimension", "value",
                        f"parameter 'src{fmt_shape(src.shape)}' of 'load_transpose2d' exceed max "
                        "supported number of dimensions of 2")
    n, mdim = src.shape
    check_partitions((mdim, n), "load_transpose2d", "result")
    m = eval_mask(mask, src.shape)
    di = st.di
    odi = _dtypes.info(dtype) if dtype is not None else di
    if m is False:
        vals = np.full((mdim, n), odi.sentinel, odi.backing)
        cnt = 0
    else:
        vals = np.array(src._read(m).T, copy=True)
        if odi is not di:
            vals = odi.round(vals)
        cnt = src._count(m)
    # element-granular transpose: modeled by the target's transpose rate, no per-chunk term
    ctx.rec.dma(cnt * di.itemsize, di.itemsize, None, rate=ctx.tgt.load_transpose_rate,
                read=st.name)
    mm = None if m is None else (False if m is False else m.T)
    return make_result(ctx, vals, odi, mm, tag="dma", api="load_transpose2d", rounded=True)


def copy(src, *, mask=None, dtype=None, **kwargs):
    """Copy an SBUF/PSUM tile into a new SBUF tile, optionally casting (VectorE/ScalarE)."""
    ctx = enter()
    a, di = tile_operand(src, "copy", "src")
    odi = _ops.out_info(dtype, di)
    if odi is di or (odi is F32 and di.is_float):
        res = np.array(a, dtype=odi.backing, copy=True)
    else:
        res = odi.round(np.asarray(a))
        if res is a:
            res = res.copy()
    m = eval_mask(mask, src.shape)
    tgt, flags = ctx.tgt, (src._st.buffer == _PSUM, False, _ops.is16(di), _ops.is16(odi))
    _cost.charge(ctx, "vector", lambda k: _cost.tensor_scalar_cycles(tgt, k, *flags),
                 _free(src.shape))
    return make_result(ctx, res, odi, m, api="copy", rounded=True)


def atomic_rmw(dst, value, op, *, mask=None, **kwargs):
    """``dst = op(dst, value)`` on HBM with an indirect (index-tile) partition index; only
    ``np.add`` is supported; duplicate indices accumulate."""
    ctx = enter()
    st = _hbm_src(dst, "atomic_rmw", "dst")
    if dst._dyn is None:
        raise nki_error("err_atomic_rmw_dynamic_index", "syntax",
                        "atomic_rmw `dst` only supports indirect dynamic indexing currently")
    _check_dyn(dst, "atomic_rmw", True)
    if _ops.op_name(op, "atomic_rmw") != "add":
        raise nki_error("err_atomic_rmw_add_only", "syntax",
                        "atomic_rmw `op` param only supports 'add' operation currently")
    _store_check_param(ctx, st)
    vals, vdi = tile_operand(value, "atomic_rmw", "value")
    dshape = dst.shape
    vals = fit_value(vals, value.shape, dshape, "value")
    m = eval_mask(mask, dshape)
    if m is False:
        return None
    key, valid = _tensor._resolve(dst, m, False)
    bk = np.broadcast_arrays(*[np.asarray(k) for k in key])
    vb = np.broadcast_to(_ops.to_f32(vals), dshape)
    if valid is not None:
        bk = [k[valid] for k in bk]
        vb = vb[valid]
    base = dst._base
    acc = base.astype(np.float64) if st.di.is_float else base.astype(np.int64)
    np.add.at(acc, tuple(bk), vb)
    base[...] = st.di.round(acc.astype(np.float32) if st.di.is_float else acc)
    st.written = True
    cnt = int(vb.size)
    amask = valid if valid is not None else m
    cont = _contig(dst, st.di)
    # read-modify-write: the rows are read and written back (one chunk per row each way)
    ch = _dma.chunks(dshape, [_dma.layout(dst), _dma.to_shape(_dma.layout(value), value.shape,
                                                                 dshape)], amask)
    ctx.rec.dma(cnt * st.di.itemsize, cont, ch, read=st.name)
    ctx.rec.dma(cnt * st.di.itemsize, cont, ch, written=st.name)
    return None


def gather_flattened(data, indices, *, mask=None, dtype=None, **kwargs):
    """Per-partition gather over the flattened free dims: output has ``indices.shape``
    (``take_along_axis(data.reshape(P,-1), indices.reshape(P,-1), -1)``); OOB -> garbage."""
    ctx = enter()
    a, di = tile_operand(data, "gather_flattened", "data")
    ia, idi = tile_operand(indices, "gather_flattened", "indices")
    if a.shape[0] != ia.shape[0]:
        raise nki_error("err_num_partition_mismatch", "value",
                        f"number of partitions (dimension 0 size of a tile) mismatch in parameters "
                        f"(data{fmt_shape(a.shape)}, indices{fmt_shape(ia.shape)}) of "
                        "'gather_flattened'")
    P = a.shape[0]
    flat = a.reshape(P, -1)
    idx = ia.reshape(P, -1).astype(np.int64)
    ok = (idx >= 0) & (idx < flat.shape[1])
    res = np.take_along_axis(flat, np.clip(idx, 0, flat.shape[1] - 1), axis=1)
    if di.is_float:
        res = np.where(ok, res, np.float32(np.nan))
    odi = _ops.out_info(dtype, di)
    ctx.rec.add("gpsimd", _cost.gpsimd_cycles(_free(ia.shape)))
    return make_result(ctx, res.reshape(ia.shape), odi, eval_mask(mask, ia.shape),
                       api="gather_flattened")


def broadcast_to(src, *, shape=None, **kwargs):
    """Broadcast a tile to ``shape`` (numpy rules, partition broadcast from 1 allowed); returns
    ``src`` itself when the shape already matches."""
    if shape is None:
        raise nki_error("err_operand_cannot_be_none", "value", "'shape' cannot be None.")
    shape = tuple(int(s) for s in shape)
    ctx = enter()
    a, di = tile_operand(src, "broadcast_to", "src")
    if tuple(src.shape) == shape:
        return src
    check_partitions(shape, "broadcast_to", "shape")
    try:
        res = np.array(np.broadcast_to(_ops.rpad(a, len(shape)), shape))
    except ValueError:
        raise nki_error("err_param_shape_incompatible_with_numpy", "value",
                        f"'broadcast_to' could not broadcast src{fmt_shape(src.shape)} to "
                        f"{fmt_shape(shape)}") from None
    n = _free(shape)
    if src.ndim and src.shape[0] != shape[0]:
        ctx.rec.add("tensor", _cost.matmul_cycles(shape[0], n, di is F32))
    else:
        _cost.charge(ctx, "vector", _cost.ii, n)
    return make_result(ctx, res, di, api="broadcast_to", rounded=True)


def expand_dims(data, axis, **kwargs):
    """Insert a unit dim at ``axis`` (only after the partition dim for on-chip tiles)."""
    if not isinstance(data, Tensor):
        raise TypeError("expand_dims expects an NKI tensor")
    _runtime.current()
    nd = data.ndim
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = [a + nd + 1 if a < 0 else a for a in axes]
    if data._st.buffer in (_SBUF, _PSUM) and any(a == 0 for a in axes):
        raise ValueError("Cannot expand dims before partition dimension for local tensors!")
    if data._v is not None:
        t = data._clone()
        t._v = np.expand_dims(data._v, tuple(axes))
        t.shape = t._v.shape
        return t
    return copy(data).expand_dims(axis)


# =============================================================================================
# element-wise math (spec §8.3, §8.4)
# =============================================================================================
def _mk_unary(name):
    def f(x, *, dtype=None, mask=None, **kwargs):
        return _ops.unary(name, name, x, dtype, mask)
    f.__name__ = name
    f.__qualname__ = name
    f.__doc__ = (f"Element-wise ``{name}`` of an SBUF/PSUM tile (computed in fp32; output dtype "
                 f"defaults to the input's).")
    return f


exp = _mk_unary("exp")
log = _mk_unary("log")
sqrt = _mk_unary("sqrt")
rsqrt = _mk_unary("rsqrt")
reciprocal = _mk_unary("reciprocal")
sin = _mk_unary("sin")
cos = _mk_unary("cos")
tan = _mk_unary("tan")
tanh = _mk_unary("tanh")
arctan = _mk_unary("arctan")
sigmoid = _mk_unary("sigmoid")
relu = _mk_unary("relu")
gelu = _mk_unary("gelu")
gelu_dx = _mk_unary("gelu_dx")
gelu_apprx_tanh = _mk_unary("gelu_apprx_tanh")
gelu_apprx_sigmoid = _mk_unary("gelu_apprx_sigmoid")
silu = _mk_unary("silu")
silu_dx = _mk_unary("silu_dx")
erf = _mk_unary("erf")
erf_dx = _mk_unary("erf_dx")
softplus = _mk_unary("softplus")
mish = _mk_unary("mish")
square = _mk_unary("square")
abs = _mk_unary("abs")
negative = _mk_unary("negative")
sign = _mk_unary("sign")
trunc = _mk_unary("trunc")
floor = _mk_unary("floor")
ceil = _mk_unary("ceil")


def invert(x, *, dtype=None, mask=None, **kwargs):
    """Bitwise NOT (integer dtypes; bool -> logical not)."""
    a_di = x._st.di if isinstance(x, Tensor) else None
    if a_di is not None and a_di.is_float:
        raise nki_error("err_bitvec_operand_must_be_integer", "syntax",
                        f"'invert' requires an integer tile, got {a_di.name}")
    return _ops.unary_int("invert", np.invert, x, dtype, mask)


def logical_not(x, *, dtype=None, mask=None, **kwargs):
    """``x == 0`` as bool (default dtype bool)."""
    return _ops.unary_int("logical_not", lambda a: a == 0, x, dtype if dtype is not None
                          else bool_, mask)


def _mk_binary(name):
    def f(x, y, *, dtype=None, mask=None, **kwargs):
        return _ops.binary(name, name, x, y, dtype, mask)
    f.__name__ = name
    f.__qualname__ = name
    f.__doc__ = (f"Element-wise ``{name}`` of two tiles or a tile and a scalar (NumPy "
                 "broadcasting incl. partition broadcast; rank-deficient tiles are partition "
                 "vectors). Output dtype: promoted (spec §11.2) or bool for comparisons.")
    return f


add = _mk_binary("add")
subtract = _mk_binary("subtract")
multiply = _mk_binary("multiply")
divide = _mk_binary("divide")
power = _mk_binary("power")
maximum = _mk_binary("maximum")
minimum = _mk_binary("minimum")
mod = _mk_binary("mod")
fmod = _mk_binary("fmod")
bitwise_and = _mk_binary("bitwise_and")
bitwise_or = _mk_binary("bitwise_or")
bitwise_xor = _mk_binary("bitwise_xor")
left_shift = _mk_binary("left_shift")
right_shift = _mk_binary("right_shift")
equal = _mk_binary("equal")
not_equal = _mk_binary("not_equal")
greater = _mk_binary("greater")
greater_equal = _mk_binary("greater_equal")
less = _mk_binary("less")
less_equal = _mk_binary("less_equal")
logical_and = _mk_binary("logical_and")
logical_or = _mk_binary("logical_or")
logical_xor = _mk_binary("logical_xor")


def where(condition, x, y, *, dtype=None, mask=None, **kwargs):
    """``x`` where ``condition`` is non-zero else ``y`` (tile or scalar)."""
    ctx = enter()
    ca, cdi = tile_operand(condition, "where", "condition")
    xa, xdi, xt = _ops.scalar_or_tile(x, "where", "x")
    ya, ydi, yt = _ops.scalar_or_tile(y, "where", "y")
    odi = _ops.out_info(dtype, _dtypes.promote(xdi, ydi))
    shapes = [condition.shape, xt.shape if xt is not None else (),
              yt.shape if yt is not None else ()]
    shape, nd = _ops.broadcast_shape(shapes, "where", ["condition", "x", "y"])
    c = _ops.rpad(np.asarray(ca) != 0, nd)
    xa = _ops.rpad(np.asarray(_ops.to_f32(xa)), nd)
    ya = _ops.rpad(np.asarray(_ops.to_f32(ya)), nd)
    res = np.where(c, xa, ya)
    res = np.broadcast_to(res, shape).astype(np.float32)
    _cost.charge(ctx, "vector", lambda k: _cost.ii(2 * k), _free(shape))
    return make_result(ctx, res, odi, eval_mask(mask, shape), api="where")


# =============================================================================================
# reductions (spec §8.6)
# =============================================================================================
def sum(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Sum over free axes (axis 0 forbidden; negative axes count from the end)."""
    return _ops.reduce("sum", "sum", x, axis, dtype, mask, keepdims)


def max(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Max over free axes."""
    return _ops.reduce("max", "max", x, axis, dtype, mask, keepdims)


def min(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Min over free axes."""
    return _ops.reduce("min", "min", x, axis, dtype, mask, keepdims)


def prod(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Product over free axes."""
    return _ops.reduce("prod", "prod", x, axis, dtype, mask, keepdims)


def mean(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Mean over free axes (fp32 output for integer inputs)."""
    return _ops.reduce("mean", "mean", x, axis, dtype, mask, keepdims)


def var(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Population variance over free axes (ddof=0; UNCONFIRMED)."""
    return _ops.reduce("var", "var", x, axis, dtype, mask, keepdims)


def all(x, axis, *, dtype=None, mask=None, keepdims=False, **kwargs):
    """Logical AND over free axes (bool output)."""
    return _ops.reduce("all", "all", x, axis, dtype, mask, keepdims)


# =============================================================================================
# matmul / transpose (spec §8.1, §8.2)
# =============================================================================================
def _size_err(api, pname, shape, d, lim):
    return nki_error("err_size_of_dimension_exceed_arch_limit", "value",
                     f"size of dimension {d} in '{pname}{fmt_shape(shape)}' of '{api}' exceed "
                     f"architecture limitation of {lim}")


def matmul(x, y, *, transpose_x=False, mask=None, **kwargs):
    """``x @ y`` (``transpose_x=False``: x is [M<=128, K<=128]) or ``x.T @ y``
    (``transpose_x=True``: x is [K<=128, M<=128]); y is [K, N<=512]. Result: fp32 tile in
    PSUM. ``transpose_x=False`` costs an extra TensorE transpose of x."""
    ctx = enter()
    xa, xdi = tile_operand(x, "matmul", "x")
    ya, ydi = tile_operand(y, "matmul", "y")
    if x.ndim != 2:
        raise nki_error("err_exceed_max_supported_dimension", "value",
                        f"parameter 'x{fmt_shape(x.shape)}' of 'matmul' exceed max supported "
                        "number of dimensions of 2")
    if transpose_x:
        K, M = x.shape
    else:
        M, K = x.shape
        if K > _hw.PE_TRANSPOSE_MAX:
            raise _size_err("matmul", "x", x.shape, 1, _hw.PE_TRANSPOSE_MAX)
    if M > _hw.GEMM_STATIONARY_FMAX:
        raise _size_err("matmul", "x", x.shape, 1 if transpose_x else 0,
                        _hw.GEMM_STATIONARY_FMAX)
    yk = y.shape[0] if y.ndim else 1
    N = _free(y.shape)
    if yk != K:
        raise nki_error("err_param_shape_incompatible_with_matmul", "value",
                        f"incompatible shapes for 'matmul' (transpose_x={transpose_x}): "
                        f"x{fmt_shape(x.shape)} and y{fmt_shape(y.shape)}: contraction "
                        f"dimensions {K} and {yk} differ")
    if N > _hw.GEMM_MOVING_FMAX:
        raise _size_err("matmul", "y", y.shape, 1, _hw.GEMM_MOVING_FMAX)
    xf = _ops.to_f32(xa)
    lhs = xf.T if transpose_x else xf
    res = np.matmul(lhs, _ops.to_f32(ya).reshape(K, N))
    if y.ndim > 2:
        res = res.reshape((M,) + tuple(y.shape[1:]))
    fp32in = xdi is F32 or ydi is F32
    if not transpose_x:
        ctx.rec.add("tensor", _cost.pe_transpose_cycles(M, K) * (2 if xdi is F32 else 1))
    ctx.rec.add("tensor", _cost.matmul_cycles(M, N, fp32in))
    return make_result(ctx, res, F32, eval_mask(mask, res.shape), tag="nl_matmul",
                       buffer=_PSUM, api="matmul", rounded=True)


def transpose(x, *, dtype=None, mask=None, **kwargs):
    """2-D partition<->free transpose (both dims <= 128) on TensorE; result in SBUF (choice)."""
    ctx = enter()
    a, di = tile_operand(x, "transpose", "x")
    if x.ndim > 2:
        raise nki_error("err_exceed_max_supported_dimension", "value",
                        f"parameter 'x{fmt_shape(x.shape)}' of 'transpose' exceed max supported "
                        "number of dimensions of 2")
    a2 = a.reshape(a.shape[0], -1) if a.ndim == 2 else a.reshape(-1, 1)
    for d, s in enumerate(a2.shape):
        if s > _hw.PE_TRANSPOSE_MAX:
            raise _size_err("transpose", "x", x.shape, d, _hw.PE_TRANSPOSE_MAX)
    odi = _ops.out_info(dtype, di)
    res = np.array(a2.T, copy=True)
    ctx.rec.add("tensor", _cost.pe_transpose_cycles(a2.shape[0], a2.shape[1]))
    return make_result(ctx, odi.round(_ops.to_f32(res)) if odi.is_float else odi.round(res),
                       odi, eval_mask(mask, res.shape), api="transpose", rounded=True)


# =============================================================================================
# fused helpers (spec §8.7, §8.8)
# =============================================================================================
def softmax(x, axis, *, dtype=None, compute_dtype=None, mask=None, **kwargs):
    """Softmax along free ``axis`` (computed in fp32). Charged as max-reduce, exp with
    accumulation, reciprocal and a scale."""
    ctx = enter()
    a, di = tile_operand(x, "softmax", "x")
    axes = _ops.norm_axes(axis, x.ndim, "softmax")
    m = eval_mask(mask, x.shape)
    af = _ops.to_f32(a)
    if isinstance(m, np.ndarray):
        af = np.where(m, af, -np.inf)
    mx = af.max(axis=axes, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    e = np.exp(af - mx)
    res = e / e.sum(axis=axes, keepdims=True)
    odi = _ops.out_info(dtype if dtype is not None else compute_dtype, di)
    n = _free(x.shape)
    rec = ctx.rec
    rec.add("vector", _cost.tensor_reduce_cycles(n, False))
    rec.add("scalar", _cost.act_cycles(n, reduce=True))
    rec.add("vector", _cost.ii(1))
    rec.add("vector", _cost.tensor_scalar_cycles(ctx.tgt, n, False, False, False, False))
    return make_result(ctx, res.astype(np.float32), odi, m, api="softmax")


def rms_norm(x, w, axis, n, epsilon=1e-6, *, dtype=None, compute_dtype=None, mask=None,
             **kwargs):
    """``x * rsqrt(sum(x^2, axis)/n + epsilon) * w`` (epsilon placement UNCONFIRMED)."""
    ctx = enter()
    a, di = tile_operand(x, "rms_norm", "x")
    wa, wdi = tile_operand(w, "rms_norm", "w")
    axes = _ops.norm_axes(axis, x.ndim, "rms_norm")
    af = _ops.to_f32(a)
    r = 1.0 / np.sqrt((af * af).sum(axis=axes, keepdims=True) / float(n) + float(epsilon))
    res = af * r.astype(np.float32) * _ops.rpad(_ops.to_f32(wa), x.ndim)
    odi = _ops.out_info(dtype if dtype is not None else compute_dtype, di)
    nf = _free(x.shape)
    rec = ctx.rec
    rec.add("scalar", _cost.act_cycles(nf, reduce=True))
    rec.add("scalar", _cost.act_cycles(1))
    rec.add("vector", _cost.tensor_scalar_cycles(ctx.tgt, nf, False, False, False, False))
    rec.add("vector", _cost.tensor_tensor_cycles(nf, False, False, False))
    return make_result(ctx, np.asarray(res, np.float32), odi, eval_mask(mask, x.shape),
                       api="rms_norm")


def dropout(x, rate, *, dtype=None, mask=None, **kwargs):
    """Zero each element with probability ``rate`` (scalar or per-partition tile); no
    rescaling."""
    ctx = enter()
    a, di = tile_operand(x, "dropout", "x")
    if isinstance(rate, Tensor):
        ra, _ = tile_operand(rate, "dropout", "rate")
        r = _ops.rpad(_ops.to_f32(ra), x.ndim)
    else:
        r = np.float32(rate)
    keep = ctx.rng.random(x.shape, dtype=np.float32) >= r
    res = np.where(keep, _ops.to_f32(a), np.float32(0))
    odi = _ops.out_info(dtype, di)
    _cost.charge(ctx, "vector", _cost.ii, _free(x.shape))
    return make_result(ctx, res, odi, eval_mask(mask, x.shape), api="dropout")


# =============================================================================================
# misc (spec §8.9)
# =============================================================================================
def static_cast(input_data, dtype):
    """Host-side helper: cast a NumPy array/scalar to ``dtype`` (bf16/fp8 via ml_dtypes)."""
    di = _dtypes.info(dtype)
    a = np.asarray(input_data)
    if di.dt == tfloat32:
        return di.round(a.astype(np.float32))
    if di.is_float:
        return a.astype(np.float32).astype(di.out_np) if a.dtype.kind != "f" \
            else a.astype(di.out_np)
    if a.dtype.kind == "f":
        return di.round(a.astype(np.float32))
    return a.astype(di.out_np)


def device_print(prefix, x, *, mask=None, **kwargs):
    """Print ``prefix`` and the tile's values (simulation only)."""
    enter()
    val = host_array(x) if isinstance(x, Tensor) else x
    print(prefix, val)
    return None


def all_reduce(*args, **kwargs):
    raise NotImplementedError("nl.all_reduce (collectives) is not supported by the simulator")


def scalar(x):
    raise NotImplementedError("nl.scalar / do-while loops are not supported by the simulator")


def gemm_grid(*args, **kwargs):
    raise NotImplementedError("nl.gemm_grid is not supported by the simulator (UNCONFIRMED API)")


gemm_stationary_grid = gemm_grid


# ---- register nl functions as ALU/activation ops accepted by nisa op= arguments ------------
def _register_ops():
    m = _ops.OP_BY_OBJ
    for name in _ops.BINARY:
        m[globals()[name]] = name
    for name in _ops.UNARY:
        if name in globals():
            m[globals()[name]] = name
    m[copy] = "copy"
    m[sum] = "add"
    m[max] = "maximum"
    m[min] = "minimum"
    m[prod] = "multiply"
    m[invert] = "invert"
    m[logical_not] = "logical_not"


_register_ops()
_tensor._NL = _sys.modules[__name__]
