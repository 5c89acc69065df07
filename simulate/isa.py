"""``neuronxcc.nki.isa`` (``nisa``) on the CPU: one function per hardware instruction.

Common rules (spec §9): operands are SBUF/PSUM tiles (never HBM), all tile operands of one
instruction have the same partition count (err_num_partition_mismatch) and element-wise
instructions the same elements per partition (no broadcasting); arithmetic is fp32 with
rounding to the output dtype; results are new tiles (SBUF, or PSUM for TensorE) unless assigned
into an existing tensor; ``mask=`` as in spec §5. Each call charges its engine per the cost
table in ``_cost``.
"""

from __future__ import annotations

import enum

import numpy as np

from . import _cost, _deps, _dma, _dtypes, _hw, _ops, _sched, _strict, _tensor
from ._dtypes import F32
from ._errors import nki_error, hw_error, fmt_shape
from ._strict import INT_TYPES
from ._index import IndexExpr, Predicate, eval_mask
from ._runtime import enter, current
from ._tensor import (Tensor, tile_operand, make_result, check_partitions, SBUF, PSUM,
                      HBM, SHARED_HBM, fit_value)
from ._ops import free_size as _free, to_f32 as _f32

_HBMS = (HBM, SHARED_HBM)


# =============================================================================================
# enums and constants (spec §9 preamble, §7.5)
# =============================================================================================
class nc_version(enum.IntEnum):
    """NeuronCore generation: gen2 = trn1/inf2, gen3 = trn2."""
    gen2 = 2
    gen3 = 3


class engine(enum.IntEnum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    vector = 5
    sync = 6


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
dma_engine = engine.sync
unknown_engine = engine.unknown


class reduce_cmd(enum.IntEnum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3


class oob_mode(enum.IntEnum):
    error = 0
    skip = 1


class dge_mode(enum.IntEnum):
    none = 0
    swdge = 1
    hwdge = 2
    unknown = 3


class _FP32:
    min = np.float32(_hw.FP32_MIN)
    max = np.float32(-_hw.FP32_MIN)


fp32 = _FP32()


def get_nc_version():
    """``nc_version.gen2`` on trn1/inf2, ``nc_version.gen3`` on trn2 (inside a kernel)."""
    return nc_version(current().tgt.nc_version)


def _engine_name(e, default):
    if e is None:
        return default
    try:
        e = engine(int(e))
    except (ValueError, TypeError):
        raise ValueError(f"unknown engine {e!r}") from None
    return {engine.unknown: default, engine.vector: "vector", engine.scalar: "scalar",
            engine.gpsimd: "gpsimd", engine.tensor: "tensor", engine.sync: "dma"}[e]


def _require_gen3(ctx, api):
    if not ctx.tgt.gen3_features:
        raise nki_error("err_min_arch_support_for_inst", "syntax",
                        f"'{api}' requires min target trn2 (NeuronCore-v3 / gen3); current target "
                        f"is {ctx.tgt.name}")


# =============================================================================================
# operand helpers
# =============================================================================================
def _pmismatch(api, **tiles):
    ps = {k: (t.shape[0] if t.ndim else 1) for k, t in tiles.items() if isinstance(t, Tensor)}
    if len(set(ps.values())) > 1:
        desc = ", ".join(f"{k}{fmt_shape(tiles[k].shape)}" for k in ps)
        raise nki_error("err_num_partition_mismatch", "value",
                        f"number of partitions (dimension 0 size of a tile) mismatch in "
                        f"parameters ({desc}) of '{api}'")


def _same_elems(api, a, b, an, bn):
    if _free(a.shape) != _free(b.shape):
        raise nki_error("err_param_shape_mismatch", "value",
                        f"Parameter shapes ({an}{fmt_shape(a.shape)}, {bn}{fmt_shape(b.shape)}) "
                        f"of '{api}' have mismatched shapes: the number of elements per "
                        "partition must be equal")


def _pvec(x, P, api, pname, nd):
    """A per-partition operand: scalar, or a (P, 1) / (P,) tile. Returns fp32 broadcastable."""
    if isinstance(x, Tensor):
        a, di = tile_operand(x, api, pname)
        if (x.shape[0] if x.ndim else 1) != P:
            raise nki_error("err_num_partition_mismatch", "value",
                            f"number of partitions (dimension 0 size of a tile) mismatch in "
                            f"parameters ({pname}{fmt_shape(x.shape)}) of '{api}' (expected {P})")
        if _free(x.shape) != 1:
            raise nki_error("err_param_shape_mismatch", "value",
                            f"'{pname}' of '{api}' must be a scalar or a [{P}, 1] vector, got "
                            f"{fmt_shape(x.shape)}")
        return _f32(a).reshape((P,) + (1,) * (nd - 1)), di
    _strict.refuse_scalar_operand(x)
    if isinstance(x, (bool, int, float, np.number)):
        return np.float32(x), _dtypes.weak_scalar_info(x)
    raise TypeError(f"'{pname}' of '{api}' must be a scalar or a tile, got {type(x).__name__}")


def _sbuf_only(t, api, pname):
    if t._st.buffer != SBUF:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand '{pname}' of '{api}' to be in address space 'sbuf', "
                        f"but got a tile in '{t._st.buffer}' instead.")


def _not_both_psum(api, a, b, an, bn):
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a._st.buffer == PSUM \
            and b._st.buffer == PSUM:
        raise nki_error("err_unsupported_memory", "type",
                        f"operands '{an}' and '{bn}' of '{api}' cannot both be in 'psum'")


def _accum_write(reg, P, vals, cmd, op_fn, ident):
    """ScalarE/VectorE accumulation registers (spec §9.3 / §9.20)."""
    cmd = reduce_cmd(int(cmd))
    r = reg[:P]
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        r[...] = ident
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        r[...] = op_fn(r, vals)


def _write_reg(ctx, reduce_res, reg, P, api):
    if reduce_res is None:
        return
    if not isinstance(reduce_res, Tensor):
        raise TypeError(f"'reduce_res' of '{api}' must be a tile")
    if reduce_res._st.buffer in _HBMS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'reduce_res' of '{api}' to be in address space "
                        f"'psum|sbuf', but got a tile in 'hbm' instead.")
    if (reduce_res.shape[0] if reduce_res.ndim else 1) != P or _free(reduce_res.shape) != 1:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"'reduce_res' of '{api}' must be a [{P}, 1] tile, got "
                        f"{fmt_shape(reduce_res.shape)}")
    di = reduce_res._st.di
    if ctx.loops:
        _deps.note_write(ctx, reduce_res, None)
    reduce_res._write(di.round(reg[:P].copy()).reshape(reduce_res.shape))
    reduce_res._st.written = True


# =============================================================================================
# TensorE
# =============================================================================================
def _size_err(api, pname, shape, d, lim):
    return nki_error("err_size_of_dimension_exceed_arch_limit", "value",
                     f"size of dimension {d} in '{pname}{fmt_shape(shape)}' of '{api}' exceed "
                     f"architecture limitation of {lim}")


def nc_matmul(stationary, moving, *, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, tile_position=(), tile_size=(), mask=None, perf_mode=None,
              **kwargs):
    """``stationary.T @ moving`` on TensorE: stationary [K<=128, M<=128], moving [K, N<=512],
    both in SBUF; result [M, N] fp32 in PSUM (``psum += nisa.nc_matmul(...)`` accumulates).
    ``perf_mode='double_row_gen3'`` (trn2, fp8): operands [K, 2, M] / [K, 2, N]."""
    ctx = enter()
    api = "nc_matmul"
    sa, sdi = tile_operand(stationary, api, "stationary")
    ma, mdi = tile_operand(moving, api, "moving")
    _sbuf_only(stationary, api, "stationary")
    _sbuf_only(moving, api, "moving")
    K = stationary.shape[0]
    Km = moving.shape[0]
    if Km != K:
        raise nki_error("err_param_shape_incompatible_with_matmul", "value",
                        f"incompatible shapes for '{api}': stationary{fmt_shape(stationary.shape)}"
                        f" and moving{fmt_shape(moving.shape)}: contraction (partition) "
                        f"dimensions {K} and {Km} differ")
    double = perf_mode is not None and str(perf_mode) not in ("none", "None", "")
    if double:
        if str(perf_mode) != "double_row_gen3":
            raise ValueError(f"unknown perf_mode {perf_mode!r}")
        _require_gen3(ctx, "nc_matmul(perf_mode='double_row_gen3')")
        if sdi.name not in ("float8_e4m3", "float8_e5m2") or \
                mdi.name not in ("float8_e4m3", "float8_e5m2"):
            raise hw_error("type", "The double_row matmult only support fp8e4m3 and fp8e5m2")
        if stationary.ndim != 3 or moving.ndim != 3 or stationary.shape[1] != 2 \
                or moving.shape[1] != 2:
            raise ValueError("double_row_gen3 operands must be shaped [K, 2, M] and [K, 2, N]")
        M, N = stationary.shape[2], moving.shape[2]
        s2 = _f32(sa).reshape(K * 2, M)
        m2 = _f32(ma).reshape(K * 2, N)
        oshape = (M, N)
    else:
        M = _free(stationary.shape)
        N = _free(moving.shape)
        s2 = _f32(sa).reshape(K, M)
        m2 = _f32(ma).reshape(K, N)
        oshape = (M,) + tuple(moving.shape[1:]) if moving.ndim > 1 else (M,)
    if M > _hw.GEMM_STATIONARY_FMAX:
        raise _size_err(api, "stationary", stationary.shape, 1, _hw.GEMM_STATIONARY_FMAX)
    if N > _hw.GEMM_MOVING_FMAX:
        raise _size_err(api, "moving", moving.shape, 1, _hw.GEMM_MOVING_FMAX)
    if tile_position or tile_size:
        _check_pe_tiling(ctx, tile_position, tile_size, K, M)
    res = np.matmul(s2.T, m2)
    if res.shape != oshape:
        res = res.reshape(oshape)
    fp32in = sdi is F32 or mdi is F32
    cyc = _cost.matmul_cycles(M, N, fp32in)
    if fp32in and (is_stationary_onezero or is_moving_onezero):
        cyc //= 2                     # "up to 2x faster for fp32 0/1 operands"
    ctx.rec.add("tensor", cyc)
    if is_transpose:
        odi = sdi if (ctx.tgt.gen3_features and sdi.itemsize == 2) else F32
        tag = "pe_transpose"
        if odi is not F32:
            res = odi.round(res)
    else:
        odi, tag = F32, "matmul"
    return make_result(ctx, res, odi, eval_mask(mask, oshape), tag=tag, buffer=PSUM, api=api,
                       rounded=True)


def _check_pe_tiling(ctx, tile_position, tile_size, K, M):
    if not tile_position or not tile_size:
        raise ValueError("nc_matmul: tile_position and tile_size must be given together")
    g = _hw.PE_TILE_GRANULE
    vals = [int(v) for v in tuple(tile_position) + tuple(tile_size)]
    if len(vals) != 4 or any(v % g for v in vals):
        raise ValueError(f"nc_matmul: tile_position and tile_size must be (row, col) pairs of "
                         f"multiples of {g}, got {tile_position}, {tile_size}")
    r, c, rs, cs = vals
    if rs < K or cs < M:
        raise ValueError(f"nc_matmul: tile_size {tuple(tile_size)} is smaller than the "
                         f"stationary access [{K}, {M}]")
    if r + rs > _hw.NUM_PARTITIONS or c + cs > _hw.GEMM_STATIONARY_FMAX:
        raise ValueError(f"nc_matmul: tile at {tuple(tile_position)} of size {tuple(tile_size)} "
                         "does not fit the 128x128 PE array")
    if not ctx.tgt.gen3_features and rs == g and cs == g:
        raise ValueError("nc_matmul: on NeuronCore-v2 a PE tile cannot be 32 in both row and "
                         "column size")


