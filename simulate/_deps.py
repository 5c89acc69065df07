"""err_unexpected_output_dependencies (spec §6), checked dynamically.

neuronx-cc rejects a write inside ``nl.affine_range`` whose destination index does not depend
on the loop variable ("Unexpected output dependencies, missing indices in the dst access: i"),
because affine iterations may run in any order or in parallel. Loop indices are plain ints
here, so the simulator checks the *consequence* instead: a plain (non-accumulating) write to an
element of a tensor allocated *outside* an affine loop, which an earlier iteration of that same
loop already wrote, raises the error. ``+=``-style accumulation (``t += x``, ``t[...] += x``,
``dma_copy(dst_rmw_op=np.add)``, ``atomic_rmw``, ``loop_reduce``) is exempt, as documented.
Not detected (lenient): conflicts hidden by per-iteration masks, and SPMD-instance conflicts.
"""

from __future__ import annotations

import itertools
import linecache
import re

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ._errors import nki_error

_uids = itertools.count(1)


class LoopState:
    """One active ``affine_range``/``sequential_range``/``static_range`` loop."""

    __slots__ = ("value", "first", "affine", "uid", "iter_no", "file", "line")

    def __init__(self, start, affine, file, line):
        self.value = start
        self.first = True
        self.affine = affine
        self.uid = next(_uids)
        self.iter_no = -1
        self.file = file
        self.line = line

    def var_name(self):
        src = linecache.getline(self.file, self.line) if self.file else ""
        m = re.search(r"for\s+(.+?)\s+in\s", src)
        return m.group(1).strip() if m else "<loop index>"


def alloc_loops(ctx):
    """Loop uids active when a tensor is allocated."""
    if not ctx.loops:
        return ()
    return tuple(L.uid for L in ctx.loops)


def _region(arr, t, key_valid):
    """The part of ``arr`` (same shape as t's storage array) that view ``t`` addresses."""
    v = t._v
    base = t._st.arr
    if v is not None:
        el = base.itemsize
        off = (v.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // el
        strides = tuple((s // el) * arr.itemsize for s in v.strides)
        return as_strided(arr.reshape(-1)[off:], shape=v.shape, strides=strides), None
    return None, key_valid


def note_write(ctx, t, mask):
    """Record a plain write through view ``t`` (under ``mask``); raise on a cross-iteration
    conflict in an enclosing affine loop entered after ``t``'s storage was allocated."""
    loops = ctx.loops
    if not loops or mask is False:
        return
    st = t._st
    aloops = st.aloops
    deps = None
    for L in loops:
        if not L.affine or L.uid in aloops or L.iter_no < 0:
            continue
        if deps is None:
            deps = st.deps
            if deps is None:
                deps = st.deps = {}
        rec = deps.get(L.uid)
        shape = st.arr.shape
        if rec is None:
            rec = deps[L.uid] = [L.iter_no, None, np.zeros(shape, bool)]
        elif rec[0] != L.iter_no:
            prev = rec[2] if rec[1] is None else (rec[1] | rec[2])
            rec[0], rec[1], rec[2] = L.iter_no, prev, np.zeros(shape, bool)
        _check_and_mark(ctx, t, mask, rec, L)


def _check_and_mark(ctx, t, mask, rec, L):
    prev, cur = rec[1], rec[2]
    if t._v is not None:
        cv, _ = _region(cur, t, None)
        if prev is not None:
            pv, _ = _region(prev, t, None)
            hit = pv if mask is None else (pv & mask)
            if hit.any():
                _raise(t, L, np.argwhere(hit)[0])
        if mask is None:
            cv[...] = True
        else:
            np.logical_or(cv, mask, out=cv)
        return
    from ._tensor import _resolve
    key, valid = _resolve(t, mask, True)
    bk = np.broadcast_arrays(*[np.asarray(k) for k in key])
    sel = valid if valid is not None else (mask if isinstance(mask, np.ndarray) else None)
    if sel is not None:
        bk = [k[sel] for k in bk]
    idx = tuple(bk)
    if prev is not None:
        hit = prev[idx]
        if np.any(hit):
            _raise(t, L, None)
    cur[idx] = True


def _raise(t, L, pos):
    where = f" (element {tuple(int(p) for p in pos)} of the destination view)" \
        if pos is not None else ""
    raise nki_error(
        "err_unexpected_output_dependencies", "syntax",
        f"Unexpected output dependencies, missing indices in the dst access: {L.var_name()} -- "
        f"tensor '{t._st.name}' is written at the same location by different iterations of "
        f"nl.affine_range ({L.file}:{L.line}){where}. Index the destination with the loop "
        "variable, accumulate with '+=', allocate the tensor inside the loop, or use "
        "nl.sequential_range.")
