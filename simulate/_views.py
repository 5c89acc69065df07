"""Strided views of a tensor's storage: the NkiTensor view operations of NKI 0.5+.

NKI 0.7 describes every tensor view as ``shape`` + ``strides`` + ``offset`` over its storage
(AWS's stub ``nki/api/nki/language/__init__.py``, class ``NkiTensor``): ``slice``, ``select``,
``permute``, ``broadcast``, ``expand_dim``, ``squeeze_dim``, ``reshape_dim``,
``flatten_dims``, ``reshape``, ``rearrange`` and the explicit access pattern ``ap()``. Here a
view is a NumPy view of the storage array (``Tensor._v``), so reads, writes, the scheduler's
byte ranges and the DMA layout rules work on it as on any other view; no data is copied.

Units: strides and offsets count elements of the storage (row-major). On-chip storage is
``(partitions, free...)`` row-major, so a partition step is a multiple of the elements per
partition (the stub's ``sb.ap(pattern=[[32, 128], [1, 32]])`` for a (128, 32) tile). A view of
an on-chip tensor keeps the partition dim first and may not let a free-dim pattern run into
the next partition.

Runtime offsets (``scalar_offset``, ``select`` with a tensor index, runtime scalars as
``offset``/``start``) take the value the simulator holds when the view is built (the
simulator runs the kernel eagerly, in program order). An index tensor read that way is kept
on the view (``Tensor._ind``) so that the instruction using the view also reads it (its
dependence on the instruction that wrote the index).
"""

from __future__ import annotations

import numpy as np

from . import _runtime, _scalar, _strict
from ._errors import nki_error, fmt_shape

_HBM = ("hbm", "shared_hbm")


class _Core:
    """The core's tensor class and view constructors, given by ``_tensor`` at import
    (``install``), so this module does not import ``_tensor``."""
    Tensor = None
    basic = None
    resolve = None


_T = _Core


def _err(t, msg):
    return nki_error("err_invalid_tensor_view", "value", f"tensor '{t._st.name}' "
                     f"{fmt_shape(t.shape)}: {msg}")


def _onchip(t):
    return t._st.buffer not in _HBM


def _arr(t):
    a = t._st.arr
    if not a.flags.c_contiguous:
        raise NotImplementedError(f"view of tensor '{t._st.name}': its storage is not "
                                  "row-major contiguous")
    return a


def _int(x, what="value"):
    """A Python int from an int or a runtime scalar (its current value)."""
    if isinstance(x, _strict.SymbolicIndex):
        return x.v
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, got {x!r}")
    return int(x)