def nc_transpose(data, *, mask=None, dtype=None, engine=None, **kwargs):
    """Partition<->free 2-D transpose (free dims flattened). TensorE: <= 128x128, SBUF input,
    result in PSUM (on trn1 NaN/Inf smear like the identity matmul it is); VectorE: <= 32x32.
    Default engine: VectorE when both dims <= 32, else TensorE."""
    ctx = enter()
    api = "nc_transpose"
    a, di = tile_operand(data, api, "data")
    P = data.shape[0] if data.ndim else 1
    F = _free(data.shape)
    eng = _engine_name(engine, "vector" if (P <= _hw.VECTOR_TRANSPOSE_MAX
                                            and F <= _hw.VECTOR_TRANSPOSE_MAX) else "tensor")
    a2 = a.reshape(P, F)
    odi = _ops.out_info(dtype, di)
    if eng == "tensor":
        if P > _hw.PE_TRANSPOSE_MAX or F > _hw.PE_TRANSPOSE_MAX:
            raise _size_err(api, "data", data.shape, 0 if P > _hw.PE_TRANSPOSE_MAX else 1,
                            _hw.PE_TRANSPOSE_MAX)
        _sbuf_only(data, api, "data")
        af = _f32(a2)
        if not ctx.tgt.gen3_features and di.is_float and not np.isfinite(af).all():
            res = np.matmul(af.T, np.eye(P, dtype=np.float32))   # v2: NaN/Inf smear
        else:
            res = np.array(af.T, copy=True)
        factor = (2 if ctx.tgt.gen3_features else _hw.MM_FP32_FACTOR) if di is F32 else 1
        ctx.rec.add("tensor", _cost.pe_transpose_cycles(P, F) * factor)
        res = odi.round(res) if odi.is_float else odi.round(res)
        # with the engine left to the compiler, an SBUF destination is legal: neuronx-cc routes
        # the TensorE result through PSUM and copies it out (AWS SD-attention kernels assign
        # nc_transpose(128x128) into SBUF tiles); _tensor.assign charges that copy
        if engine is not None and engine != unknown_engine:
            return make_result(ctx, res, odi, eval_mask(mask, res.shape), tag="pe_transpose",
                               buffer=PSUM, api=api, rounded=True)
        # a temporary of an engine-unspecified transpose is an SBUF tile (the consumer may be a
        # matmul operand, AWS flash_attn_bwd); its PSUM -> SBUF copy is charged when it is
        # used as such (_runtime.commit) or assigned into SBUF, not when assigned into PSUM
        t = make_result(ctx, res, odi, eval_mask(mask, res.shape), tag="pe_transpose_auto",
                        buffer=SBUF, api=api, rounded=True)
        t._st.copy_out = _cost.tensor_scalar_cycles(ctx.tgt, F if P else 0, True, False,
                                                    False, odi.itemsize == 2)
        return t
    if eng != "vector":
        raise ValueError(f"nc_transpose runs on the tensor or vector engine, not {eng}")
    if P > _hw.VECTOR_TRANSPOSE_MAX or F > _hw.VECTOR_TRANSPOSE_MAX:
        raise _size_err(api, "data", data.shape, 0 if P > _hw.VECTOR_TRANSPOSE_MAX else 1,
                        _hw.VECTOR_TRANSPOSE_MAX)
    res = np.array(a2.T, copy=True)
    res = odi.round(_f32(res)) if odi is not di else res
    ctx.rec.add("vector", _cost.ii(F))
    return make_result(ctx, res, odi, eval_mask(mask, res.shape), api=api, rounded=True)


# =============================================================================================
# ScalarE
# =============================================================================================
def _act_fn(op, api):
    name = _ops.op_name(op, api)
    if name == "identity":
        name = "copy"
    if name not in _ops.ACTIVATION_NAMES or name not in _ops.UNARY:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"{name} is not supported in '{api}'")
    return _ops.UNARY[name][0]


def _act_scale(scale, P, api, nd):
    if isinstance(scale, Tensor):
        if scale._st.di is not F32:
            raise nki_error("err_activation_scale_invalid_type", "type",
                            f"'scale' param of '{api}' must be a scalar or vector of type float32, "
                            f"got '{scale._st.di.name}'")
        if (scale.shape[0] if scale.ndim else 1) != P or _free(scale.shape) != 1:
            raise nki_error("err_activation_scale_scalar_or_vector", "syntax",
                            f"'scale' param of '{api}' can only be a scalar or a vector in "
                            f"partition dimension, scale.shape={fmt_shape(scale.shape)}")
        a, _ = tile_operand(scale, api, "scale")
        return _f32(a).reshape((P,) + (1,) * (nd - 1))
    _strict.refuse_scalar_operand(scale)
    if isinstance(scale, (bool, int, float, np.number)):
        return np.float32(scale)
    raise nki_error("err_activation_scale_invalid_type", "type",
                    f"'scale' param of '{api}' must be a scalar or vector of type float32, got "
                    f"'{type(scale).__name__}'")


_BIAS_OK = ("float32", "float16", "bfloat16")


def _act_bias(bias, P, api, nd, v07=None):
    """``v07`` (the nki.* front end passes its target): the NKI 0.7 rules of
    nki.isa.activation -- a compile-time scalar bias from NeuronCore-v3 on, and any dtype but
    tfloat32 ("Data types", "Layout")."""
    if bias is None:
        return None
    if v07 is not None and not isinstance(bias, Tensor):
        _strict.refuse_scalar_operand(bias)
        if isinstance(bias, (bool, int, float, np.number)):
            if not v07.gen3_features:
                raise nki_error("err_activation_bias_invalid_type", "type",
                                f"'bias' param of '{api}' must be a [{P}, 1] vector on "
                                f"{v07.name} (NeuronCore-v2); a scalar bias needs "
                                "NeuronCore-v3 or newer")
            return np.float32(bias)
    if not isinstance(bias, Tensor):
        raise nki_error("err_activation_bias_invalid_type", "type",
                        f"'bias' param of '{api}' must be a vector of type float32, float16, or "
                        f"bfloat16, got '{type(bias).__name__}'")
    if v07 is not None:
        if bias._st.di.name == "tfloat32":
            raise nki_error("err_activation_bias_invalid_type", "type",
                            f"'bias' param of '{api}' can be any dtype except tfloat32")
    elif bias._st.di.name not in _BIAS_OK:
        raise nki_error("err_activation_bias_invalid_type", "type",
                        f"'bias' param of '{api}' must be a vector of type float32, float16, or "
                        f"bfloat16, got '{bias._st.di.name}'")
    a, _ = tile_operand(bias, api, "bias")
    if (bias.shape[0] if bias.ndim else 1) != P or _free(bias.shape) != 1:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"'bias' param of '{api}' must be a [{P}, 1] vector, got "
                        f"{fmt_shape(bias.shape)}")
    return _f32(a).reshape((P,) + (1,) * (nd - 1))


_ACT_REDUCE = {"add": np.add, "maximum": np.maximum, "minimum": np.minimum,
               "multiply": np.multiply}
_ACT_IDENT = {"add": 0.0, "maximum": -np.inf, "minimum": np.inf, "multiply": 1.0}


def activation(op, data, *, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, mask=None, dtype=None, **kwargs):
    """``op(data * scale + bias)`` on ScalarE (fp32). ``scale``: scalar or fp32 [P, 1] tile;
    ``bias``: [P, 1] fp32/fp16/bf16 tile. With ``reduce_op``/``reduce_cmd`` the per-partition
    reduction of the result over all free dims goes to the ScalarE accumulation registers
    (reset / reduce / reset_reduce) and, if ``reduce_res`` is given, into it. A ``reduce_res``
    with the default ``reduce_cmd=idle`` behaves as ``reset_reduce`` (simulator choice)."""
    return _activation("activation", op, data, bias, scale, reduce_op, reduce_res, reduce_cmd,
                       mask, dtype)


def _activation(api, op, data, bias, scale, reduce_op, reduce_res, cmd, mask, dtype,
                v07=False):
    """``v07``: the NKI 0.7 rules of nki.isa.activation / activation_reduce (the nki.* front
    end): scalar or any-dtype bias (``_act_bias``), and ``reduce_cmd`` exactly as the stub's
    pseudo code -- ``idle`` leaves the registers alone and ``reduce_res`` reads them out
    whatever the command (the legacy front end treats a ``reduce_res`` with ``idle`` as
    ``reset_reduce``)."""
    ctx = enter()
    fn = _act_fn(op, api)
    a, di = tile_operand(data, api, "data")
    P = data.shape[0] if data.ndim else 1
    nd = max(data.ndim, 1)
    sc = _act_scale(scale, P, api, nd)
    bi = _act_bias(bias, P, api, nd, ctx.tgt if v07 else None)
    if bi is not None and fn is _ops.UNARY["reciprocal"][0] and not ctx.tgt.gen3_features:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"reciprocal with a bias is not supported in '{api}' on "
                        f"{ctx.tgt.name} (NeuronCore-v2)")
    x = _f32(a)
    if not (isinstance(sc, np.float32) and sc == 1.0):
        x = x * sc
        if bi is not None:
            x += bi                      # in place: x is already a fresh array
    elif bi is not None:
        x = x + bi
    if fn is np.exp or fn is np.tanh:
        res = fn(x, out=x) if x is not a else fn(x)
    else:
        res = np.asarray(fn(x), dtype=np.float32)
    if res is a:
        res = res.copy()
    m = eval_mask(mask, data.shape)
    odi = _ops.out_info(dtype, di)
    if v07:
        return _activation_v07(ctx, api, res, data, reduce_op, reduce_res, cmd, m, odi)
    do_reduce = reduce_op is not None and (int(cmd) != 0 or reduce_res is not None)
    if do_reduce:
        rname = _act_reduce_fn(ctx, api, reduce_op)
        red_src = res.reshape(P, -1)
        ident = _ACT_IDENT[rname]
        if isinstance(m, np.ndarray):
            red_src = np.where(m.reshape(P, -1), red_src, np.float32(ident))
        elif m is False:
            red_src = np.full((P, 1), ident, np.float32)
        red = _ACT_REDUCE[rname].reduce(red_src, axis=1).astype(np.float32)
        eff = reduce_cmd.reset_reduce if int(cmd) == 0 else cmd
        _accum_write(ctx.act_acc, P, red, eff, _ACT_REDUCE[rname], ident)
        _write_reg(ctx, reduce_res, ctx.act_acc, P, api)
    elif int(cmd) == int(reduce_cmd.reset):
        ctx.act_acc[:P] = 0
    # the readout into reduce_res is what costs (nki.isa.activation: "no further performance
    # penalty ... except reading out reduce_regs into reduce_res"); a chain of reductions into
    # the registers pays it once. A reduce_res with idle behaves as reset_reduce (above)
    _cost.charge(ctx, "scalar",
                 lambda k: _cost.act_cycles(k, reduce=do_reduce and reduce_res is not None),
                 _free(data.shape))
    return make_result(ctx, res, odi, m, api=api)


