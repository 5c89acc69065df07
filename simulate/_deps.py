"""err_unexpected_output_dependencies (spec §6), checked dynamically.

neuronx-cc rejects a write inside ``nl.affine_range`` whose destination index does not depend
on the loop variable ("Unexpected output dependencies, missing indices in the dst access: i"),
because affine iterations may run in any order or in parallel. Loop indices are plain ints
here, so the simulator checks the observable consequence: the *identical* access (same region of
the same tensor, same mask) written by a plain (non-accumulating) write in two different
iterations of an affine loop that was entered after the tensor was allocated. Accesses that
depend on the loop index differ between iterations and pass, even if they overlap (as with the
compiler's static rule). ``+=``-style accumulation (``t += x``, ``t[...] += x``,
``dma_copy(dst_rmw_op=np.add)``, ``atomic_rmw``, ``loop_reduce``) is exempt, as documented.
Not detected (lenient): conflicts hidden by per-iteration masks, and SPMD-instance conflicts.
"""

from __future__ import annotations

import itertools
import linecache
import re

import numpy as np

from ._errors import nki_error

_uids = itertools.count(1)


class LoopState:
    """One active ``affine_range``/``sequential_range``/``static_range`` loop."""

    __slots__ = ("value", "first", "affine", "static", "uid", "iter_no", "file", "line",
                 "allocs")

    def __init__(self, start, affine, file, line, static=False):
        self.value = start
        self.first = True
        self.affine = affine
        # static_range is unrolled by the compiler: every iteration is program text
        self.static = static
        self.uid = next(_uids)
        self.iter_no = -1
        self.file = file
        self.line = line
        # weak references to the on-chip storages accounted during the current iteration: a
        # loop body is a block scope, so they are dead when the iteration ends
        self.allocs = []

    def var_name(self):
        src = linecache.getline(self.file, self.line) if self.file else ""
        m = re.search(r"for\s+(.+?)\s+in\s", src)
        return m.group(1).strip() if m else "<loop index>"


def alloc_loops(ctx):
    """Loop uids active when a tensor is allocated."""
    if not ctx.loops:
        return ()
    return tuple(L.uid for L in ctx.loops)


def _signature(t, mask):
    """Identity of an access: region (offset/shape/strides, or index arrays) plus its mask."""
    v = t._v
    st = t._st
    if v is not None:
        sig = (v.__array_interface__["data"][0] - st.arr.__array_interface__["data"][0],
               v.shape, v.strides)
    else:
        key, valid = t._resolved(mask if isinstance(mask, np.ndarray) else None)
        sig = tuple((np.shape(k), hash(np.ascontiguousarray(k).tobytes())) for k in key)
        if valid is not None:
            sig += (hash(np.packbits(valid).tobytes()),)
    if isinstance(mask, np.ndarray):
        sig += (mask.shape, hash(np.packbits(mask).tobytes()))
    return sig


def note_write(ctx, t, mask, skip=()):
    """Record a plain write through view ``t`` (under ``mask``); raise when the identical
    access was written by a different iteration of an enclosing affine loop entered after
    ``t``'s storage was allocated (i.e. the access does not depend on that loop's index).
    Loops whose uids are in ``skip`` are reductions of the written value (nl.loop_reduce)."""
    loops = ctx.loops
    if not loops or mask is False:
        return
    st = t._st
    aloops = st.aloops
    sig = None
    for L in loops:
        if not L.affine or L.uid in aloops or L.iter_no < 0 or L.uid in skip:
            continue
        if sig is None:
            sig = _signature(t, mask)
            if st.deps is None:
                st.deps = {}
        d = st.deps.get(L.uid)
        if d is None:
            d = st.deps[L.uid] = {}
        it = d.get(sig)
        if it is not None and it != L.iter_no:
            _raise(t, L, it)
        d[sig] = L.iter_no


def _raise(t, L, first_iter):
    where = f" (iterations {first_iter} and {L.iter_no})"
    raise nki_error(
        "err_unexpected_output_dependencies", "syntax",
        f"Unexpected output dependencies, missing indices in the dst access: {L.var_name()} -- "
        f"tensor '{t._st.name}' is written at the same location by different iterations of "
        f"nl.affine_range ({L.file}:{L.line}){where}. Index the destination with the loop "
        "variable, accumulate with '+=', allocate the tensor inside the loop, or use "
        "nl.sequential_range.")
