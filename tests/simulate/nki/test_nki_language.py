"""nki.language (NKI 0.7): tensors, loops (Python-unrolled aliases, nl.fori_loop)."""
import numpy as np
import pytest

import simulate
from nki07_fixtures import nk  # noqa: F401 (fixture)


def _run(nki, fn, *arrays):
    return nki.jit(fn)(*arrays)


def _echo(nl, nisa, a, out):
    """Write an output for kernels that only check tracing behaviour."""
    t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.dma_copy(dst=out, src=t)
    return out


def _count_register(nl, nisa, count):
    """A register loaded with the ``(1, 1)`` int32 ``count`` (a runtime trip count) and its
    SBUF tile."""
    c = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=c, src=count)
    reg = nisa.register_alloc()
    nisa.register_load(reg, c)
    return reg, c


def _over_counts(nki, k, a):
    """``k(a, count)`` run and sized at runtime counts 0 and 1: ``[(output, program size)]``."""
    runs = []
    for n in (0, 1):
        count = np.array([[n]], np.int32)
        runs.append((_run(nki, k, a, count), simulate.program_size(nki.jit(k), a, count)))
    return runs


def test_ndarray_nan_zeros_and_buffers(nk):
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray((2, 128, 4), dtype=nl.float32, buffer=nl.shared_hbm)
        fresh = nl.ndarray((128, 4), nl.float32)                 # buffer defaults to sbuf
        z = nl.zeros((128, 4), nl.float32, nl.sbuf)              # buffer positional (stub)
        nisa.dma_copy(dst=out[0], src=fresh)
        nisa.dma_copy(dst=out[1], src=z)
        assert nl.is_sbuf(nl.sbuf) and nl.is_psum(nl.psum) and nl.is_hbm(nl.shared_hbm)
        assert nl.is_hbm(nl.hbm) and nl.is_on_chip(nl.psum) and not nl.is_on_chip(nl.hbm)
        return out

    out = _run(nki, k, np.zeros((1, 1), np.float32))
    assert np.isnan(out[0]).all()            # fresh allocations hold NaN (simulator guide)
    assert (out[1] == 0).all()


def test_partition_dim_first_no_block_dims(nk):
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.ndarray((4, simulate.language.par_dim(128), 64), nl.float32)
        return _echo(nl, nisa, a, out)

    with pytest.raises(ValueError, match="no block dimensions"):
        _run(nki, k, np.zeros((1, 1), np.float32))

    def k2(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 128, 64), nl.float32, buffer=nl.sbuf)   # 4 partitions, 128*64 free
        assert t.shape == (4, 128, 64)
        return _echo(nl, nisa, a, out)
    _run(nki, k2, np.zeros((1, 1), np.float32))


def test_tile_size_program_ids_ds_load_store(nk, rng):
    nki, nl, nisa = nk
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_bank_fmax == 512
    assert nl.tile_size.gemm_stationary_fmax == 128 and nl.tile_size.gemm_moving_fmax == 512
    assert nl.tile_size.psum_bank_fmax_bytes == 2048

    @nki.jit
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        assert nl.num_programs(0) == 2 and nl.program_ndim() == 2
        t = nl.load(a[nl.ds(i * 64, 64), :])
        u = nl.exp(t)
        v = nl.add(u, 1.0)
        nl.store(out[nl.ds(i * 64, 64), :], value=v)
        return out

    a = rng.standard_normal((128, 32)).astype(np.float32)
    np.testing.assert_allclose(k[2, 1](a), np.exp(a) + 1, rtol=1e-6)
    # the tile_size SBUF figures follow the launch's target
    with simulate.measure(target="trn2"):
        @nki.jit
        def k2(a):
            out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
            assert nl.tile_size.sbuf_fmax_bytes == 229376 - 16384
            return _echo(nl, nisa, a, out)
        k2(a)


def _copy_tiles(nki, nl, nisa, loop):
    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        for i in loop(a.shape[0] // 128):
            t = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a[i * 128:(i + 1) * 128, :])
            nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=t)
        return out
    return nki.jit(k)


@pytest.mark.parametrize("name", ["affine_range", "sequential_range", "static_range", "range"])
def test_range_aliases_unroll(nk, rng, name):
    """NKI 0.7: the range aliases are Python range; every iteration is program text."""
    nki, nl, nisa = nk
    loop = range if name == "range" else getattr(nl, name)
    k = _copy_tiles(nki, nl, nisa, loop)
    a = rng.standard_normal((512, 64)).astype(np.float32)
    with simulate.measure() as m:
        np.testing.assert_array_equal(k(a), a)
    assert m.program_instructions == 8 == m.instructions["dma"]
    assert simulate.program_size(k, a) == 8
    if name != "range":
        assert isinstance(loop(3), range)


