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

import enum

import numpy as np

from .. import _deps, _dma_compute, _index, _ops, _runtime, _scalar, _strict, _tensor
from .. import _dtypes as _dt
from .. import isa as _I
from .. import language as _L
from .._errors import nki_error, hw_error, fmt_shape
from .._tensor import Tensor

DOC_ISA = "https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.1/nki/api/generated/nki.isa."


# -- enums (values of the 0.7 stub; IntEnum so that the legacy implementations, which take
# ints, accept them) ---------------------------------------------------------------------------
class engine(enum.IntEnum):
    """nki.isa.engine: ``dma`` (4) is new in the nki.* namespace; the other values are the
    legacy ones."""
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.IntEnum):
    """nki.isa.reduce_cmd; ``load_reduce`` (new in 0.7) loads ``reduce_init`` into the
    registers and accumulates on top (tensor_scalar_reduce, exponential)."""
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.IntEnum):
    """nki.isa.dge_mode. NB the 0.7 numbering differs from the legacy one (unknown 0 / none 3
    here, none 0 / unknown 3 in neuronxcc.nki.isa); only hwdge (2) means the same."""
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.IntEnum):
    error = 0
    skip = 1


class dma_engine(enum.IntEnum):
    """DMA transfer engine of ``sendrecv`` (0.7 stub): the shared DMA with CoreBarrier
    synchronization, or GpSimd's internal DMA for SBUF-to-SBUF swaps in LNC=2."""
    dma = 1
    gpsimd_dma = 2


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.IntEnum):
    """nki.isa.nc_version: gen2 = trn1/inf2, gen3 = trn2, gen4 = trn3."""
    gen2 = 2
    gen3 = 3
    gen4 = 4


_RC = reduce_cmd
_ENGINE = engine        # the enum, where a parameter named 'engine' shadows it


def get_nc_version():
    """The ``nc_version`` of the current target (gen4 on trn3)."""
    return nc_version(_runtime.current().tgt.nc_version)


def get_nc_sub_version():
    """Silicon revision within the generation: the simulator models the first one (0)."""
    _runtime.current()
    return 0


_LEGACY_DGE = {0: _I.dge_mode.unknown, 1: _I.dge_mode.swdge, 2: _I.dge_mode.hwdge,
               3: _I.dge_mode.none}

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
    if e is None or int(e) == int(engine.unknown):
        return None
    if int(e) == int(engine.dma):
        raise ValueError("nki.isa.engine.dma is not a compute engine for this instruction")
    return e


def _buffer(api, t, pname, allowed):
    """``t`` lives in one of ``allowed`` ("sbuf", "psum", "hbm")."""
    b = t.buffer
    kind = "hbm" if b in ("hbm", "shared_hbm", "private_hbm") else b
    if kind not in allowed:
        where = " or ".join(a.upper() for a in allowed)
        raise nki_error("err_unsupported_memory", "type",
                        f"nisa.{api}: '{pname}' must be in {where}, got {b} ({_doc(api)})")


def _same_dtype(api, a, aname, b, bname, rule=""):
    """Refuse two operands of different dtypes (``rule``: the doc's wording, appended)."""
    if np.dtype(a.dtype) != np.dtype(b.dtype):
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"nisa.{api}: '{aname}' dtype {a.dtype} differs from '{bname}' dtype "
                        f"{b.dtype}{rule} ({_doc(api)})")


def _dtype_in(api, t, pname, names, what=None):
    n = t._st.di.name
    if n not in names:
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"nisa.{api}: '{pname}' dtype {n} is not supported; "
                        f"{what or 'supported: ' + ', '.join(names)} ({_doc(api)})")


def _rows(api, t, P, pname, elems=None):
    """``t`` has ``P`` partitions (and ``elems`` elements per partition if given)."""
    p = t.shape[0] if t.ndim else 1
    if p != P or (elems is not None and _free(t.shape) != elems):
        want = f"[{P}, {elems}]" if elems is not None else f"{P} partitions"
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.{api}: '{pname}' {fmt_shape(t.shape)} must have {want} "
                        f"({_doc(api)})")


def _priority(api, priority):
    # dma_copy / dma_transpose: "priority level 0-3 ... (NeuronCore-v4+ only)"
    if priority is None:
        return
    tgt = _runtime.current().tgt
    if tgt.nc_version < 4:
        raise nki_error("err_min_arch_support_for_inst", "syntax",
                        f"nisa.{api}: 'priority' needs NeuronCore-v4 (trn3); target is "
                        f"{tgt.name} ({_doc(api)})")
    if int(priority) not in (0, 1, 2, 3):
        raise ValueError(f"nisa.{api}: priority must be 0-3, got {priority!r} ({_doc(api)})")


def _cmd(api, cmd, allowed):
    c = reduce_cmd(int(cmd))
    if c not in allowed:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"nisa.{api}: reduce_cmd.{c.name} is not supported here (supported: "
                        f"{', '.join(a.name for a in allowed)}) ({_doc(api)})")
    return c


