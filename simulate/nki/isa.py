"""``nki.isa`` (``nisa``) of NKI 0.7 (Neuron SDK 2.33) on the simulator's core.

Every instruction writes ``dst`` (migration guide 0.2.0: instructions take their destination
first, no ``mask=``, no result allocation). Each one calls the legacy implementation in
``simulate.isa`` -- which computes the values, checks the operands and charges the engine --
and writes its pending result into ``dst`` exactly as the legacy ``dst[...] = nisa.op(...)``
path does (``_tensor.assign``): no extra copy is charged, the result never occupies SBUF/PSUM,
and the destination rules (PSUM for TensorE results, 4-byte PSUM accumulation, start
partitions, dtype rounding) are the legacy ones. Added here: the 0.7 ``dst`` checks stated in
the docstrings of AWS's stub ``nki/api/nki/isa/__init__.py`` (shape, dtype, memory) and
``nc_matmul(accumulate=...)``.
"""

from __future__ import annotations

import numpy as np

from .. import _index, _runtime, _tensor
from .. import isa as _I
from .._errors import nki_error, fmt_shape
from .._tensor import Tensor
from ..isa import engine, reduce_cmd, oob_mode, dge_mode, nc_version, get_nc_version  # noqa: F401,E501 (public enums)

DOC_ISA = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/generated/nki.isa."

tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


def _doc(api):
    return f"{DOC_ISA}{api}.html"


def _free(shape):
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return n


def _need_tensor(api, t, pname):
    if not isinstance(t, Tensor):
        raise TypeError(f"nisa.{api}: '{pname}' must be an NKI tensor, got {type(t).__name__} "
                        f"({_doc(api)})")


def _same_layout(api, dst, shape, what="the result"):
    """``dst`` holds the instruction's output: the same partition count and the same number of
    elements per partition (the stub's docstrings state this per instruction)."""
    dshape = tuple(dst.shape)
    shape = tuple(shape)
    if dshape == shape:
        return
    dp = dshape[0] if dshape else 1
    p = shape[0] if shape else 1
    if dp != p or _free(dshape) != _free(shape):
        raise nki_error(
            "err_param_shape_mismatch", "value",
            f"nisa.{api}: 'dst' {fmt_shape(dshape)} does not match {what} {fmt_shape(shape)}: "
            f"dst must have the same partition size and the same number of elements per "
            f"partition ({_doc(api)})")


def _into(api, dst, result, accumulate=None):
    """Write the pending ``result`` of a legacy instruction into ``dst`` (the legacy
    ``dst[...] = result`` path of ``Tensor.__setitem__``)."""
    ctx = _runtime.enter(keep=result)
    _tensor.assign(ctx, dst, result, accumulate=accumulate, api=api)


def _eng(e):
    return None if e is None or int(e) == int(engine.unknown) else e


# -- data movement ------------------------------------------------------------------------------
def dma_copy(dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None):
    """``dst = src`` on a DMA queue (HBM or SBUF on either side; dtype cast via fp32). PSUM is
    not a DMA operand in 0.3+ (nki.isa.dma_copy: "Both src and dst tiles can be in HBM or
    SBUF"); the element counts must match ("Tile size")."""
    api = "dma_copy"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, src, "src")
    for t, pn in ((dst, "dst"), (src, "src")):
        if t.buffer == "psum":
            raise nki_error("err_unsupported_memory", "type",
                            f"nisa.dma_copy: '{pn}' is in PSUM; DMA reads and writes HBM or "
                            f"SBUF only ({_doc(api)})")
    if int(np.prod(dst.shape)) != int(np.prod(src.shape)):
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.dma_copy: 'src' {fmt_shape(src.shape)} and 'dst' "
                        f"{fmt_shape(dst.shape)} hold different numbers of elements "
                        f"({_doc(api)})")
    _I.dma_copy(dst=dst, src=src, oob_mode=oob_mode, dge_mode=dge_mode)


def tensor_copy(dst, src, engine=engine.unknown, name=None):
    """Copy ``src`` (SBUF/PSUM) into ``dst`` on VectorE/ScalarE/GpSimdE: bit-accurate for equal
    dtypes, through fp32 otherwise; the output dtype is ``dst.dtype`` (no ``dtype=`` in 0.7)."""
    api = "tensor_copy"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, src, "src")
    _same_layout(api, dst, src.shape, "'src'")
    _into(api, dst, _I.tensor_copy(src, dtype=dst.dtype, engine=_eng(engine)))


def memset(dst, value, engine=engine.unknown, name=None):
    """Fill ``dst`` with the compile-time constant ``value`` (VectorE or GpSimdE)."""
    api = "memset"
    _need_tensor(api, dst, "dst")
    _into(api, dst, _I.memset(dst.shape, value, dst.dtype, engine=_eng(engine)))