def test_python_loop_index_is_an_int_under_nki(nk):
    """The legacy strict rewrite of Python range to sequential_range does not apply."""
    nki, nl, nisa = nk
    seen = []

    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        tiles = [1, 2, 3]
        for i in range(3):
            seen.append(tiles[i])            # a list index: legal Python int under 0.7
        for j in nl.affine_range(2):
            seen.append(int(j))
        return _echo(nl, nisa, a, out)
    assert simulate.is_strict()
    _run(nki, k, np.zeros((1, 1), np.float32))
    assert seen == [1, 2, 3, 0, 1]


def test_fori_loop_runs_every_iteration_counts_once(nk, rng):
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)

        def body(i):
            t = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a[nl.ds(i * 128, 128), :])
            nisa.dma_copy(dst=out[i * 128:i * 128 + 128, :], src=t)
        assert nl.fori_loop(0, a.shape[0] // 128, body) is None
        return out

    a = rng.standard_normal((1024, 32)).astype(np.float32)
    with simulate.measure() as m:
        np.testing.assert_array_equal(_run(nki, k, a), a)
    assert m.instructions["dma"] == 16          # every iteration ran
    assert m.program_instructions == 2          # the body is one copy of program text
    assert simulate.program_size(nki.jit(k), a) == 2


def test_a_zero_trip_fori_loop_body_is_program_text_without_effects(nk, rng):
    """The compiler emits a runtime loop's body whatever its trip count: the program size does
    not depend on the count table, and a count of 0 changes nothing (outputs, registers,
    engine time, DMA bytes)."""
    nki, nl, nisa = nk

    def k(a, count):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a[0:128, :])
        nisa.dma_copy(dst=out[0:128, :], src=t)
        reg, c = _count_register(nl, nisa, count)

        def body(i):
            u = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
            nisa.activation(dst=u, op=nl.copy, data=t, scale=2.0)
            nisa.dma_copy(dst=out[0:128, :], src=u)
            nisa.register_move(reg, 5)
        nl.fori_loop(0, reg, body)
        nisa.register_store(c, reg)
        nisa.dma_copy(dst=out[0:1, 0:1], src=c)
        return out

    a = rng.standard_normal((128, 16)).astype(np.float32)
    sizes, runs = [], []
    for n in (0, 1):
        count = np.array([[n]], np.int32)
        sizes.append(simulate.program_size(nki.jit(k), a, count))
        with simulate.measure() as m:
            o = _run(nki, k, a, count)
        runs.append((m.program_instructions, m.instructions.get("scalar", 0),
                     m.hbm_bytes_written))
        want = a.copy() if n == 0 else 2 * a
        want[0, 0] = 5 if n else 0              # the register the body moves 5 into
        np.testing.assert_array_equal(o, want)
    assert sizes[0] == sizes[1] == runs[0][0] == runs[1][0]
    assert runs[0][1:] == (0, a.nbytes + 4)      # no ScalarE time, no body DMA
    assert runs[1][1] == 1


def test_a_while_loop_in_a_zero_trip_body_runs_once(nk, rng):
    """A while loop nested in a body traced for its text only: the register write that ends
    it is dropped there, so it is traced once (it hung), and counts as with one iteration."""
    nki, nl, nisa = nk

    def k(a, count):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t)
        reg, _ = _count_register(nl, nisa, count)

        def body(i):
            go = nisa.register_alloc(1)

            def step(r):
                nisa.register_move(go, 0)
                return go
            nl.while_loop(go, step)
        nl.fori_loop(0, reg, body)
        return out

    a = rng.standard_normal((128, 4)).astype(np.float32)
    (o0, size0), (o1, size1) = _over_counts(nki, k, a)
    np.testing.assert_array_equal(o0, a)
    np.testing.assert_array_equal(o1, a)
    assert size0 == size1