def _op_is(api, op, pname, names):
    n = _ops.op_name(op, api, pname)
    if n not in names:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"nisa.{api}: '{pname}' {n} is not supported (supported: "
                        f"{', '.join(names)}) ({_doc(api)})")
    return n


_FLOATS = ("float32", "float16", "bfloat16", "tfloat32", "float8_e4m3", "float8_e4m3fn",
           "float8_e5m2", "float8_e8m0fnu")


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
    _priority(api, priority)
    if int(engine) not in (int(_ENGINE.unknown), int(_ENGINE.sync), int(_ENGINE.scalar)):
        raise ValueError(f"nisa.dma_copy: 'engine' selects the HWDGE trigger engine: sync, "
                         f"scalar or unknown ({_doc(api)})")
    _I.dma_copy(dst=dst, src=src, oob_mode=int(oob_mode),
                dge_mode=_LEGACY_DGE[int(dge_mode)])


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
def _acc_mode(api, dst, accumulate):
    """The ``_tensor.assign`` accumulate mode of a TensorE ``accumulate=`` argument (stub,
    "Accumulation mode"): ``False`` overwrites (and opens an accumulation group); ``None``
    overwrites the locations not written since allocation and adds onto the others ("first
    write overwrites, subsequent writes accumulate"); ``True`` adds, and is "only valid after
    the PSUM location has been initialized by a matmul with accumulate=False": refused on a
    location nothing wrote (undefined on all targets) and, in strict mode, on one whose last
    group was opened by another instruction -- a memset or ``nl.zeros`` zero fill, a copy,
    another engine's value (the stub's note: undefined on NeuronCore-v2/v3)."""
    if accumulate is None:
        return "add"               # fresh locations are overwritten by _tensor.assign
    if not (accumulate is True or (accumulate is not False and bool(accumulate))):
        return None
    st = dst._st
    if st.groups is None or _runtime.is_text_only():   # (text only: the groups are not kept)
        return "add"
    if _tensor.has_group(dst, _tensor.PSUM_UNWRITTEN):
        raise nki_error(
            "err_matmul_accumulate_uninitialized", "value",
            f"nisa.{api}(accumulate=True) onto PSUM tensor '{st.name}' where no "
            f"instruction has written yet: 'Using accumulate=True on an uninitialized "
            f"PSUM location is undefined behavior on all targets'; start the group with "
            f"accumulate=False or leave accumulate=None ({_doc(api)})")
    if _strict.is_strict():
        if _tensor.has_group(dst, _tensor.PSUM_FOREIGN):
            _strict.refuse_explicit_accumulation(api, st.name, st.foreign, _doc(api))
        if _tensor.has_group(dst, _tensor.PSUM_ZERO):
            _strict.refuse_explicit_accumulation(
                api, st.name, "a zero fill (nl.zeros, memset)", _doc(api))
    return "add"


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
    acc = _acc_mode(api, dst, accumulate)
    r = _I.nc_matmul(stationary, moving, is_stationary_onezero=is_stationary_onezero,
                     is_moving_onezero=is_moving_onezero, is_transpose=is_transpose,
                     tile_position=tile_position, tile_size=tile_size, perf_mode=perf_mode)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r, accumulate=acc)


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None,
                 tile_size=None, accumulate=None, name=None):
    """MXFP8/MXFP4 matmul with dequantization on TensorE (NeuronCore-v4 only): ``dst`` (PSUM,
    float32 or bfloat16) ``[M, N]`` = dequantized ``stationary`` [P, M] x ``moving`` [P, N]
    (``*_x4`` packed, SBUF), contracting over the partitions and the 4 values of each packed
    element; scales (uint8 or float8_e8m0fnu, SBUF) one per 8 partitions x 1 packed element,
    spread over quadrants (``simulate._mx``). ``accumulate`` as for ``nc_matmul``. Indirect
    views are not simulated."""
    api = "nc_matmul_mx"
    _need_tensor(api, dst, "dst")
    _buffer(api, dst, "dst", ("psum",))
    if np.dtype(dst.dtype) not in (np.dtype(np.float32), np.dtype(_dt.bfloat16)):
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"nisa.nc_matmul_mx: 'dst' must be float32 or bfloat16, got {dst.dtype} "
                        f"({_doc(api)})")
    for t, nm in ((stationary, "stationary"), (moving, "moving"),
                  (stationary_scale, "stationary_scale"), (moving_scale, "moving_scale")):
        _need_tensor(api, t, nm)
    acc = _acc_mode(api, dst, accumulate)
    r = _I.nc_matmul_mx(stationary, moving, stationary_scale, moving_scale,
                        tile_position=tile_position or (), tile_size=tile_size or (),
                        out_bf16=np.dtype(dst.dtype) == np.dtype(_dt.bfloat16))
    _same_layout(api, dst, r.shape)
    _into(api, dst, r, accumulate=acc)


