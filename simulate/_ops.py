"""Element-wise math, ALU op registry and the shared unary / binary / reduction engines used by
``language`` and ``isa`` (spec §8, §9, §11).

All arithmetic is done in fp32 (VectorE/ScalarE convert inputs to fp32 and round on output);
integer add/subtract/multiply between two integer tiles are exact (they lower to GpSimdE);
bitvec ops work on the integer bit patterns.
"""

from __future__ import annotations

import numpy as np

from . import _cost, _dtypes, _strict
from ._dtypes import F32, BOOL
from ._errors import nki_error, fmt_shape
from ._index import eval_mask
from ._tensor import Tensor, tile_operand, make_result, PSUM, SBUF
from ._runtime import enter

f32 = np.float32

# =============================================================================================
# transcendental helpers (fp32 in, fp32 out, computed in fp64 where cheap accuracy matters)
# =============================================================================================
_ERF_T = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
          -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def erf(x):
    """erf with abs error < 2e-7: Taylor series for |x| < 0.5, Numerical Recipes' Chebyshev
    erfc (fractional error < 1.2e-7) elsewhere. (No scipy.)"""
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = _ERF_T[-1]
    for c in _ERF_T[-2::-1]:
        poly = c + t * poly
    erfc = t * np.exp(-z * z + poly)
    big = np.where(x >= 0, 1.0 - erfc, erfc - 1.0)
    x2 = x * x
    small = (2.0 / np.sqrt(np.pi)) * x * (
        1.0 + x2 * (-1.0 / 3 + x2 * (1.0 / 10 + x2 * (-1.0 / 42 + x2 * (
            1.0 / 216 + x2 * (-1.0 / 1320 + x2 * (1.0 / 9360)))))))
    return np.where(z < 0.5, small, big)


def _sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(f32)


def _softplus(x):
    return np.logaddexp(f32(0), x)


def _gelu(x):
    xd = x.astype(np.float64)
    return (0.5 * xd * (1.0 + erf(xd / np.sqrt(2.0)))).astype(f32)


def _gelu_dx(x):
    xd = x.astype(np.float64)
    cdf = 0.5 * (1.0 + erf(xd / np.sqrt(2.0)))
    pdf = np.exp(-0.5 * xd * xd) / np.sqrt(2.0 * np.pi)
    return (cdf + xd * pdf).astype(f32)


def _gelu_tanh(x):
    xd = x.astype(np.float64)
    return (0.5 * xd * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (xd + 0.044715 * xd ** 3)))
            ).astype(f32)


def _gelu_sigmoid(x):
    # x * sigmoid(1.702 x) -- constant UNCONFIRMED (spec §8.3)
    return (x * _sigmoid(f32(1.702) * x)).astype(f32)


def _silu(x):
    return (x * _sigmoid(x)).astype(f32)


def _silu_dx(x):
    s = _sigmoid(x)
    return (s * (1 + x * (1 - s))).astype(f32)


def _erf(x):
    return erf(x).astype(f32)


def _erf_dx(x):
    xd = x.astype(np.float64)
    return (2.0 / np.sqrt(np.pi) * np.exp(-xd * xd)).astype(f32)


def _mish(x):
    return (x * np.tanh(_softplus(x))).astype(f32)


def _rsqrt(x):
    return (1.0 / np.sqrt(x)).astype(f32)


def _recip(x):
    return (f32(1.0) / x).astype(f32)


def _relu(x):
    return np.maximum(x, f32(0))


def _copy(x):
    return np.array(x, dtype=f32, copy=True)


def _square(x):
    return x * x


