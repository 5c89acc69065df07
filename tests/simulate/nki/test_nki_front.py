"""nki.* front end: registration, nki.jit / nki.simulate, targets, launch records."""
import sys
import types
import warnings

import numpy as np
import pytest

import simulate
from nki07_fixtures import nk  # noqa: F401 (fixture)
from simulate import _hw
from simulate import isa as lisa, language as lnl


def _add_kernel(nki, nl, nisa):
    @nki.jit
    def add(a, b):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        x = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        y = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=a)
        nisa.dma_copy(dst=y, src=b)
        nisa.tensor_tensor(dst=x, data1=x, data2=y, op=nl.add)
        nisa.dma_copy(dst=out, src=x)
        return out
    return add


def test_register_aliases(nk):
    nki, nl, nisa = nk
    import simulate.nki as front
    assert nki is front and nl is front.language and nisa is front.isa
    assert simulate.register_as_nki() is front            # idempotent
    simulate.unregister_nki()
    assert "nki" not in sys.modules and "nki.isa" not in sys.modules
    simulate.register_as_nki()


def test_register_refuses_real_nki(monkeypatch):
    simulate.unregister_nki()
    fake = types.ModuleType("nki")
    fake.__file__ = "/opt/aws/site-packages/nki/__init__.py"
    monkeypatch.setitem(sys.modules, "nki", fake)
    with pytest.raises(RuntimeError, match="real 'nki' package"):
        simulate.register_as_nki()


def test_register_refuses_installed_nki(monkeypatch):
    import importlib.machinery
    import importlib.util
    simulate.unregister_nki()
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        if name == "nki":
            return importlib.machinery.ModuleSpec("nki", None, origin="/site-packages/nki")
        return real(name, *a, **k)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(RuntimeError, match="refusing to shadow"):
        simulate.register_as_nki()


def test_jit_call_simulate_and_api_record(nk, rng):
    nki, nl, nisa = nk
    add = _add_kernel(nki, nl, nisa)
    a, b = (rng.standard_normal((128, 512)).astype(np.float32) for _ in range(2))
    with simulate.measure() as m:
        out = add(a, b)
        out2 = nki.simulate(add)(a, b)
    np.testing.assert_array_equal(out, a + b)
    np.testing.assert_array_equal(out2, a + b)
    assert m.api == "nki" and m.apis == {"nki"}
    assert [k.api for k in m.kernels] == ["nki", "nki"]
    assert m.kernels[0].summary()["api"] == "nki"
    # a plain function is wrapped by nki.simulate
    np.testing.assert_array_equal(nki.simulate(add.func)(a, b), a + b)


def test_measure_same_numbers_as_legacy(nk, rng):
    """The same instructions through either front end cost the same (one implementation)."""
    nki, nl, nisa = nk
    a = rng.standard_normal((128, 512)).astype(np.float32)

    @nki.jit
    def k07(x):
        out = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        u = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)
        nisa.dma_copy(dst=out, src=u)
        return out

    @simulate.jit
    def kleg(x):
        out = lnl.ndarray(x.shape, dtype=lnl.bfloat16, buffer=lnl.shared_hbm)
        t = lnl.ndarray(x.shape, x.dtype, buffer=lnl.sbuf)
        lisa.dma_copy(dst=t, src=x)
        u = lnl.ndarray(x.shape, lnl.bfloat16, buffer=lnl.sbuf)
        u[...] = lisa.tensor_copy(t, dtype=lnl.bfloat16)
        lisa.dma_copy(dst=out, src=u)
        return out

    with simulate.measure(target="trn2") as m1:
        r1 = k07(a)
    with simulate.measure(target="trn2") as m2:
        r2 = kleg(a)
    np.testing.assert_array_equal(r1, r2)
    assert m1.api == "nki" and m2.api == "legacy"
    assert m1.engine_cycles == m2.engine_cycles
    assert m1.instructions == m2.instructions
    assert m1.estimated_seconds == m2.estimated_seconds
    assert m1.program_instructions == m2.program_instructions
    with simulate.measure() as m3:
        k07(a)
        kleg(a)
    assert m3.api == "legacy+nki"


def test_grid_and_lnc(nk, rng):
    nki, nl, nisa = nk

    @nki.jit
    def rows(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        t = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[i * 128:(i + 1) * 128, :])
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=t)
        return out

    a = rng.standard_normal((512, 64)).astype(np.float32)
    np.testing.assert_array_equal(rows[4](a), a)                 # SPMD grid (int > 2)
    np.testing.assert_array_equal(rows[4, 1](a), a)              # tuple grid
    with simulate.measure(target="trn2") as m:
        out = rows[2](a[:256])                                   # kernel[lnc]
    np.testing.assert_array_equal(out, a[:256])
    assert m.kernels[0].cores == 2
    with pytest.raises(Exception, match="multi neuron cores"):
        with simulate.measure(target="trn1"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows[2](a[:256])


def test_jit_options_and_subkernels(nk):
    nki, nl, nisa = nk
    with pytest.raises(TypeError, match="platform_target"):
        nki.jit(lambda a: a, platform_target="trn2")
    with pytest.raises(TypeError, match="mode"):
        nki.jit(mode="simulation")

    @nki.jit
    def inner(a):
        return a

    @nki.jit
    def outer(a):
        return inner(a)
    with pytest.raises(TypeError, match="only the top-level kernel"):
        outer(np.zeros((2, 2), np.float32))


def test_target_from_env(nk, monkeypatch, rng):
    nki, nl, nisa = nk
    add = _add_kernel(nki, nl, nisa)
    a = rng.standard_normal((128, 64)).astype(np.float32)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen3")
    with simulate.measure() as m:
        add(a, a)
    assert m.kernels[0].target == "trn2"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    with simulate.measure() as m:
        with pytest.warns(UserWarning, match="not supported on Trn1"):
            add(a, a)
    assert m.kernels[0].target == "trn1"
    # measure(target=...) overrides the environment, as for legacy launches
    with simulate.measure(target="trn2") as m:
        add(a, a)
    assert m.kernels[0].target == "trn2"


def test_trn3_when_available(nk, monkeypatch, rng):
    try:
        _hw.get_target("trn3")
    except ValueError:
        pytest.skip("no trn3 target in simulate/_hw.py yet")
    nki, nl, nisa = nk
    add = _add_kernel(nki, nl, nisa)
    a = rng.standard_normal((128, 64)).astype(np.float32)
    for name in ("trn3", "gen4"):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
        with simulate.measure() as m:
            np.testing.assert_array_equal(add(a, a), a + a)
        assert m.kernels[0].target == _hw.get_target("trn3").name