def quantize_mx(dst, src, dst_scale, name=None):
    """MXFP8 quantization of fp16/bf16 ``src`` [P, F] (SBUF) on VectorE (NeuronCore-v4 only):
    ``dst`` [P, F // 4] ``float8_e5m2_x4``/``float8_e4m3fn_x4`` and one scale per 8 partitions
    x 4 elements in ``dst_scale`` (uint8 or float8_e8m0fnu), at partition ``32 * (g // 4) + g %
    4`` for group g (``P // 8`` rows when P <= 32). Scale ``2**(floor(log2(amax)) - (Emax -
    1))``, ``2**-127`` for an all-zero group (stub, "Scale calculation")."""
    api = "quantize_mx"
    for t, nm in ((dst, "dst"), (src, "src"), (dst_scale, "dst_scale")):
        _need_tensor(api, t, nm)
        _buffer(api, t, nm, ("sbuf",))
    sdn = _dt.info(dst_scale.dtype).name
    if sdn not in ("uint8", "float8_e8m0fnu"):
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"nisa.quantize_mx: 'dst_scale' must be float8_e8m0fnu or uint8, got "
                        f"{sdn} ({_doc(api)})")
    r, exps = _I.quantize_mx(src, _dt.info(dst.dtype).name)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)
    from .. import _mx
    P, F4 = src.shape[0], exps.shape[1]
    need = _mx.scale_rows_needed(P)
    if dst_scale.shape[0] < need or _tensor._free(dst_scale.shape) < F4:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.quantize_mx: 'dst_scale' {fmt_shape(dst_scale.shape)} cannot hold "
                        f"the scales of a {P}-partition src: it needs {need} partitions (4 at "
                        f"the start of each 32-partition quadrant) and {F4} elements per "
                        f"partition ({_doc(api)})")
    ctx = _runtime.enter()
    sdi = _dt.info(dst_scale.dtype)
    vals = exps.astype(np.uint8) if sdn == "uint8" else np.exp2(exps - 127.0).astype(np.float32)
    for q in range(0, P // 8, 4):     # the scale rows of each quadrant, one write per quadrant
        rows = vals[q:q + 4]
        p0 = 32 * (q // 4)
        part = _tensor.make_result(ctx, rows, sdi, tag="quantize_mx", api=api)
        _into(api, dst_scale[p0:p0 + rows.shape[0], 0:F4], part)


def nc_transpose(dst, data, engine=engine.unknown, name=None):
    """Partition <-> free transpose of ``data`` into ``dst`` (TensorE: <= 128x128, SBUF input,
    PSUM output; VectorE: <= 32x32). ``dst.dtype`` must equal ``data.dtype`` ("Data types")."""
    api = "nc_transpose"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, data, "data")
    _same_dtype(api, dst, "dst", data, "data", "; the output must have the input's dtype")
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
    """``dst = op(data * scale + bias)`` on ScalarE, with the stub's reduce semantics
    (nki.isa.activation pseudo code): ``reset``/``reset_reduce`` zero the ScalarE registers,
    ``reduce``/``reset_reduce`` add the row sums of the result onto them, ``idle`` leaves them
    alone, and ``reduce_res`` (a [P, 1] tile, optional) receives them whatever the command.
    ``reduce_op`` must be ``nl.add`` ("reduce_op must be nl.add"). ``bias`` may be a scalar
    from NeuronCore-v3 on, and of any dtype but tfloat32 ("Layout", "Data types")."""
    api = "activation"
    _need_tensor(api, dst, "dst")
    if reduce_op is not None:
        _op_is(api, reduce_op, "reduce_op", ("add",))
    r = _I._activation(api, op, data, bias, scale, reduce_op, reduce_res,
                       _cmd(api, reduce_cmd, (_RC.idle, _RC.reset, _RC.reduce,
                                              _RC.reset_reduce)),
                       None, dst.dtype, v07=True)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """``activation`` with ``reduce_cmd=reset_reduce`` (nki.isa.activation_reduce: "equivalent
    to calling nisa.activation with reduce_cmd=nisa.reduce_cmd.reset_reduce"); ``reduce_res``
    None keeps the result in the registers. NeuronCore-v2 reduces with add only."""
    api = "activation_reduce"
    _need_tensor(api, dst, "dst")
    if reduce_op is None:
        raise nki_error("err_operand_cannot_be_none", "value",
                        f"nisa.activation_reduce: 'reduce_op' cannot be None ({_doc(api)})")
    r = _I._activation(api, op, data, bias, scale, reduce_op, reduce_res, _RC.reset_reduce,
                       None, dst.dtype, v07=True)
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



def dma_compute(dst, srcs, reduce_op, scales=None, unique_indices=True,
                oob_mode=oob_mode.error, name=None):
    """``dst = reduce_op(srcs[0] * scales[0], ...)`` computed in fp32 by the DMA engines
    (new in 0.7): a static transfer, or a read-modify-write with one indirect
    (``.ap(vector_offset=...)``) side -- scatter ``dst(HBM)[indices] += src(SBUF)`` or gather
    ``dst(SBUF) += src(HBM)[indices]``. The stub's restrictions are enforced: ``nl.add`` only,
    every scale 1.0, at most 16 sources of ``dst``'s element count, HBM or SBUF operands, the
    RMW forms with exactly 2 sources and ``unique_indices=True`` (rows repeated in the indirect
    access refused). Semantics and cost: :mod:`simulate._dma_compute`."""
    api = "dma_compute"
    _need_tensor(api, dst, "dst")
    if not isinstance(srcs, (list, tuple)) or not srcs:
        raise TypeError(f"nisa.dma_compute: 'srcs' must be a non-empty list of NKI tensors, "
                        f"got {srcs!r} ({_doc(api)})")
    for i, s in enumerate(srcs):
        _need_tensor(api, s, f"srcs[{i}]")
    _op_is(api, reduce_op, "reduce_op", ("add",))
    if scales is not None:
        if len(scales) != len(srcs) or any(float(x) != 1.0 for x in scales):
            raise ValueError(f"nisa.dma_compute: 'scales' must be None or {len(srcs)} values "
                             f"all 1.0 (one per source), got {list(scales)!r} ({_doc(api)})")
    if not unique_indices:
        raise ValueError(f"nisa.dma_compute: unique_indices=False is not supported "
                         f"(non-unique scatter/gather indices); allowed: True ({_doc(api)})")

    def err(code, kind, message):
        return nki_error(code, kind, f"nisa.dma_compute: {message} ({_doc(api)})")

    _dma_compute.dma_compute(dst, list(srcs), skip_oob=int(oob_mode) == int(_OOB.skip),
                             err=err)


# -- DMA transpose ------------------------------------------------------------------------------
_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst, src, axes=None, priority=None, dge_mode=dge_mode.unknown,
                  oob_mode=oob_mode.error, name=None):
    """Transpose ``src`` (HBM or SBUF, 2-4 dims) into an SBUF ``dst`` on the DMA engines with
    the stub's fixed permutations (2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0)); ``src.dtype ==
    dst.dtype``. Direct transposes take ``dge_mode`` unknown or hwdge (hwdge: NeuronCore-v3+,
    2-byte dtype, ``src.shape[-1] <= 128``, 2-D ``src.shape[0] == 16``, 3-D/4-D
    ``src.shape[0]`` in {1, 2, 4, 8, 16} with ``src.shape[0] * src.shape[-2]`` a multiple of
    16). The indirect (swdge, ``.ap(vector_offset=...)``) form is not simulated."""
    api = "dma_transpose"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, src, "src")
    _buffer(api, dst, "dst", ("sbuf",))
    _buffer(api, src, "src", ("hbm", "sbuf"))
    _same_dtype(api, dst, "dst", src, "src", ": src.dtype == dst.dtype")
    _priority(api, priority)
    nd = src.ndim
    if nd in _TRANSPOSE_AXES and axes is not None and tuple(axes) != _TRANSPOSE_AXES[nd]:
        raise ValueError(f"nisa.dma_transpose: supported axes are (1, 0), (2, 1, 0) and "
                         f"(3, 1, 2, 0); for a {nd}-D src {_TRANSPOSE_AXES[nd]}, got "
                         f"{tuple(axes)} ({_doc(api)})")
    dm = _DGE(int(dge_mode))          # the parameter shadows the enum
    if dm in (_DGE.none, _DGE.swdge):
        raise hw_error("value",
                       f"nisa.dma_transpose: dge_mode.{dm.name} is not valid for a direct "
                       f"transpose (unknown or hwdge); swdge is the indirect (gather) "
                       f"transpose, which the simulator does not model ({_doc(api)})")
    if int(oob_mode) != 0:
        raise ValueError(f"nisa.dma_transpose: oob_mode.skip is only valid when src uses "
                         f"indirect indexing ({_doc(api)})")
    if dm == _DGE.hwdge:
        tgt = _runtime.current().tgt
        if not tgt.gen3_features:
            raise nki_error("err_min_arch_support_for_hwdge", "syntax",
                            f"nisa.dma_transpose: dge_mode.hwdge needs NeuronCore-v3 or newer; "
                            f"target is {tgt.name} ({_doc(api)})")
        sh = tuple(src.shape)
        ok = np.dtype(src.dtype).itemsize == 2 and sh[-1] <= 128
        if nd == 2:
            ok = ok and sh[0] == 16
        elif nd in (3, 4):
            ok = ok and sh[0] in (1, 2, 4, 8, 16) and (sh[0] * sh[-2]) % 16 == 0
        if not ok:
            raise hw_error("value",
                           f"nisa.dma_transpose: src {fmt_shape(sh)} {src.dtype} breaks the "
                           f"hwdge transpose constraints (2-byte dtype, src.shape[-1] <= 128; "
                           f"2-D: src.shape[0] == 16; 3-D/4-D: src.shape[0] in "
                           f"{{1, 2, 4, 8, 16}} and src.shape[0] * src.shape[-2] % 16 == 0) "
                           f"({_doc(api)})")
    r = _I.dma_transpose(src, axes=axes)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


