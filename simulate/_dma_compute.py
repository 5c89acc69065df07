"""DMA-engine compute (NKI 0.7 ``nki.isa.dma_compute``): ``dst = srcs[0] + srcs[1] + ...``
computed in fp32 inside the DMA engines, statically addressed or as a read-modify-write with
one indirect (``vector_offset``) side.

Rules and modes are those of the docstring of ``dma_compute`` in AWS's 0.7 stub
(``aws-neuron-sdk`` ``nki/api/nki/isa/__init__.py``; quoted where used):

* ``reduce_op`` add only, every scale 1.0, at most ``DMA_COMPUTE_MAX_SRCS`` sources, the
  element counts of every source and ``dst`` equal, operands in HBM or SBUF;
* static mode: no indirect operand, and every address known at compile time ("Both ``srcs``
  and ``dst`` tensors must have compile-time known addresses (unless using vector_offset for
  indirect access)"; "For ``dma_compute`` without ``vector_offset``, the only supported DGE mode
  is None (static DMA)"): an operand whose view took an offset from a runtime scalar (a
  register, a ``fori_loop`` index: ``Tensor._rto``) or from an index tensor
  (``.ap(scalar_offset=tensor)``: ``Tensor._ind``) is refused, unless it is the
  ``vector_offset`` access itself;
* scatter RMW ``dst(HBM)[indices] = dst(HBM)[indices] + src(SB)``: ``dst`` indirect in HBM,
  one source the same indirect access, the other in SBUF;
* gather RMW ``dst(SB) = dst(SB) + src(HBM)[indices]``: ``dst`` in SBUF, one source indirect
  in HBM, the other the same access as ``dst``;
* the RMW modes take exactly 2 sources and ``unique_indices=True``; a repeated row of the
  indirect access is refused here where the simulator sees it (the stub: "non-unique indices
  not yet supported"). ``oob_mode.skip`` skips the rows whose index is out of bounds (neither
  read nor written), ``oob_mode.error`` refuses them.

Cost (a guess, marked so in ``docs/simulator.md``): one DMA instruction whose transfer is every
source's bytes (the elements moved, at each source's dtype): an RMW reads ``dst``'s rows and
the SBUF operand and writes the rows back as they are summed, so it moves twice a copy's
bytes. HBM traffic is exact: each HBM source's bytes read and ``dst``'s written (skipped rows
excluded).
"""

from __future__ import annotations

import numpy as np

from . import _deps, _dma, _hw, _ops, _tensor
from ._errors import fmt_shape
from ._fit import fit_value
from ._runtime import enter
from .language import _contig, _store_check_param

_HBMS = (_tensor.HBM, _tensor.SHARED_HBM)


def _indirect(t) -> bool:
    return t._dyn is not None


def _same_access(a, b) -> bool:
    """``a`` and ``b`` address the same elements of the same tensor (the RMW's "matching"
    source)."""
    if a is b:
        return True
    if a._st is not b._st or tuple(a.shape) != tuple(b.shape):
        return False
    ka, va = _tensor._resolve(a, None, True)
    kb, vb = _tensor._resolve(b, None, True)
    same = all(np.array_equal(np.broadcast_to(x, a.shape), np.broadcast_to(y, a.shape))
               for x, y in zip(ka, kb))
    return same and (va is None) == (vb is None) and (va is None or np.array_equal(va, vb))


def _rmw_indirect(dst, srcs, err):
    """The indirect access of a call with an indirect operand, which must be one of the two
    read-modify-write forms (module docstring): ``dst`` in the scatter form, the HBM source
    in the gather form."""
    if len(srcs) != 2:
        raise err("err_param_shape_mismatch", "value",
                  f"read-modify-write (an indirect operand) takes exactly 2 sources, got "
                  f"{len(srcs)}")
    a, b = srcs
    on_hbm = dst._st.buffer in _HBMS
    if on_hbm and _indirect(dst):
        for same, other in ((a, b), (b, a)):
            if _same_access(same, dst) and other._st.buffer == _tensor.SBUF \
                    and not _indirect(other):
                return dst
    if dst._st.buffer == _tensor.SBUF and not _indirect(dst):
        for ind, same in ((a, b), (b, a)):
            if _indirect(ind) and ind._st.buffer in _HBMS and _same_access(same, dst):
                return ind
    raise err("err_unsupported_memory", "type",
              "an indirect operand needs one of the two read-modify-write forms: scatter "
              "dst(HBM)[indices] = dst(HBM)[indices] + src(SBUF) (one source the same "
              "indirect access as dst) or gather dst(SBUF) = dst(SBUF) + src(HBM)[indices] "
              "(one source the same access as dst)")


