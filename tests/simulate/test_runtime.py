"""Entry points, kernel I/O conventions, SPMD grids, targets (spec §2, §12)."""
import warnings

import ml_dtypes
import numpy as np
import pytest

import simulate as nki
from simulate import _hw
import simulate.language as nl
import simulate.isa as nisa
import simulate.typing as nt


@nki.jit
def _copy(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.load(a))
    return out


def test_api_outside_kernel_rejected():
    with pytest.raises(RuntimeError, match="calling NKI API outside of NKI kernels is not "
                                           "supported") as e:
        nl.zeros((4, 4), nl.float32)
    assert e.value.nki_error == "err_nki_api_outside_of_nki_kernel"
    with pytest.raises(RuntimeError):
        nl.affine_range(4)
    with pytest.raises(RuntimeError):
        nl.program_id(0)


def test_return_convention_dtype_preserved():
    a = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    out = _copy(a)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, a)
    out = _copy(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert out.dtype == np.int16


def test_float64_inputs_become_float32():
    out = _copy(np.full((2, 2), 1 / 3))
    assert out.dtype == np.float32 and out[0, 0] == np.float32(1 / 3)


def test_output_convention_b_writes_into_arguments():
    def kernel(a, b):           # 2.20 style: b is the output, nothing is returned
        nl.store(b, nl.multiply(nl.load(a), 2.0))

    a = np.ones((4, 4), np.float32)
    b = np.zeros((4, 4), np.float32)
    assert nki.simulate_kernel(kernel, a, b) is None
    np.testing.assert_array_equal(b, 2)
    np.testing.assert_array_equal(a, 1)            # inputs are copied, never aliased


def test_kernel_without_output_rejected():
    def kernel(a):
        nl.load(a)
    with pytest.raises(ValueError, match="has no output") as e:
        nki.simulate_kernel(kernel, np.ones((2, 2), np.float32))
    assert e.value.nki_error == "err_tensor_output_not_written_to"


def test_output_never_written():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        return out
    with pytest.raises(ValueError, match="never written") as e:
        k(np.ones((2, 2), np.float32))
    assert e.value.nki_error == "err_tensor_output_not_written_to"


def test_immutable_parameter():
    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(a, nl.load(a))
        nl.store(out, nl.load(a))
        return out
    with pytest.raises(TypeError, match="Cannot update immutable parameter `a`") as e:
        k(np.ones((2, 2), np.float32))
    assert e.value.nki_error == "err_cannot_update_immutable_parameter"

    @nki.jit
    def k2(a: nt.mutable_tensor):
        nl.store(a, nl.add(nl.load(a), 1.0))
        return a
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(k2(x), 2)
    np.testing.assert_array_equal(x, 1)

    @nki.jit
    def k3(a: nt.mutable_tensor, b):
        out = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.shared_hbm)
        nl.store(a, nl.load(b))
        nl.store(out, nl.load(b))
        return out
    with pytest.raises(SyntaxError, match="Mutable kernel parameter `a` not returned"):
        k3(x, x)


def test_shared_hbm_rules():
    @nki.jit
    def k(a):
        for i in nl.affine_range(2):
            out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        return out
    with pytest.raises(RuntimeError, match="shared_hbm buffer can only be created top level "
                                           "kernel scope") as e:
        k(np.ones((2, 2), np.float32))
    assert e.value.nki_error == "err_shared_hbm_must_in_kernel_level"

    def helper(shape):
        return nl.ndarray(shape, dtype=nl.float32, buffer=nl.shared_hbm)

    @nki.jit
    def k2(a):
        out = helper(a.shape)
        nl.store(out, nl.load(a))
        return out
    with pytest.raises(RuntimeError, match="top level kernel scope"):
        k2(np.ones((2, 2), np.float32))


def test_hbm_init_value_rejected_and_uninitialised_is_nan():
    @nki.jit
    def k(a):
        return nl.zeros((2, 2), nl.float32, buffer=nl.shared_hbm)
    with pytest.raises(SyntaxError, match="Creating HBM tensor with init value is not "
                                          "supported."):
        k(np.ones((2, 2), np.float32))

    @nki.jit
    def k2(a):
        t = nl.ndarray((2, 2), nl.float32)          # garbage until written
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out
    assert np.isnan(k2(np.ones((2, 2), np.float32))).all()

    @nki.jit
    def k3(a):
        t = nl.ndarray((2, 2), nl.int32)
        out = nl.ndarray((2, 2), nl.int32, buffer=nl.shared_hbm)
        nl.store(out, t)
        return out
    assert (k3(np.ones((2, 2), np.float32)) == np.iinfo(np.int32).max).all()