_DGE = dge_mode
_OOB = oob_mode


# -- VectorE with accumulation registers --------------------------------------------------------
def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None,
                         reduce_res_negate=False, name=None):
    """``dst = data op0 operand0`` and ``reduce_op`` (add, multiply, max, min) of it over the
    free dims through the VectorE accumulation registers ("Accumulator behavior":
    reset_reduce starts at the op's identity, reduce continues, load_reduce starts at
    ``reduce_init``); ``reduce_res`` receives them (negated if ``reduce_res_negate``; the
    registers keep the sign). ``reverse0`` is "not supported yet" in the stub."""
    api = "tensor_scalar_reduce"
    _need_tensor(api, dst, "dst")
    _op_is(api, reduce_op, "reduce_op", ("add", "multiply", "maximum", "minimum"))
    c = _cmd(api, reduce_cmd, (_RC.reset_reduce, _RC.reduce, _RC.load_reduce))
    if reduce_res is not None:
        _need_tensor(api, reduce_res, "reduce_res")
        _buffer(api, reduce_res, "reduce_res", ("sbuf", "psum"))
    r = _I._tensor_scalar_reduce(data, op0, operand0, reduce_op, reduce_res, reverse0,
                                 dst.dtype, None, cmd=c, init=reduce_init,
                                 negate=reduce_res_negate)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                reduce_init=0.0, name=None):
    """``dst = exp(src - max_value)`` on VectorE, NeuronCore-v4 only ("Available only on
    NeuronCore-v4 and newer"; refused elsewhere); optional row sums through the VectorE
    accumulation registers (idle, reset_reduce, reduce, load_reduce from ``reduce_init``).
    Cost: ``_cost.vector_exp_cycles`` (4x ScalarE's exp throughput on trn3)."""
    api = "exponential"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, src, "src")
    _buffer(api, dst, "dst", ("sbuf", "psum"))
    _buffer(api, src, "src", ("sbuf", "psum"))
    _dtype_in(api, dst, "dst", _FLOATS[:4] + ("float8_e4m3", "float8_e4m3fn", "float8_e5m2",
                                              "int8", "int16", "int32", "uint8", "uint16"))
    _dtype_in(api, src, "src", _FLOATS[:3] + ("float8_e4m3", "float8_e4m3fn", "float8_e5m2",
                                              "int8", "int16", "int32", "uint8", "uint16",
                                              "uint32"))
    c = _cmd(api, reduce_cmd, (_RC.idle, _RC.reset_reduce, _RC.reduce, _RC.load_reduce))
    if reduce_res is not None:
        _need_tensor(api, reduce_res, "reduce_res")
        _buffer(api, reduce_res, "reduce_res", ("sbuf", "psum"))
        _dtype_in(api, reduce_res, "reduce_res", _FLOATS[:4] + ("float8_e4m3", "float8_e4m3fn",
                                                                "float8_e5m2"))
    if src.ndim > 4 or dst.ndim > 4:
        raise ValueError(f"nisa.exponential: src and dst are up to 4-D tensors ({_doc(api)})")
    r = _I._exponential(src, max_value, reduce_res, c, reduce_init, dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1,
                 reduce_cmd=reduce_cmd.reset_reduce, reduce_res=None, reduce_op=None,
                 range_start=0, on_false_value=..., name=None):
    """(NeuronCore-v3+) ``dst = on_true_tile`` where ``comp_op0(range_start + j, bound0)`` and
    ``comp_op1(range_start + j, bound1)`` hold along the free index j, else ``on_false_value``
    (FP32_MIN, the only value allowed); the max of each row goes through the VectorE
    registers (default ``reset_reduce``). ``on_true_tile`` of a float dtype, bounds float32."""
    api = "range_select"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, on_true_tile, "on_true_tile")
    _dtype_in(api, on_true_tile, "on_true_tile", _FLOATS, "a float dtype")
    for b, bn in ((bound0, "bound0"), (bound1, "bound1")):
        _need_tensor(api, b, bn)
        _dtype_in(api, b, bn, ("float32",))
    c = _cmd(api, reduce_cmd, (_RC.idle, _RC.reset, _RC.reduce, _RC.reset_reduce))
    if on_false_value is ...:
        on_false_value = _I.fp32.min
    r = _I.range_select(on_true_tile=on_true_tile, comp_op0=comp_op0, comp_op1=comp_op1,
                        bound0=bound0, bound1=bound1, reduce_cmd=c, reduce_res=reduce_res,
                        reduce_op=np.maximum if reduce_op is None else reduce_op,
                        range_start=range_start, on_false_value=on_false_value,
                        dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=None, reverse_pred=False, name=None):
    """``dst = where(predicate, on_true, on_false)`` on VectorE (written in place, as the legacy
    instruction does); with ``reduce_cmd`` reset_reduce/reduce the row max goes through the
    VectorE registers, ``reduce_res`` receives them. Stub constraints: ``on_true``, ``dst``
    and ``predicate`` of identical layout; ``predicate`` int8/uint8/int16/uint16; ``on_true``
    not tfloat32/int32/uint32; ``on_false`` a float32 scalar or a [P, 1] tile; ``reduce_res``
    [P, 1] of a float dtype; max only."""
    api = "select_reduce"
    for t, pn in ((dst, "dst"), (predicate, "predicate"), (on_true, "on_true")):
        _need_tensor(api, t, pn)
    _buffer(api, dst, "dst", ("sbuf", "psum"))
    P = dst.shape[0]
    F = _free(dst.shape)
    _rows(api, on_true, P, "on_true", F)
    _rows(api, predicate, P, "predicate", F)
    _dtype_in(api, predicate, "predicate", ("int8", "uint8", "int16", "uint16"))
    if reduce_res is not None:
        _need_tensor(api, reduce_res, "reduce_res")
        _rows(api, reduce_res, P, "reduce_res", 1)
        _dtype_in(api, reduce_res, "reduce_res", _FLOATS, "a float dtype")
    c = _cmd(api, reduce_cmd, (_RC.idle, _RC.reset, _RC.reduce, _RC.reset_reduce))
    _I.select_reduce(dst=dst, predicate=predicate, on_true=on_true, on_false=on_false,
                     reduce_res=reduce_res, reduce_cmd=c,
                     reduce_op=np.maximum if reduce_op is None else reduce_op,
                     reverse_pred=reverse_pred)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    """``dst[i] = src[i]`` where ``predicate[i]`` is non-zero (zero with ``reverse_pred``),
    ``dst`` unchanged elsewhere (VectorE, in place). Stub constraints: ``src`` (a tile or a
    scalar), ``dst`` and ``predicate`` of the same layout; ``predicate`` uint8/uint16/uint32;
    ``src.dtype == dst.dtype``; ``src`` and ``predicate`` not both in PSUM (legacy check)."""
    api = "tensor_copy_predicated"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, predicate, "predicate")
    _buffer(api, dst, "dst", ("sbuf", "psum"))
    P = dst.shape[0]
    F = _free(dst.shape)
    _rows(api, predicate, P, "predicate", F)
    _dtype_in(api, predicate, "predicate", ("uint8", "uint16", "uint32"))
    if isinstance(src, Tensor):
        _rows(api, src, P, "src", F)
        _same_dtype(api, src, "src", dst, "dst", ": they must share the data type")
    _I.tensor_copy_predicated(src=src, dst=dst, predicate=predicate, reverse_pred=reverse_pred)


