"""trn3 (NeuronCore-v4) as a target, and the 8-bit float formats each target defines.

Numbers from AWS's trn3 pages as collected in shared/reference (nki-today.md §4,
hardware-and-limits.md §2-§3): 79 BF16 TFLOPS per core, 32 MiB SBUF, 16 DMA engines at
38.4 GB/s (the DMA table's 33 B/ns), ScalarE's 2x mode for 16-bit copies; FP8 formats: IEEE-style
E4M3 and E5M2 on trn1/trn2, OCP E4M3 (max 448), E5M2 and E8M0 scales on trn3.
"""
import ml_dtypes
import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate import _hw


def test_trn3_resolves_by_name_and_generation():
    t = _hw.get_target("trn3")
    assert _hw.get_target("gen4") is t and _hw.get_target("TRN3") is t
    assert t.nc_version == 4
    assert t.sbuf_bytes_per_partition * 128 == 32 * 2 ** 20
    assert t.tensor_peak_flops == pytest.approx(79e12, rel=0.01)
    assert t.dma_bytes_per_s == 528e9


def _copy_kernel(dtype, engine):
    def kernel(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        x = nl.load(a)
        y = nisa.tensor_copy(x, dtype=dtype, engine=engine)
        nl.store(out, y)
        return out
    return kernel


def test_scalar_engine_copies_16_bit_data_twice_as_fast_on_trn3():
    a = np.ones((128, 2048), ml_dtypes.bfloat16)
    cyc = {}
    for tgt in ("trn2", "trn3"):
        with nki.measure(target=tgt) as m:
            nki.simulate_kernel(_copy_kernel(nl.bfloat16, nisa.scalar_engine), a)
        cyc[tgt] = m.engine_cycles["scalar"]
    assert cyc["trn2"] == 2048 and cyc["trn3"] == 1024
    f = np.ones((128, 2048), np.float32)            # fp32 keeps the 1x rate
    with nki.measure(target="trn3") as m:
        nki.simulate_kernel(_copy_kernel(nl.float32, nisa.scalar_engine), f)
    assert m.engine_cycles["scalar"] == 2048


def test_trn3_sbuf_capacity():
    def fill(a):
        keep = [nl.zeros((128, 30000), nl.float32) for _ in (0,) * 2]   # 240,000 B
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, 0.0)
        return out
    a = np.ones((1, 1), np.float32)
    with nki.measure(target="trn3"):
        nki.simulate_kernel(fill, a)                 # fits 256 KiB
    with nki.measure(target="trn2"), pytest.raises(RuntimeError, match="SBUF capacity"):
        nki.simulate_kernel(fill, a)                 # not 224 KiB


@pytest.mark.parametrize("target,dtype,ok", [
    ("trn2", ml_dtypes.float8_e4m3, True),
    ("trn2", ml_dtypes.float8_e5m2, True),
    ("trn2", ml_dtypes.float8_e4m3fn, False),
    ("trn3", ml_dtypes.float8_e4m3fn, True),
    ("trn3", ml_dtypes.float8_e5m2, True),
    ("trn3", ml_dtypes.float8_e4m3, False),
    ("trn1", ml_dtypes.float8_e4m3, True),
])
def test_fp8_formats_per_target(target, dtype, ok):
    """A format the target does not define is a TypeError naming it, never a silent cast."""
    a = (np.arange(128 * 4).reshape(128, 4) % 7).astype(dtype)

    def kernel(a):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.copy(nl.load(a), dtype=nl.float32))
        return out
    with nki.measure(target=target):
        if ok:
            np.testing.assert_array_equal(nki.simulate_kernel(kernel, a), a.astype(np.float32))
        else:
            with pytest.raises(TypeError, match=f"{np.dtype(dtype).name} is not an 8-bit float "
                                                f"format of {target}"):
                nki.simulate_kernel(kernel, a)


def test_ocp_e4m3_rounds_and_saturates_as_its_format():
    """trn3's OCP E4M3 holds up to 448 (IEEE-style E4M3: 240); values round to it."""
    a = np.array([[300.0, 448.0, 0.1]] * 128, np.float32)

    def kernel(a):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        y = nl.copy(nl.load(a), dtype=ml_dtypes.float8_e4m3fn)
        nl.store(out, nl.copy(y, dtype=nl.float32))
        return out
    with nki.measure(target="trn3"):
        out = nki.simulate_kernel(kernel, a)
    np.testing.assert_array_equal(out, a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert out[0, 1] == 448.0