@nki.jit
def _spmd_add(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    i = nl.program_id(0)
    j = nl.program_id(1)
    sl = (nl.ds(i * 64, 64), nl.ds(j * 32, 32))
    nl.store(out[sl], nl.add(nl.load(a[sl]), nl.load(b[sl])))
    return out


def test_spmd_2d_grid(rng):
    a = rng.standard_normal((128, 96)).astype(np.float32)
    b = rng.standard_normal((128, 96)).astype(np.float32)
    np.testing.assert_array_equal(_spmd_add[2, 3](a, b), a + b)
    np.testing.assert_array_equal(nki.simulate_kernel(_spmd_add[2, 3], a, b), a + b)
    np.testing.assert_array_equal(nki.simulate_kernel(nki.baremetal(_spmd_add)[2, 3], a, b),
                                  a + b)


def test_program_id_num_programs_ndim():
    seen = []

    @nki.jit
    def k(a):
        seen.append((nl.program_id(0), nl.program_id(1), nl.num_programs(), nl.num_programs(1),
                     nl.num_programs((0, 1)), nl.program_ndim()))
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a))
        return out
    k[2, 3](np.ones((2, 2), np.float32))
    assert [s[:2] for s in seen] == [(i, j) for i in range(2) for j in range(3)]
    assert seen[0][2:] == (6, 3, (2, 3), 2)

    @nki.jit
    def k2(a):
        nl.program_id(1)
    with pytest.raises(IndexError, match="program_id"):
        k2[4](np.ones((2, 2), np.float32))
    with pytest.raises(IndexError):
        k2(np.ones((2, 2), np.float32))


def test_private_memory_per_instance():
    @nki.jit
    def k(a):
        out = nl.ndarray((4, 2), a.dtype, buffer=nl.shared_hbm)
        scratch = nl.ndarray((1, 2), a.dtype, buffer=nl.private_hbm)
        pid = nl.program_id(0)
        nl.store(scratch, nl.add(nl.load(a[pid:pid + 1, :]), 1.0))
        nl.store(out[pid:pid + 1, :], nl.load(scratch))
        return out
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(k[4](a), a + 1)


def test_nested_grid_launch_rejected():
    @nki.jit
    def outer(a):
        return _copy[2](a)
    with pytest.raises(SyntaxError, match="Calling kernel with spmd grid") as e:
        outer(np.ones((2, 2), np.float32))
    assert e.value.nki_error == "err_nested_kernel_with_spmd_grid"


