"""Tensors, views, indexing, masked reads/writes and assignment (spec §3, §4, §5).

Layout
------
A ``Storage`` owns one numpy backing array (``arr``; float types as rounded float32, see
``_dtypes``), its NKI dtype, buffer (``sbuf``/``psum``/``hbm``/``shared_hbm``) and partition
dimension ``pdim`` (dims before it are block dims). A ``Tensor`` is a view of a storage:

* basic views (ints, slices, ``nl.ds``, and ``nl.arange`` entries that sit alone on their own
  tile axis with a constant stride) hold a numpy *view* ``_v`` -- reads and writes are free;
* everything else (several aranges in one entry, index tiles for gather/scatter, masked
  accesses that would be out of bounds) holds a fancy ``_key`` into ``_base`` and is resolved
  on access.

Static out-of-bounds accesses are detected at view creation but raised on access, because
``mask=`` (known only to the API call) may exclude the offending elements.
"""

from __future__ import annotations

import numpy as np

from . import _cost, _deps, _dtypes, _runtime, _hw, _sched, _spill, _strict
from ._dtypes import F32
from ._errors import nki_error, hw_error, fmt_shape
from ._index import IndexExpr, MGridResult, Predicate, _is_int
from ._fit import fit_value, fit_mask  # noqa: F401 (re-exported to isa/language)
from ._runtime import enter
from ._scalar import runtime_name

SBUF, PSUM, HBM, SHARED_HBM = "sbuf", "psum", "hbm", "shared_hbm"
_HBM_KINDS = (HBM, SHARED_HBM)
_NL = None            # simulate.language, bound at import time of language.py


def space(buf):
    return "hbm" if buf in _HBM_KINDS else buf


# =============================================================================================
# storage
# =============================================================================================
class Storage:
    __slots__ = ("arr", "di", "buffer", "_name", "pdim", "ctx", "param", "mutable", "written",
                 "bpp", "banks", "acct", "aloops", "deps", "foreign", "pinned",
                 "copy_out", "reduce_loops", "groups", "gkinds", "expired", "lazy", "uid",
                 "__weakref__")

    def __init__(self, arr, di, buffer, ctx, pdim=0, name=None):
        self.arr = arr
        self.di = di
        self.buffer = buffer
        self._name = name
        self.pdim = pdim
        self.ctx = ctx
        self.param = False
        self.mutable = False
        self.written = False
        self.acct = False
        self.bpp = 0
        self.banks = 0
        self.pinned = False
        self.copy_out = 0         # cycles of a compiler-inserted PSUM -> SBUF copy, if any
        self.reduce_loops = ()    # uids of the loops an nl.loop_reduce accumulator reduces over
        self.groups = None        # PSUM: per-element accumulation-group state (PSUM_* codes)
        self.gkinds = 0           # bit c set: some element of ``groups`` may hold code c
        self.expired = None       # (file, line) of the loop whose iteration it died with
        self.lazy = False         # allocated block by block beyond capacity (_spill)
        self.uid = None           # allocation number in its grid instance (_spill)
        # loops active at allocation (uids) and per-loop written-element records (_deps)
        self.aloops = _deps.alloc_loops(ctx) if ctx is not None else ()
        self.deps = None
        # PSUM: the last instruction that left a foreign value (PSUM_FOREIGN) in this tile, for
        # the messages of the accumulation-group rules
        self.foreign = None

    @staticmethod
    def new_param(arr, di, name, mutable):
        st = Storage(arr, di, HBM, None, 0, name)
        st.param = True
        st.mutable = mutable
        return st

    @property
    def name(self):
        if self._name:
            return self._name
        return f"{self.buffer}_tensor_{id(self) & 0xFFFFFF:x}"

    def __del__(self):
        if self.acct:
            try:
                _runtime.release(self)
            except Exception:       # interpreter shutdown
                pass


def _sizes(shape, pdim, itemsize):
    n = 1
    for i, s in enumerate(shape):
        if i != pdim:
            n *= int(s)
    return n * itemsize


def _loop_iteration(ctx):
    """The iteration of the innermost NKI loop (not ``static_range``) running now, or None:
    the scope across which the compiler rotates a loop-local tile's buffers."""
    for L in reversed(ctx.loops):
        if not L.static:
            return L.uid, L.iter_no
    return None


def new_onchip(ctx, arr, di, buffer, pdim=0, name=None, api="ndarray"):
    """Create an SBUF/PSUM storage (validated, not yet accounted)."""
    shape = arr.shape
    if len(shape) < 2:
        raise nki_error(
            "err_unsupported_memory", "value",
            f"Insufficient rank: SBUF/PSUM tensor '{name or api}' of shape {fmt_shape(shape)} "
            "must have at least 2 dimensions (partition and free).")
    p = shape[pdim]
    if p > _hw.NUM_PARTITIONS:
        raise nki_error(
            "err_num_partition_exceed_arch_limit", "value",
            f"number of partitions {p} exceed architecture limitation of {_hw.NUM_PARTITIONS}.")
    st = Storage(arr, di, buffer, ctx, pdim, name)
    bpp = _sizes(shape, pdim, di.itemsize)
    st.bpp = bpp
    if buffer == SBUF:
        cap = ctx.tgt.sbuf_bytes_per_partition
        if bpp > cap:
            raise hw_error(
                "runtime",
                f"Size of free dimensions {bpp / 1024:g} KB per partition on SBUF buffer "
                f"exceeds the {cap // 1024} KB per partition of {ctx.tgt.name}: tensor "
                f"'{st.name}' {fmt_shape(shape)} {di.name} needs {bpp} bytes per partition.")
    else:
        nblocks, fb, banks = _runtime.psum_banks_for(shape, pdim, di.itemsize)
        if fb > _hw.PSUM_BANK_BYTES:
            raise hw_error(
                "runtime",
                f"PSUM tensor '{st.name}' {fmt_shape(shape)} {di.name} needs {fb} bytes per "
                f"partition per tile, but a PSUM tile must fit one {_hw.PSUM_BANK_BYTES}-byte "
                f"bank ({_hw.PSUM_FMAX} fp32 elements per partition).")
        st.banks = banks
    if _sched.ACTIVE is not None:
        _sched.ACTIVE.alloc(st, _loop_iteration(ctx))
    return st