# -- TensorE ------------------------------------------------------------------------------------
def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=None, name=None):
    """``dst = stationary.T @ moving`` (or ``+=``) on TensorE into a PSUM ``dst``.

    ``accumulate`` (nki.isa.nc_matmul, "Accumulation mode"): ``False`` overwrites; ``True``
    adds onto the existing PSUM content and is undefined on a location no matmul has
    initialized (refused here); ``None`` (default) overwrites the locations not written since
    the PSUM tensor was allocated and accumulates onto the others ("first write overwrites,
    subsequent writes accumulate")."""
    api = "nc_matmul"
    _need_tensor(api, dst, "dst")
    if accumulate is True or (accumulate is not None and accumulate is not False
                              and bool(accumulate)):
        st = dst._st
        if st.fresh is not None and _tensor._companion(dst, st.fresh).any():
            raise nki_error(
                "err_matmul_accumulate_uninitialized", "value",
                f"nisa.nc_matmul(accumulate=True) onto PSUM tensor '{st.name}' where no "
                f"instruction has written yet: 'Using accumulate=True on an uninitialized "
                f"PSUM location is undefined behavior on all targets'; start the group with "
                f"accumulate=False or leave accumulate=None ({_doc(api)})")
        acc = "add"
    elif accumulate is None:
        acc = "add"                # fresh locations are overwritten by _tensor.assign
    else:
        acc = None
    r = _I.nc_matmul(stationary, moving, is_stationary_onezero=is_stationary_onezero,
                     is_moving_onezero=is_moving_onezero, is_transpose=is_transpose,
                     tile_position=tile_position, tile_size=tile_size, perf_mode=perf_mode)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r, accumulate=acc)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Partition <-> free transpose of ``data`` into ``dst`` (TensorE: <= 128x128, SBUF input,
    PSUM output; VectorE: <= 32x32). ``dst.dtype`` must equal ``data.dtype`` ("Data types")."""
    api = "nc_transpose"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, data, "data")
    if np.dtype(dst.dtype) != np.dtype(data.dtype):
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"nisa.nc_transpose: 'dst' dtype {dst.dtype} differs from 'data' dtype "
                        f"{data.dtype}; the output must have the input's dtype ({_doc(api)})")
    r = _I.nc_transpose(data, engine=_eng(engine))
    tensor_e = r._tag in ("pe_transpose_auto", "pe_transpose")
    if tensor_e and dst.buffer != "psum":
        raise nki_error("err_unsupported_memory", "type",
                        f"nisa.nc_transpose on the Tensor Engine writes PSUM; 'dst' is in "
                        f"{dst.buffer} ({_doc(api)})")
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


# -- VectorE / ScalarE / GpSimdE -----------------------------------------------------------------
def tensor_tensor(dst, data1, data2, op, engine=engine.unknown, name=None):
    api = "tensor_tensor"
    _need_tensor(api, dst, "dst")
    r = _I.tensor_tensor(data1, data2, op, dtype=dst.dtype, engine=_eng(engine))
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None,
                  reverse1=False, engine=engine.unknown, name=None):
    api = "tensor_scalar"
    _need_tensor(api, dst, "dst")
    r = _I.tensor_scalar(data, op0, operand0, reverse0, op1, operand1, reverse1,
                         dtype=dst.dtype, engine=_eng(engine))
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    api = "activation"
    _need_tensor(api, dst, "dst")
    r = _I.activation(op, data, bias=bias, scale=scale, reduce_op=reduce_op,
                      reduce_res=reduce_res, reduce_cmd=reduce_cmd, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    api = "tensor_reduce"
    _need_tensor(api, dst, "dst")
    r = _I.tensor_reduce(op, data, axis, negate=negate, keepdims=keepdims, dtype=dst.dtype)
    shape = tuple(r.shape) if len(r.shape) != 1 else (r.shape[0], 1)
    _same_layout(api, dst, shape)
    _into(api, dst, r)


def reciprocal(dst, data, name=None):
    api = "reciprocal"
    _need_tensor(api, dst, "dst")
    r = _I.reciprocal(data, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    """``dst[c, w, z, y, x] = offset + c * channel_multiplier + w*step_w + ... + x*step_x``
    (int32 math, cast to ``dst.dtype``; ``dst`` in SBUF; the pattern's element count must
    equal dst's elements per partition). Built as the index expression the legacy
    ``nisa.iota`` materialises."""
    api = "iota"
    _need_tensor(api, dst, "dst")
    if dst.buffer != "sbuf":
        raise nki_error("err_unsupported_memory", "type",
                        f"nisa.iota: 'dst' must be in SBUF, got {dst.buffer} ({_doc(api)})")
    pat = [(int(s), int(n)) for s, n in pattern]
    if not 1 <= len(pat) <= 4:
        raise ValueError(f"nisa.iota: pattern has 1 to 4 [step, num] pairs ({_doc(api)})")
    P = dst.shape[0]
    nd = len(pat) + 1
    nums = [n for _, n in pat]
    if int(np.prod(nums)) != _free(dst.shape):
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.iota: pattern {pattern} has {int(np.prod(nums))} elements but "
                        f"'dst' {fmt_shape(dst.shape)} has {_free(dst.shape)} per partition "
                        f"({_doc(api)})")

    def axis(n, k):
        key = tuple(slice(None) if j == k else None for j in range(nd))
        return _index.arange(n)[key]

    expr = axis(P, 0) * int(channel_multiplier) + int(offset)
    for k, (step, n) in enumerate(pat, start=1):
        expr = expr + axis(n, k) * step
    _into(api, dst, _I.iota(expr, dst.dtype))


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "np",
                                                                   "Tensor", "DOC_ISA")]
