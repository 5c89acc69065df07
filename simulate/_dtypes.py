"""NKI data types: dtype objects, storage, rounding and type promotion (spec §10, §11).

Storage convention (how a tile's numpy backing array holds its values):

* float types (float32, bfloat16, float16, float8_e4m3, float8_e5m2, tfloat32) are backed by
  **float32 arrays whose values are already rounded to the declared type** (RNE via ml_dtypes;
  tfloat32 by RNE on the low 13 mantissa bits). Engines compute in fp32 and round on write.
* integer types are backed by their numpy integer dtype; ``bool_`` by numpy ``bool``.

Float -> integer conversion rounds to nearest even and saturates to the integer range (NaN -> 0).
This is an UNCONFIRMED modelling choice (see docs/simulator.md).
"""

from __future__ import annotations

import numpy as np
import ml_dtypes

from ._errors import nki_error

# ---- dtype objects (compare equal to the numpy dtypes / types users pass) --------------------
float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)   # IEEE-style E4M3 (max 240, has inf) [SPEC §10.1]
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)     # OCP E4M3 (max 448, no inf): trn3
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)   # E8M0 block scales (MXFP8): trn3
tfloat32 = np.dtype("V4")                        # opaque 4-byte type, as in the legacy stub
# MX packed types (NeuronCore-v4, nki.isa.nc_matmul_mx / quantize_mx): 4 quantized elements per
# element, held as their raw bits (uint32 for 4 x fp8, uint16 for 4 x fp4; element k of a pack
# in bits 8k.. / 4k.., little-endian as AWS's mx_cpu_utils packs them). Distinct dtypes: one-field
# records named after the type.
float8_e5m2_x4 = np.dtype([("float8_e5m2_x4", "<u4")])
float8_e4m3fn_x4 = np.dtype([("float8_e4m3fn_x4", "<u4")])
float4_e2m1fn_x4 = np.dtype([("float4_e2m1fn_x4", "<u2")])
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)
float32r = float32  # mentioned only in known issues (UNCONFIRMED); behaves as float32 here

_F32 = np.float32


def _round_identity(a):
    return a if a.dtype == _F32 else a.astype(_F32)


def _make_ml_rounder(mldt):
    def rnd(a):
        if a.dtype != _F32:
            a = a.astype(_F32)
        return a.astype(mldt).astype(_F32)
    return rnd


