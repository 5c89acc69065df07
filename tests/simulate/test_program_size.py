"""Measurement.program_instructions: the size of the compiled program, not of the execution.

An affine_range/sequential_range body is emitted once by the compiler; static_range and Python
loops are unrolled into program text; every grid instance runs the same program."""
import warnings

import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
from simulate import _hw


def _copy_kernel(loop):
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in loop(a.shape[0] // 128):
            t = nl.load(a[i * 128:(i + 1) * 128, :])
            nl.store(out[i * 128:(i + 1) * 128, :], value=nl.exp(t))
        return out
    return kernel


def _measure(kernel, *args):
    with nki.measure() as m:
        nki.simulate_kernel(kernel, *args)
    return m


@pytest.mark.parametrize("loop", [nl.affine_range, nl.sequential_range])
def test_nki_loop_body_counted_once(loop):
    for rows in (128, 512, 2048):
        m = _measure(_copy_kernel(loop), np.ones((rows, 64), np.float32))
        # load, exp, store: three instructions of program text whatever the trip count
        assert m.program_instructions == 3
        assert sum(m.instructions.values()) == 3 * rows // 128


@pytest.mark.parametrize("loop", [nl.static_range, range])
def test_unrolled_loops_grow_the_program(loop):
    m = _measure(_copy_kernel(loop), np.ones((512, 64), np.float32))
    assert m.program_instructions == 12 == sum(m.instructions.values())


def test_nested_loops_and_static_inside_affine():
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in nl.affine_range(a.shape[0] // 128):
            for j in nl.static_range(2):                      # unrolled: 2 copies of the body
                for k in nl.sequential_range(a.shape[1] // 128):   # body once
                    cols = nl.ds(k * 128, 128)
                    t = nl.load(a[nl.ds(i * 128, 128), cols])
                    nl.store(out[nl.ds(i * 128, 128), cols], value=nl.add(t, j))
        return out

    m = _measure(kernel, np.ones((512, 512), np.float32))
    assert m.program_instructions == 2 * 3
    assert sum(m.instructions.values()) == 4 * 2 * 4 * 3


def test_grid_instances_share_one_program():
    @nki.jit
    def kernel(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        p = nl.program_id(0)
        t = nl.load(a[nl.ds(p * 128, 128), :])
        nl.store(out[nl.ds(p * 128, 128), :], value=t)
        return out

    with nki.measure() as m:
        nki.simulate_kernel(kernel[4], np.ones((512, 32), np.float32))
    assert m.program_instructions == 2 and sum(m.instructions.values()) == 8
    assert m.program_instructions_per_kernel == {"kernel": 2}
    assert "program size 2 instructions" in m.report()
    assert m.kernels[0].summary()["program_instructions"] == 2


def test_warning_above_threshold(monkeypatch):
    monkeypatch.setattr(_hw, "PROGRAM_INSTRUCTION_WARN", 5)
    with pytest.warns(nki.ProgramSizeWarning, match=r"has 12 instructions \(> 5\)"):
        _measure(_copy_kernel(nl.static_range), np.ones((512, 64), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", nki.ProgramSizeWarning)
        _measure(_copy_kernel(nl.affine_range), np.ones((512, 64), np.float32))


def test_error_at_compiler_limit(monkeypatch):
    monkeypatch.setattr(_hw, "PROGRAM_INSTRUCTION_LIMIT", 10)
    with pytest.raises(RuntimeError, match=r"exceeds 10 instructions, neuronx-cc's limit"):
        _measure(_copy_kernel(range), np.ones((512, 64), np.float32))
    m = _measure(_copy_kernel(nl.affine_range), np.ones((2048, 64), np.float32))
    assert m.program_instructions == 3


def test_program_size_traces_loop_bodies_once_without_running_them():
    @nki.jit
    def k(a):
        out = nl.ndarray((4, 128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        for i in nl.affine_range(4):
            t = nl.load(a[i])
            for j in nl.static_range(3):            # unrolled: three copies
                t[...] = nl.add(t, 1.0)
            for j in (0, 1):                        # Python loop over a tuple: unrolled too
                t[...] = nl.multiply(t, 2.0)
            for j in range(5):                      # range(): the compiler's sequential_range
                t[...] = nl.subtract(t, 1.0)
            nl.store(out[i], t)
        return out
    x = np.zeros((4, 128, 64), np.float32)
    with nki.measure() as m:
        k[2](x)
    assert nki.program_size(k[2], x) == m.program_instructions == 1 + 3 + 2 + 1 + 1


def test_program_size_of_the_backward_is_bounded_in_n():
    """The backward's loop nest: spans saturate at BWD_K_SPANS and more passes reuse the pass
    loop, so 4x the keys leave the program a few hundred instructions (far under the 20,000
    budget; the multi-pass scratch code is the only addition)."""
    import ml_dtypes
    from nki_kernels import nki as binding, port
    from nki_kernels.attention.backward import flash_attn_bwd
    bf16 = np.dtype(ml_dtypes.bfloat16)
    sizes = {}
    legacy = binding.namespace("legacy")        # the SPMD grid [1, 1]
    for N in (16384, 65536):
        q = np.zeros((1, 1, N, 64), bf16)
        lse = np.zeros((1, 1, N), np.float32)
        for causal in (None, "top_left"):
            with port.tracing(legacy):
                sizes[N, causal] = nki.program_size(flash_attn_bwd.jitted(legacy)[1, 1], q, q,
                                                    q, q, q, lse, scale=0.125, causal=causal)
    assert sizes[16384, None] < 1000 and sizes[65536, None] < 1000
    assert sizes[16384, "top_left"] < 5000 and sizes[65536, "top_left"] < 5000