# name -> (fp32 function, lowering engine). "scalar" = ScalarE activation table (spec §11.4).
UNARY = {
    "exp": (np.exp, "scalar"), "log": (np.log, "scalar"), "sqrt": (np.sqrt, "scalar"),
    "rsqrt": (_rsqrt, "scalar"), "reciprocal": (_recip, "scalar"), "sin": (np.sin, "scalar"),
    "cos": (np.cos, "scalar"), "tan": (np.tan, "scalar"), "tanh": (np.tanh, "scalar"),
    "arctan": (np.arctan, "scalar"), "sigmoid": (_sigmoid, "scalar"), "relu": (_relu, "scalar"),
    "gelu": (_gelu, "scalar"), "gelu_dx": (_gelu_dx, "scalar"),
    "gelu_apprx_tanh": (_gelu_tanh, "scalar"), "gelu_apprx_sigmoid": (_gelu_sigmoid, "scalar"),
    "silu": (_silu, "scalar"), "silu_dx": (_silu_dx, "scalar"), "erf": (_erf, "scalar"),
    "erf_dx": (_erf_dx, "scalar"), "softplus": (_softplus, "scalar"), "mish": (_mish, "scalar"),
    "square": (_square, "scalar"), "abs": (np.abs, "scalar"), "negative": (np.negative, "vector"),
    "sign": (np.sign, "scalar"), "trunc": (np.trunc, "vector"), "floor": (np.floor, "vector"),
    "ceil": (np.ceil, "vector"), "copy": (_copy, "scalar"),
}
# activation functions accepted by nisa.activation(op=...) (spec §11.4)
ACTIVATION_NAMES = {"copy", "square", "sigmoid", "relu", "gelu", "gelu_dx", "gelu_apprx_tanh",
                    "gelu_apprx_sigmoid", "silu", "silu_dx", "tanh", "softplus", "mish", "erf",
                    "erf_dx", "exp", "log", "sin", "arctan", "sqrt", "rsqrt", "reciprocal",
                    "sign", "abs", "cos", "negative", "identity"}


# =============================================================================================
# ALU ops
# =============================================================================================
def _logical(fn):
    return lambda a, b: fn(a != 0, b != 0)


def _shift_right(a, b):
    # logical right shift on the bit pattern (arithmetic right shift unsupported, §11.3)
    if a.dtype.kind == "i":
        u = a.astype(np.dtype(f"u{a.dtype.itemsize}"))
        return np.right_shift(u, b.astype(u.dtype) if hasattr(b, "astype") else b)
    return np.right_shift(a, b)


class Op:
    __slots__ = ("name", "kind", "fn", "red", "ident", "engine")

    def __init__(self, name, kind, fn, red=None, ident=None):
        self.name = name
        self.kind = kind          # 'arith' | 'bitvec' | 'cmp' | 'logical'
        self.fn = fn
        self.red = red            # numpy reduction function (legal as reduce op) or None
        self.ident = ident


BINARY = {
    "add": Op("add", "arith", np.add, np.sum, 0.0),
    "subtract": Op("subtract", "arith", np.subtract, None, 0.0),
    "multiply": Op("multiply", "arith", np.multiply, np.prod, 1.0),
    "divide": Op("divide", "arith", np.divide),
    "power": Op("power", "arith", np.power),
    "maximum": Op("maximum", "arith", np.maximum, np.max, -np.inf),
    "minimum": Op("minimum", "arith", np.minimum, np.min, np.inf),
    "mod": Op("mod", "arith", np.mod),
    "fmod": Op("fmod", "arith", np.fmod),
    "bitwise_and": Op("bitwise_and", "bitvec", np.bitwise_and, np.bitwise_and.reduce, -1),
    "bitwise_or": Op("bitwise_or", "bitvec", np.bitwise_or, np.bitwise_or.reduce, 0),
    "bitwise_xor": Op("bitwise_xor", "bitvec", np.bitwise_xor, np.bitwise_xor.reduce, 0),
    "left_shift": Op("left_shift", "bitvec", np.left_shift),
    "right_shift": Op("right_shift", "bitvec", _shift_right),
    "equal": Op("equal", "cmp", np.equal),
    "not_equal": Op("not_equal", "cmp", np.not_equal),
    "greater": Op("greater", "cmp", np.greater),
    "greater_equal": Op("greater_equal", "cmp", np.greater_equal),
    "less": Op("less", "cmp", np.less),
    "less_equal": Op("less_equal", "cmp", np.less_equal),
    "logical_and": Op("logical_and", "logical", _logical(np.logical_and),
                      lambda a, axis, keepdims=False: np.all(a != 0, axis=axis, keepdims=keepdims),
                      1.0),
    "logical_or": Op("logical_or", "logical", _logical(np.logical_or),
                     lambda a, axis, keepdims=False: np.any(a != 0, axis=axis, keepdims=keepdims),
                     0.0),
    "logical_xor": Op("logical_xor", "logical", _logical(np.logical_xor),
                      lambda a, axis, keepdims=False: np.logical_xor.reduce(
                          a != 0, axis=axis, keepdims=keepdims), 0.0),
}

