"""MX (OCP microscaling) numerics of NeuronCore-v4: the packed ``*_x4`` data types, the block
scales and the arithmetic of ``nki.isa.quantize_mx`` / ``nki.isa.nc_matmul_mx`` (AWS's 2.33
stub docstrings; docs/simulator.md, "The nki.* front end (NKI 0.7)").

* A scaling group is 8 partitions x 4 elements of one partition (32 values): for packed data,
  8 partitions x one ``*_x4`` element.
* Packed element k of a ``float8_*_x4`` value sits in bits 8k..8k+7 of its uint32, of a
  ``float4_e2m1fn_x4`` value in bits 4k..4k+3 of its uint16.
* Scales are E8M0 exponents (value ``2**(e - 127)``). In SBUF the scale of group g (partitions
  8g..8g+7) sits on partition ``32 * (g // 4) + g % 4``: 4 scale rows at the start of each
  32-partition quadrant the data spans (tutorial ``load_scales_scattered``; quantize_mx page).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

ELEM = {"float8_e5m2_x4": ml_dtypes.float8_e5m2, "float8_e4m3fn_x4": ml_dtypes.float8_e4m3fn,
        "float4_e2m1fn_x4": ml_dtypes.float4_e2m1fn}
#: largest unbiased exponent of the element type (quantize_mx "Scale calculation")
EMAX = {"float8_e5m2_x4": 15, "float8_e4m3fn_x4": 8}


def scale_partition(g):
    """SBUF partition (relative to the scale tile's start) of scaling group ``g``."""
    g = np.asarray(g)
    return 32 * (g // 4) + g % 4


def scale_rows_needed(p):
    """Partitions a scale tile must have for data on ``p`` partitions."""
    return int(scale_partition(p // 8 - 1)) + 1


def unpack(bits, name):
    """float32 values ``[..., F * 4]`` of packed ``bits`` ``[..., F]`` of MX type ``name``."""
    bits = np.ascontiguousarray(bits)
    if name == "float4_e2m1fn_x4":
        nib = (bits[..., None].astype(np.uint32) >> np.arange(0, 16, 4, dtype=np.uint32)) & 0xF
        vals = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    else:
        vals = bits.astype("<u4").view(np.uint8).reshape(bits.shape + (4,)) \
            .view(ELEM[name]).astype(np.float32)
    return vals.reshape(bits.shape[:-1] + (bits.shape[-1] * 4,))


def pack_fp8(vals, name):
    """uint32 ``[P, F // 4]`` packing float32 ``vals`` ``[P, F]`` cast (RNE) to the element type."""
    q = np.ascontiguousarray(np.asarray(vals, np.float32).astype(ELEM[name]))
    return q.view(np.uint8).reshape(q.shape[0], -1, 4).copy().view("<u4")[..., 0]


def quantize(src, name):
    """``(packed uint32 [P, F // 4], biased exponents int32 [P // 8, F // 4])`` of float32
    ``src`` ``[P, F]``: per group the scale ``2 ** (floor(log2(amax)) - (EMAX - 1))``,
    ``2 ** -127`` for an all-zero group (stub, "Scale calculation"); data = src / scale, cast
    to the element type with round-to-nearest-even."""
    P, F = src.shape
    src = np.asarray(src, np.float32)
    amax = np.abs(src).reshape(P // 8, 8, F // 4, 4).max(axis=(1, 3))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(amax)) - (EMAX[name] - 1)
    e = np.where(amax > 0, e, -127)
    e = np.clip(e, -127, 127).astype(np.int32)
    scale = np.repeat(np.repeat(np.exp2(e.astype(np.float64)), 8, axis=0), 4, axis=1)
    return pack_fp8((src / scale).astype(np.float32), name), e + 127


def dequantized(bits, name, exps):
    """float64 ``[P, F, 4]`` values of packed ``bits`` ``[P, F]`` with biased exponents
    ``exps`` ``[P // 8, F]`` (one per 8 partitions x one packed element)."""
    v = unpack(bits, name).astype(np.float64).reshape(bits.shape + (4,))
    s = np.exp2(np.repeat(np.asarray(exps, np.float64) - 127.0, 8, axis=0))
    return v * s[..., None]


def matmul(st_bits, st_name, st_exps, mv_bits, mv_name, mv_exps):
    """``[M, N]`` result of nc_matmul_mx: contraction over partitions and the 4 elements of
    each packed value, each operand scaled by its group's scale (float64, rounded once)."""
    s = dequantized(st_bits, st_name, st_exps)
    m = dequantized(mv_bits, mv_name, mv_exps)
    return np.einsum("kiq,kjq->ij", s, m).astype(np.float32)