# =============================================================================================
# tensor / view
# =============================================================================================
class Tensor:
    """An NKI tensor or tile (a view of a Storage). ``shape``/``dtype`` as in NKI."""

    _dyn_index = True           # a tile used as an index is an indirect (dynamic) index

    __slots__ = ("_st", "shape", "_v", "_base", "_key", "_dyn", "_oob", "_pax", "_p0", "_pst",
                 "_mask", "_tag", "_inpl", "_chg", "_ind", "_rto", "__weakref__")
    _is_nki_tensor = True
    __array_ufunc__ = None      # make numpy defer to our reflected operators

    def __init__(self, st, v=None):
        self._st = st
        if v is None:
            v = st.arr
        self._v = v
        self.shape = v.shape
        self._base = None
        self._key = None
        self._dyn = None
        self._oob = None
        self._pax = st.pdim
        self._p0 = 0
        self._pst = 1
        self._mask = None
        self._tag = None
        self._inpl = -1
        self._ind = None          # index tensors a runtime-offset view reads (_views)
        self._rto = None          # the runtime scalar (nki.*) an offset of this view came from

    # -- properties ----------------------------------------------------------------------------
    @property
    def dtype(self):
        return self._st.di.dt

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def itemsize(self):
        return self._st.di.itemsize

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def buffer(self):
        return self._st.buffer

    @property
    def name(self):
        return self._st.name

    def __len__(self):
        return self.shape[0]

    def __iter__(self):
        raise TypeError("NKI tensors are not iterable; index them with slices or nl.arange")

    def __repr__(self):
        return (f"<nki tensor '{self._st.name}' {fmt_shape(self.shape)} {self._st.di.name} "
                f"in {self._st.buffer}>")

    def __array__(self, dtype=None, copy=None):
        raise TypeError("NKI tiles cannot be converted to NumPy arrays inside a kernel (no NumPy "
                        "on tensor data); use nl.store to write results to HBM.")

    def __bool__(self):
        raise nki_error("err_dynamic_control_flow_not_supported", "syntax",
                        "dynamic control-flow depending on tensor value is not supported.")

    __hash__ = object.__hash__

    def _clone(self):
        t = Tensor.__new__(Tensor)
        t._st = self._st
        t.shape = self.shape
        t._v = self._v
        t._base = self._base
        t._key = self._key
        t._dyn = self._dyn
        t._oob = self._oob
        t._pax = self._pax
        t._p0 = self._p0
        t._pst = self._pst
        t._mask = None
        t._tag = None
        t._inpl = -1
        t._ind = self._ind
        t._rto = self._rto
        return t

    # -- indexing --------------------------------------------------------------------------------
    def __getitem__(self, key):
        r = self._index(key)
        rto = _runtime_scalar_in(key)
        if rto is not None:
            r._rto = rto
        return r

    def _index(self, key):
        if type(key) is not tuple:
            if isinstance(key, MGridResult):
                key = tuple(key)
            else:
                if key is Ellipsis:
                    return self._clone()
                key = (key,)
        elif any(isinstance(k, MGridResult) for k in key):
            nk = []
            for k in key:
                nk.extend(k if isinstance(k, MGridResult) else (k,))
            key = tuple(nk)
        nd = len(self.shape)
        if any(k is Ellipsis for k in key):
            i = next(j for j, k in enumerate(key) if k is Ellipsis)
            fill = nd - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if (len(key) == 2 and nd == 1 and self._v is not None
                and self._st.buffer not in _HBM_KINDS):
            # a rank-1 on-chip tile is a partition vector, i.e. a (P, 1) column (spec §3.6;
            # AWS flash_fwd indexes the (P,) tile l_buffer[:, i] again as [:, 0])
            col = self._clone()
            col._v = self._v[:, None]
            col.shape = tuple(col._v.shape)
            return col._index(key)
        if len(key) > nd:
            raise IndexError(f"too many indices for tensor '{self._st.name}': tensor is "
                             f"{nd}-dimensional, but {len(key)} were indexed")
        if self._v is None:
            return _index_compose(self, key)
        if (key and self._st.buffer not in _HBM_KINDS and _is_int(key[0])
                and type(key[0]) is not bool and _nki_api()):
            # NKI 0.7 (NkiTensor.__getitem__): an integer on dim 0 of an on-chip tensor is a
            # size-1 slice, the partition dim is kept
            i = int(key[0])
            key = (slice(i, i + 1 if i != -1 else None),) + key[1:]
        adv = False
        has_slice = False
        for k in key:
            tk = type(k)
            if tk is slice:
                has_slice = True
            elif tk is int:
                pass
            elif isinstance(k, (IndexExpr, Tensor, DynExpr)):
                adv = True
            elif isinstance(k, (bool, np.bool_)):
                raise IndexError("boolean indices are not supported on NKI tensors")
            elif _is_int(k):
                pass
            elif k is None:
                raise IndexError("np.newaxis (None) indices are not supported on NKI tensors; "
                                 "use expand_dims")
            elif isinstance(k, Predicate):
                raise NotImplementedError(
                    "operand masking by indexing with a predicate (x[pred]) is not supported "
                    "by this simulator; use mask=")
            else:
                raise IndexError(f"unsupported index {k!r} for tensor '{self._st.name}'")
        if adv:
            if has_slice:
                raise nki_error("err_unsupported_mixing_basic_advanced_tensor_indexing",
                                "syntax",
                                "Mixing basic tensor indexing and advanced tensor indexing is "
                                "not supported.")
            return _index_advanced(self, key)
        return _index_basic(self, key)

    # -- assignment ------------------------------------------------------------------------------
    def __setitem__(self, key, value):
        ctx = _runtime.current()
        if type(value) is Tensor and value._inpl == ctx.seq and value._st is self._st:
            value._inpl = -1      # the tail of ``t[idx] += x`` (already written in place)
            return
        ctx = enter(keep=value)
        assign(ctx, self._index(key), value)

    def _inplace(self, value, op):
        ctx = enter(keep=value)
        assign(ctx, self, value, accumulate=op)
        self._inpl = ctx.seq
        return self

    def __iadd__(self, v):
        return self._inplace(v, "add")

    def __isub__(self, v):
        return self._inplace(v, "subtract")

    def __imul__(self, v):
        return self._inplace(v, "multiply")

    def __itruediv__(self, v):
        return self._inplace(v, "divide")

    # -- operators -> nl functions ---------------------------------------------------------------
    def __add__(self, o):
        if isinstance(o, IndexExpr):
            return DynExpr(self, o)
        return _NL.add(self, o)

    def __radd__(self, o):
        if isinstance(o, IndexExpr):
            return DynExpr(self, o)
        return _NL.add(o, self)

    def __sub__(self, o):
        return _NL.subtract(self, o)

    def __rsub__(self, o):
        return _NL.subtract(o, self)

    def __mul__(self, o):
        return _NL.multiply(self, o)

    def __rmul__(self, o):
        return _NL.multiply(o, self)

    def __truediv__(self, o):
        return _NL.divide(self, o)

    def __rtruediv__(self, o):
        return _NL.divide(o, self)

    def __pow__(self, o):
        return _NL.power(self, o)

    def __rpow__(self, o):
        return _NL.power(o, self)

    def __mod__(self, o):
        return _NL.mod(self, o)

    def __rmod__(self, o):
        return _NL.mod(o, self)

    def __neg__(self):
        return _NL.negative(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _NL.abs(self)

    def __invert__(self):
        return _NL.invert(self)

    def __and__(self, o):
        return _NL.bitwise_and(self, o)

    def __rand__(self, o):
        return _NL.bitwise_and(o, self)

    def __or__(self, o):
        return _NL.bitwise_or(self, o)

    def __ror__(self, o):
        return _NL.bitwise_or(o, self)

    def __xor__(self, o):
        return _NL.bitwise_xor(self, o)

    def __rxor__(self, o):
        return _NL.bitwise_xor(o, self)

    def __lshift__(self, o):
        return _NL.left_shift(self, o)

    def __rlshift__(self, o):
        return _NL.left_shift(o, self)

    def __rshift__(self, o):
        return _NL.right_shift(self, o)

    def __rrshift__(self, o):
        return _NL.right_shift(o, self)

    def __lt__(self, o):
        return _NL.less(self, o)

    def __le__(self, o):
        return _NL.less_equal(self, o)

    def __gt__(self, o):
        return _NL.greater(self, o)

    def __ge__(self, o):
        return _NL.greater_equal(self, o)

    def __eq__(self, o):
        return _NL.equal(self, o)

    def __ne__(self, o):
        return _NL.not_equal(self, o)

    # -- methods -----------------------------------------------------------------------------------
    def reshape(self, *shape, **kw):
        if kw:
            if shape or set(kw) != {"shape"}:
                raise TypeError(f"reshape() takes the new shape positionally or as shape=; "
                                f"got positional {shape!r} and keywords {sorted(kw)}")
            shape = (kw["shape"],)
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if _nki_api():
            return _views.reshape(self, shape)      # NKI 0.7 NkiTensor.reshape (views)
        shape = tuple(int(s) for s in shape)
        if self._st.buffer not in _HBM_KINDS:
            raise TypeError("Can only reshape tensors in HBM")
        if self._v is None:
            raise TypeError("cannot reshape an advanced-indexed view; reshape the tensor first")
        try:
            v = self._v.view()
            v.shape = shape                 # raises instead of copying
        except (AttributeError, ValueError) as e:
            raise ValueError(f"cannot reshape tensor '{self._st.name}' of shape "
                             f"{fmt_shape(self.shape)} into {fmt_shape(shape)}: {e}") from None
        t = Tensor(self._st, v)
        t._pax = 0
        t._rto = self._rto
        return t

    def view(self, dtype):
        """Reinterpret the bits as ``dtype`` (the last dimension scales with the itemsize).
        Simulator note: returns a *copy* (values are re-decoded), not an alias."""
        di = _dtypes.info(dtype)
        src = host_array(self)
        if di.dt == _dtypes.tfloat32:
            raw = src.view(np.float32)
        else:
            raw = src.view(di.out_np)
        arr = di.round(raw.astype(np.float32)) if di.is_float else np.array(raw, di.backing)
        if self._st.buffer in _HBM_KINDS:
            st = Storage(arr, di, self._st.buffer, self._st.ctx, 0, self._st._name)
            st.param, st.written = self._st.param, True
            return Tensor(st)
        ctx = enter()
        st = new_onchip(ctx, arr, di, self._st.buffer)
        _runtime.commit(ctx, st)
        return Tensor(st)

    def astype(self, dtype):
        return _NL.copy(self, dtype=dtype)

    def broadcast_to(self, shape):
        return _NL.broadcast_to(self, shape=shape)

    def expand_dims(self, axis):
        return _NL.expand_dims(self, axis)

    def assert_shape(self, shape):
        if tuple(self.shape) != tuple(int(s) for s in shape):
            raise nki_error("err_annotation_shape_mismatch", "type",
                            f"shape of `{self._st.name}{fmt_shape(self.shape)}` does not match "
                            f"the expected shape of {fmt_shape(shape)}")
        return self

    # -- data access -------------------------------------------------------------------------------
    def _read(self, mask=None):
        """Backing-dtype array of this view (a numpy view when possible). Masked-out elements
        of out-of-bounds accesses hold the dtype's sentinel."""
        if _sched.ACTIVE is not None:
            _sched.ACTIVE.read(self)
            if self._ind is not None:
                for x in self._ind:
                    _sched.ACTIVE.read(x)
        st = self._st
        if st.ctx is not None and st.ctx.space is not None and st.acct:
            _spill.touch(st.ctx, self, False)
        v = self._v
        if v is not None:
            return v
        key, valid = _resolve(self, mask, False)
        if valid is None:
            return self._base[key]
        bk = np.broadcast_arrays(*key)
        out = np.full(self.shape, self._st.di.sentinel, self._st.arr.dtype)
        sel = tuple(k[valid] for k in bk)
        out[valid] = self._base[sel]
        return out

    def _write(self, vals, mask=None, skip_oob=False):
        """Write backing-dtype ``vals`` (broadcastable to self.shape) where ``mask``; nothing
        while kernel code runs for its program text only (``_runtime.text_only``)."""
        if _runtime.is_text_only():
            return
        if _sched.ACTIVE is not None:
            _sched.ACTIVE.write(self)
            if self._ind is not None:
                for x in self._ind:
                    _sched.ACTIVE.read(x)
        st = self._st
        if st.ctx is not None and st.ctx.space is not None and st.acct:
            _spill.touch(st.ctx, self, True)
        v = self._v
        if v is not None:
            if mask is None:
                v[...] = vals
            else:
                np.copyto(v, vals, where=mask, casting="unsafe")
            return
        key, valid = _resolve(self, mask, skip_oob)
        if valid is None:
            self._base[key] = vals
            return
        bk = np.broadcast_arrays(*key)
        vb = np.broadcast_to(vals, self.shape)
        self._base[tuple(k[valid] for k in bk)] = vb[valid]

    def _resolved(self, mask):
        """``(key, valid)`` of a fancy view under ``mask`` (see ``_resolve``; for ``_deps``)."""
        return _resolve(self, mask, True)

    def _count(self, mask):
        """Number of elements accessed under ``mask`` (in-bounds, unmasked)."""
        n = self.size
        if mask is None:
            return n
        if mask is False:
            return 0
        return int(np.count_nonzero(mask))


class DynExpr:
    _dyn_index = True           # an indirect (dynamic) index
    """``index_tile + nl.arange(...)``: a runtime (dynamic) index entry."""

    __slots__ = ("tile", "expr")

    def __init__(self, tile, expr):
        self.tile = tile
        self.expr = expr

    def __add__(self, o):
        return DynExpr(self.tile, self.expr + o)

    __radd__ = __add__

    @property
    def shape(self):
        return np.broadcast_shapes(self.tile.shape, self.expr.shape)

    def values(self):
        return self.tile._read().astype(np.int64) + self.expr.values()

    def __bool__(self):
        raise nki_error("err_dynamic_control_flow_not_supported", "syntax",
                        "dynamic control-flow depending on tensor value is not supported.")


# =============================================================================================
# indexing internals
# =============================================================================================
def _oob_msg(name, dim, lo, hi, n):
    return nki_error("err_tensor_access_out_of_bound", "index",
                     f"Out-of-bound access for tensor `{name}` on dimension {dim}: index range "
                     f"[{lo}, {hi}] exceed dimension size of {n}")


def _index_basic(t, key):
    v = t._v
    shape = v.shape
    nd = len(shape)
    idx = []
    oob = None
    pax = t._pax
    new_pax = None
    p0, pst = t._p0, t._pst
    kept = 0
    counts = []          # per-dim (start, step, count) or int, for the OOB fallback
    for d in range(nd):
        n = shape[d]
        k = key[d] if d < len(key) else slice(None)
        if type(k) is slice:
            step = 1 if k.step is None else int(k.step)
            if step == 0:
                raise ValueError("slice step cannot be zero")
            if step > 0:
                s = 0 if k.start is None else int(k.start)
                e = n if k.stop is None else int(k.stop)
                if s < 0:
                    s += n
                if e < 0:
                    e += n
                cnt = max(0, -(-(e - s) // step))
            else:
                s = n - 1 if k.start is None else int(k.start)
                if s < 0:
                    s += n
                if k.stop is None:
                    e = -1
                else:
                    e = int(k.stop)
                    if e < 0:
                        e += n
                cnt = max(0, -(-(s - e) // (-step)))
            if cnt:
                last = s + (cnt - 1) * step
                lo, hi = (s, last) if step > 0 else (last, s)
                if lo < 0 or hi >= n:
                    if oob is None:
                        oob = []
                    oob.append((d, lo, hi, n))
            counts.append((s, step, cnt))
            stop = s + cnt * step
            idx.append(slice(s, stop if stop >= 0 else None, step))
            if d == pax:
                new_pax = kept
                p0 += s * pst
                pst *= step
            kept += 1
        else:
            i = int(k)
            if i < 0:
                i += n
            if i < 0 or i >= n:
                if oob is None:
                    oob = []
                oob.append((d, int(k), int(k), n))
            counts.append(i)
            idx.append(i)
            if d == pax:
                p0 += i * pst
    if oob is None:
        return _basic(t, v[tuple(idx) + (Ellipsis,)], new_pax, p0, pst)
    # out of bounds: fancy representation with unclipped index arrays, raised on access
    rshape = tuple(c[2] for c in counts if type(c) is tuple)
    R = len(rshape)
    keyarr = []
    ax = 0
    for c in counts:
        if type(c) is tuple:
            s, step, cnt = c
            a = (s + step * np.arange(cnt, dtype=np.int64)).reshape(
                (1,) * ax + (cnt,) + (1,) * (R - ax - 1))
            keyarr.append(a)
            ax += 1
        else:
            keyarr.append(np.int64(c))
    r = _fancy(t, v, tuple(keyarr), rshape, None, oob, new_pax, p0, pst)
    return r


def _basic(t, values, pax, p0, pst):
    """A view of ``t``'s storage whose elements are the NumPy view ``values`` (no index key)."""
    r = _fancy(t, None, None, values.shape, None, None, pax, p0, pst)
    r._v = values
    return r


def _fancy(t, base, key, shape, dyn, oob, pax, p0, pst):
    r = Tensor.__new__(Tensor)
    r._st = t._st
    r._v = None
    r.shape = tuple(shape)
    r._base = base
    r._key = key
    r._dyn = dyn
    r._oob = oob
    r._pax = pax
    r._p0 = p0
    r._pst = pst
    r._mask = None
    r._tag = None
    r._inpl = -1
    r._ind = t._ind
    r._rto = t._rto
    return r


def _runtime_scalar_in(key):
    """The name of a runtime scalar in an index key (an entry, or a slice bound), or None."""
    for k in key if type(key) is tuple else (key,):
        if type(k) is slice:
            rto = runtime_name(k.start) or runtime_name(k.stop)
        else:
            rto = runtime_name(k)
        if rto is not None:
            return rto
    return None


def _index_advanced(t, key):
    v = t._v
    shape = v.shape
    name = t._st.name
    dyn = []
    shapes = []
    for d, k in enumerate(key):
        if isinstance(k, IndexExpr):
            if k.ndim == 1 and k.terms and all(var.ndim == 1 for var, _ in k.terms):
                raise nki_error("err_1d_arange_not_supported", "syntax",
                                f"indexing tensor `{name}` with 1d arange is not supported.")
            shapes.append(k.shape)
        elif isinstance(k, (Tensor, DynExpr)):
            dyn.append(d)
            shapes.append(k.shape)
        else:
            shapes.append(())
    R = max((len(s) for s in shapes), default=0)
    # rank-deficient index tiles are partition-aligned (right-padded), like operands
    shapes = [s + (1,) * (R - len(s)) if (len(s) and len(s) < R and isinstance(
        key[i], (Tensor, DynExpr))) else s for i, s in enumerate(shapes)]
    try:
        rshape = np.broadcast_shapes(*shapes)
    except ValueError:
        raise IndexError(f"index entries of tensor `{name}` with shapes {shapes} cannot be "
                         "broadcast together") from None
    extra = shape[len(key):]
    pax = t._pax
    # ---- static bounds ----
    oob = None
    for d, k in enumerate(key):
        n = shape[d]
        if isinstance(k, IndexExpr):
            lo, hi = k.bounds()
        elif d in dyn:
            continue
        else:
            lo = hi = int(k)
            if lo < 0:
                lo = hi = lo + n
        if lo < 0 or hi >= n:
            if oob is None:
                oob = []
            oob.append((d, lo, hi, n))
    # ---- partition tracking ----
    new_pax, p0, pst = None, t._p0, t._pst
    if pax is not None and pax < len(key):
        k = key[pax]
        if isinstance(k, IndexExpr):
            lo, _ = k.bounds()
            p0 += lo * pst
            nz = [(var, c) for var, c in k.terms if c != 0]
            if len(nz) == 1:
                var, c = nz[0]
                new_pax = R - var.ndim + var.axis
                pst *= c
            else:
                new_pax = 0
                if k.terms and not nz:
                    pst = 0              # ``0 * arange``: every partition reads one row
        elif pax in dyn:
            new_pax = 0
        else:
            p0 += int(k) * pst
    elif pax is not None:
        new_pax = R + (pax - len(key))
    # ---- fast path: every non-int entry is one arange alone on its own axis ----
    if not dyn and oob is None:
        axes = []
        ok = True
        for k in key:
            if isinstance(k, IndexExpr):
                if not k.affine or len(k.terms) != 1 or k.terms[0][1] == 0:
                    ok = False
                    break
                var, c = k.terms[0]
                axes.append(R - var.ndim + var.axis)
        if ok and len(set(axes)) == len(axes):
            idx = []
            for k in key:
                if isinstance(k, IndexExpr):
                    var, c = k.terms[0]
                    s = k.const + c * var.start
                    stop = s + c * var.n
                    idx.append(slice(s, stop if stop >= 0 else None, c))
                else:
                    i = int(k)
                    idx.append(i + shape[len(idx)] if i < 0 else i)
            nv = v[tuple(idx) + (Ellipsis,)]
            ne = len(axes)
            if axes != sorted(axes):
                order = sorted(range(ne), key=lambda j: axes[j])
                nv = nv.transpose(tuple(order) + tuple(range(ne, nv.ndim)))
            nv = nv.reshape(tuple(rshape) + tuple(extra))
            return _basic(t, nv, new_pax, p0, pst)
    # ---- general fancy view ----
    keyl = []
    for d, k in enumerate(key):
        if isinstance(k, IndexExpr):
            keyl.append(k.values())
        elif d in dyn:
            keyl.append(k)
        else:
            i = int(k)
            keyl.append(np.int64(i + shape[d] if i < 0 else i))
    if extra:
        # implicit trailing dims: full ranges placed after the broadcast index dims
        E = len(extra)
        for j, n in enumerate(extra):
            keyl.append(np.arange(n, dtype=np.int64).reshape((n,) + (1,) * (E - j - 1)))
        keyl = [_pad_left(k, E) if isinstance(k, np.ndarray) and i < len(key) else k
                for i, k in enumerate(keyl)]
    return _fancy(t, v, tuple(keyl), tuple(rshape) + tuple(extra), tuple(dyn) or None, oob,
                  new_pax, p0, pst)


def _pad_left(a, E):
    # index arrays of the leading entries get E trailing unit dims
    return a.reshape(a.shape + (1,) * E) if a.ndim else a


def _index_compose(t, key):
    """Index an advanced view again (rare): materialise per-dim index arrays."""
    keyr, valid = _resolve(t, None, False)
    full = np.broadcast_arrays(*[np.asarray(k) for k in keyr])
    nk = []
    for k in key:
        if isinstance(k, IndexExpr):
            nk.append(k.values())
        elif isinstance(k, (Tensor, DynExpr)):
            raise NotImplementedError("indirect indexing of an advanced-indexed view")
        else:
            nk.append(k)
    nk = tuple(nk)
    new = tuple(f[nk] for f in full)
    shape = new[0].shape if new else ()
    return _fancy(t, t._base, new, shape, None, None, 0 if t._pax is not None else None,
                  t._p0, t._pst)


def _resolve(t, mask, skip_oob):
    """Key of a fancy view ready for numpy, plus the bool array of accessed elements (or
    None when every element is accessed)."""
    key = t._key
    valid = None
    if t._dyn is not None:
        key = list(key)
        base_shape = t._base.shape
        R = len(t.shape)
        for d in t._dyn:
            k = key[d]
            vals = k.values() if isinstance(k, DynExpr) else k._read().astype(np.int64)
            if vals.ndim < R:
                vals = vals.reshape(vals.shape + (1,) * (R - vals.ndim))
            key[d] = vals
        bad = None
        for d in t._dyn:
            n = base_shape[d]
            b = (key[d] < 0) | (key[d] >= n)
            if b.any():
                bad = b if bad is None else (bad | b)
        if bad is not None:
            bad = np.broadcast_to(bad, t.shape)
            hit = bad                     # out-of-range rows that are actually accessed
            if mask is False:
                hit = None
            elif mask is not None:
                hit = bad & mask
            # (text only: a runtime loop of no iteration, whose indices the hardware never
            # computes, see _views.make: clipped like skipped rows)
            if hit is not None and hit.any() and not skip_oob and not _runtime.is_text_only():
                bk = np.broadcast_arrays(*[np.asarray(k) for k in key])
                pos = tuple(int(x[0]) for x in np.nonzero(hit))
                flat = 0
                for d, kk in enumerate(bk):
                    flat = flat * base_shape[d] + int(kk[pos])
                for n in base_shape[len(bk):]:
                    flat *= n
                raise IndexError(f"index {flat} is out of bounds for axis 0 with size "
                                 f"{int(np.prod(base_shape))}")
            # skipped (oob_mode.skip) or masked-out out-of-range rows are neither read nor
            # written: clip their indices and leave them out of ``valid``
            valid = ~bad
            for d in t._dyn:
                key[d] = np.clip(key[d], 0, base_shape[d] - 1)
        key = tuple(key)
    if t._oob is not None:
        if mask is None:
            d, lo, hi, n = t._oob[0]
            raise _oob_msg(t._st.name, d, lo, hi, n)
        m = mask if mask is not False else np.zeros(t.shape, bool)
        key = list(key)
        for d, lo, hi, n in t._oob:
            k = np.asarray(key[d])
            b = np.broadcast_to((k < 0) | (k >= n), t.shape) & m
            if b.any():
                vals = np.broadcast_to(k, t.shape)[m]        # index range of unmasked elements
                raise _oob_msg(t._st.name, d, int(vals.min()), int(vals.max()), n)
            key[d] = np.clip(k, 0, n - 1)
        key = tuple(key)
        valid = m if valid is None else (valid & m)
    elif mask is not None and mask is not False and valid is not None:
        valid = valid & mask
    return key, valid


# =============================================================================================
# operands, results, assignment
# =============================================================================================
def check_start_partition(t, api, pname):
    """Start-partition rule for compute-engine accesses (spec §1)."""
    if t._pax == 0:
        n = t.shape[0]
    else:
        n = 1
    p0 = t._p0
    if p0 == 0 and (t._pst == 1 or n == 1):
        return
    if t._pst != 1 and n > 1:
        raise nki_error(
            "err_unsupported_memory", "value",
            f"partition dimension of operand '{pname}' of '{api}' must be accessed with unit "
            f"stride (got stride {t._pst}); stride over free dimensions instead.")
    for lim, starts in _hw.START_PARTITION_RULES:
        if n <= lim:
            if p0 in starts:
                return
            raise hw_error(
                "value",
                f"start partition {p0} of operand '{pname}' ({n} partitions) of '{api}' is not "
                f"allowed: an access spanning {'<= 32' if lim == 32 else '33-64' if lim == 64 else '> 64'} "
                f"partitions must start at partition {' / '.join(map(str, starts))}.")


def _out_of_scope(st, api, pname):
    f, line = st.expired
    raise nki_error("err_local_variable_used_out_of_scope", "syntax",
                    f"operand '{pname}' of '{api}': tile '{st.name}' was allocated in an "
                    f"iteration of the loop at {f}:{line} and is used after that iteration "
                    "ended. A loop body is a block scope; to carry a tile across iterations "
                    "allocate it before the loop and write it in place.")


def tile_operand(t, api, pname, allow_hbm=False, mask=None):
    """Validate a compute operand; returns (array, DInfo). ``mask`` (a bool array of the
    operand's shape) marks the elements the instruction reads: out-of-bounds indices are
    allowed where it is off."""
    if type(t) is not Tensor:
        if isinstance(t, IndexExpr):
            raise TypeError(f"operand '{pname}' of '{api}' is an nl.arange/mgrid index; "
                            "materialise it with nisa.iota first")
        raise TypeError(f"operand '{pname}' of '{api}' must be an NKI tile, got "
                        f"{type(t).__name__}")
    st = t._st
    if st.expired is not None:
        _out_of_scope(st, api, pname)
    if st.buffer in _HBM_KINDS and not allow_hbm:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand '{pname}' of '{api}' to be in address space "
                        f"'psum|sbuf', but got a tile in 'hbm' instead.")
    if t._pax not in (0, None):
        raise nki_error("err_failed_to_infer_tile_from_local_tensor", "type",
                        f"Failed to infer tile from tensor '{st.name}' of shape "
                        f"{fmt_shape(t.shape)}: the first dimension of the tile is not the "
                        "partition dimension of the tensor (index the block dimensions).")
    if t._dyn is not None:
        raise nki_error("err_copy_dynamic_indirect_indices_not_natively_supported", "syntax",
                        f"cannot copy a tensor with indirect memory reference access to "
                        f"'{api}'; use nisa.tensor_copy_dynamic_src/dst")
    if t._p0 != 0 or t._pst != 1:
        check_start_partition(t, api, pname)
    return t._read(mask), st.di


def check_partitions(shape, api, desc):
    if len(shape) and shape[0] > _hw.NUM_PARTITIONS:
        raise nki_error("err_num_partition_exceed_arch_limit", "value",
                        f"number of partition in {desc}{fmt_shape(shape)} of '{api}' exceed "
                        f"architecture limitation of {_hw.NUM_PARTITIONS}.")


def make_result(ctx, arr, di, mask=None, tag=None, buffer=SBUF, api="", rounded=False):
    """Wrap a computed array as a new (pending) tile of dtype ``di``."""
    if di.itemsize == 1 and di.is_float:
        _dtypes.check_target(di, ctx.tgt, f"result of '{api}'" if api else "a result")
    if not rounded:
        arr = di.round(arr)
    shape = arr.shape
    if arr.ndim == 0:
        arr = arr.reshape(1, 1)
    elif arr.ndim == 1:
        pass
    if len(shape) and shape[0] > _hw.NUM_PARTITIONS:
        raise nki_error("err_num_partition_exceed_arch_limit", "value",
                        f"number of partitions {shape[0]} exceed architecture limitation of "
                        f"{_hw.NUM_PARTITIONS}." + (f" (result of '{api}')" if api else ""))
    st = Storage(arr, di, buffer, ctx, 0, None)
    st.written = True             # holds the instruction's result (_spill refills it)
    n = arr.size
    p = shape[0] if len(shape) else 1
    st.bpp = (n // p if p else 0) * di.itemsize
    if buffer == PSUM:
        st.banks = max(1, -(-st.bpp // _hw.PSUM_BANK_BYTES))
    t = Tensor(st, arr)
    if _sched.ACTIVE is not None:
        _sched.ACTIVE.alloc(st, _loop_iteration(ctx))
        _sched.ACTIVE.write(t)
    if len(shape) == 0:
        t._v = arr.reshape(())
        t.shape = ()
    if mask is not None:
        if mask is False:
            mask = np.zeros(t.shape, bool)
        t._mask = mask
        if di.is_float and not arr.flags.writeable:
            arr = arr.copy()
            st.arr = arr
            t._v = arr
        np.copyto(t._v, di.sentinel, where=~mask)
    t._tag = tag
    t._chg = ctx.last_charge
    ctx.last_charge = None
    ctx.pending = t
    return t


_ACC_FN = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
           "divide": np.divide}
_WRITE_DT_OK = (_dtypes.F32, _dtypes.I32, _dtypes.U32)


def combine_masks(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if a is False or b is False:
        return False
    return a & b


def assign(ctx, dst, value, accumulate=None, mask=None, api="tensor_copy"):
    """``dst = value`` / ``dst op= value`` with dtype rounding, broadcasting and masks.

    If ``value`` is the pending result of the previous instruction, that instruction writes
    straight into ``dst`` (no extra copy, no temporary tile); otherwise a copy (or, for
    accumulation, an add) instruction is charged."""
    st = dst._st
    if st.expired is not None:
        _out_of_scope(st, api, "dst")
    if st.buffer in _HBM_KINDS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'dst' of '{api}' to be in address space 'psum|sbuf', "
                        f"but got a tile in 'hbm' instead. Use nl.store to write to HBM.")
    if dst._dyn is not None:
        raise nki_error("err_copy_dynamic_indirect_indices_not_natively_supported", "syntax",
                        "cannot copy a tensor with indirect memory reference access to "
                        f"'{st.name}'; use nisa.tensor_copy_dynamic_dst")
    ddi = st.di
    direct = False
    tag = None
    if type(value) is Tensor:
        vst = value._st
        if value is ctx.pending:
            ctx.pending = None
            direct = True
            tag = value._tag
            vals = value._v
            vmask = value._mask
        else:
            # a copy of a named tile copies every element (masked-out ones are garbage)
            vals, _ = tile_operand(value, api, "src")
            vmask = None
        vdi = vst.di
        vshape = value.shape
    elif isinstance(value, (int, float, np.number, bool, np.bool_)):
        vals = np.asarray(value)
        vdi = _dtypes.weak_scalar_info(value)
        vshape = ()
        vmask = None
        if vdi.is_float:
            vals = vals.astype(np.float32)
    elif isinstance(value, (IndexExpr, Predicate)):
        raise TypeError("index expressions cannot be assigned to tiles; materialise them with "
                        "nisa.iota")
    else:
        raise TypeError(f"cannot assign a {type(value).__name__} to an NKI tile")

    # hardware rules for results of TensorE instructions
    if direct and tag == "pe_transpose_auto":
        if st.buffer == PSUM:
            tag = "pe_transpose"
        else:
            # compiler-inserted PSUM -> SBUF copy on VectorE (the PSUM staging tile is not
            # modeled in the PSUM budget; docs/simulator.md)
            ctx.rec.add("vector", value._st.copy_out)
            tag = None
    if direct and tag is not None:
        if tag in ("matmul", "pe_transpose", "matmul_mx"):
            if st.buffer != PSUM:
                raise nki_error("err_unsupported_memory", "type",
                                "Result buffer of matmult must be psum! (destination "
                                f"'{st.name}' is in {st.buffer})")
            if tag == "matmul" and ddi not in _WRITE_DT_OK:
                raise hw_error("type", f"PSUM tensor for non-transpose writes must be a 4-byte "
                                       f"dtype (FP32/int32); '{st.name}' is {ddi.name}")
            if tag == "pe_transpose" and ddi not in _WRITE_DT_OK:
                if not (ctx.tgt.gen3_features and ddi.itemsize == 2 and ddi is vdi):
                    raise hw_error("type",
                                   f"PSUM tensor for writes must be either 4-byte (FP32/int32) "
                                   f"or (trn2 transpose, same dtype as the input) BF16/FP16; "
                                   f"'{st.name}' is {ddi.name}")
    if dst._p0 != 0 or dst._pst != 1:
        if vshape == () and type(value) is not Tensor:
            # an immediate (``t[i, j] = 5``) moves no data between partitions: only the
            # unit-stride rule applies. The start-partition rule is documented for where the
            # allocator places a tensor and, through it, for which partition shifts an engine can
            # make from a source to a destination (D26 arch guide, "Accessing SBUF/PSUM" and
            # "Cross-Partition Connectivity"); AWS's nl.gather_flattened example writes
            # single elements at partitions 1..31 this way.
            if dst._pst != 1 and (dst.shape[0] if dst._pax == 0 else 1) > 1:
                check_start_partition(dst, api, "dst")
        elif not (direct and tag == "dma"):
            check_start_partition(dst, api, "dst")

    dshape = dst.shape
    if vshape != dshape:
        vals = fit_value(vals, vshape, dshape)
        vmask = fit_mask(vmask, vshape, dshape)
    m = combine_masks(vmask, mask)
    if m is False:
        return

    rec = ctx.rec
    n = _free(dshape)
    if direct:
        _recharge_direct(ctx, value, vshape, dst, dshape, n, m)
        if _sched.ACTIVE is not None:
            _sched.ACTIVE.direct(value._st)
    group = None
    if st.buffer == PSUM and not _runtime.is_text_only():
        group = _psum_group_write(dst, direct, tag, accumulate, value)
    if accumulate is None:
        if ddi is not vdi and not (ddi is F32 and vdi.is_float):
            vals = ddi.round(vals)
        if ctx.loops:
            # a loop_reduce accumulator written out is a reduction over its loops, not a race
            skip = value._st.reduce_loops if type(value) is Tensor else ()
            _deps.note_write(ctx, dst, m, skip)
        dst._write(vals, m)
        if not direct or (tag == "nl_matmul" and st.buffer != PSUM):
            _charge_copy(ctx, value, dst, n)     # (nl.matmul into SBUF: PSUM evacuation)
    else:
        fn = _ACC_FN[accumulate]
        cur = dst._read()
        fresh = None
        if (st.groups is not None and st.gkinds & _UNWRITTEN_BIT and direct
                and tag in _TENSOR_ENGINE_TAGS):
            # the first matmul of an accumulation group overwrites its bank (spec §9.1): an
            # element never written since the PSUM tile was allocated holds no addend
            fresh = _companion(dst, st.groups) == PSUM_UNWRITTEN
            if not fresh.any():
                fresh = None
        if fresh is not None:
            a = np.where(fresh, np.zeros((), cur.dtype), cur)
            a = a.astype(np.float32, copy=False) if ddi.is_float else a.astype(np.float64)
            dst._write(ddi.round(fn(a, vals)), m)
        elif (ddi is F32 and m is None and dst._v is not None and vals.dtype == np.float32
              and not _runtime.is_text_only()):
            fn(cur, vals, out=cur)
        else:
            a = cur.astype(np.float32, copy=False) if ddi.is_float else cur.astype(np.float64)
            res = fn(a, vals)
            dst._write(ddi.round(res), m)
        if not (direct and tag in ("matmul", "pe_transpose", "nl_matmul", "matmul_mx")
                and accumulate == "add" and st.buffer == PSUM):
            a_psum = st.buffer == PSUM
            b_psum = type(value) is Tensor and value._st.buffer == PSUM and not direct
            rec.add("vector", _cost.tensor_tensor_cycles(
                n, a_psum, b_psum, ddi is _dtypes.BF16 and vdi is _dtypes.BF16))
    if group is not None:
        _set_groups(dst, m, *group)
    st.written = True


_TENSOR_ENGINE_TAGS = ("matmul", "pe_transpose", "nl_matmul", "matmul_mx")


def _companion(t, comp):
    """The elements of ``comp`` (an array shaped like ``t``'s contiguous storage) that view
    ``t`` addresses: a view for basic indexing, a copy for advanced indexing."""
    st = t._st
    if t._v is not None:
        isz = st.arr.itemsize
        off = (t._v.__array_interface__["data"][0] - st.arr.__array_interface__["data"][0]) // isz
        strides = tuple(s // isz * comp.itemsize for s in t._v.strides)
        return np.lib.stride_tricks.as_strided(comp.reshape(-1)[off:], t._v.shape, strides)
    key, _ = _resolve(t, None, True)
    return np.broadcast_to(comp[key], t.shape)


def _mark_written(t, comp, mask, code, only=None):
    """Set ``comp`` (a per-element companion of ``t``'s storage) to ``code`` where ``t``
    addresses it (and ``mask`` holds); with ``only``, just the elements now equal to it."""
    if t._v is not None:
        fv = _companion(t, comp)
        sel = None if mask is None else np.broadcast_to(mask, fv.shape)
        if only is not None:
            sel = fv == only if sel is None else sel & (fv == only)
        if sel is None:
            fv[...] = code
        else:
            np.copyto(fv, code, where=sel)
        return
    key, valid = _resolve(t, None, True)
    bk = np.broadcast_arrays(*key)
    sel = np.ones(t.shape, bool) if mask is None else np.broadcast_to(mask, t.shape)
    if valid is not None:
        sel = sel & valid
    if only is not None:
        sel = sel & (np.broadcast_to(comp[key], t.shape) == only)
    comp[tuple(k[sel] for k in bk)] = code


# Accumulation-group state of a PSUM element (``Storage.groups``). TensorE's first matmul of a
# group overwrites and the later ones accumulate (spec §9.1); NKI 0.7's nc_matmul stub
# ("Accumulation mode") makes ``accumulate=True`` valid only where an ``accumulate=False``
# matmul opened the group, and calls accumulating onto a value a non-matmul instruction
# (memset, tensor_copy) left undefined on NeuronCore-v2/v3.
PSUM_UNWRITTEN = 0   # not written since allocation
PSUM_MATMUL = 1      # a TensorE overwrite opened the group (later TensorE adds keep it open)
PSUM_ZERO = 2        # a zero fill (nl.zeros, memset 0, ``t[...] = 0``) by another engine
PSUM_FOREIGN = 3     # any other value another engine wrote
_UNWRITTEN_BIT = 1 << PSUM_UNWRITTEN


def new_groups(st, code):
    """Give PSUM storage ``st`` its accumulation-group codes, every element ``code``."""
    st.groups = np.full(st.arr.shape, code, np.uint8)
    st.gkinds = 1 << code


def has_group(t, code) -> bool:
    """Whether an element the PSUM view ``t`` addresses holds accumulation-group ``code``
    (``t``'s storage tracks them)."""
    st = t._st
    return bool(st.gkinds >> code & 1) and bool((_companion(t, st.groups) == code).any())


def _set_groups(dst, mask, code, only):
    """``_mark_written`` of a group code, skipped when the storage-wide ``gkinds`` shows there
    is nothing to change (most accumulating matmuls), and ``gkinds`` kept exact after it."""
    st = dst._st
    bit = 1 << code
    if (st.gkinds == bit) if only is None else not st.gkinds >> only & 1:
        return
    _mark_written(dst, st.groups, mask, code, only)
    kinds = np.bincount(st.groups.reshape(-1), minlength=PSUM_FOREIGN + 1)
    st.gkinds = sum(1 << c for c, n in enumerate(kinds) if n)


def _psum_group_write(dst, direct, tag, accumulate, value):
    """The accumulation-group code a write into PSUM ``dst`` leaves, as ``(code, only)`` for
    :func:`_set_groups`. A TensorE overwrite opens a group; a TensorE accumulation overwrites
    (and so opens) the never-written elements and keeps the others' state; another engine's
    write leaves a zero fill or a foreign value. In strict mode a TensorE accumulation onto a
    foreign value is refused (_strict item 4); the check is per element."""
    st = dst._st
    if st.groups is None:       # an instruction's result tile: it holds that result
        new_groups(st, PSUM_MATMUL)
    by_pe = direct and tag in _TENSOR_ENGINE_TAGS
    if by_pe and accumulate == "add":
        if _strict.is_strict() and has_group(dst, PSUM_FOREIGN):
            _strict.refuse_foreign_accumulation(st.name, st.foreign)
        return PSUM_MATMUL, PSUM_UNWRITTEN
    if by_pe and accumulate is None:
        return PSUM_MATMUL, None
    if accumulate is None and (
            (isinstance(value, (int, float, np.number)) and value == 0)
            or (direct and tag == "memset" and not np.any(value._st.arr))):
        return PSUM_ZERO, None                   # a zero fill: same result either way
    st.foreign = (f"'{tag}'" if direct and tag else
                  "a VectorE accumulation" if accumulate is not None else "a copy")
    return PSUM_FOREIGN, None


def _free(shape):
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def _recharge_direct(ctx, value, vshape, dst, dshape, n, m):
    """An instruction writing straight into ``dst`` is charged for what it writes there:

    * a compute result broadcast to a larger destination writes ``n`` (destination free size)
      elements per partition, not its operands' size;
    * a load written into a strided SBUF view is cut into chunks by the view's runs too."""
    chg = getattr(value, "_chg", None)
    if chg is None:
        return
    value._chg = None                    # charge corrections apply once
    if chg[0] == "dma":
        from . import _dma
        _, hl, old = chg
        dl = _dma.layout(dst)
        if dl == ("run", max(1, n)) and tuple(vshape[1:]) == tuple(dshape[1:]):
            return                           # contiguous per partition, as assumed
        new = _dma.chunks(dshape, [_dma.to_shape(hl, vshape, dshape), dl], m)
        ctx.rec.dma_rechunk(old, new)
        return
    engine, fn, n0 = chg
    if n > n0:
        ctx.rec.engine_cycles[engine] += fn(n) - fn(n0)


def _charge_copy(ctx, value, dst, n):
    if type(value) is not Tensor:
        ctx.rec.add("vector", _cost.ii(n))          # memset
        return
    a, b = value._st, dst._st
    ctx.rec.add("vector", _cost.tensor_scalar_cycles(
        ctx.tgt, n, a.buffer == PSUM, b.buffer == PSUM,
        a.di.is_float and a.di.itemsize == 2, b.di.is_float and b.di.itemsize == 2))


def _nki_api():
    """True inside a launch of the nki.* (NKI 0.7) front end."""
    return _runtime.in_kernel() and getattr(_runtime.current().rec, "api", "") == "nki"


def host_array(t):
    """numpy array (declared dtype; bf16 as ml_dtypes) of an HBM tensor or view."""
    di = t._st.di
    a = t._read()
    if di.is_float:
        if di.out_np == np.float32:
            return np.array(a, dtype=np.float32)
        return a.astype(di.out_np)
    return np.array(a, dtype=di.out_np)


from . import _views  # noqa: E402 (installs the NkiTensor view methods on Tensor)
_views.install(Tensor, _basic, _resolve)