def _act_reduce_fn(ctx, api, reduce_op):
    rname = _ops.op_name(reduce_op, api, "reduce_op")
    if rname not in _ACT_REDUCE:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"{rname} is not supported in '{api}' ('reduce_op')")
    if rname != "add" and not ctx.tgt.gen3_features:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"{rname} is not supported in '{api}' ('reduce_op') on "
                        f"{ctx.tgt.name}: NeuronCore-v2 only supports add")
    return rname


def _activation_v07(ctx, api, res, data, reduce_op, reduce_res, cmd, m, odi):
    """The reduce part of NKI 0.7's activation (stub pseudo code): reset/reset_reduce zero the
    ScalarE registers, reduce/reset_reduce accumulate ``reduce_op`` of the activated data over
    the free dims, ``reduce_res`` (if given) receives the registers."""
    P = data.shape[0] if data.ndim else 1
    c = int(cmd)
    if c not in (0, 1, 2, 3):
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"reduce_cmd {cmd!r} is not supported in '{api}' (idle, reset, reduce, "
                        "reset_reduce)")
    accumulate = c in (2, 3)
    if accumulate and reduce_op is None:
        raise nki_error("err_operand_cannot_be_none", "value",
                        f"'{api}': reduce_cmd {cmd!r} needs a 'reduce_op'")
    rname = _act_reduce_fn(ctx, api, reduce_op) if reduce_op is not None else "add"
    ident = _ACT_IDENT[rname]
    if c in (1, 3):
        ctx.act_acc[:P] = ident           # zero for add, the stub's only documented reduce_op
    if accumulate:
        red_src = res.reshape(P, -1)
        if isinstance(m, np.ndarray):
            red_src = np.where(m.reshape(P, -1), red_src, np.float32(ident))
        elif m is False:
            red_src = np.full((P, 1), ident, np.float32)
        red = _ACT_REDUCE[rname].reduce(red_src, axis=1).astype(np.float32)
        ctx.act_acc[:P] = _ACT_REDUCE[rname](ctx.act_acc[:P], red)
    _write_reg(ctx, reduce_res, ctx.act_acc, P, api)
    # only the readout into reduce_res costs (the stub: "no further performance penalty ...
    # except reading out reduce_regs into reduce_res", an extra instruction)
    _cost.charge(ctx, "scalar", lambda k: _cost.act_cycles(k, reduce=reduce_res is not None),
                 _free(data.shape))
    return make_result(ctx, res, odi, m, api=api)


def activation_reduce(op, data, *, reduce_op, reduce_res, bias=None, scale=1.0, mask=None,
                      dtype=None, **kwargs):
    """``activation`` + per-partition ``reduce_op`` (add on trn1) of the result over all free
    dims, written into ``reduce_res`` ([P, 1], in place). Costs activation + 64 cycles."""
    if reduce_res is None:
        raise nki_error("err_operand_cannot_be_none", "value", "'reduce_res' cannot be None.")
    return _activation("activation_reduce", op, data, bias, scale, reduce_op, reduce_res,
                       reduce_cmd.reset_reduce, mask, dtype)


def _exponential(src, max_value, reduce_res, cmd, init, dtype):
    """NKI 0.7 ``nisa.exponential`` (NeuronCore-v4 VectorE; no legacy ``neuronxcc.nki``
    counterpart, so its semantics live here for the nki.* front end): ``exp(src - max_value)``
    in fp32, ``max_value`` a scalar or fp32 [P, 1]; ``reduce_cmd`` reset_reduce / reduce /
    load_reduce (from ``init``) adds the row sums onto the VectorE accumulation registers, idle
    leaves them alone; ``reduce_res`` receives them. Cost: ``_cost.vector_exp_cycles``."""
    ctx = enter()
    api = "exponential"
    tgt = ctx.tgt
    if not tgt.vector_exp_speedup:
        raise nki_error("err_min_arch_support_for_inst", "syntax",
                        f"'{api}' is available only on NeuronCore-v4 and newer (trn3); current "
                        f"target is {tgt.name} (NeuronCore-v{tgt.nc_version})")
    a, di = tile_operand(src, api, "src")
    P = src.shape[0] if src.ndim else 1
    nd = max(src.ndim, 1)
    mv, _ = _pvec(max_value, P, api, "max_value", nd)
    if isinstance(max_value, Tensor) and max_value._st.di is not F32:
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"'max_value' of '{api}' must be float32, got {max_value._st.di.name}")
    res = np.exp(_f32(a) - mv).astype(np.float32)
    c = int(cmd)
    if c not in (0, 2, 3, 4):
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"reduce_cmd {cmd!r} is not supported in '{api}' (idle, reset_reduce, "
                        "reduce, load_reduce)")
    if c != 4 and not (isinstance(init, (int, float, np.number)) and float(init) == 0.0):
        raise ValueError(f"'{api}': reduce_init must be unset or 0.0 unless reduce_cmd is "
                         "load_reduce")
    acc = ctx.vec_acc
    if c == 3:
        acc[:P] = 0
    elif c == 4:
        iv, _ = _pvec(init, P, api, "reduce_init", 2)
        acc[:P] = np.broadcast_to(np.asarray(iv, np.float32).reshape(-1), (P,))
    if c != 0:
        acc[:P] = acc[:P] + res.reshape(P, -1).sum(axis=1, dtype=np.float32)
    _write_reg(ctx, reduce_res, acc, P, api)
    _cost.charge(ctx, "vector", lambda k: _cost.vector_exp_cycles(tgt, k), _free(src.shape))
    return make_result(ctx, res, _ops.out_info(dtype, di), None, api=api)


# =============================================================================================
# VectorE / GpSimdE element-wise
# =============================================================================================
def tensor_tensor(data1, data2, op, *, dtype=None, mask=None, engine=None, **kwargs):
    """Element-wise ``op(data1, data2)``: same partitions and elements per partition (no
    broadcasting); not both in PSUM. Integer add/subtract/multiply and power run on GpSimdE
    (exact int32; no PSUM access)."""
    ctx = enter()
    api = "tensor_tensor"
    o = _ops.binary_op(op, api)
    a, adi = tile_operand(data1, api, "data1")
    b, bdi = tile_operand(data2, api, "data2")
    _pmismatch(api, data1=data1, data2=data2)
    if ctx.tgt.gen3_features and _free(data2.shape) == 1 and _free(data1.shape) > 1:
        # a (P, 1) data2 broadcast along the free dims: accepted on trn2, UNCONFIRMED in the
        # docs (which say "no broadcasting"); AWS's trn2-only double_row_matmul kernel
        # multiplies [128, 1024] by a [128, 1] scale this way in its hardware-tested suite
        b = np.broadcast_to(b.reshape((a.shape[0],) + (1,) * (a.ndim - 1)), a.shape)
    else:
        _same_elems(api, data1, data2, "data1", "data2")
    _not_both_psum(api, data1, data2, "data1", "data2")
    if b.shape != a.shape:
        b = b.reshape(a.shape)
    odi = _ops.out_info(dtype, _dtypes.promote(adi, bdi)
                        if o.kind not in ("cmp", "logical") else _dtypes.promote(adi, bdi))
    is_int_arith = o.name in ("add", "subtract", "multiply") and adi.is_int and bdi.is_int
    eng = _engine_name(engine, "gpsimd" if (o.name == "power" or is_int_arith) else "vector")
    if o.kind == "bitvec":
        if adi.is_float or bdi.is_float:
            raise nki_error("err_bitvec_operand_must_be_integer", "syntax",
                            f"bitvec operator '{o.name}' of '{api}' requires integer operands")
        res = np.asarray(o.fn(a.astype(np.int64), b.astype(np.int64)))
        if odi.is_int:
            res = res.astype(odi.backing)
    elif is_int_arith and eng == "gpsimd":
        res = o.fn(a.astype(np.int64), b.astype(np.int64))
    else:
        if is_int_arith and eng != "gpsimd":
            raise nki_error("err_tensor_int32_add_multiply_supported_engine", "syntax",
                            f"int32 {o.name} in '{api}' is only supported on the GpSimd engine")
        res = _ops.apply_binary(o, _f32(a), _f32(b))
    if eng == "gpsimd":
        for t, nm in ((data1, "data1"), (data2, "data2")):
            if t._st.buffer == PSUM:
                raise nki_error("err_unsupported_memory", "type",
                                f"Expected operand '{nm}' of '{api}' (GpSimd engine) to be in "
                                f"address space 'sbuf', but got a tile in 'psum' instead.")
        _cost.charge(ctx, "gpsimd", _cost.gpsimd_cycles, _free(data1.shape))
    else:
        flags = (data1._st.buffer == PSUM, data2._st.buffer == PSUM,
                 adi is _dtypes.BF16 and bdi is _dtypes.BF16 and data1._st.buffer == SBUF
                 and data2._st.buffer == SBUF and o.name in ("add", "multiply", "subtract"))
        _cost.charge(ctx, "vector", lambda k: _cost.tensor_tensor_cycles(k, *flags),
                     _free(data1.shape))
    return make_result(ctx, np.asarray(res), odi, eval_mask(mask, data1.shape), api=api)


_SCALARE_TS = {("multiply", "add"), ("multiply", None), ("add", None)}


def tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None,
                  reverse1=False, *, dtype=None, mask=None, engine=None, **kwargs):
    """``(data op0 operand0) op1 operand1`` (``reverse`` swaps an op's operands); operands are
    scalars or [P, 1] vectors broadcast along the free dims. fp32 math; output dtype = data's."""
    ctx = enter()
    api = "tensor_scalar"
    a, di = tile_operand(data, api, "data")
    P = data.shape[0] if data.ndim else 1
    nd = max(data.ndim, 1)
    o0 = _ops.binary_op(op0, api, "op0")
    if (op1 is None) != (operand1 is None):
        raise nki_error("err_operand_cannot_be_none", "value",
                        f"'op1' and 'operand1' of '{api}' must both be given or both be None.")
    o1 = _ops.binary_op(op1, api, "op1") if op1 is not None else None
    if o1 is not None and ((o0.kind == "bitvec") != (o1.kind == "bitvec")):
        raise nki_error("err_instruction_engine_unsupported_op_comb", "syntax",
                        f"'{api}': op0 ({o0.name}) and op1 ({o1.name}) must both be bitvec or both "
                        "arithmetic")
    v0, _ = _pvec(operand0, P, api, "operand0", nd)
    eng = _engine_name(engine, "vector")
    if eng == "scalar":
        if (o0.name, o1.name if o1 else None) not in _SCALARE_TS or not ctx.tgt.gen3_features:
            raise nki_error("err_instruction_engine_unsupported_op_comb", "syntax",
                            f"'{api}' on the scalar engine only supports (multiply, add), "
                            "(multiply, None), (add, None) on trn2")
    bitvec = o0.kind == "bitvec"
    if bitvec:
        if di.is_float:
            raise nki_error("err_bitvec_operand_must_be_integer", "syntax",
                            f"bitvec operator '{o0.name}' of '{api}' requires an integer tile")
        x = a.astype(np.int64)
        v0i = np.asarray(v0).astype(np.int64)
        r = o0.fn(v0i, x) if reverse0 else o0.fn(x, v0i)
        if o1 is not None:
            v1, _ = _pvec(operand1, P, api, "operand1", nd)
            v1i = np.asarray(v1).astype(np.int64)
            r = o1.fn(v1i, r) if reverse1 else o1.fn(r, v1i)
        res = np.asarray(r)
    else:
        x = _f32(a)
        r = _ops.apply_binary(o0, v0, x) if reverse0 else _ops.apply_binary(o0, x, v0)
        if o1 is not None:
            v1, _ = _pvec(operand1, P, api, "operand1", nd)
            r = _ops.apply_binary(o1, v1, r) if reverse1 else _ops.apply_binary(o1, r, v1)
        res = np.asarray(r, dtype=np.float32)
    if res.shape != data.shape:
        res = np.broadcast_to(res, data.shape).copy()
    odi = _ops.out_info(dtype, di)
    n = _free(data.shape)
    if eng == "scalar":
        tgt, f16 = ctx.tgt, (_ops.is16(di), _ops.is16(odi))
        _cost.charge(ctx, "scalar", lambda k: _cost.act_copy_cycles(tgt, k, *f16), n)
    elif eng == "gpsimd":
        _cost.charge(ctx, "gpsimd", _cost.gpsimd_cycles, n)
    else:
        tgt, flags = ctx.tgt, (data._st.buffer == PSUM, False, _ops.is16(di), _ops.is16(odi))
        _cost.charge(ctx, "vector", lambda k: _cost.tensor_scalar_cycles(tgt, k, *flags), n)
    return make_result(ctx, res, odi, eval_mask(mask, data.shape), api=api)


def scalar_tensor_tensor(*, data, op0, operand0, op1, operand1, reverse0=False,
                         reverse1=False, dtype=None, mask=None, **kwargs):
    """``(data op0 operand0) op1 operand1``: operand0 scalar or [P, 1]; operand1 a tile with
    data's shape; data and operand1 not both in PSUM. VectorE 2N (N for bf16
    subtract->multiply)."""
    ctx = enter()
    api = "scalar_tensor_tensor"
    a, di = tile_operand(data, api, "data")
    b, bdi = tile_operand(operand1, api, "operand1")
    _pmismatch(api, data=data, operand1=operand1)
    _same_elems(api, data, operand1, "data", "operand1")
    _not_both_psum(api, data, operand1, "data", "operand1")
    P = data.shape[0] if data.ndim else 1
    nd = max(data.ndim, 1)
    o0 = _ops.binary_op(op0, api, "op0")
    o1 = _ops.binary_op(op1, api, "op1")
    v0, _ = _pvec(operand0, P, api, "operand0", nd)
    x = _f32(a)
    b = _f32(b).reshape(data.shape)
    r = _ops.apply_binary(o0, v0, x) if reverse0 else _ops.apply_binary(o0, x, v0)
    r = _ops.apply_binary(o1, b, r) if reverse1 else _ops.apply_binary(o1, r, b)
    odi = _ops.out_info(dtype, _dtypes.promote(di, bdi))
    n = _free(data.shape)
    fast = (di is _dtypes.BF16 and bdi is _dtypes.BF16 and o0.name == "subtract"
            and o1.name == "multiply")
    _cost.charge(ctx, "vector", lambda k: _cost.ii(k if fast else 2 * k), n)
    return make_result(ctx, np.asarray(r, np.float32), odi, eval_mask(mask, data.shape),
                       api=api)


def tensor_scalar_reduce(*, data, op0, operand0, reduce_op, reduce_res, reverse0=False,
                         dtype=None, mask=None, **kwargs):
    """Returns ``data op0 operand0`` and writes ``reduce_op`` (add/subtract/multiply/max/min)
    of it over all free dims into ``reduce_res`` ([P, 1], in place)."""
    return _tensor_scalar_reduce(data, op0, operand0, reduce_op, reduce_res, reverse0, dtype,
                                 mask)


def _tensor_scalar_reduce(data, op0, operand0, reduce_op, reduce_res, reverse0, dtype, mask,
                          cmd=None, init=None, negate=False):
    """``cmd`` (NKI 0.7, nki.isa.tensor_scalar_reduce "Accumulator behavior"): the reduction
    goes through the VectorE accumulation registers -- ``reset_reduce`` starts them at the
    reduce_op's identity, ``reduce`` continues, ``load_reduce`` starts them at ``init`` (scalar
    or [P, 1] fp32) -- and ``reduce_res`` (optional) receives them, negated if ``negate``
    (the registers keep the sign). ``cmd=None``: the legacy instruction (no registers)."""
    ctx = enter()
    api = "tensor_scalar_reduce"
    if reverse0:
        raise NotImplementedError("tensor_scalar_reduce: reverse0 is not supported yet")
    a, di = tile_operand(data, api, "data")
    P = data.shape[0] if data.ndim else 1
    nd = max(data.ndim, 1)
    o0 = _ops.binary_op(op0, api, "op0")
    if o0.kind != "arith":
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"{o0.name} is not supported in '{api}' ('op0')")
    ro = _ops.binary_op(reduce_op, api, "reduce_op")
    if ro.name not in ("add", "subtract", "multiply", "maximum", "minimum"):
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"{ro.name} is not supported in '{api}' ('reduce_op')")
    v0, _ = _pvec(operand0, P, api, "operand0", nd)
    res = np.asarray(_ops.apply_binary(o0, _f32(a), v0), np.float32)
    if res.shape != data.shape:
        res = np.broadcast_to(res, data.shape).copy()
    m = eval_mask(mask, data.shape)
    src = res.reshape(P, -1)
    ident = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf,
             "minimum": np.inf}[ro.name]
    if isinstance(m, np.ndarray):
        src = np.where(m.reshape(P, -1), src, np.float32(ident))
    if ro.name == "subtract":
        red = -src.sum(axis=1)           # 0 - x0 - x1 - ... (UNCONFIRMED seed)
    else:
        red = ro.red(src, axis=1)
    reg = np.asarray(red, np.float32)
    if cmd is not None:
        c = int(cmd)
        if c not in (2, 3, 4):
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"reduce_cmd {cmd!r} is not supported in '{api}' (reset_reduce, "
                            "reduce, load_reduce)")
        if (init is not None) != (c == 4):
            raise ValueError(f"'{api}': reduce_init must be given with reduce_cmd.load_reduce "
                             "and only then")
        acc = ctx.vec_acc
        if c == 3:
            acc[:P] = ident
        elif c == 4:
            iv, _ = _pvec(init, P, api, "reduce_init", 2)
            acc[:P] = np.broadcast_to(np.asarray(iv, np.float32).reshape(-1), (P,))
        fn = np.add if ro.name == "subtract" else ro.fn
        acc[:P] = (acc[:P] + reg) if ro.name == "subtract" else fn(acc[:P], reg)
        reg = -acc[:P] if negate else acc[:P]
    _write_reg(ctx, reduce_res, reg, P, api)
    ctx.rec.add("vector", _cost.ii(_free(data.shape)))
    return make_result(ctx, res, _ops.out_info(dtype, di), m, api=api)


def tensor_tensor_scan(data0, data1, initial, op0, op1, reverse0=False, reverse1=False, *,
                       dtype=None, mask=None, **kwargs):
    """Per partition along the flattened free dim: ``r[i] = op1(op0(data0[i], r[i-1]),
    data1[i])`` with ``r[-1] = initial`` (scalar or [P, 1]). fp32, arithmetic ops only."""
    ctx = enter()
    api = "tensor_tensor_scan"
    a, adi = tile_operand(data0, api, "data0")
    b, bdi = tile_operand(data1, api, "data1")
    _pmismatch(api, data0=data0, data1=data1)
    _same_elems(api, data0, data1, "data0", "data1")
    _not_both_psum(api, data0, data1, "data0", "data1")
    o0 = _ops.binary_op(op0, api, "op0")
    o1 = _ops.binary_op(op1, api, "op1")
    for o in (o0, o1):
        if o.kind != "arith":
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"{o.name} is not supported in '{api}'")
    P = data0.shape[0] if data0.ndim else 1
    A = _f32(a).reshape(P, -1)
    B = _f32(b).reshape(P, -1)
    init, _ = _pvec(initial, P, api, "initial", 2)
    r = np.broadcast_to(np.asarray(init, np.float32).reshape(-1, 1) if np.ndim(init)
                        else np.float32(init), (P, 1)).reshape(P).copy()
    out = np.empty_like(A)
    f0, f1 = o0.fn, o1.fn
    for i in range(A.shape[1]):
        t = f0(r, A[:, i]) if reverse0 else f0(A[:, i], r)
        r = (f1(B[:, i], t) if reverse1 else f1(t, B[:, i])).astype(np.float32)
        out[:, i] = r
    odi = _ops.out_info(dtype, _dtypes.promote(adi, bdi))
    ctx.rec.add("vector", _cost.ii(2 * A.shape[1]))
    return make_result(ctx, out.reshape(data0.shape), odi, eval_mask(mask, data0.shape),
                       api=api)


def tensor_copy(src, *, mask=None, dtype=None, engine=None, **kwargs):
    """Copy a tile (optionally casting) on VectorE (default), ScalarE or GpSimdE (no PSUM).
    On trn1 ScalarE copies go through fp32 (int32 beyond 2^24 lose precision)."""
    ctx = enter()
    api = "tensor_copy"
    a, di = tile_operand(src, api, "src")
    eng = _engine_name(engine, "vector")
    odi = _ops.out_info(dtype, di)
    if eng == "gpsimd" and src._st.buffer == PSUM:
        raise nki_error("err_unsupported_memory", "type",
                        "Expected operand 'src' of 'tensor_copy' (GpSimd engine) to be in "
                        "address space 'sbuf', but got a tile in 'psum' instead.")
    if eng == "scalar" and not ctx.tgt.gen3_features and di.is_int:
        res = odi.round(a.astype(np.float32))
    elif odi is di or (odi is F32 and di.is_float):
        res = np.array(a, dtype=odi.backing, copy=True)
    else:
        res = odi.round(np.asarray(a))
        if res is a:
            res = res.copy()
    n = _free(src.shape)
    if eng == "scalar":
        tgt, f16 = ctx.tgt, (_ops.is16(di), _ops.is16(odi))
        _cost.charge(ctx, "scalar", lambda k: _cost.act_copy_cycles(tgt, k, *f16), n)
    elif eng == "gpsimd":
        _cost.charge(ctx, "gpsimd", _cost.gpsimd_cycles, n)
    else:
        tgt, flags = ctx.tgt, (src._st.buffer == PSUM, False, _ops.is16(di), _ops.is16(odi))
        _cost.charge(ctx, "vector", lambda k: _cost.tensor_scalar_cycles(tgt, k, *flags), n)
    return make_result(ctx, res, odi, eval_mask(mask, src.shape), api=api, rounded=True)