@pytest.mark.parametrize("form", ["indirect", "scalar_offset"])
def test_a_zero_trip_body_addresses_are_not_checked(nk, rng, form):
    """A body traced for its text only runs on values the hardware never computes there (its
    writes are dropped: an index tile it fills keeps whatever was there): an indirect gather or
    a runtime offset built from them is not bounds-checked, so a valid program is not refused;
    with one iteration the same body reads the rows it names."""
    nki, nl, nisa = nk

    def k(a, count):
        out = nl.ndarray((128, a.shape[1]), dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        nisa.dma_copy(dst=out[0:128, :], src=t)
        reg, _ = _count_register(nl, nisa, count)

        def body(i):
            idx = nl.ndarray((128, 1), nl.int32, buffer=nl.sbuf)
            nisa.memset(idx, 1)                  # dropped when the loop has no iteration
            u = nl.ndarray((128, a.shape[1]), a.dtype, buffer=nl.sbuf)
            if form == "indirect":
                src = a.ap(pattern=[[a.shape[1], 128], [1, a.shape[1]]], offset=0,
                           vector_offset=idx[0:128, 0:1], indirect_dim=0)
            else:
                src = a.ap(pattern=[[a.shape[1], 128], [1, a.shape[1]]], offset=0,
                           scalar_offset=idx[0:1, 0:1], indirect_dim=0)
            nisa.dma_copy(dst=u, src=src)
            nisa.dma_copy(dst=out[0:128, :], src=u)
        nl.fori_loop(0, reg, body)
        return out

    a = rng.standard_normal((256, 16)).astype(np.float32)
    (o0, size0), (o1, size1) = _over_counts(nki, k, a)
    np.testing.assert_array_equal(o0, np.zeros((128, 16), np.float32))
    np.testing.assert_array_equal(
        o1, np.repeat(a[1:2], 128, axis=0) if form == "indirect" else a[1:129])
    assert size0 == size1


@pytest.mark.parametrize("use", ["int", "range", "if", "shape", "list", "cmp_if"])
def test_fori_index_is_a_runtime_scalar(nk, use):
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        def body(i):
            if use == "int":
                int(i)
            elif use == "range":
                range(i)
            elif use == "if":
                if i:
                    pass
            elif use == "shape":
                nl.ndarray((128, i + 1), nl.float32)
            elif use == "list":
                [0, 1][i]
            elif use == "cmp_if":
                if i > 0:
                    pass
        nl.fori_loop(0, 2, body)
        return _echo(nl, nisa, a, out)

    with pytest.raises(TypeError, match="fori_loop"):
        _run(nki, k, np.zeros((1, 1), np.float32))


def test_fori_loop_step_and_bounds(nk):
    nki, nl, nisa = nk
    seen = []

    def k(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.fori_loop(2, 9, lambda i: seen.append((i * 1).v), step=3)
        with pytest.raises(ValueError, match="step"):
            nl.fori_loop(0, 4, lambda i: None, step=0)
        with pytest.raises(TypeError, match="returns None"):
            nl.fori_loop(0, 1, lambda i: i)
        return _echo(nl, nisa, a, out)
    _run(nki, k, np.zeros((1, 1), np.float32))
    assert seen == [2, 5, 8]


def test_dynamic_range_removed(nk):
    nki, nl, nisa = nk
    with pytest.raises(NotImplementedError, match="removed in NKI 0.7"):
        nl.dynamic_range(4)


def test_ndarray_address_places_the_tensor_outside_the_stack(nk):
    """``nl.ndarray(..., address=(partition, byte offset))`` is a direct allocation (as
    nki-library's attention_cte and its SbufManager use it): tensors placed at the same PSUM
    bank share it instead of each taking a bank of the allocator's stack, so twelve live PSUM
    tiles in four banks fit; a placement past the memory is refused."""
    nki, nl, nisa = nk

    @nki.jit
    def k(a, b):
        out = nl.ndarray((12, 128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
        at = nl.ndarray((128, 128), a.dtype, buffer=nl.sbuf, address=(0, 0))
        bt = nl.ndarray((128, 512), b.dtype, buffer=nl.sbuf, address=(0, 256))
        nisa.dma_copy(dst=at, src=a)
        nisa.dma_copy(dst=bt, src=b)
        tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum,
                            address=(0, (i % 4) * 2048)) for i in range(12)]
        for i, t in enumerate(tiles):                   # all twelve are live here
            nisa.nc_matmul(dst=t, stationary=at, moving=bt)
            r = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=r, src=t)
            nisa.dma_copy(dst=out[i], src=r)
        return out

    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 128)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    with simulate.spill(False):
        got = k(a, b)
    want = a.T.astype(np.float64) @ b
    assert np.abs(got - want[None]).max() < 1e-3 * np.abs(want).max()

    @nki.jit
    def past(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 7 * 2048 + 4))
        nisa.dma_copy(dst=out, src=a)
        del t
        return out

    with pytest.raises(RuntimeError, match="Allocated memory out of bound"):
        past(a)