# op objects (nl.* functions and numpy functions) -> name; filled by language.py
OP_BY_OBJ = {}


def _reg_np():
    m = OP_BY_OBJ
    for name, obj in [("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply),
                      ("divide", np.divide), ("divide", np.true_divide), ("power", np.power),
                      ("maximum", np.maximum), ("minimum", np.minimum), ("maximum", np.max),
                      ("maximum", np.amax), ("minimum", np.min), ("minimum", np.amin),
                      ("add", np.sum), ("multiply", np.prod),
                      ("mod", np.mod), ("fmod", np.fmod), ("bitwise_and", np.bitwise_and),
                      ("bitwise_or", np.bitwise_or), ("bitwise_xor", np.bitwise_xor),
                      ("left_shift", np.left_shift), ("right_shift", np.right_shift),
                      ("equal", np.equal), ("not_equal", np.not_equal),
                      ("greater", np.greater), ("greater_equal", np.greater_equal),
                      ("less", np.less), ("less_equal", np.less_equal),
                      ("logical_and", np.logical_and), ("logical_or", np.logical_or),
                      ("logical_xor", np.logical_xor)]:
        m[obj] = name
    for name, obj in [("exp", np.exp), ("log", np.log), ("sqrt", np.sqrt), ("sin", np.sin),
                      ("cos", np.cos), ("tan", np.tan), ("tanh", np.tanh),
                      ("arctan", np.arctan), ("abs", np.abs), ("abs", np.absolute),
                      ("negative", np.negative), ("sign", np.sign), ("square", np.square),
                      ("copy", np.copy), ("reciprocal", np.reciprocal), ("floor", np.floor),
                      ("ceil", np.ceil), ("trunc", np.trunc), ("invert", np.invert),
                      ("logical_not", np.logical_not)]:
        m[obj] = name


_reg_np()


def op_name(op, api, param="op"):
    try:
        return OP_BY_OBJ[op]
    except (KeyError, TypeError):
        pass
    if isinstance(op, str):
        return op
    raise nki_error("err_instruction_unsupported_op", "syntax",
                    f"{getattr(op, '__name__', op)!s} is not supported in '{api}' ('{param}')")


def binary_op(op, api, param="op"):
    name = op_name(op, api, param)
    try:
        return BINARY[name]
    except KeyError:
        raise nki_error("err_instruction_unsupported_op", "syntax",
                        f"{name} is not supported in '{api}' ('{param}')") from None


def apply_binary(o: Op, a, b):
    """Apply ALU op ``o`` to fp32 (or integer for bitvec) operands."""
    if o.kind == "bitvec":
        return o.fn(_as_int(a), _as_int(b))
    r = o.fn(a, b)
    if o.kind in ("cmp", "logical"):
        return r.astype(f32) if isinstance(r, np.ndarray) else f32(r)
    return r


def _as_int(a):
    if isinstance(a, np.ndarray):
        if a.dtype.kind == "f":
            return a.astype(np.int64)
        if a.dtype == np.bool_:
            return a.astype(np.uint8)
        return a
    return int(a)


# =============================================================================================
# operand helpers
# =============================================================================================
def free_size(shape):
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def rpad(a, nd):
    """Right-pad a rank-deficient operand with unit dims (partition-aligned broadcast, §3.6)."""
    if 0 < a.ndim < nd:
        return a.reshape(a.shape + (1,) * (nd - a.ndim))
    return a


def scalar_or_tile(x, api, pname):
    """(array, DInfo, Tensor-or-None) for a tile or a (weakly typed) scalar operand."""
    if type(x) is Tensor:
        a, di = tile_operand(x, api, pname)
        return a, di, x
    _strict.refuse_scalar_operand(x)
    if isinstance(x, (bool, np.bool_, int, float, np.number)):
        di = _dtypes.weak_scalar_info(x)
        if di.is_float:
            return f32(x), di, None
        return np.int64(x), di, None
    raise TypeError(f"operand '{pname}' of '{api}' must be a tile or a scalar, got "
                    f"{type(x).__name__}")


def to_f32(a):
    if isinstance(a, np.ndarray):
        return a if a.dtype == f32 else a.astype(f32)
    return f32(a)


def out_info(dtype, default):
    return default if dtype is None else _dtypes.info(dtype)


def broadcast_shape(shapes, api, names):
    nd = max((len(s) for s in shapes), default=0)
    padded = [tuple(s) + (1,) * (nd - len(s)) if len(s) else tuple(s) for s in shapes]
    try:
        return np.broadcast_shapes(*padded), nd
    except ValueError:
        raise nki_error(
            "err_param_shape_incompatible_with_numpy", "value",
            f"operands of '{api}' could not be broadcast together with shapes "
            + ", ".join(f"{n}{fmt_shape(s)}" for n, s in zip(names, shapes))) from None


def is16(di):
    return di.is_float and di.itemsize == 2


# =============================================================================================
# engines
# =============================================================================================
def unary(api, name, x, dtype=None, mask=None):
    ctx = enter()
    a, di = tile_operand(x, api, "x")
    fn, eng = UNARY[name]
    odi = out_info(dtype, di)
    res = fn(to_f32(a))
    if res is a:
        res = res.copy()
    m = eval_mask(mask, x.shape)
    n = free_size(x.shape)
    if eng == "scalar":
        _cost.charge(ctx, "scalar", _cost.act_cycles, n)
    else:
        _cost.charge(ctx, "vector", _cost.ii, n)
    return make_result(ctx, res, odi, m, api=api)


def unary_int(api, fn, x, dtype=None, mask=None):
    ctx = enter()
    a, di = tile_operand(x, api, "x")
    odi = out_info(dtype, di)
    res = fn(a)
    m = eval_mask(mask, x.shape)
    _cost.charge(ctx, "vector", _cost.ii, free_size(x.shape))
    return make_result(ctx, np.asarray(res), odi, m, api=api)


def binary(api, name, x, y, dtype=None, mask=None):
    ctx = enter()
    o = BINARY[name]
    xa, xdi, xt = scalar_or_tile(x, api, "x")
    ya, ydi, yt = scalar_or_tile(y, api, "y")
    if xt is None and yt is None:
        raise TypeError(f"'{api}' needs at least one tile operand")
    if o.kind in ("cmp", "logical"):
        odi = out_info(dtype, BOOL)
    elif name == "divide" and not xdi.is_float and not ydi.is_float:
        # true division, as in NumPy: an integer quotient is float32 unless dtype= says
        # otherwise (inferred, not documented: AWS vision.py resize_nearest floors
        # ``int32_iota / out_w`` and its hardware test expects the floor of the true quotient)
        odi = out_info(dtype, _dtypes.info(_dtypes.float32))
    else:
        odi = out_info(dtype, _dtypes.promote(xdi, ydi))
    xs = xt.shape if xt is not None else ()
    ys = yt.shape if yt is not None else ()
    shape, nd = broadcast_shape([xs, ys], api, ["x", "y"])
    if isinstance(xa, np.ndarray):
        xa = rpad(xa, nd)
    if isinstance(ya, np.ndarray):
        ya = rpad(ya, nd)
    engine = "vector"
    if o.kind == "bitvec":
        if xdi.is_float or ydi.is_float:
            raise nki_error("err_bitvec_operand_must_be_integer", "syntax",
                            f"bitvec operator '{name}' requires integer operands, got "
                            f"{xdi.name} and {ydi.name}")
        res = o.fn(_as_int(xa), _as_int(ya))
        res = np.asarray(res)
        if odi.is_int:
            res = res.astype(odi.backing)     # bit patterns wrap
    elif (name in ("add", "subtract", "multiply") and xt is not None and yt is not None
          and xdi.is_int and ydi.is_int):
        # 32-bit integer add/multiply are exact on GpSimdE (spec §9.7, §10.2)
        res = o.fn(xa.astype(np.int64), ya.astype(np.int64))
        engine = "gpsimd"
    else:
        res = apply_binary(o, to_f32(xa), to_f32(ya))
    res = np.asarray(res)
    if res.shape != shape:
        res = np.broadcast_to(res, shape).copy()
    m = eval_mask(mask, shape)
    _charge_binary(ctx, engine, xt, yt, xdi, ydi, shape)
    return make_result(ctx, res, odi, m, api=api)


def _charge_binary(ctx, engine, xt, yt, xdi, ydi, shape):
    n = free_size(shape)
    rec = ctx.rec
    if engine == "gpsimd":
        _cost.charge(ctx, "gpsimd", _cost.gpsimd_cycles, n)
        return
    if xt is not None and yt is not None and len(shape):
        px = xt.shape[0] if xt.ndim else 1
        py = yt.shape[0] if yt.ndim else 1
        if px != py:
            # partition broadcast: ones-matmul on TensorE (spec §3.6)
            rec.add("tensor", _cost.matmul_cycles(shape[0], n, False))
        fx, fy = free_size(xt.shape), free_size(yt.shape)
        if fx > 1 and fy > 1:
            flags = (xt._st.buffer == PSUM, yt._st.buffer == PSUM,
                     xdi is _dtypes.BF16 and ydi is _dtypes.BF16
                     and xt._st.buffer == SBUF and yt._st.buffer == SBUF)
            _cost.charge(ctx, "vector", lambda k: _cost.tensor_tensor_cycles(k, *flags), n)
            return
    t = xt if xt is not None and (yt is None or free_size(xt.shape) >= free_size(yt.shape)) \
        else yt
    di = xdi if t is xt else ydi
    tgt, psum_in, b16 = ctx.tgt, t._st.buffer == PSUM, is16(di)
    _cost.charge(ctx, "vector",
                 lambda k: _cost.tensor_scalar_cycles(tgt, k, psum_in, False, b16, b16), n)


def norm_axes(axis, ndim, api):
    if axis is None:
        raise nki_error("err_operand_cannot_be_none", "value", f"'axis' of '{api}' cannot be None.")
    if isinstance(axis, (list, tuple)):
        axes = [int(a) for a in axis]
    else:
        axes = [int(axis)]
    out = []
    for a in axes:
        if a < 0:
            a += ndim
        if a == 0:
            raise nki_error("err_unsupported_reduction_axis", "value",
                            f"'{api}' cannot reduce along the partition dimension (axis 0); "
                            "use nisa.tensor_partition_reduce, a transpose or a ones-matmul")
        if a >= ndim or a < 0:
            raise ValueError(f"axis {axis} is out of range for a {ndim}-D tile in '{api}'")
        out.append(a)
    return tuple(sorted(set(out)))


_RED_FN = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}
_RED_IDENT = {"sum": 0.0, "max": -np.inf, "min": np.inf, "prod": 1.0}