def _dyn_read(t, api, pname):
    if not isinstance(t, Tensor):
        raise TypeError(f"'{pname}' of '{api}' must be a tile")
    if t._st.buffer in _HBMS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand '{pname}' of '{api}' to be in address space "
                        f"'psum|sbuf', but got a tile in 'hbm' instead.")
    return t._read()


def tensor_copy_dynamic_src(src, *, mask=None, dtype=None, engine=None, **kwargs):
    """Copy whose source free-dim offset is a runtime value read from SBUF
    (``src[ix, offsets_tile[0, j] + iy]``). MIN_II 600 cycles."""
    ctx = enter()
    api = "tensor_copy_dynamic_src"
    a = _dyn_read(src, api, "src")
    di = src._st.di
    odi = _ops.out_info(dtype, di)
    res = odi.round(np.array(a, copy=True)) if odi is not di else np.array(a, copy=True)
    _cost.charge(ctx, "vector", lambda k: max(_hw.DYNAMIC_COPY_MIN_II, k), _free(src.shape))
    return make_result(ctx, res, odi, eval_mask(mask, src.shape), api=api, rounded=True)


def tensor_copy_dynamic_dst(*, dst, src, mask=None, dtype=None, engine=None, **kwargs):
    """Copy ``src`` into ``dst`` whose free-dim offset is a runtime value (in place)."""
    ctx = enter()
    api = "tensor_copy_dynamic_dst"
    a, di = tile_operand(src, api, "src")
    if dst._st.buffer in _HBMS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'dst' of '{api}' to be in address space 'psum|sbuf', "
                        "but got a tile in 'hbm' instead.")
    vals = fit_value(a, src.shape, dst.shape, "src")
    ddi = dst._st.di
    m = eval_mask(mask, dst.shape)
    if m is not False:
        if ctx.loops:
            _deps.note_write(ctx, dst, m)
        dst._write(ddi.round(np.asarray(vals)) if ddi is not di else vals, m)
    dst._st.written = True
    # the instruction writes the destination's elements (src may be broadcast)
    ctx.rec.add("vector", max(_hw.DYNAMIC_COPY_MIN_II, _free(dst.shape)))
    return None


def tensor_copy_predicated(*, src, dst, predicate, reverse_pred=False, mask=None, dtype=None,
                           **kwargs):
    """``dst[i] = src[i]`` where ``predicate[i]`` is non-zero (zero if ``reverse_pred``), else
    unchanged (in place). ``src`` may be a scalar; not both src and predicate in PSUM."""
    ctx = enter()
    api = "tensor_copy_predicated"
    if not isinstance(dst, Tensor) or dst._st.buffer in _HBMS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'dst' of '{api}' to be in address space 'psum|sbuf'.")
    pa, pdi = tile_operand(predicate, api, "predicate")
    _pmismatch(api, dst=dst, predicate=predicate)
    if isinstance(src, Tensor):
        sa, sdi = tile_operand(src, api, "src")
        _not_both_psum(api, src, predicate, "src", "predicate")
        _pmismatch(api, src=src, dst=dst)
        sa = np.asarray(sa).reshape(dst.shape)
    else:
        sa, sdi = np.asarray(src), _dtypes.weak_scalar_info(src)
    p = np.asarray(pa).reshape(dst.shape) != 0
    if reverse_pred:
        p = ~p
    m = eval_mask(mask, dst.shape)
    if m is False:
        return None
    if isinstance(m, np.ndarray):
        p = p & m
    ddi = dst._st.di
    vals = ddi.round(np.asarray(sa)) if sdi is not ddi else sa
    if ctx.loops:
        _deps.note_write(ctx, dst, p)
    dst._write(np.broadcast_to(vals, dst.shape), p)
    dst._st.written = True
    ctx.rec.add("vector", _cost.ii(_free(dst.shape)))
    return None


def reciprocal(data, *, dtype=None, mask=None, **kwargs):
    """``1/x`` on VectorE (more precise than ScalarE; 8N cycles)."""
    ctx = enter()
    a, di = tile_operand(data, "reciprocal", "data")
    res = np.float32(1.0) / _f32(a)
    _cost.charge(ctx, "vector", lambda k: _cost.ii(_hw.RECIPROCAL_FACTOR * k), _free(data.shape))
    return make_result(ctx, np.asarray(res, np.float32), _ops.out_info(dtype, di),
                       eval_mask(mask, data.shape), api="reciprocal")


def iota(expr, dtype, *, mask=None, **kwargs):
    """Materialise an affine index expression (or loop index) as an SBUF tile (int32 math,
    then cast to ``dtype``). Shape = the expression's broadcast shape."""
    ctx = enter()
    api = "iota"
    if isinstance(expr, IndexExpr):
        if expr.ndim == 1 and expr.terms:
            raise nki_error("err_1d_arange_not_supported", "syntax",
                            "iota with 1d arange is not supported.")
        vals = expr.values()
        vals = np.asarray(vals)
        shape = expr.shape
        if len(shape) == 0:
            vals = vals.reshape(1, 1)
    elif isinstance(expr, INT_TYPES):             # incl. a loop index / program id
        vals = np.full((1, 1), int(expr), np.int64)
    else:
        raise TypeError(f"'expr' of 'iota' must be an index expression, got "
                        f"{type(expr).__name__}")
    vals = np.asarray(vals, np.int64)
    vals = np.broadcast_to(vals, vals.shape).astype(np.int32)   # int32 arithmetic (wraps)
    check_partitions(vals.shape, api, "expr")
    di = _dtypes.info(dtype)
    res = di.round(vals.astype(np.float32)) if di.is_float else di.round(vals)
    _cost.charge(ctx, "gpsimd", lambda k: _cost.gpsimd_cycles(k, start=True), _free(vals.shape))
    return make_result(ctx, np.array(res, copy=True), di, eval_mask(mask, vals.shape), api=api,
                       rounded=True)


def memset(shape, value, dtype, *, mask=None, engine=None, **kwargs):
    """New tile of ``shape`` filled with the constant ``value`` (VectorE or GpSimdE)."""
    ctx = enter()
    shape = tuple(int(s) for s in shape)
    check_partitions(shape, "memset", "shape")
    di = _dtypes.info(dtype)
    arr = di.round(np.full(shape, value, np.float32 if di.is_float else np.float64))
    eng = _engine_name(engine, "vector")
    _cost.charge(ctx, "gpsimd" if eng == "gpsimd" else "vector", _cost.ii, _free(shape))
    return make_result(ctx, np.array(arr, copy=True), di, eval_mask(mask, shape), api="memset",
                       rounded=True, tag="memset")


def affine_select(pred, on_true_tile, on_false_value, *, mask=None, dtype=None, **kwargs):
    """``on_true_tile`` where the affine predicate ``pred`` (comparison of arange/mgrid
    expressions and loop ints) holds, else ``on_false_value`` (GpSimdE, N + 150 cycles)."""
    ctx = enter()
    api = "affine_select"
    a, di = tile_operand(on_true_tile, api, "on_true_tile")
    if isinstance(pred, Predicate):
        if pred.op == "and":
            raise nki_error("err_unsupported_expression_in_mask", "value",
                            "affine_select predicate must be a single affine comparison")
        pred.check()
        p = pred.evaluate()
        p = _broadcast_pred(p, on_true_tile.shape)
    elif isinstance(pred, (bool, np.bool_)):
        p = bool(pred)
    else:
        raise TypeError("'pred' of 'affine_select' must be an affine predicate of nl.arange / "
                        "nl.mgrid indices")
    return _affine_select(ctx, api, p, a, di, on_true_tile, on_false_value, dtype, mask)


def _affine_select(ctx, api, p, a, di, on_true_tile, on_false_value, dtype, mask):
    """The selection and cost of affine_select, given the evaluated predicate ``p`` (bool or
    a boolean array of ``on_true_tile``'s shape); the nki.* front end evaluates its 0.7
    ``pattern``/``offset``/``channel_multiplier``/``cmp_op`` form and comes in here."""
    fdi = _dtypes.weak_scalar_info(on_false_value)
    odi = _ops.out_info(dtype, _dtypes.promote(di, fdi))
    res = np.array(_f32(a), dtype=np.float32, copy=True)
    if p is not True:
        if p is False:
            res[...] = np.float32(on_false_value)
        else:
            np.copyto(res, np.float32(on_false_value), where=~p)
    _cost.charge(ctx, "gpsimd", lambda k: _cost.gpsimd_cycles(k, start=True),
                 _free(on_true_tile.shape))
    return make_result(ctx, res, odi, eval_mask(mask, on_true_tile.shape), api=api)


def _broadcast_pred(p, shape):
    try:
        return np.broadcast_to(p, shape)
    except ValueError:
        if p.ndim < len(shape):
            return np.broadcast_to(p.reshape(p.shape + (1,) * (len(shape) - p.ndim)), shape)
        raise ValueError(f"predicate of shape {list(p.shape)} does not match the tile "
                         f"{list(shape)}") from None


_CMP_OPS = ("equal", "less", "less_equal", "greater", "greater_equal", "not_equal")


def range_select(*, on_true_tile, comp_op0, comp_op1, bound0, bound1,
                 reduce_cmd=reduce_cmd.idle, reduce_res=None, reduce_op=np.amax, range_start=0,
                 on_false_value=fp32.min, mask=None, dtype=None, **kwargs):
    """(trn2 only) Keep ``on_true_tile[:, j]`` where ``comp_op0(range_start + j, bound0)`` and
    ``comp_op1(range_start + j, bound1)`` (bounds [P, 1] fp32), else ``on_false_value``
    (fp32.min); optional max-reduction into the VectorE accumulators / ``reduce_res``."""
    ctx = enter()
    api = "range_select"
    _require_gen3(ctx, api)
    a, di = tile_operand(on_true_tile, api, "on_true_tile")
    P = on_true_tile.shape[0]
    c0 = _ops.binary_op(comp_op0, api, "comp_op0")
    c1 = _ops.binary_op(comp_op1, api, "comp_op1")
    for c in (c0, c1):
        if c.name not in _CMP_OPS[:5]:
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"{c.name} is not supported in '{api}'")
    if np.float32(on_false_value) != fp32.min:
        raise ValueError("range_select: on_false_value must be nl.fp32.min")
    b0, _ = _pvec(bound0, P, api, "bound0", 2)
    b1, _ = _pvec(bound1, P, api, "bound1", 2)
    A = _f32(a).reshape(P, -1)
    j = np.float32(range_start) + np.arange(A.shape[1], dtype=np.float32)[None, :]
    keep = c0.fn(j, b0) & c1.fn(j, b1)
    res = np.where(keep, A, np.float32(on_false_value)).astype(np.float32)
    m = eval_mask(mask, on_true_tile.shape)
    if reduce_res is not None or int(reduce_cmd) != 0:
        rname = _ops.op_name(reduce_op, api, "reduce_op")
        if rname != "maximum":
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"{rname} is not supported in '{api}' ('reduce_op')")
        red = res.max(axis=1)
        _accum_write(ctx.vec_acc, P, red, reduce_cmd, np.maximum, -np.inf)
        _write_reg(ctx, reduce_res, ctx.vec_acc, P, api)
    ctx.rec.add("vector", _cost.ii(A.shape[1]))
    return make_result(ctx, res.reshape(on_true_tile.shape), _ops.out_info(dtype, di), m,
                       api=api)