def test_trace_subkernel_inline_writes_into_passed_tiles():
    @nki.jit(mode="trace")
    def helper(tile, out_tile):
        out_tile[...] = nl.multiply(tile, 3.0)
        return nl.add(tile, 1.0)

    @nki.jit
    def k(a):
        t = nl.load(a)
        o = nl.ndarray(a.shape, nl.float32)
        r = helper(t, o)
        out = nl.ndarray((2,) + a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out[0], o)
        nl.store(out[1], r)
        return out
    out = k(np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(out[0], 3)
    np.testing.assert_array_equal(out[1], 2)


def test_multi_core_grid_dims():
    @nki.jit(platform_target="trn2")
    def k(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        nl.store(out[i:i + 1, :], nl.load(a[i:i + 1, :]))
        return out
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_array_equal(k[nl.nc(2) * 2](a), a)
    np.testing.assert_array_equal(k[nl.spmd_dim(nl.nc(2), 2)](a), a)
    with pytest.raises(RuntimeError, match="SPMD grid with multi neuron cores is not supported "
                                           "on trn1"):
        nki.jit(k.func, platform_target="trn1")[nl.nc(2)](a)


def test_jit_forms_and_modes():
    def body(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a))
        return out
    a = np.ones((2, 2), np.float32)
    for k in (nki.jit(body), nki.jit(mode="simulation")(body), nki.jit(body, mode="auto"),
              nki.jit(body, mode="jax"), nki.trace(body),
              nki.jit(body, additional_compile_opt="-O1", show_compiler_tb=True)):
        np.testing.assert_array_equal(k(a), a)
    with pytest.raises(ValueError, match="unknown nki.jit mode"):
        nki.jit(body, mode="bogus")


def test_baremetal_warns_once_benchmark_and_profile():
    from simulate import _runtime
    _runtime._cpu_note_shown[0] = False

    def body(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.exp(nl.load(a)))
        return out
    a = np.ones((128, 512), np.float32)
    with pytest.warns(RuntimeWarning, match="CPU simulator"):
        nki.baremetal(body)(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nki.baremetal(save_neff_name="x.neff")(body)(a)
    bench = nki.benchmark(warmup=5, iters=10)(body)
    out = bench(a)
    np.testing.assert_allclose(out, np.exp(a), rtol=1e-6)
    lat = bench.benchmark_result.nc_latency.get_latency_percentile(50)
    lo, hi = bench.benchmark_result.modeled_seconds
    est = bench.benchmark_result.estimated_seconds
    # neuron-bench's figure: the device time plus the fitted per-launch benchmark overhead
    assert lat == pytest.approx(est * 1e6 + _hw.BENCH_OVERHEAD_NS / 1e3)
    assert lo <= est and lo <= hi and hi > 0
    gb = nki.benchmark(warmup=1, iters=1)(body)[1]
    gb(a)
    assert gb.benchmark_result.nc_latency.get_latency_percentile(99) > 0
    prof = nki.profile(working_directory="/tmp", save_neff_name="file.neff")(body)
    prof(a)
    assert prof.profile_result.hbm_bytes_read == 128 * 512 * 4


def test_platform_target_default_env_and_measure_override(monkeypatch):
    seen = []

    def body(a):
        seen.append(nisa.get_nc_version())
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a))
        return out
    a = np.ones((2, 2), np.float32)
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    nki.jit(body)(a)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    nki.jit(body)(a)
    nki.jit(body, platform_target="gen3")(a)
    with nki.measure(target="trn1"):
        nki.jit(body, platform_target="trn2")(a)
    assert seen == [nisa.nc_version.gen3, nisa.nc_version.gen2, nisa.nc_version.gen3,
                    nisa.nc_version.gen2]
    with pytest.raises(ValueError, match="Unknown platform target"):
        nki.jit(body, platform_target="trn9")(a)


def test_non_array_arguments_pass_through():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        scale: float

    @nki.jit
    def k(a, cfg, flag=True, name="x", nothing=None):
        assert flag is True and name == "x" and nothing is None
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.multiply(nl.load(a), cfg.scale))
        return out
    np.testing.assert_array_equal(k(np.ones((2, 2), np.float32), Cfg(2.0)), 2)


def test_hbm_reshape_return_and_tensor_props():
    seen = {}

    @nki.jit
    def k(a):
        out = nl.ndarray((4, 8), a.dtype, buffer=nl.shared_hbm)
        t = nl.load(a)
        seen.update(shape=t.shape, ndim=t.ndim, itemsize=t.itemsize, dtype=t.dtype)
        nl.store(out, t)
        with pytest.raises(TypeError, match="Can only reshape tensors in HBM"):
            t.reshape((8, 4))
        return out.reshape((32,))
    o = k(np.arange(32, dtype=np.float32).reshape(4, 8))
    assert o.shape == (32,)
    assert seen == dict(shape=(4, 8), ndim=2, itemsize=4, dtype=np.float32)


def test_view_reinterprets_bits():
    @nki.jit
    def k(a):
        v = a.view(nl.int32)
        out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(v))
        return out
    a = np.array([[1.0, -2.0]], np.float32)
    np.testing.assert_array_equal(k(a), a.view(np.int32))


def test_shared_hbm_shared_across_instances():
    @nki.jit
    def k(a):
        out = nl.ndarray((4, 1), nl.float32, buffer=nl.shared_hbm)
        out2 = nl.ndarray((4, 1), nl.float32, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        nl.store(out[p:p + 1, :], nisa.iota(p, dtype=nl.float32))
        nl.store(out2[p:p + 1, :], nisa.iota(10 * p, dtype=nl.float32))
        return out, out2
    o1, o2 = k[4](np.ones((1, 1), np.float32))
    np.testing.assert_array_equal(o1[:, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(o2[:, 0], [0, 10, 20, 30])


def test_index_constructors_need_a_kernel():
    for f in (lambda: nl.arange(4), lambda: nl.mgrid[0:4, 0:4], lambda: nl.ds(0, 4),
              lambda: nisa.get_nc_version()):
        with pytest.raises(RuntimeError, match="outside of NKI kernels"):
            f()