def reduce(api, kind, x, axis, dtype=None, mask=None, keepdims=False, negate=False,
           charge=True, ctx=None):
    """Free-axis reduction. ``kind``: sum/max/min/prod/mean/var/all or an Op (isa)."""
    if ctx is None:
        ctx = enter()
    a, di = tile_operand(x, api, "x")
    axes = norm_axes(axis, x.ndim, api)
    m_in = eval_mask(mask, x.shape)
    af = to_f32(a)
    count = None
    if isinstance(kind, Op):
        o = kind
        if o.red is None:
            raise nki_error("err_instruction_unsupported_op", "syntax",
                            f"{o.name} is not supported in '{api}'")
        if o.kind == "bitvec":
            if di.is_float:
                raise nki_error("err_reduce_bitvec_op_invalid_dtype", "syntax",
                                f"bitvec reduction '{o.name}' in '{api}' requires an integer "
                                f"input, got {di.name}")
            src = a.astype(np.int64)
            if isinstance(m_in, np.ndarray):
                src = np.where(m_in, src, o.ident)
            res = o.red(src, axis=axes, keepdims=keepdims)
        else:
            src = af
            if isinstance(m_in, np.ndarray):
                src = np.where(m_in, af, f32(o.ident))
            res = o.red(src, axis=axes, keepdims=keepdims)
        if negate:
            if o.kind != "arith":
                raise nki_error("err_reduce_unsupported_negate", "syntax",
                                "negate option can only be used with arithmetic ops in "
                                f"'{api}', got {o.name}")
            res = -np.asarray(res, dtype=f32)
        addmax = o.name in ("add", "maximum")
    else:
        if kind in _RED_FN:
            src = af if not isinstance(m_in, np.ndarray) else np.where(m_in, af,
                                                                         f32(_RED_IDENT[kind]))
            res = _RED_FN[kind](src, axis=axes, keepdims=keepdims)
        elif kind == "mean":
            if isinstance(m_in, np.ndarray):
                count = np.maximum(m_in.sum(axis=axes, keepdims=keepdims), 1)
                res = np.where(m_in, af, 0).sum(axis=axes, keepdims=keepdims) / count
            else:
                res = af.mean(axis=axes, keepdims=keepdims, dtype=np.float64)
        elif kind == "var":
            if isinstance(m_in, np.ndarray):
                count = np.maximum(m_in.sum(axis=axes, keepdims=keepdims), 1)
                mu = np.where(m_in, af, 0).sum(axis=axes, keepdims=True) / np.maximum(
                    m_in.sum(axis=axes, keepdims=True), 1)
                res = (np.where(m_in, (af - mu) ** 2, 0)).sum(axis=axes, keepdims=keepdims) \
                    / count
            else:
                res = af.var(axis=axes, keepdims=keepdims, dtype=np.float64)
        elif kind == "all":
            src = a != 0
            if isinstance(m_in, np.ndarray):
                src = src | ~m_in
            res = np.all(src, axis=axes, keepdims=keepdims)
        else:
            raise ValueError(kind)
        addmax = kind in ("sum", "max")
    res = np.asarray(res)
    if res.dtype != np.bool_:
        res = res.astype(f32)
    if kind == "all":
        odi = out_info(dtype, BOOL)
    elif kind == "mean" and not di.is_float:
        odi = out_info(dtype, F32)
    else:
        odi = out_info(dtype, di)
    m_out = None
    if isinstance(m_in, np.ndarray):
        m_out = m_in.any(axis=axes, keepdims=keepdims)
        if m_out.all():
            m_out = None
    elif m_in is False:
        m_out = False
    if charge:
        ctx.rec.add("vector", _cost.tensor_reduce_cycles(
            free_size(x.shape), addmax and di is _dtypes.BF16 and odi is _dtypes.BF16))
    return make_result(ctx, res, odi, m_out, api=api)