# -- random numbers -----------------------------------------------------------------------------
def set_rng_seed(src_seeds, name=None):
    """Seed the PRNG that :func:`dropout` draws from with the 32-bit value of ``src_seeds``, a
    ``[1, 1]`` tensor in SBUF or PSUM (the stub: "Seed the pseudo random number generator
    (PRNG) inside the Vector Engine"). The legacy ``nl.random_seed``: the same generator,
    charged as it is (one instruction on VectorE)."""
    api = "set_rng_seed"
    _need_tensor(api, src_seeds, "src_seeds")
    _buffer(api, src_seeds, "src_seeds", ("sbuf", "psum"))
    if tuple(src_seeds.shape) != (1, 1) or src_seeds._st.di.name not in (
            "int32", "uint32", "float32"):
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.set_rng_seed: 'src_seeds' must be a [1, 1] tensor of a 32-bit "
                        f"value, got {fmt_shape(src_seeds.shape)} {src_seeds._st.di.name} "
                        f"({_doc(api)})")
    _L.random_seed(seed=src_seeds)


def dropout(dst, data, prob, name=None):
    """``dst = data`` with each element replaced by 0 with probability ``prob`` (a scalar, or a
    ``(data.shape[0], 1)`` tile of per-partition probabilities) on VectorE, drawn from the PRNG
    :func:`set_rng_seed` seeds; no rescale. ``dst.dtype`` must match ``data.dtype`` (stub). The
    legacy ``nisa.dropout``: the same draw and cost."""
    api = "dropout"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, data, "data")
    _same_dtype(api, dst, "dst", data, "data", ": the output data type must match the input's")
    r = _I.dropout(data, prob, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False,
                         reverse1=False, name=None):
    """``dst = (data op0 operand0) op1 operand1`` on VectorE; ``op0``/``op1`` arithmetic
    ("Bitvec operators are not supported"); ``operand0`` scalar or [P, 1]; ``operand1`` a tile
    of ``data``'s layout."""
    api = "scalar_tensor_tensor"
    _need_tensor(api, dst, "dst")
    for o, pn in ((op0, "op0"), (op1, "op1")):
        if _ops.binary_op(o, api, pn).kind != "arith":
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"nisa.scalar_tensor_tensor: '{pn}' must be an arithmetic operator "
                            f"({_doc(api)})")
    r = _I.scalar_tensor_tensor(data=data, op0=op0, operand0=operand0, op1=op1,
                                operand1=operand1, reverse0=reverse0, reverse1=reverse1,
                                dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False,
                       name=None):
    """Per partition: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])``, ``r[-1] = initial``
    (float32 scalar or [P, 1] tile); arithmetic ops; fp32 math, cast to ``dst.dtype``."""
    api = "tensor_tensor_scan"
    _need_tensor(api, dst, "dst")
    r = _I.tensor_tensor_scan(data0, data1, initial, op0, op1, reverse0, reverse1,
                              dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


# -- GpSimdE ------------------------------------------------------------------------------------
def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=None,
                  offset=0, name=None):
    """``dst = on_true_tile`` where ``cmp_op(offset + p * channel_multiplier + w*step_w + ...
    + x*step_x, 0)`` holds (default ``nl.equal``), else ``on_false_value`` (a float32 scalar);
    the pattern has 1 to 4 ``[step, num]`` pairs whose element count equals the elements per
    partition of ``dst`` and ``on_true_tile``; both in SBUF (GpSimdE)."""
    api = "affine_select"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, on_true_tile, "on_true_tile")
    _buffer(api, dst, "dst", ("sbuf",))
    _buffer(api, on_true_tile, "on_true_tile", ("sbuf",))
    if isinstance(on_false_value, Tensor) or not isinstance(
            on_false_value, (bool, int, float, np.number)):
        raise TypeError(f"nisa.affine_select: 'on_false_value' must be a float32 scalar "
                        f"({_doc(api)})")
    o = _ops.binary_op(np.equal if cmp_op is None else cmp_op, api, "cmp_op")
    if o.kind != "cmp":
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"nisa.affine_select: 'cmp_op' must be a comparison, got {o.name} "
                        f"({_doc(api)})")
    pat = [(int(st), int(n)) for st, n in pattern]
    if not 1 <= len(pat) <= 4:
        raise ValueError(f"nisa.affine_select: pattern has 1 to 4 [step, num] pairs "
                         f"({_doc(api)})")
    P = dst.shape[0]
    F = int(np.prod([n for _, n in pat]))
    _rows(api, on_true_tile, P, "on_true_tile")
    if F != _free(dst.shape) or F != _free(on_true_tile.shape):
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.affine_select: pattern {pattern} has {F} elements but 'dst' "
                        f"{fmt_shape(dst.shape)} / 'on_true_tile' "
                        f"{fmt_shape(on_true_tile.shape)} have {_free(dst.shape)} / "
                        f"{_free(on_true_tile.shape)} per partition ({_doc(api)})")
    val = np.full((P, 1), int(offset), np.int64) + \
        np.arange(P, dtype=np.int64)[:, None] * int(channel_multiplier)
    for step, n in pat:                       # row-major over the pattern dims
        val = (val[:, :, None] + np.arange(n, dtype=np.int64)[None, None, :] * step)
        val = val.reshape(P, -1)
    val = val.astype(np.int32)                # int32 affine arithmetic
    p = np.asarray(o.fn(val, 0), bool).reshape(on_true_tile.shape)
    ctx = _runtime.enter()
    a, di = _tensor.tile_operand(on_true_tile, api, "on_true_tile")
    r = _I._affine_select(ctx, api, p, a, di, on_true_tile, on_false_value, dst.dtype, None)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