def select_reduce(*, dst, predicate, on_true, on_false, reduce_res=None,
                  reduce_cmd=reduce_cmd.idle, reduce_op=np.amax, reverse_pred=False, mask=None,
                  dtype=None, **kwargs):
    """``dst = where(predicate, on_true, on_false)`` in place (``on_false`` scalar or [P, 1]);
    optional per-partition max into ``reduce_res`` via the VectorE accumulators."""
    ctx = enter()
    api = "select_reduce"
    ta, tdi = tile_operand(on_true, api, "on_true")
    pa, pdi = tile_operand(predicate, api, "predicate")
    if not isinstance(dst, Tensor) or dst._st.buffer in _HBMS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'dst' of '{api}' to be in address space 'psum|sbuf'.")
    _pmismatch(api, dst=dst, predicate=predicate, on_true=on_true)
    _not_both_psum(api, on_true, predicate, "on_true", "predicate")
    if tdi.name in ("tfloat32", "int32", "uint32"):
        raise nki_error("err_instruction_unsupported_dtypes", "syntax",
                        f"'on_true' of '{api}' cannot be {tdi.name}")
    P = dst.shape[0]
    nd = max(dst.ndim, 1)
    fv, _ = _pvec(on_false, P, api, "on_false", nd)
    p = np.asarray(pa).reshape(dst.shape) != 0
    if reverse_pred:
        p = ~p
    res = np.where(p, _f32(ta).reshape(dst.shape), fv).astype(np.float32)
    m = eval_mask(mask, dst.shape)
    ddi = dst._st.di
    if m is not False:
        if ctx.loops:
            _deps.note_write(ctx, dst, m)
        dst._write(ddi.round(res), m)
        dst._st.written = True
    if reduce_res is not None or int(reduce_cmd) != 0:
        rname = _ops.op_name(reduce_op, api, "reduce_op")
        if rname != "maximum":
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"{rname} is not supported in '{api}' ('reduce_op')")
        red = res.reshape(P, -1).max(axis=1)
        _accum_write(ctx.vec_acc, P, red, reduce_cmd, np.maximum, -np.inf)
        _write_reg(ctx, reduce_res, ctx.vec_acc, P, api)
    ctx.rec.add("vector", _cost.ii(_free(dst.shape)))
    return None


def dropout(data, prob, *, mask=None, dtype=None, **kwargs):
    """Zero each element with probability ``prob`` (scalar or [P, 1]); no rescale."""
    ctx = enter()
    api = "dropout"
    a, di = tile_operand(data, api, "data")
    P = data.shape[0]
    pr, _ = _pvec(prob, P, api, "prob", max(data.ndim, 1))
    keep = ctx.rng.random(data.shape, dtype=np.float32) >= pr
    res = np.where(keep, _f32(a), np.float32(0)).astype(np.float32)
    odi = _ops.out_info(dtype, di)
    if di.is_int and odi is not di:
        raise ValueError("dropout on integer data: the output dtype must equal the input dtype")
    _cost.charge(ctx, "vector", _cost.ii, _free(data.shape))
    return make_result(ctx, res, odi, eval_mask(mask, data.shape), api=api)


# =============================================================================================
# reductions
# =============================================================================================
def tensor_reduce(op, data, axis, *, mask=None, dtype=None, negate=False, keepdims=False,
                  **kwargs):
    """Reduce free ``axis`` (int or list; consecutive free axes ending at the last dim) with an
    ALU op legal for reductions (add, multiply, max, min, bitwise and/or/xor, logical ...).
    ``negate`` multiplies arithmetic results by -1."""
    ctx = enter()
    api = "tensor_reduce"
    o = _ops.binary_op(op, api)
    if not isinstance(data, Tensor):
        raise TypeError("'data' of 'tensor_reduce' must be a tile")
    axes = _ops.norm_axes(axis, data.ndim, api)
    if list(axes) != list(range(axes[0], axes[0] + len(axes))) or axes[-1] != data.ndim - 1:
        raise nki_error("err_unsupported_reduction_axis", "value",
                        f"'{api}' reduces consecutive free axes ending at the last dimension; "
                        f"got axis={axis} for a {data.ndim}-D tile")
    return _ops.reduce(api, o, data, axes, dtype, mask, keepdims, negate=negate, ctx=ctx)


def tensor_partition_reduce(op, data, *, mask=None, dtype=None, **kwargs):
    """Reduce across partitions: (P, F...) -> (1, F...) with add, max, bitwise_or or
    bitwise_and (GpSimdE)."""
    ctx = enter()
    api = "tensor_partition_reduce"
    name = _ops.op_name(op, api)
    if name not in ("add", "maximum", "bitwise_or", "bitwise_and"):
        raise nki_error("err_par_reduce_unsupported_op", "syntax",
                        f"par_reduce does not support operator={name}")
    a, di = tile_operand(data, api, "data")
    o = _ops.BINARY[name]
    if o.kind == "bitvec":
        if di.is_float:
            raise nki_error("err_par_reduce_bitvec_op_invalid_dtype", "syntax",
                            f"bitvec partition reduction '{name}' requires an integer tile")
        res = o.red(a.astype(np.int64), axis=0, keepdims=True)
    else:
        res = o.red(_f32(a), axis=0, keepdims=True).astype(np.float32)
    ctx.rec.add("gpsimd", _cost.gpsimd_cycles(_free(data.shape)))
    return make_result(ctx, np.asarray(res), _ops.out_info(dtype, di),
                       eval_mask(mask, res.shape), api=api)


def _operand_mask(mask, in_shape, out_shape, data_first=False):
    """``mask=`` of an instruction whose output grid differs from its input's (bn_stats, max8,
    nc_find_index8, nc_match_replace8): -> (input mask of ``in_shape``, output mask); each is
    None (all on), False (all off) or a bool array.

    A predicate may range over the indices of an input tile, not only the output's: "each
    comparison expression should indicate which range of indices along one of the input tile
    axes should be valid for the computation" (D26 nki.api.shared, "NKI API Masking"; AWS's
    layernorm tutorial masks bn_stats' input columns, the nc_match_replace8 example max8's).
    A mask that fits the output grid keeps its output meaning unless ``data_first`` (the
    instruction documents that its mask applies to ``data``). Masked-out input elements are
    not read; a partition none of whose input elements is on is not written."""
    if mask is None:
        return None, None
    order = ("in", "out") if data_first else ("out", "in")
    err = None
    for which in order:
        try:
            m = eval_mask(mask, in_shape if which == "in" else out_shape)
        except ValueError as e:
            err = err or e
            continue
        if which == "out" and not data_first:
            return None, m
        if m is None or m is False:
            return (None if m is None else np.zeros(in_shape, bool)), m
        P = in_shape[0]
        rows = m.reshape(P, -1).any(axis=1)
        mo = None if rows.all() else (False if not rows.any() else
                                      np.broadcast_to(rows.reshape((P,) + (1,) * (len(out_shape) - 1)),
                                                      out_shape))
        if data_first and tuple(in_shape) == tuple(out_shape):
            mo = m
        return m, mo
    raise err


def _read_mask(mi):
    return mi if isinstance(mi, np.ndarray) else (None if mi is None else False)


def bn_stats(data, *, mask=None, dtype=None, **kwargs):
    """Per partition over the (flattened, <= 512) free dim: [count, mean, var*count] of the
    even-indexed elements, then the same for the odd-indexed ones -> [P, 6]."""
    ctx = enter()
    api = "bn_stats"
    P = data.shape[0] if isinstance(data, Tensor) and data.ndim else 1
    mi, mo = _operand_mask(mask, data.shape, (P, 6)) if isinstance(data, Tensor) else (None, None)
    a, di = tile_operand(data, api, "data", mask=_read_mask(mi))
    A = _f32(a).reshape(P, -1).astype(np.float64)
    F = A.shape[1]
    if F > _hw.BN_STATS_FMAX:
        raise _size_err(api, "data", data.shape, 1, _hw.BN_STATS_FMAX)
    on = np.ones((P, F), bool) if mi is None else np.asarray(mi).reshape(P, F)
    out = np.zeros((P, 6), np.float64)
    for g in range(2):
        sl, ok = A[:, g::2], on[:, g::2]        # parity of the element's index in the row
        c = ok.sum(axis=1)
        out[:, 3 * g] = c
        cc = np.where(c > 0, c, 1)
        mu = np.where(ok, sl, 0.0).sum(axis=1) / cc
        out[:, 3 * g + 1] = mu
        out[:, 3 * g + 2] = np.where(ok, (sl - mu[:, None]) ** 2, 0.0).sum(axis=1)
    ctx.rec.add("vector", _cost.ii(F))
    return make_result(ctx, out.astype(np.float32), _ops.out_info(dtype, di), mo, api=api)


def bn_aggr(data, *, mask=None, dtype=None, **kwargs):
    """Aggregate concatenated bn_stats outputs [P, 3k] into [P, 2] = [mean, variance]
    (population variance) of all underlying elements."""
    ctx = enter()
    api = "bn_aggr"
    a, di = tile_operand(data, api, "data")
    P = data.shape[0]
    A = _f32(a).reshape(P, -1).astype(np.float64)
    if A.shape[1] % 3:
        raise ValueError(f"bn_aggr input must have 3k elements per partition, got {A.shape[1]}")
    c = A[:, 0::3]
    mu = A[:, 1::3]
    m2 = A[:, 2::3]
    n = c.sum(axis=1)
    nn = np.where(n > 0, n, 1)
    mean = (c * mu).sum(axis=1) / nn
    var = (m2 + c * (mu - mean[:, None]) ** 2).sum(axis=1) / nn
    out = np.stack([mean, var], axis=1).astype(np.float32)
    ctx.rec.add("vector", _cost.ii(A.shape[1]))
    return make_result(ctx, out, _ops.out_info(dtype, di), eval_mask(mask, (P, 2)), api=api)


def _elems_check(api, pname, t):
    n = _free(t.shape)
    if not (_hw.MAX8_MIN_ELEMS <= n <= _hw.MAX8_MAX_ELEMS):
        raise ValueError(f"'{pname}' of '{api}' has {n} elements per partition, but must be "
                         f"between {_hw.MAX8_MIN_ELEMS} and {_hw.MAX8_MAX_ELEMS}")


def max8(*, src, mask=None, dtype=None, **kwargs):
    """Top-8 values per partition in descending order -> [P, 8]."""
    ctx = enter()
    api = "max8"
    P = src.shape[0] if isinstance(src, Tensor) and src.ndim else 1
    mi, mo = _operand_mask(mask, src.shape, (P, 8)) if isinstance(src, Tensor) else (None, None)
    a, di = tile_operand(src, api, "src", mask=_read_mask(mi))
    _elems_check(api, "src", src)
    A = _f32(a).reshape(P, -1)
    if mi is not None:
        A = np.where(np.asarray(mi).reshape(P, -1), A, -np.inf)   # masked-out: not read
    top = -np.sort(-A, axis=1)[:, :8]
    ctx.rec.add("vector", _cost.ii(A.shape[1]))
    return make_result(ctx, top.astype(np.float32), _ops.out_info(dtype, di), mo, api=api)