def _check_unique(ind, valid, err):
    """Refuse an indirect access whose in-bounds rows repeat (unique_indices=True)."""
    key, _ = _tensor._resolve(ind, None, True)
    bk = np.broadcast_arrays(*[np.asarray(k) for k in key])
    flat = np.ravel_multi_index(tuple(bk), ind._base.shape)
    if valid is not None:
        flat = flat[valid]
    flat = np.asarray(flat).reshape(-1)
    if np.unique(flat).size != flat.size:
        raise err("err_param_shape_mismatch", "value",
                  f"unique_indices=True but the indirect access of '{ind._st.name}' "
                  f"repeats rows (non-unique indices are not supported)")


def dma_compute(dst, srcs, *, skip_oob: bool, err):
    """``dst = sum(srcs)`` in fp32, cast to ``dst``'s dtype, on a DMA queue (the checks of the
    front end done: operands are tensors, add, unit scales, unique indices asked). ``err(name,
    kind, message)`` builds the front end's errors."""
    ctx = enter()
    n = int(np.prod(dst.shape))
    if len(srcs) > _hw.DMA_COMPUTE_MAX_SRCS:
        raise err("err_param_shape_mismatch", "value",
                  f"'srcs' holds {len(srcs)} tensors; at most {_hw.DMA_COMPUTE_MAX_SRCS}")
    for i, t in enumerate([dst, *srcs]):
        name = "dst" if i == 0 else f"srcs[{i - 1}]"
        if t._st.buffer not in (*_HBMS, _tensor.SBUF):
            raise err("err_unsupported_memory", "type",
                      f"'{name}' is in {t._st.buffer}; the DMA reads and writes HBM or SBUF")
        if int(np.prod(t.shape)) != n:
            raise err("err_param_shape_mismatch", "value",
                      f"'{name}' {fmt_shape(t.shape)} holds {int(np.prod(t.shape))} elements, "
                      f"dst {fmt_shape(dst.shape)} {n}: the element counts must match")
    for i, t in enumerate([dst, *srcs]):
        rto = t._rto or (t._ind[0]._st.name if t._ind else None)
        if rto is not None and not _indirect(t):
            raise err("err_unsupported_memory", "value",
                      f"'{'dst' if i == 0 else f'srcs[{i - 1}]'}' is addressed at a runtime "
                      f"offset ({rto}): 'Both srcs and dst tensors must have compile-time known "
                      "addresses (unless using vector_offset for indirect access)' -- dma_compute "
                      "without vector_offset is a static DMA. Unroll the address (a Python loop) "
                      "or take the rows through .ap(vector_offset=...)")
    valid = None
    ind = None
    if _indirect(dst) or any(_indirect(s) for s in srcs):
        ind = _rmw_indirect(dst, srcs, err)
        _, valid = _tensor._resolve(ind, None, skip_oob)
        _check_unique(ind, valid, err)
    if dst._st.buffer in _HBMS:
        _store_check_param(ctx, dst._st)
    total = np.zeros(dst.shape, np.float32)
    for s in srcs:
        v = _ops.to_f32(s._read(valid if _indirect(s) else None))
        total += fit_value(v, s.shape, dst.shape, "srcs")
    di = dst._st.di
    out = di.round(total)
    if ctx.loops and ind is None:
        _deps.note_write(ctx, dst, None)
    dst._write(out, valid, skip_oob=skip_oob)
    dst._st.written = True
    cnt = dst._count(valid)
    hbm_srcs = [s for s in srcs if s._st.buffer in _HBMS]
    moved = sum(cnt * s._st.di.itemsize for s in srcs)
    side = hbm_srcs[0] if hbm_srcs else dst
    ch = _dma.chunks(dst.shape, [_dma.layout(dst)] + [
        _dma.to_shape(_dma.layout(s), s.shape, dst.shape) for s in srcs], valid)
    reads = [(s._st.name, cnt * s._st.di.itemsize) for s in hbm_srcs]
    ctx.rec.dma(moved, _contig(side, side._st.di), ch,
                read=reads[0][0] if reads else None,
                read_bytes=reads[0][1] if reads else None,
                written=dst._st.name if dst._st.buffer in _HBMS else None,
                written_bytes=cnt * di.itemsize, more_reads=reads[1:])