def _round_tf32(a):
    a = np.array(a, dtype=_F32, copy=True)
    b = a.view(np.uint32)
    finite = (b & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    lsb = (b >> np.uint32(13)) & np.uint32(1)
    r = (b + np.uint32(0xFFF) + lsb) & np.uint32(0xFFFFE000)
    b[...] = np.where(finite, r, b)
    return a


def _make_int_rounder(dt):
    info = np.iinfo(dt)
    lo, hi = float(info.min), float(info.max)

    def rnd(a):
        if a.dtype == dt:
            return a
        if a.dtype.kind == "f":
            a = np.nan_to_num(np.rint(a), nan=0.0, posinf=hi, neginf=lo)
            return np.clip(a, lo, hi).astype(dt)
        if a.dtype.kind == "b":
            return a.astype(dt)
        return np.clip(a, info.min, info.max).astype(dt)
    return rnd


def _round_bool(a):
    return a if a.dtype == np.bool_ else (a != 0)


class DInfo:
    """Static facts about one NKI dtype. ``round(arr)`` returns a backing-dtype array."""

    __slots__ = ("dt", "name", "kind", "backing", "itemsize", "round", "is_float", "is_int",
                 "rank", "bits", "sentinel", "out_np")

    def __init__(self, dt, name, kind, backing, itemsize, rnd, rank, sentinel, out_np):
        self.dt = dt
        self.name = name
        self.kind = kind              # 'f' float, 'i' signed int, 'u' unsigned int, 'b' bool
        self.backing = np.dtype(backing)
        self.itemsize = itemsize
        self.round = rnd
        self.is_float = kind == "f"
        self.is_int = kind in "iu"
        self.rank = rank              # float precision rank / int bit width
        self.bits = itemsize * 8
        self.sentinel = sentinel      # fill value of uninitialised memory
        self.out_np = np.dtype(out_np)  # dtype of arrays handed back to the host

    def __repr__(self):
        return f"DInfo({self.name})"


_INFO = {}


def _reg(dt, name, kind, backing, itemsize, rnd, rank, sentinel, out_np):
    _INFO[dt] = DInfo(dt, name, kind, backing, itemsize, rnd, rank, sentinel, out_np)


_NAN = np.float32(np.nan)
_reg(float32, "float32", "f", _F32, 4, _round_identity, 5, _NAN, _F32)
_reg(tfloat32, "tfloat32", "f", _F32, 4, _round_tf32, 4, _NAN, _F32)
_reg(bfloat16, "bfloat16", "f", _F32, 2, _make_ml_rounder(ml_dtypes.bfloat16), 3, _NAN, bfloat16)
_reg(float16, "float16", "f", _F32, 2, _make_ml_rounder(np.float16), 3, _NAN, np.float16)
_reg(float8_e4m3, "float8_e4m3", "f", _F32, 1, _make_ml_rounder(ml_dtypes.float8_e4m3), 1,
     _NAN, float8_e4m3)
_reg(float8_e5m2, "float8_e5m2", "f", _F32, 1, _make_ml_rounder(ml_dtypes.float8_e5m2), 1,
     _NAN, float8_e5m2)
_reg(float8_e4m3fn, "float8_e4m3fn", "f", _F32, 1, _make_ml_rounder(ml_dtypes.float8_e4m3fn), 1,
     _NAN, float8_e4m3fn)
_reg(float8_e8m0fnu, "float8_e8m0fnu", "f", _F32, 1,
     _make_ml_rounder(ml_dtypes.float8_e8m0fnu), 1, _NAN, float8_e8m0fnu)


def _make_packed_rounder(backing):
    bt = np.dtype(backing)

    def rnd(a):
        if a.dtype == bt:
            return a
        if a.dtype.kind not in "iu":
            raise TypeError(f"MX packed data holds raw bits; cannot convert {a.dtype} values "
                            f"(quantize with nki.isa.quantize_mx)")
        return a.astype(bt)
    return rnd


# kind 'p': packed raw bits; no arithmetic, only copies and the MX instructions read them
for _dt, _nm, _bk in ((float8_e5m2_x4, "float8_e5m2_x4", np.uint32),
                      (float8_e4m3fn_x4, "float8_e4m3fn_x4", np.uint32),
                      (float4_e2m1fn_x4, "float4_e2m1fn_x4", np.uint16)):
    _reg(_dt, _nm, "p", _bk, np.dtype(_bk).itemsize, _make_packed_rounder(_bk), 0,
         np.iinfo(_bk).max, _bk)
MX_PACKED = {"float8_e5m2_x4": ml_dtypes.float8_e5m2, "float8_e4m3fn_x4": ml_dtypes.float8_e4m3fn,
             "float4_e2m1fn_x4": ml_dtypes.float4_e2m1fn}

# Integer sentinel: the type's maximum (a likely out-of-bounds index / overflow) (choice).
for _dt, _nm, _k in ((int8, "int8", "i"), (int16, "int16", "i"), (int32, "int32", "i"),
                     (uint8, "uint8", "u"), (uint16, "uint16", "u"), (uint32, "uint32", "u")):
    _reg(_dt, _nm, _k, _dt, _dt.itemsize, _make_int_rounder(_dt), _dt.itemsize * 8,
         np.iinfo(_dt).max, _dt)
_reg(bool_, "bool", "b", np.bool_, 1, _round_bool, 1, True, np.bool_)

ALL_DTYPES = tuple(_INFO)

# Host arrays of types without an NKI equivalent are narrowed (documented in docs/simulator.md).
_HOST_NARROW = {np.dtype(np.float64): float32, np.dtype(np.int64): int32,
                np.dtype(np.uint64): uint32, np.dtype(np.longdouble): float32}

_cache = {}


def info(dtype) -> DInfo:
    """DInfo of a dtype given as np.dtype, numpy type, ml_dtypes type or string.

    Raises err_unsupported_dtype_value (ValueError) for anything else."""
    try:
        return _cache[dtype]
    except (KeyError, TypeError):
        pass
    di = None
    try:
        if isinstance(dtype, DInfo):
            return dtype
        nd = np.dtype(dtype)
        di = _INFO.get(nd)
    except TypeError:
        di = None
    if di is None:
        raise nki_error(
            "err_unsupported_dtype_value", "value",
            f"Unsupported dtype '{dtype}', expected one of "
            + ", ".join(i.name for i in _INFO.values()))
    try:
        _cache[dtype] = di
    except TypeError:
        pass
    return di


def host_info(np_dtype) -> DInfo:
    """NKI dtype used for a host array of numpy dtype ``np_dtype`` (float64 -> float32 ...)."""
    nd = np.dtype(np_dtype)
    nd = _HOST_NARROW.get(nd, nd)
    return info(nd)


def check_target(di: DInfo, tgt, what: str) -> None:
    """Refuse an 8-bit float format the target does not define (a TypeError naming it):
    trn1/trn2 have IEEE-style E4M3 (max 240) and E5M2; trn3 has OCP E4M3 (max 448), E5M2 and
    E8M0 scales (``_hw.Target.fp8_dtypes``; nki-today.md §4)."""
    if di.itemsize == 1 and di.kind == "f" and di.name not in tgt.fp8_dtypes:
        raise TypeError(
            f"{what}: dtype {di.name} is not an 8-bit float format of {tgt.name}; "
            f"{tgt.name} supports {', '.join(tgt.fp8_dtypes)}")


F32 = _INFO[float32]
BF16 = _INFO[bfloat16]
I32 = _INFO[int32]
U8 = _INFO[uint8]
U32 = _INFO[uint32]
BOOL = _INFO[bool_]


# ---- promotion (spec §11.2) -----------------------------------------------------------------
_FLOAT_BY_RANK = {5: float32, 4: tfloat32}


def _promote_float(a: DInfo, b: DInfo) -> DInfo:
    if a is b:
        return a
    if a.rank != b.rank:
        hi, lo = (a, b) if a.rank > b.rank else (b, a)
        return hi
    # same rank, different types: fp16+bf16 -> fp32; e4m3+e5m2 -> bf16
    if a.rank == 3:
        return F32
    return BF16


_SIGNED = {8: int8, 16: int16, 32: int32}
_UNSIGNED = {8: uint8, 16: uint16, 32: uint32}


def _promote_int(a: DInfo, b: DInfo) -> DInfo:
    if a is b:
        return a
    if a.kind == b.kind:
        return a if a.bits >= b.bits else b
    s, u = (a, b) if a.kind == "i" else (b, a)
    if s.bits > u.bits:
        return s
    nb = u.bits * 2
    if nb > 32:
        return F32        # int32 + uint32 -> fp32 (no 64-bit ints on hardware)
    return _INFO[_SIGNED[nb]]


def promote(a: DInfo, b: DInfo) -> DInfo:
    """Result dtype of a binary op on two typed operands."""
    if a is b:
        return a
    if a.kind == "b":
        return b
    if b.kind == "b":
        return a
    if a.is_float and b.is_float:
        return _promote_float(a, b)
    if a.is_float:
        return a
    if b.is_float:
        return b
    return _promote_int(a, b)


def weak_scalar_info(v) -> DInfo:
    """Weakly typed Python scalars take the widest type of their kind (spec §11.2)."""
    if isinstance(v, (bool, np.bool_)):
        return U8 if isinstance(v, bool) else BOOL
    if isinstance(v, np.generic):
        return host_info(v.dtype)
    if isinstance(v, int):
        return I32
    return F32