# -- VectorE statistics and top-8 ---------------------------------------------------------------
def bn_stats(dst, data, name=None):
    """Per partition (<= 512 elements): [count, mean, var*count] of the even-indexed elements,
    then of the odd-indexed ones; ``dst`` holds 6 elements per partition."""
    api = "bn_stats"
    _need_tensor(api, dst, "dst")
    r = _I.bn_stats(data, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def bn_aggr(dst, data, name=None):
    """Aggregate bn_stats outputs (3k elements per partition) into [mean, variance]; ``dst``
    holds 2 elements per partition."""
    api = "bn_aggr"
    _need_tensor(api, dst, "dst")
    r = _I.bn_aggr(data, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


def _dst_p8(api, dst, P):
    if dst.ndim != 2 or tuple(dst.shape) != (P, 8):
        raise nki_error("err_param_shape_mismatch", "value",
                        f"nisa.{api}: 'dst' {fmt_shape(dst.shape)} must be a 2-D [{P}, 8] tile "
                        f"({_doc(api)})")


def max8(dst, src, name=None):
    """The 8 largest values of each partition (8 to 16384 elements, up to 3-D ``src``) in
    descending order into a 2-D [P, 8] ``dst``."""
    api = "max8"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, src, "src")
    if src.ndim > 3:
        raise ValueError(f"nisa.max8: 'src' is up to 3-dimensional ({_doc(api)})")
    _dst_p8(api, dst, src.shape[0])
    _into(api, dst, _I.max8(src=src, dtype=dst.dtype))


def nc_find_index8(dst, data, vals, name=None):
    """Index of each of the 8 ``vals`` per partition in ``data`` (a value repeated in ``vals``
    takes the next occurrence); absent values give the all-ones sentinel of ``dst``'s dtype
    (uint16 or uint32, [P, 8], 2-D)."""
    api = "nc_find_index8"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, data, "data")
    _dst_p8(api, dst, data.shape[0])
    _dtype_in(api, dst, "dst", ("uint16", "uint32"))
    if data.ndim > 3 or vals.ndim > 3:
        raise ValueError(f"nisa.nc_find_index8: 'data' and 'vals' are up to 3-dimensional "
                         f"({_doc(api)})")
    _I._elems_check(api, "data", data)
    _into(api, dst, _I.nc_find_index8(data=data, vals=vals, dtype=dst.dtype))


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """``dst`` = ``data`` with the first occurrence of each of the 8 ``vals`` replaced by
    ``imm`` (``vals`` processed last to first); ``dst_idx`` receives the matched indices."""
    api = "nc_match_replace8"
    _need_tensor(api, dst, "dst")
    r = _I.nc_match_replace8(data=data, vals=vals, imm=imm, dst_idx=dst_idx, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


# -- cross-partition ----------------------------------------------------------------------------
def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Within each 32-partition quadrant ``dst[i] = src[shuffle_mask[i]]`` (255: unchanged),
    in place on ``dst`` (VectorE). Stub constraints: same dtype and same elements per
    partition for ``src`` and ``dst``."""
    api = "nc_stream_shuffle"
    _need_tensor(api, dst, "dst")
    _need_tensor(api, src, "src")
    _same_dtype(api, dst, "dst", src, "src")
    _I.nc_stream_shuffle(src, dst, shuffle_mask)


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce ``data`` across partitions into a 1-partition ``dst`` (GpSimdE): add, max,
    bitwise_or, bitwise_and (the stub's ``average`` is not simulated)."""
    api = "tensor_partition_reduce"
    _need_tensor(api, dst, "dst")
    r = _I.tensor_partition_reduce(op, data, dtype=dst.dtype)
    _same_layout(api, dst, r.shape)
    _into(api, dst, r)


# -- virtual registers --------------------------------------------------------------------------
# nki.isa.register_alloc / register_move / register_load / register_store (2.33 stub): 32-bit
# registers of the engine sequencers, used as fori_loop / while_loop bounds and runtime
# offsets. Values and the tracer's refusals live in simulate._scalar (VirtualRegister). The
# instructions run on the sequencers; the simulator charges them no engine time and does not
# count them in the program size (UNCONFIRMED: no cost is documented).
VirtualRegister = _scalar.VirtualRegister


def register_alloc(x=None):
    """A new virtual register, uninitialized (``None``) or holding the int ``x``."""
    _runtime.current()
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, np.integer))):
        raise TypeError(f"nisa.register_alloc: x must be None or an int, got "
                        f"{type(x).__name__} ({_doc('register_alloc')})")
    return VirtualRegister(x)