def layout(t):
    """``(shape, strides, offset)`` of view ``t`` in storage elements."""
    v = t._v
    if v is None:
        raise _err(t, "an indirect/advanced-indexed view has no strided layout")
    a = t._st.arr
    isz = a.itemsize
    off = (v.__array_interface__["data"][0] - a.__array_interface__["data"][0])
    return tuple(v.shape), tuple(s // isz for s in v.strides), off // isz


def make(t, shape, strides, offset, ind=None, api="ap"):
    """The view of ``t``'s storage with element ``shape``/``strides``/``offset`` (checked
    against the storage bounds and, on chip, the partition layout)."""
    T = _T
    a = _arr(t)
    shape = tuple(int(s) for s in shape)
    strides = tuple(int(s) for s in strides)
    offset = int(offset)
    if len(shape) != len(strides):
        raise _err(t, f"{api}: {len(shape)} counts but {len(strides)} strides")
    for n in shape:
        if n < 0:
            raise _err(t, f"{api}: negative count in {shape}")
    for s in strides:
        if s < 0:
            raise _err(t, f"{api}: negative stride in {strides} (access patterns step "
                          f"forward)")
    if any(n == 0 for n in shape):
        span = 0
    else:
        span = sum((n - 1) * s for n, s in zip(shape, strides))
    out = offset < 0 or (shape and all(shape) and offset + span >= a.size) or offset > a.size
    if out and offset != 0 and _runtime.is_text_only():
        # a body traced for its program text only (a runtime loop of no iteration) runs on
        # values the hardware never computes there (table rows, registers): its addresses are
        # not checked, only its instructions counted
        offset, out = 0, span >= a.size
    if out:
        raise IndexError(
            f"{api}: access pattern {[[s, n] for s, n in zip(strides, shape)]} at offset "
            f"{offset} reaches element {offset + span} of tensor '{t._st.name}', which has "
            f"{a.size} elements")
    p0, pst = 0, 1
    if _onchip(t):
        if not shape:
            raise _err(t, f"{api}: an on-chip view keeps its partition dim")
        row = a.size // a.shape[0] if a.shape[0] else 1
        p0, f0 = divmod(offset, row)
        if shape[0] > 1:
            if strides[0] % row:
                raise _err(t, f"{api}: partition stride {strides[0]} is not a multiple of the "
                              f"{row} elements per partition")
            pst = strides[0] // row
        free_span = sum((n - 1) * s for n, s in zip(shape[1:], strides[1:])) \
            if all(shape[1:]) else 0
        if f0 + free_span >= row and all(shape):
            raise _err(t, f"{api}: the free-dim pattern {[[s, n] for s, n in zip(strides[1:], shape[1:])]} "
                          f"from element {f0} runs past the {row} elements of a partition")
    flat = a.reshape(-1)
    v = np.lib.stride_tricks.as_strided(flat[offset:] if offset < a.size else flat[:0],
                                        shape=shape,
                                        strides=tuple(s * a.itemsize for s in strides),
                                        writeable=True)
    r = T.basic(t, v, 0, p0, pst)
    r._ind = ind if ind is not None else t._ind
    return r


def _dim(t, dim, api, allow_new=False):
    nd = len(t.shape) + (1 if allow_new else 0)
    d = _int(dim, "dim")
    if d < 0:
        d += nd
    if not 0 <= d < nd:
        raise _err(t, f"{api}: dim {dim} out of range for {len(t.shape)} dims")
    return d


def _not_partition(t, d, api):
    if d == 0 and _onchip(t):
        raise _err(t, f"{api}: the partition dim (dim 0) of an on-chip tensor cannot be "
                      f"changed (NkiTensor.{api})")


def _scalar_value(x, what):
    """Value of a runtime offset: an int, a runtime scalar, or a 1-element int tensor.
    Returns ``(value, index_tensor_or_None)``."""
    T = _T
    if isinstance(x, T.Tensor):
        if x.size != 1:
            raise nki_error("err_invalid_tensor_view", "value",
                            f"{what}: the index tensor '{x._st.name}' {fmt_shape(x.shape)} must "
                            f"hold one element")
        if not np.issubdtype(np.dtype(x._st.arr.dtype), np.integer):
            raise TypeError(f"{what}: the index tensor '{x._st.name}' must have an integer "
                            f"dtype, got {x.dtype}")
        v = x._v if x._v is not None else x._base[T.resolve(x, None, False)[0]]
        return int(np.asarray(v).reshape(-1)[0]), x
    return _int(x, what), None


def _merge_ind(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return tuple(a) + tuple(b)


# -- the NkiTensor view methods -----------------------------------------------------------------
def strides(t):
    return layout(t)[1]


def offset(t):
    return layout(t)[2]


def get_pattern(t):
    shape, st, _ = layout(t)
    return [[s, n] for s, n in zip(st, shape)]


def is_contiguous(t):
    shape, st, _ = layout(t)
    dims = range(1, len(shape)) if _onchip(t) else range(len(shape))
    want = 1
    for d in reversed(list(dims)):
        if shape[d] == 1:
            continue
        if st[d] != want:
            return False
        want *= shape[d]
    return True


def is_indirect(t):
    return t._ind is not None


def slice_(t, dim, start, end, step=1):
    api = "slice"
    d = _dim(t, dim, api)
    shape, st, off = layout(t)
    s, e, k = _int(start, "start"), _int(end, "end"), _int(step, "step")
    if k < 1:
        raise _err(t, f"slice: step {step} must be >= 1")
    if not 0 <= s < e <= shape[d]:
        raise _err(t, f"slice: need 0 <= start < end <= {shape[d]} on dim {d}, got "
                      f"start={s}, end={e}")
    n = -(-(e - s) // k)
    shape = shape[:d] + (n,) + shape[d + 1:]
    st2 = st[:d] + (st[d] * k,) + st[d + 1:]
    return make(t, shape, st2, off + s * st[d], api=api)


def select(t, dim, index):
    api = "select"
    d = _dim(t, dim, api)
    shape, st, off = layout(t)
    i, ind = _scalar_value(index, "NkiTensor.select")
    if ind is not None and d == 0 and _onchip(t):
        raise _err(t, "select: a dynamic select on an on-chip tensor cannot use the "
                      "partition dim (dim 0)")
    if ind is not None and t._ind is not None:
        raise _err(t, "select: only one dynamic select per tensor (the view is already "
                      "indirect)")
    if not 0 <= i < shape[d] and ind is not None and _runtime.is_text_only():
        # a runtime index in a body traced for its program text only (a runtime loop of no
        # iteration): its table rows were never written, the hardware never runs it
        i = 0
    if not 0 <= i < shape[d]:
        raise IndexError(f"select: index {i} out of range [0, {shape[d]}) on dim {d} of "
                         f"tensor '{t._st.name}'")
    if d == 0 and _onchip(t):
        # on chip the partition dim stays (as a size-1 dim), as integer indexing does
        return make(t, (1,) + shape[1:], (st[0],) + st[1:], off + i * st[0], api=api)
    return make(t, shape[:d] + shape[d + 1:], st[:d] + st[d + 1:], off + i * st[d],
                ind=_merge_ind(t._ind, (ind,) if ind is not None else None), api=api)


def permute(t, dims):
    api = "permute"
    shape, st, off = layout(t)
    dims = tuple(_int(x) for x in dims)
    if sorted(dims) != list(range(len(shape))):
        raise _err(t, f"permute: {dims} is not a permutation of range({len(shape)})")
    if _onchip(t) and dims[0] != 0:
        raise _err(t, f"permute: on-chip tensors keep the partition dim first (dims[0] must "
                      f"be 0, got {dims})")
    return make(t, [shape[i] for i in dims], [st[i] for i in dims], off, api=api)


def broadcast(t, dim, size):
    api = "broadcast"
    d = _dim(t, dim, api)
    shape, st, off = layout(t)
    if shape[d] != 1:
        raise _err(t, f"broadcast: dim {d} has size {shape[d]}, not 1")
    _not_partition(t, d, api)
    return make(t, shape[:d] + (_int(size),) + shape[d + 1:], st[:d] + (0,) + st[d + 1:], off,
                api=api)


def expand_dim(t, dim):
    api = "expand_dim"
    d = _dim(t, dim, api, allow_new=True)
    _not_partition(t, d, api)
    shape, st, off = layout(t)
    return make(t, shape[:d] + (1,) + shape[d:], st[:d] + (0,) + st[d:], off, api=api)


def squeeze_dim(t, dim):
    api = "squeeze_dim"
    d = _dim(t, dim, api)
    shape, st, off = layout(t)
    if shape[d] != 1:
        raise _err(t, f"squeeze_dim: dim {d} has size {shape[d]}, not 1")
    _not_partition(t, d, api)
    return make(t, shape[:d] + shape[d + 1:], st[:d] + st[d + 1:], off, api=api)


def _infer(parts, total, what):
    parts = [_int(p) for p in parts]
    unknown = [i for i, p in enumerate(parts) if p == -1]
    if len(unknown) > 1:
        raise ValueError(f"{what}: at most one -1 in {tuple(parts)}")
    known = 1
    for p in parts:
        if p != -1:
            known *= p
    if unknown:
        if known == 0 or total % known:
            raise ValueError(f"{what}: cannot infer -1 in {tuple(parts)} for size {total}")
        parts[unknown[0]] = total // known
    prod = 1
    for p in parts:
        prod *= p
    if prod != total:
        raise ValueError(f"{what}: {tuple(parts)} has {prod} elements, the dim has {total}")
    return parts


def reshape_dim(t, dim, shape):
    api = "reshape_dim"
    d = _dim(t, dim, api)
    sh, st, off = layout(t)
    parts = _infer(shape if isinstance(shape, (tuple, list)) else (shape,), sh[d],
                   f"NkiTensor.reshape_dim on '{t._st.name}'")
    if d == 0 and _onchip(t) and sum(1 for p in parts if p != 1) > 1:
        raise _err(t, f"reshape_dim: the partition dim (dim 0) of an on-chip tensor can only "
                      f"be reshaped trivially, got {tuple(parts)}")
    if d == 0 and _onchip(t) and parts and parts[0] != sh[0]:
        raise _err(t, f"reshape_dim: the partition dim stays first (got {tuple(parts)})")
    new_st = []
    acc = st[d]
    for p in reversed(parts):
        new_st.append(acc)
        acc *= p
    new_st.reverse()
    return make(t, sh[:d] + tuple(parts) + sh[d + 1:], st[:d] + tuple(new_st) + st[d + 1:],
                off, api=api)


def _numpy_reshape(t, shape, api):
    v = t._v
    if v is None:
        raise _err(t, f"{api}: an indirect/advanced-indexed view cannot be reshaped")
    try:
        nv = v.view()
        nv.shape = shape                     # raises instead of copying
    except (AttributeError, ValueError) as e:
        raise ValueError(f"{api}: cannot view tensor '{t._st.name}' {fmt_shape(t.shape)} as "
                         f"{fmt_shape(shape)} without copying: {e}") from None
    a = t._st.arr
    isz = a.itemsize
    off = (nv.__array_interface__["data"][0] - a.__array_interface__["data"][0]) // isz
    return make(t, nv.shape, [s // isz for s in nv.strides], off, api=api)


def flatten_dims(t, start_dim, end_dim):
    api = "flatten_dims"
    s = _dim(t, start_dim, api)
    e = _dim(t, end_dim, api)
    if e < s:
        raise _err(t, f"flatten_dims: end_dim {end_dim} < start_dim {start_dim}")
    if s == 0 and _onchip(t) and e > 0:
        raise _err(t, "flatten_dims: start_dim must be > 0 on an on-chip tensor")
    sh = tuple(t.shape)
    n = 1
    for x in sh[s:e + 1]:
        n *= x
    return _numpy_reshape(t, sh[:s] + (n,) + sh[e + 1:], api)


def reshape(t, shape):
    api = "reshape"
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    shape = [_int(s) for s in shape]
    total = 1
    for x in t.shape:
        total *= x
    shape = tuple(_infer(shape, total, f"NkiTensor.reshape of '{t._st.name}'"))
    if _onchip(t) and (not shape or shape[0] != t.shape[0]):
        raise _err(t, f"reshape: on-chip tensors keep the partition dim: shape[0] must be "
                      f"{t.shape[0]}, got {fmt_shape(shape)}")
    return _numpy_reshape(t, shape, api)


def rearrange(t, src_pattern, dst_pattern, fixed_sizes=None):
    """einops-style: split the grouped dims of ``src_pattern``, reorder, merge the grouped
    dims of ``dst_pattern`` (the merge must be a no-copy view)."""
    api = "rearrange"
    fixed = dict(fixed_sizes or {})
    src = tuple(src_pattern)
    if len(src) != len(t.shape):
        raise _err(t, f"rearrange: source pattern {src} has {len(src)} entries for "
                      f"{len(t.shape)} dims")
    names, sizes = [], []
    for ent, n in zip(src, t.shape):
        grp = (ent,) if isinstance(ent, str) else tuple(ent)
        parts = _infer([fixed.get(g, -1) if len(grp) > 1 else n for g in grp], n,
                       f"rearrange {ent!r}")
        names.extend(grp)
        sizes.extend(parts)
    if len(set(names)) != len(names):
        raise ValueError(f"rearrange: repeated name in {src}")
    split = _numpy_reshape(t, tuple(sizes), api) if tuple(sizes) != tuple(t.shape) else t
    dst = tuple(dst_pattern)
    flat_dst = []
    for ent in dst:
        flat_dst.extend((ent,) if isinstance(ent, str) else tuple(ent))
    if sorted(flat_dst) != sorted(names):
        raise ValueError(f"rearrange: {dst} does not use the names of {src} exactly once")
    order = [names.index(nm) for nm in flat_dst]
    perm = permute(split, order) if order != list(range(len(order))) else split
    merged = []
    for ent in dst:
        grp = (ent,) if isinstance(ent, str) else tuple(ent)
        n = 1
        for g in grp:
            n *= sizes[names.index(g)]
        merged.append(n)
    if tuple(merged) == tuple(perm.shape):
        return perm
    return _numpy_reshape(perm, tuple(merged), api)


def _reinterpret(t, di):
    """``t`` (a view) as the same bytes of dtype ``di``: its storage reinterpreted, units now
    ``di`` elements. Only raw-bit storage (integer and MX packed types, whose backing array
    holds the bytes themselves) in HBM: float storage holds decoded values, and an on-chip
    reinterpretation would need its own SBUF accounting (not done). The reinterpreted storage
    shares the memory but is a separate Storage: the dependence tracker does not see writes
    through one as writes to the other (fine for read-only kernel inputs)."""
    sdi = t._st.di
    raw = lambda d: d.kind in "iup" and d.backing.itemsize == d.itemsize  # noqa: E731
    if not (raw(sdi) and raw(di)):
        raise NotImplementedError(
            f"NkiTensor.ap(dtype={di.name}) reinterprets '{t._st.name}' ({sdi.name}): only "
            f"integer / MX packed storage is reinterpreted (float storage holds decoded values)")
    if _onchip(t):
        raise NotImplementedError(
            f"NkiTensor.ap(dtype={di.name}) on on-chip tensor '{t._st.name}': reinterpretation "
            f"is simulated for HBM tensors only")
    a = _arr(t)
    nbytes = a.size * a.itemsize
    if nbytes % di.itemsize:
        raise _err(t, f"ap(dtype={di.name}): {nbytes} bytes are not a whole number of "
                      f"{di.itemsize}-byte elements")
    _, _, off = layout(t)
    if (off * a.itemsize) % di.itemsize:
        raise _err(t, f"ap(dtype={di.name}): view offset is not aligned to {di.itemsize} bytes")
    flat = a.reshape(-1).view(di.backing)
    old = t._st
    st = type(old)(flat, di, old.buffer, old.ctx, 0, f"{old.name}.as_{di.name}")
    st.param, st.mutable, st.written = old.param, old.mutable, old.written
    nt = _T.Tensor(st, flat)
    if off:
        nt = make(nt, [flat.size - off * a.itemsize // di.itemsize], [1],
                  off * a.itemsize // di.itemsize, api="ap")
    return nt


def _vector_indirect(t, pattern, offset, idx, indirect_dim):
    """``t.ap(pattern, offset, vector_offset=idx, indirect_dim=d)``: per-partition indirect
    access of the HBM tensor ``t`` (nki.isa.dma_copy, "Vector indirection": gather on ``src``,
    scatter on ``dst``). Element ``[p, f...]`` is storage element ``t.offset + offset +
    idx[p] * t.strides[d] + sum_k step_k f_k``: the pattern's first pair ``[t.strides[d], P]``
    is the partition walk, which the index replaces; ``idx`` an SBUF ``(P, 1)`` integer tile.
    Row ``idx[p]`` is out of bounds outside ``[0, t.shape[d])`` (``oob_mode.skip`` skips it),
    and where the offset would push its elements past the end of the storage.

    The result is the core's indirect view (an index tile on the partition dim, the legacy
    ``t2[idx[i_p, 0], i_f]`` of the rows view ``t2``), so gathers and scatters share the
    legacy DMA's numerics, bounds handling and cost. The free pattern must stay within one
    row (``0 <= f < t.strides[d]``), as every documented use does."""
    from . import _index

    if _onchip(t):
        raise _err(t, "ap(vector_offset=): the indexed tensor must be in HBM "
                      "(nki.isa.dma_copy, indirect addressing)")
    if not isinstance(idx, _T.Tensor) or idx._st.buffer != "sbuf":
        raise TypeError("NkiTensor.ap(vector_offset=): expected an SBUF tensor of one index "
                        f"per partition, got {type(idx).__name__}"
                        + ("" if not isinstance(idx, _T.Tensor) else f" in {idx._st.buffer}"))
    if len(idx.shape) != 2 or idx.shape[1] != 1 or np.dtype(idx.dtype).kind not in "iu":
        raise _err(t, f"ap(vector_offset=): the index tensor must be a (P, 1) integer tile, "
                      f"got {fmt_shape(idx.shape)} {np.dtype(idx.dtype).name}")
    shape, st, base = layout(t)
    d = _int(indirect_dim, "indirect_dim")
    if not 0 <= d < len(st):
        raise _err(t, f"ap: indirect_dim {indirect_dim} out of range for {len(st)} dims")
    pat = [(_int(p[0]), _int(p[1])) for p in pattern]
    row = st[d]
    if not pat or pat[0] != (row, idx.shape[0]):
        raise _err(t, f"ap(vector_offset=): the pattern's first pair must be the partition "
                      f"walk [t.strides[{d}], P] = [{row}, {idx.shape[0]}], got "
                      f"{[list(p) for p in pat]}")
    free = pat[1:]
    last = sum((n - 1) * s for s, n in free) if all(n for _, n in free) else 0
    if not free or row <= 0 or any(s < 0 for s, _ in free) or last >= row:
        raise NotImplementedError(
            f"NkiTensor.ap(vector_offset=): a free pattern {[list(p) for p in free]} beyond "
            f"one indexed row of {row} elements is not simulated")
    off = base + (0 if offset is None else _int(offset, "offset"))
    # the rows that fit in the storage from ``off`` (all ``shape[d]`` of them, unless an offset
    # pushes the last past the end: those are out of bounds)
    n_rows = max(0, min(shape[d], (_arr(t).size - off - last - 1) // row + 1))
    rows = make(t, (n_rows, last + 1), (row, 1), off, api="ap")
    expr = None
    for k, (s, n) in enumerate(free):
        ax = _index.arange(n)[(None,) + tuple(slice(None) if j == k else None
                                              for j in range(len(free)))] * s
        expr = ax if expr is None else expr + ax
    return _T.Tensor.__getitem__(rows, (idx, expr))


def ap(t, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0,
       dtype=None):
    """Explicit ``[[stride, count], ...]`` access pattern over ``t``'s storage, starting at
    ``t``'s own storage offset plus ``offset``; ``scalar_offset`` adds ``value *
    t.strides[indirect_dim]``."""
    api = "ap"
    if dtype is not None:
        from . import _dtypes
        if _dtypes.info(dtype).dt != t._st.di.dt:
            t = _reinterpret(t, _dtypes.info(dtype))
    if vector_offset is not None:
        if scalar_offset is not None:
            raise _err(t, "ap: vector_offset and scalar_offset are mutually exclusive")
        return _vector_indirect(t, pattern, offset, vector_offset, indirect_dim)
    shape, st, base = layout(t)
    pat = [(int(s), int(n)) for s, n in ((_int(p[0]), _int(p[1])) for p in pattern)]
    off = base + (0 if offset is None else _int(offset, "offset"))
    ind = None
    if scalar_offset is not None:
        if t._ind is not None:
            raise _err(t, "ap: the view is already indirect")
        val, ind_t = _scalar_value(scalar_offset, "NkiTensor.ap(scalar_offset=)")
        d = _int(indirect_dim, "indirect_dim")
        if not 0 <= d < len(st):
            raise _err(t, f"ap: indirect_dim {indirect_dim} out of range for "
                          f"{len(st)} dims")
        off += val * st[d]
        if ind_t is not None:
            ind = (ind_t,)
    r = make(t, [n for _, n in pat], [s for s, _ in pat], off, ind=_merge_ind(t._ind, ind),
             api=api)
    rto = _scalar.runtime_name(offset) or _scalar.runtime_name(scalar_offset)
    if rto is not None:
        r._rto = rto
    return r


def install(Tensor, basic, resolve):
    """The NkiTensor view methods on the core's tensor class."""
    _Core.Tensor, _Core.basic, _Core.resolve = Tensor, staticmethod(basic), staticmethod(resolve)
    Tensor.ap = ap
    Tensor.slice = slice_
    Tensor.select = select
    Tensor.permute = permute
    Tensor.broadcast = broadcast
    Tensor.expand_dim = expand_dim
    Tensor.squeeze_dim = squeeze_dim
    Tensor.reshape_dim = reshape_dim
    Tensor.flatten_dims = flatten_dims
    Tensor.rearrange = rearrange
    Tensor.get_pattern = get_pattern
    Tensor.is_contiguous = is_contiguous
    Tensor.is_indirect = is_indirect
    Tensor.strides = property(strides)
    Tensor.offset = property(offset)