def nc_find_index8(*, data, vals, mask=None, dtype=None, **kwargs):
    """Index of the first occurrence of each of the 8 ``vals`` per partition in the flattened
    ``data`` row -> [P, 8] uint32 (absent values give 0xFFFFFFFF; undefined on hardware)."""
    ctx = enter()
    api = "nc_find_index8"
    P = data.shape[0] if isinstance(data, Tensor) and data.ndim else 1
    mi, mo = (_operand_mask(mask, data.shape, (P, 8), data_first=True)   # "mask applies to data"
              if isinstance(data, Tensor) else (None, None))
    a, di = tile_operand(data, api, "data", mask=_read_mask(mi))
    v, vdi = tile_operand(vals, api, "vals")
    _pmismatch(api, data=data, vals=vals)
    if _free(vals.shape) != 8:
        raise ValueError(f"'vals' of '{api}' must have exactly 8 elements per partition")
    A = _f32(a).reshape(P, -1)
    V = _f32(v).reshape(P, 8)
    eq = A[:, None, :] == V[:, :, None]
    if mi is not None:
        eq &= np.asarray(mi).reshape(P, 1, -1)
    # a value repeated in vals takes the next occurrence in data, in ascending order across
    # the repeats (2.33 stub, nki.isa.nc_match_replace8: "nc_find_index8 ... pairs duplicate
    # vals with their matching positions in ascending order across dst_idx columns")
    rank = (V[:, :, None] == V[:, None, :]) & np.tri(8, k=-1, dtype=bool)[None]
    rank = rank.sum(axis=2)                          # earlier equal vals in the row
    pos = np.cumsum(eq, axis=2) - 1                  # occurrence number of each match
    hit = eq & (pos == rank[:, :, None])
    found = hit.any(axis=2)
    idx = np.where(found, hit.argmax(axis=2), np.iinfo(np.uint32).max).astype(np.uint32)
    ctx.rec.add("vector", _cost.ii(A.shape[1]))
    odi = _ops.out_info(dtype, _dtypes.U32)
    return make_result(ctx, idx, odi, mo, api=api)


def nc_match_replace8(*, data, vals, imm, dst_idx=None, mask=None, dtype=None, **kwargs):
    """Replace the first occurrence of each of the 8 ``vals`` (in order) in each flattened row
    of ``data`` with ``imm``; returns the modified data; ``dst_idx`` receives the indices."""
    ctx = enter()
    api = "nc_match_replace8"
    P = data.shape[0] if isinstance(data, Tensor) and data.ndim else 1
    mi, mo = (_operand_mask(mask, data.shape, data.shape, data_first=True)  # "applies to data"
              if isinstance(data, Tensor) else (None, None))
    a, di = tile_operand(data, api, "data", mask=_read_mask(mi))
    v, vdi = tile_operand(vals, api, "vals")
    _pmismatch(api, data=data, vals=vals)
    if _free(vals.shape) != 8:
        raise ValueError(f"'vals' of '{api}' must have exactly 8 elements per partition")
    _elems_check(api, "data", data)
    A = _f32(a).reshape(P, -1).copy()
    V = _f32(v).reshape(P, 8)
    idx = np.full((P, 8), np.iinfo(np.uint32).max, np.uint32)
    rows = np.arange(P)
    imm32 = np.float32(imm)
    if mi is not None:
        mi = np.asarray(mi).reshape(P, -1)
    rows_on = np.ones(P, bool) if mi is None else mi.any(axis=1)
    # vals are processed last to first (2.33 stub, nki.isa.nc_match_replace8, "Behavior with
    # duplicate vals"): a repeated value's first match goes to its highest dst_idx column
    for k in reversed(range(8)):
        eq = A == V[:, k:k + 1]
        if mi is not None:
            eq &= mi
        found = eq.any(axis=1)
        j = eq.argmax(axis=1)
        A[rows[found], j[found]] = imm32
        idx[found, k] = j[found]
    if dst_idx is not None:
        if not isinstance(dst_idx, Tensor):
            raise TypeError("'dst_idx' must be a tile")
        ddi = dst_idx._st.di
        if ctx.loops:
            _deps.note_write(ctx, dst_idx, None)
        wm = None if rows_on.all() else np.broadcast_to(
            rows_on.reshape((P,) + (1,) * (dst_idx.ndim - 1)), dst_idx.shape)
        dst_idx._write(ddi.round(idx).reshape(dst_idx.shape), wm)
        dst_idx._st.written = True
    ctx.rec.add("vector", _cost.ii(A.shape[1]))
    return make_result(ctx, A.reshape(data.shape), _ops.out_info(dtype, di), mo, api=api)


def nc_stream_shuffle(src, dst, shuffle_mask, *, dtype=None, mask=None, **kwargs):
    """Within each 32-partition quadrant: ``dst[q*32+i] = src[q*32+shuffle_mask[i]]`` (255 =
    leave unchanged); in place on ``dst``. A 1-partition src broadcasts with an all-zero mask."""
    ctx = enter()
    api = "nc_stream_shuffle"
    a, di = tile_operand(src, api, "src")
    if not isinstance(dst, Tensor) or dst._st.buffer in _HBMS:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'dst' of '{api}' to be in address space 'psum|sbuf'.")
    _same_elems(api, src, dst, "src", "dst")
    sm = list(shuffle_mask)
    Q = _hw.STREAM_SHUFFLE_QUADRANT
    if len(sm) != Q:
        raise ValueError(f"shuffle_mask of '{api}' must have {Q} entries")
    Ps, Pd = src.shape[0], dst.shape[0]
    S = np.asarray(a).reshape(Ps, -1)
    cur = dst._read().reshape(Pd, -1).copy()
    ddi = dst._st.di
    Sd = ddi.round(np.asarray(S)) if ddi is not di else S
    for p in range(Pd):
        q, i = divmod(p, Q)
        s = sm[i]
        if s == 255:
            continue
        sp = q * Q + int(s)
        if Ps == 1:
            sp = 0
        if sp < Ps:
            cur[p] = Sd[sp]
    m = eval_mask(mask, dst.shape)
    if m is not False:
        if ctx.loops:
            _deps.note_write(ctx, dst, m)
        dst._write(cur.reshape(dst.shape), m)
    dst._st.written = True
    ctx.rec.add("vector", _cost.ii(_free(src.shape)))
    return None


def local_gather(src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, *, mask=None,
                 **kwargs):
    """GpSimd gather within 16-partition groups (spec §9.23): each group's index values,
    flattened partition-first, are element offsets into the flattened free dims; every
    partition of the group gathers ``num_elem_per_idx`` contiguous elements per index."""
    ctx = enter()
    api = "local_gather"
    a, di = tile_operand(src_buffer, api, "src_buffer")
    ia, idi = tile_operand(index, api, "index")
    _pmismatch(api, src_buffer=src_buffer, index=index)
    G = _hw.LOCAL_GATHER_GROUP
    P = src_buffer.shape[0]
    if P % G:
        raise ValueError(f"'{api}': partitions must be a multiple of {G}, got {P}")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"'{api}': num_elem_per_idx must be one of 1, 2, 4, 8, 16, 32")
    S = np.asarray(a).reshape(P, -1)
    I = np.asarray(ia).reshape(P, -1).astype(np.int64)
    n = I.shape[1]
    nv = G * n if num_valid_indices is None else int(num_valid_indices)
    if nv > _hw.LOCAL_GATHER_MAX_INDICES:
        raise ValueError(f"'{api}': at most {_hw.LOCAL_GATHER_MAX_INDICES} indices per core")
    out = np.empty((P, nv * num_elem_per_idx), S.dtype)
    F = S.shape[1]
    offs = np.arange(num_elem_per_idx)
    for g in range(P // G):
        grp = I[g * G:(g + 1) * G]
        flat = grp.T.reshape(-1)[:nv]                  # partition-first (column-major)
        cols = (flat[:, None] + offs[None, :]).reshape(-1)
        cols = np.clip(cols, 0, F - 1)                 # OOB undefined on hardware
        out[g * G:(g + 1) * G] = S[g * G:(g + 1) * G][:, cols]
    ctx.rec.add("gpsimd", _cost.gpsimd_cycles(out.shape[1]))
    return make_result(ctx, out, di, eval_mask(mask, out.shape), api=api, rounded=True)


def sequence_bounds(*, segment_ids, dtype=None, **kwargs):
    """(1, n) segment ids -> (1, 2, n): [start, end) of each position's run of equal ids;
    id 0 (padding) gives start = n, end = -1."""
    ctx = enter()
    api = "sequence_bounds"
    a, di = tile_operand(segment_ids, api, "segment_ids")
    if segment_ids.shape[0] != 1:
        raise ValueError(f"'{api}': segment_ids must have partition dim 1, got "
                         f"{fmt_shape(segment_ids.shape)}")
    s = np.asarray(a).reshape(-1)
    n = s.size
    start = np.empty(n, np.int64)
    end = np.empty(n, np.int64)
    i = 0
    while i < n:
        j = i
        while j + 1 < n and s[j + 1] == s[i]:
            j += 1
        start[i:j + 1] = i
        end[i:j + 1] = j + 1
        i = j + 1
    pad = s == 0
    start[pad] = n
    end[pad] = -1
    out = np.stack([start, end])[None].astype(np.float32)
    ctx.rec.add("gpsimd", _cost.gpsimd_cycles(n))
    return make_result(ctx, out, _ops.out_info(dtype, di), None, api=api)


# =============================================================================================
# DMA
# =============================================================================================
def dma_copy(*, dst, src, mask=None, dst_rmw_op=None, oob_mode=oob_mode.error,
             dge_mode=dge_mode.unknown, **kwargs):
    """Copy ``src`` -> ``dst`` (each HBM or SBUF) on a DMA queue, casting to dst's dtype.
    Index tiles on the partition dim of an HBM side give gather/scatter; ``oob_mode.skip``
    skips out-of-range rows; ``dst_rmw_op=np.add`` accumulates into dst."""
    from .language import _check_dyn, _store_check_param, _contig
    ctx = enter()
    api = "dma_copy"
    for t, nm in ((dst, "dst"), (src, "src")):
        if not isinstance(t, Tensor):
            raise TypeError(f"'{nm}' of '{api}' must be an NKI tensor")
    if int(dge_mode) == 2:          # hwdge (the parameter shadows the enum class)
        if not ctx.tgt.gen3_features:
            raise nki_error("err_min_arch_support_for_hwdge", "syntax",
                            f"dge_mode=hwdge requires min target trn2; current target is "
                            f"{ctx.tgt.name}")
    _check_dyn(src, api, True)
    _check_dyn(dst, api, True)
    skip = int(oob_mode) == 1
    if dst_rmw_op is not None:
        if _ops.op_name(dst_rmw_op, api, "dst_rmw_op") != "add":
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"'{api}' dst_rmw_op only supports np.add")
        if skip:
            raise ValueError("dst_rmw_op is only supported with oob_mode.error")
    sst, dstt = src._st, dst._st
    if dstt.buffer in _HBMS:
        _store_check_param(ctx, dstt)
    m = eval_mask(mask, dst.shape)
    if m is False:
        return None
    sshape = src.shape
    vals = None
    if src._dyn is None:
        # a statically out-of-range source view is legal where the mask turns it off
        vals = src._read(m if (src._oob is not None and sshape == dst.shape) else None)
    valid_src = None
    if vals is None:
        if _sched.ACTIVE is not None:
            _sched.ACTIVE.read(src)
        key, valid_src = _tensor._resolve(src, m if sshape == dst.shape else None, skip)
        if valid_src is None:
            vals = src._base[key]
        else:
            bk = np.broadcast_arrays(*key)
            vals = np.zeros(sshape, src._base.dtype)
            vals[valid_src] = src._base[tuple(k[valid_src] for k in bk)]
    if sshape != dst.shape:
        vals = fit_value(vals, sshape, dst.shape, "src")
        if valid_src is not None:
            valid_src = _tensor.fit_mask(valid_src, sshape, dst.shape)
    wmask = _tensor.combine_masks(m, valid_src)
    # rows of an indirect destination skipped by oob_mode.skip are not written (and their
    # source rows are not read): leave them out of the transfer
    if dst._dyn is not None and skip:
        _, valid_dst = _tensor._resolve(dst, wmask, True)
        if valid_dst is not None:
            wmask = _tensor.combine_masks(wmask, valid_dst)
    if isinstance(wmask, np.ndarray) and not wmask.any():
        wmask = False
    ddi, sdi = dstt.di, sst.di
    if wmask is not False:
        if dst_rmw_op is not None:
            cur = dst._read(wmask if isinstance(wmask, np.ndarray) else None)
            res = (_f32(cur) + _f32(vals)) if ddi.is_float else cur.astype(np.int64) + vals
            vals = ddi.round(np.asarray(res))
        elif ddi is not sdi and not (ddi is F32 and sdi.is_float):
            vals = ddi.round(np.asarray(vals))
        if ctx.loops and dst_rmw_op is None:
            _deps.note_write(ctx, dst, wmask)
        dst._write(vals, wmask, skip_oob=skip)
    dstt.written = True
    cnt = dst._count(wmask)
    src_hbm, dst_hbm = sst.buffer in _HBMS, dstt.buffer in _HBMS
    hbm_side = sst if src_hbm else dstt
    nbytes = cnt * hbm_side.di.itemsize
    cont = _contig(src if src_hbm else dst, hbm_side.di)
    ch = _dma.chunks(dst.shape, [_dma.layout(dst),
                                 _dma.to_shape(_dma.layout(src), sshape, dst.shape)], wmask)
    ctx.rec.dma(nbytes, cont, ch, read=sst.name if src_hbm else None,
                written=dstt.name if dst_hbm else None,
                read_bytes=cnt * sdi.itemsize, written_bytes=cnt * ddi.itemsize)
    return None