def _need_reg(api, r, pname):
    if not isinstance(r, VirtualRegister):
        raise TypeError(f"nisa.{api}: '{pname}' must be a VirtualRegister (nisa.register_alloc)"
                        f", got {type(r).__name__} ({_doc(api)})")


def register_move(dst, src):
    """``dst = src``: a compile-time int or another register."""
    api = "register_move"
    _runtime.current()
    _need_reg(api, dst, "dst")
    if isinstance(src, VirtualRegister):
        if not src.initialized:
            raise ValueError(f"nisa.register_move: 'src' register was never written "
                             f"({_doc(api)})")
    elif isinstance(src, bool) or not isinstance(src, (int, np.integer)):
        raise TypeError(f"nisa.register_move: 'src' must be an int or a VirtualRegister, got "
                        f"{type(src).__name__} ({_doc(api)})")
    dst.set(src)


def register_load(dst, src):
    """Load the single (<= 32-bit) element of ``src`` (HBM or SBUF) into the register ``dst``."""
    api = "register_load"
    _runtime.current()
    _need_reg(api, dst, "dst")
    _need_tensor(api, src, "src")
    _buffer(api, src, "src", ("hbm", "sbuf"))
    if np.dtype(src.dtype).itemsize > 4:
        raise TypeError(f"nisa.register_load: 'src' holds a {src.dtype}; registers are 32-bit "
                        f"({_doc(api)})")
    _scalar.register_load(dst, src)


def register_store(dst, src):
    """Store the register ``src`` into the single element of ``dst`` (HBM or SBUF)."""
    api = "register_store"
    ctx = _runtime.current()
    _need_reg(api, src, "src")
    _need_tensor(api, dst, "dst")
    _buffer(api, dst, "dst", ("hbm", "sbuf"))
    if not src.initialized:
        raise ValueError(f"nisa.register_store: 'src' register was never written ({_doc(api)})")
    if ctx.loops:
        _deps.note_write(ctx, dst, None)
    _scalar.store_value(dst, src, api)
    dst._st.written = True


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "np", "enum",
                                                                   "nki_error", "hw_error",
                                                                   "fmt_shape",
                                                                   "Tensor", "DOC_ISA")]
