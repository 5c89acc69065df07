"""DMA descriptor model: how many contiguous chunks a transfer is cut into.

A DMA moves, for every partition (dimension 0 of the transfer), the elements of that partition
in the destination's element order. A *chunk* (one descriptor) is a maximal run of elements
that is contiguous on **both** sides: the HBM side (strided / gathered views) and the SBUF side
(a view into a tile, or a fresh tile, which is contiguous per partition). SBUF partitions are
separate address ranges, so a chunk never spans partitions; a gather/scatter moves at least one
chunk per row. The cost model charges ``DMA_CHUNK_OVERHEAD_BYTES`` of transfer time per chunk
(``_cost.LaunchRecord.dma``).

A *side layout* describes one side's addresses within one partition, in that side's own shape:

* ``("run", r)``: the partition's elements form contiguous runs of ``r`` elements (``r``
  divides the elements per partition);
* ``("offs", a)``: ``a`` = int64 element offsets of partition 0's elements (flat, in order);
  a new chunk starts wherever consecutive offsets are not adjacent.
"""

from __future__ import annotations

import math

import numpy as np

from ._fit import fit_value



def _out_shape(shape):
    shape = tuple(shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return shape


def _free(shape):
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def fresh(shape):
    """Layout of a new (or whole, dense) SBUF tile: one run per partition."""
    return ("run", max(1, _free(_out_shape(shape))))


def logical_strides(view, st):
    """Element strides of ``view`` (a numpy view of ``st.arr``) in the tensor's *device*
    layout: row-major over the storage's shape for HBM; row-major over the free dims for
    SBUF/PSUM (the partition dim excluded, block dims included). The simulator's backing
    arrays may be in another memory order (a transposed host input, a transposed result), so
    numpy's own strides are only used to locate elements."""
    base = st.arr
    shape = base.shape
    el = base.itemsize
    onchip = st.buffer in ("sbuf", "psum")
    skip = st.pdim if onchip else None
    cs = [0] * len(shape)
    acc = 1
    for k in range(len(shape) - 1, -1, -1):
        if k == skip:
            continue
        cs[k] = acc
        acc *= shape[k]
    bs = base.strides
    if base.flags.c_contiguous and not skip:    # (the partition stride is never used)
        return [s // el for s in view.strides]
    dims = [k for k in range(len(shape)) if shape[k] > 1]
    order = sorted(dims, key=lambda k: -bs[k])
    dense = all(bs[k] > 0 for k in dims)
    if dense:
        want = el
        for k in reversed(order):
            if bs[k] != want:
                dense = False
                break
            want *= shape[k]
    if not dense:                               # exotic backing layout: trust numpy
        return [s // el for s in view.strides]

    def logical(off):
        idx = 0
        for k in order:
            q, off = divmod(off, bs[k])
            idx += q * cs[k]
        return idx

    o0 = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    l0 = logical(o0)
    return [logical(o0 + view.strides[d]) - l0 if view.shape[d] > 1 else 0
            for d in range(view.ndim)]


def _run(shape, ls):
    """Elements of the innermost run of unit logical stride (dims 1.. of ``shape``)."""
    run = 1
    for d in range(len(shape) - 1, 0, -1):
        n = shape[d]
        if n == 1:
            continue
        if ls[d] == run:
            run *= n
        else:
            break
    return run


def layout(t):
    """Per-partition layout of a DMA side given as a tensor view ``t`` (HBM or SBUF)."""
    shape = _out_shape(t.shape)
    F = _free(shape)
    v = t._v
    st = t._st
    if v is not None:
        if v.ndim < 2:
            return ("run", 1)
        return ("run", max(1, min(F, _run(v.shape, logical_strides(v, st)))))
    base = t._base
    if len(t.shape) < 2:
        return ("run", 1)
    ls = logical_strides(base, st)
    off = np.zeros(t.shape[1:], np.int64)
    for d, k in enumerate(t._key):
        if getattr(k, "_dyn_index", False):
            continue            # index tiles select whole rows (partition dimension only)
        a = np.broadcast_to(np.asarray(k), t.shape)[0]
        off = off + a * ls[d]
    return ("offs", off.reshape(-1))


def contiguous_bytes(t, itemsize):
    """HBM-side contiguous bytes per partition (``dma_bytes_per_partition``): the first
    contiguous run of a partition's data, at most the partition's bytes."""
    F = _free(_out_shape(t.shape))
    kind, x = layout(t)
    if kind == "run":
        return min(F, x) * itemsize
    if x.size < 2:
        return itemsize
    steps = np.diff(x) == 1
    run = x.size if steps.all() else int(np.argmin(steps)) + 1
    return min(F, run) * itemsize


def _as_offsets(lay, F):
    kind, x = lay
    if kind == "offs":
        return x
    k = np.arange(F, dtype=np.int64)
    return (k // x) * (x + 1) + k % x        # runs of x, separated by a one-element gap


def to_shape(lay, vshape, dshape):
    """Map a side layout given in ``vshape`` order onto the destination's element order
    (broadcast or same-size reshape, as ``_fit.fit_value`` does for the values)."""
    vs, ds = _out_shape(vshape), _out_shape(dshape)
    if tuple(vs[1:]) == tuple(ds[1:]):
        return lay
    off = _as_offsets(lay, _free(vs)).reshape((1,) + tuple(vs[1:]))
    mapped = fit_value(off, (1,) + tuple(vs[1:]), (1,) + tuple(ds[1:]))
    return ("offs", np.ascontiguousarray(mapped).reshape(-1))


def _count_multiples(F, runs):
    """Positions k in [0, F) with k % r == 0 for some r in ``runs`` (inclusion-exclusion)."""
    runs = sorted(set(runs))
    total = 0
    n = len(runs)
    for mask in range(1, 1 << n):
        l, bits = 1, 0
        for i in range(n):
            if mask >> i & 1:
                l = l * runs[i] // math.gcd(l, runs[i])
                bits += 1
        total += (-1) ** (bits + 1) * (-(-F // l))
    return total


def chunks(dshape, sides, mask=None):
    """Number of DMA chunks (descriptors) of a transfer over ``dshape`` whose sides have the
    given layouts (already in ``dshape`` order). ``mask``: None or a bool array of ``dshape``
    (False = element not transferred)."""
    shape = _out_shape(dshape)
    P, F = shape[0], _free(shape)
    if P == 0 or F == 0 or mask is False:
        return 0
    runs = [x for kind, x in sides if kind == "run"]
    offs = [x for kind, x in sides if kind == "offs"]
    if not offs and mask is None and len(runs) <= 3:
        return P * _count_multiples(F, runs or [F])
    brk = np.zeros(F, bool)
    brk[0] = True
    for r in runs:
        brk[::r] = True
    for o in offs:
        if o.size > 1:
            brk[1:] |= np.diff(o) != 1
    if mask is None:
        return P * int(np.count_nonzero(brk))
    m2 = np.asarray(mask).reshape(P, F)
    starts = m2.copy()
    starts[:, 1:] &= brk[1:] | ~m2[:, :-1]
    return int(np.count_nonzero(starts))