_DEFAULT_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(src, *, axes=None, mask=None, dtype=None, dge_mode=dge_mode.unknown,
                  **kwargs):
    """DMA-engine transpose of an HBM or SBUF tile into a new SBUF tile. Default permutation:
    2-D (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0); ``axes`` accepts exactly those."""
    from .language import _check_dyn
    ctx = enter()
    api = "dma_transpose"
    if not isinstance(src, Tensor):
        raise TypeError(f"'src' of '{api}' must be an NKI tensor")
    _check_dyn(src, api, False)
    nd = src.ndim
    if nd not in _DEFAULT_AXES:
        raise nki_error("err_exceed_max_supported_dimension", "value",
                        f"parameter 'src{fmt_shape(src.shape)}' of '{api}' must have 2 to 4 "
                        "dimensions")
    perm = _DEFAULT_AXES[nd]
    if axes is not None and tuple(axes) != perm:
        raise ValueError(f"'{api}': axes must be {perm} for a {nd}-D source, got {tuple(axes)}")
    st = src._st
    on_hbm = st.buffer in _HBMS
    if not on_hbm and st.buffer != SBUF:
        raise nki_error("err_unsupported_memory", "type",
                        f"Expected operand 'src' of '{api}' to be in address space 'hbm|sbuf', "
                        f"but got a tile in '{st.buffer}' instead.")
    m = eval_mask(mask, src.shape)
    vals = np.array(np.transpose(src._read(m if on_hbm else None), perm), copy=True)
    check_partitions(vals.shape, api, "result")
    di = st.di
    odi = _ops.out_info(dtype, di)
    if odi is not di:
        vals = odi.round(vals)
    cnt = src._count(m)
    rate = ctx.tgt.dma_transpose_hbm_rate if on_hbm else ctx.tgt.dma_transpose_sbuf_rate
    ctx.rec.dma(cnt * di.itemsize, di.itemsize, None, rate=rate,
                read=st.name if on_hbm else None)
    mm = None if not isinstance(m, np.ndarray) else np.transpose(m, perm)
    if m is False:
        mm = False
    return make_result(ctx, vals, odi, mm, tag="dma", api=api, rounded=True)


def builtin_custom_op(*args, **kwargs):
    raise NotImplementedError("nisa.builtin_custom_op is not supported by the simulator")


# -- MX (NeuronCore-v4): nc_matmul_mx, quantize_mx ------------------------------------------------
def _need_v4(ctx, api):
    if ctx.tgt.nc_version < 4:
        raise hw_error("type", f"'{api}' is available only on NeuronCore-v4 and newer "
                               f"(trn3); the target is {ctx.tgt.name}")


def _mx_exps(t, api, pname):
    """Biased E8M0 exponents held by scale tile ``t`` (uint8 or float8_e8m0fnu)."""
    a, di = tile_operand(t, api, pname)
    if di.name == "uint8":
        return a.astype(np.int32)
    if di.name == "float8_e8m0fnu":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.rint(np.log2(a.astype(np.float64)) + 127).astype(np.int32)
    raise nki_error("err_param_dtype_mismatch", "type",
                    f"'{api}': '{pname}' must be float8_e8m0fnu or uint8, got {di.name}")


def _mx_scales_of(t, api, pname, P, F):
    """``[P // 8, F]`` exponents of the groups of a ``P``-partition data tile, read from scale
    tile ``t`` at the quadrant-spread partitions (``_mx.scale_partition``)."""
    from . import _mx
    need = _mx.scale_rows_needed(P)
    if t.shape[0] < need or _free(t.shape) < F:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"'{api}': '{pname}' {fmt_shape(t.shape)} cannot hold the scales of "
                        f"a {P}-partition data tile with {F} packed elements per partition: "
                        f"it needs {need} partitions (4 per 32-partition quadrant, at the "
                        f"quadrant's start) and {F} elements per partition")
    e = _mx_exps(t, api, pname).reshape(t.shape[0], -1)
    return e[_mx.scale_partition(np.arange(P // 8)), :F]


def nc_matmul_mx(stationary, moving, stationary_scale, moving_scale, *, tile_position=(),
                 tile_size=(), out_bf16=False):
    """MXFP8/MXFP4 matmul on TensorE (NeuronCore-v4): ``[M, N]`` fp32 PSUM result of the
    dequantized ``stationary`` [P, M] and ``moving`` [P, N] (``*_x4`` packed, SBUF),
    contracting over the P partitions and the 4 values of each packed element."""
    from . import _mx
    ctx = enter()
    api = "nc_matmul_mx"
    _need_v4(ctx, api)
    sa, sdi = tile_operand(stationary, api, "stationary")
    ma, mdi = tile_operand(moving, api, "moving")
    for t, nm in ((stationary, "stationary"), (moving, "moving"),
                  (stationary_scale, "stationary_scale"), (moving_scale, "moving_scale")):
        _sbuf_only(t, api, nm)
    for di, nm in ((sdi, "stationary"), (mdi, "moving")):
        if di.name not in _mx.ELEM:
            raise nki_error("err_param_dtype_mismatch", "type",
                            f"'{api}': '{nm}' must be float8_e5m2_x4, float8_e4m3fn_x4 or "
                            f"float4_e2m1fn_x4, got {di.name}")
    P, Pm = stationary.shape[0], moving.shape[0]
    if P != Pm or P % 32 or P > _hw.NUM_PARTITIONS:
        raise nki_error("err_param_shape_incompatible_with_matmul", "value",
                        f"'{api}': stationary{fmt_shape(stationary.shape)} and moving"
                        f"{fmt_shape(moving.shape)} must have the same partition size, a "
                        f"multiple of 32 and at most 128")
    M, N = _free(stationary.shape), _free(moving.shape)
    if M % 2 or M > _hw.GEMM_STATIONARY_FMAX:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"'{api}': the free size of stationary ({M}) must be even and at most "
                        f"{_hw.GEMM_STATIONARY_FMAX}")
    nmax = 8192 if out_bf16 else 4096
    if N > nmax:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"'{api}': the free size of moving ({N}) exceeds {nmax} (8 PSUM banks "
                        f"of {'bf16' if out_bf16 else 'fp32'})")
    if tile_position or tile_size:
        _check_pe_tiling(ctx, tile_position, tile_size, P, M)
    se = _mx_scales_of(stationary_scale, api, "stationary_scale", P, M)
    me = _mx_scales_of(moving_scale, api, "moving_scale", P, N)
    res = _mx.matmul(sa.reshape(P, M), sdi.name, se, ma.reshape(P, N), mdi.name, me)
    # 315 MXFP8 TFLOPS per NC-v4 = 4 x its 79 BF16 TFLOPS (nki-today.md section 4): each moving
    # row carries 4x the contraction of a BF16 row in the same cycles
    ctx.rec.add("tensor", _cost.matmul_cycles(M, N, False))
    oshape = (M,) + tuple(moving.shape[1:])
    return make_result(ctx, res.reshape(oshape), F32, tag="matmul_mx", buffer=PSUM, api=api,
                       rounded=True)


def quantize_mx(src, out_name):
    """MXFP8 quantization on VectorE (NeuronCore-v4): ``(packed [P, F // 4] result tile,
    biased exponents [P // 8, F // 4])`` of fp16/bf16 ``src`` [P, F] (SBUF). The caller places
    the exponents in its scale tile."""
    from . import _mx
    ctx = enter()
    api = "quantize_mx"
    _need_v4(ctx, api)
    a, di = tile_operand(src, api, "src")
    _sbuf_only(src, api, "src")
    if di.name not in ("float16", "bfloat16"):
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"'{api}': 'src' must be float16 or bfloat16, got {di.name}")
    if out_name not in _mx.EMAX:
        raise nki_error("err_param_dtype_mismatch", "type",
                        f"'{api}': 'dst' must be float8_e5m2_x4 or float8_e4m3fn_x4, got "
                        f"{out_name}")
    P, F = src.shape[0], _free(src.shape)
    if P % 32 or P > _hw.NUM_PARTITIONS or F % 4:
        raise nki_error("err_param_shape_mismatch", "value",
                        f"'{api}': src{fmt_shape(src.shape)} must have a multiple of 32 "
                        f"partitions (at most 128) and a free size that is a multiple of 4")
    bits, exps = _mx.quantize(a.reshape(P, F).astype(np.float32), out_name)
    # UNCONFIRMED: not documented; charged as one VectorE pass over src (1 element per
    # partition per cycle, the MIN_II floor)
    ctx.rec.add("vector", _cost.ii(F))
    odi = next(d for d in _dtypes.ALL_DTYPES if _dtypes.info(d).name == out_name)
    return make_result(ctx, bits, _dtypes.info(odi), tag="quantize_mx", buffer=SBUF, api=api,
                       rounded=True), exps
