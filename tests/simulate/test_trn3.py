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
import simulate.nki as nki7             # the nki.* (NKI 0.7) front end: the API trn3 runs
from simulate import _hw

nl7, nisa7 = nki7.language, nki7.isa


def test_trn3_resolves_by_name_and_generation():
    t = _hw.get_target("trn3")
    assert _hw.get_target("gen4") is t and _hw.get_target("TRN3") is t
    assert t.nc_version == 4
    assert t.sbuf_bytes_per_partition * 128 == 32 * 2 ** 20
    assert t.tensor_peak_flops == pytest.approx(79e12, rel=0.01)
    assert t.dma_bytes_per_s == 528e9


def _copy_kernel(dtype, engine):
    @nki7.jit
    def kernel(a):
        out = nl7.ndarray(a.shape, dtype, buffer=nl7.shared_hbm)
        x = nl7.ndarray(a.shape, a.dtype, buffer=nl7.sbuf)
        nisa7.dma_copy(dst=x, src=a)
        y = nl7.ndarray(a.shape, dtype, buffer=nl7.sbuf)
        nisa7.tensor_copy(dst=y, src=x, engine=engine)
        nisa7.dma_copy(dst=out, src=y)
        return out
    return kernel


def test_scalar_engine_copies_16_bit_data_twice_as_fast_on_trn3():
    a = np.ones((128, 2048), ml_dtypes.bfloat16)
    cyc = {}
    for tgt in ("trn2", "trn3"):
        with nki.measure(target=tgt) as m:
            _copy_kernel(nl7.bfloat16, nisa7.scalar_engine)(a)
        cyc[tgt] = m.engine_cycles["scalar"]
    assert cyc["trn2"] == 2048 and cyc["trn3"] == 1024
    f = np.ones((128, 2048), np.float32)            # fp32 keeps the 1x rate
    with nki.measure(target="trn3") as m:
        _copy_kernel(nl7.float32, nisa7.scalar_engine)(f)
    assert m.engine_cycles["scalar"] == 2048


def test_trn3_sbuf_capacity():
    @nki7.jit
    def fill(a):
        keep = [nl7.zeros((128, 30000), nl7.float32, buffer=nl7.sbuf) for _ in (0,) * 2]
        out = nl7.ndarray((128, 1), nl7.float32, buffer=nl7.shared_hbm)
        nisa7.dma_copy(dst=out, src=keep[1][:, 0:1])      # 2 x 120,000 B live
        return out
    a = np.ones((1, 1), np.float32)
    with nki.measure(target="trn3"):
        fill(a)                                       # fits 256 KiB
    with nki.spill(False), nki.measure(target="trn2"), pytest.raises(RuntimeError,
                                                                      match="SBUF capacity"):
        fill(a)                                       # not 224 KiB


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

    kernel7 = _copy_kernel(nl7.float32, nisa7.unknown_engine)
    run = kernel7 if target == "trn3" else (lambda a: nki.simulate_kernel(kernel, a))
    with nki.measure(target=target):
        if ok:
            np.testing.assert_array_equal(run(a), a.astype(np.float32))
        else:
            with pytest.raises(TypeError, match=f"{np.dtype(dtype).name} is not an 8-bit float "
                                                f"format of {target}"):
                run(a)


def test_ocp_e4m3_rounds_and_saturates_as_its_format():
    """trn3's OCP E4M3 holds up to 448 (IEEE-style E4M3: 240); values round to it."""
    a = np.array([[300.0, 448.0, 0.1]] * 128, np.float32)

    @nki7.jit
    def kernel(a):
        out = nl7.ndarray(a.shape, nl7.float32, buffer=nl7.shared_hbm)
        x = nl7.ndarray(a.shape, a.dtype, buffer=nl7.sbuf)
        nisa7.dma_copy(dst=x, src=a)
        y = nl7.ndarray(a.shape, ml_dtypes.float8_e4m3fn, buffer=nl7.sbuf)
        nisa7.tensor_copy(dst=y, src=x)
        z = nl7.ndarray(a.shape, nl7.float32, buffer=nl7.sbuf)
        nisa7.tensor_copy(dst=z, src=y)
        nisa7.dma_copy(dst=out, src=z)
        return out
    with nki.measure(target="trn3"):
        out = kernel(a)
    np.testing.assert_array_equal(out, a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert out[0, 1] == 448.0


def test_the_legacy_api_does_not_target_trn3():
    """neuronxcc.nki ends with SDK 2.29 and no legacy toolchain targets NeuronCore-v4: a legacy
    launch on trn3 is refused with what to use instead."""
    a = np.ones((128, 4), np.float32)

    def kernel(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a))
        return out
    with nki.measure(target="trn3"), pytest.raises(ValueError, match="does not target trn3"):
        nki.simulate_kernel(kernel, a)
