"""NkiTensor views (NKI 0.7): ap, slice, select, permute, broadcast, expand_dim, squeeze_dim,
reshape_dim, flatten_dims, reshape, rearrange, strides/offset/get_pattern; runtime scalars as
offsets; nl.while_loop; nl.arange / nl.mgrid refused."""
import numpy as np
import pytest

import simulate
from simulate import _scalar
from nki07_fixtures import nk  # noqa: F401 (fixture)


def _run(nki, fn, *arrays):
    return nki.jit(fn)(*arrays)


def _copy_out(nl, nisa, view, shape):
    """DMA a view (HBM or SBUF) into a new HBM tensor of ``shape`` (a kernel output)."""
    out = nl.ndarray(shape, dtype=view.dtype, buffer=nl.hbm)
    nisa.dma_copy(dst=out, src=view)
    return out


A = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)


def test_hbm_views_match_numpy(nk):
    nki, nl, nisa = nk

    def k(a):
        outs = []
        outs.append(_copy_out(nl, nisa, a.slice(1, 1, 5, 2), (4, 2, 8)))
        outs.append(_copy_out(nl, nisa, a.select(2, 3), (4, 6)))
        outs.append(_copy_out(nl, nisa, a.permute((2, 0, 1)), (8, 4, 6)))
        outs.append(_copy_out(nl, nisa, a.reshape_dim(2, (2, -1)), (4, 6, 2, 4)))
        outs.append(_copy_out(nl, nisa, a.flatten_dims(1, 2), (4, 48)))
        outs.append(_copy_out(nl, nisa, a.reshape((24, 8)), (24, 8)))
        outs.append(_copy_out(nl, nisa, a.select(0, 1).expand_dim(0).broadcast(0, 3), (3, 6, 8)))
        outs.append(_copy_out(nl, nisa, a.slice(0, 0, 1, 1).squeeze_dim(0), (6, 8)))
        outs.append(_copy_out(nl, nisa, a.rearrange(('b', 's', ('h', 'd')), ('b', 'h', 's', 'd'),
                                                    {'h': 2}), (4, 2, 6, 4)))
        outs.append(_copy_out(nl, nisa, a.ap([[8, 6], [1, 4]], offset=48 + 2), (6, 4)))
        assert a.strides == (48, 8, 1) and a.offset == 0
        s = a.slice(1, 2, 6).slice(2, 1, 8, 3)
        assert s.strides == (48, 8, 3) and s.offset == 17
        assert s.get_pattern() == [[48, 4], [8, 4], [3, 3]]
        assert a.is_contiguous() and not s.is_contiguous() and not a.is_indirect()
        return tuple(outs)

    o = _run(nki, k, A)
    exp = [A[:, 1:5:2], A[:, :, 3], A.transpose(2, 0, 1), A.reshape(4, 6, 2, 4),
           A.reshape(4, 48), A.reshape(24, 8), np.broadcast_to(A[1], (3, 6, 8)), A[0],
           A.reshape(4, 6, 2, 4).transpose(0, 2, 1, 3),
           np.lib.stride_tricks.as_strided(A.reshape(-1)[50:], (6, 4), (32, 4))]
    for i, (got, want) in enumerate(zip(o, exp)):
        np.testing.assert_array_equal(got, want, err_msg=f"view {i}")


def test_sbuf_ap_partition_stride_and_views(nk):
    nki, nl, nisa = nk
    X = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)

    def k(x):
        t = nl.ndarray((8, 12), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        # every other partition from partition 1, columns 2..7 step 2
        a = t.ap([[24, 4], [2, 3]], offset=12 + 2)
        b = t.reshape((8, 3, 4)).permute((0, 2, 1))          # (8, 4, 3)
        c = t.ap([[12, 8], [0, 5]], offset=11)               # column 11 broadcast 5 times
        d = t[3]                                             # int on dim 0 keeps a (1, 12)
        assert d.shape == (1, 12)
        assert b.strides == (12, 1, 4)
        return (_copy_out(nl, nisa, a, (4, 3)), _copy_out(nl, nisa, b, (8, 4, 3)),
                _copy_out(nl, nisa, c, (8, 5)), _copy_out(nl, nisa, d, (1, 12)))

    a, b, c, d = _run(nki, k, X)
    np.testing.assert_array_equal(a, X[1::2, 2:8:2])
    np.testing.assert_array_equal(b, X.reshape(8, 3, 4).transpose(0, 2, 1))
    np.testing.assert_array_equal(c, np.repeat(X[:, 11:12], 5, axis=1))
    np.testing.assert_array_equal(d, X[3:4])


def test_view_writes_go_to_storage(nk):
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray((4, 6, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        z = nl.zeros((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out.select(2, 5), src=z)           # a strided HBM destination
        return out

    o = _run(nki, k, A)
    want = A.copy()
    want[:, :, 5] = 0
    np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("bad", [
    lambda t: t.permute((1, 0)),            # on-chip: partition dim stays first
    lambda t: t.broadcast(0, 4),            # on-chip partition dim / size != 1
    lambda t: t.expand_dim(0),
    lambda t: t.reshape((4, 24)),           # partition dim changes
    lambda t: t.reshape_dim(0, (2, 4)),
    lambda t: t.ap([[5, 8], [1, 12]]),      # partition stride not a multiple of 12
    lambda t: t.ap([[12, 8], [1, 13]]),     # free pattern runs into the next partition
    lambda t: t.slice(1, 4, 2),             # start >= end
    lambda t: t.ap([[12, 9], [1, 12]]),     # beyond the storage
])
def test_view_rules_refused(nk, bad):
    nki, nl, nisa = nk

    def k(a):
        t = nl.ndarray((8, 12), nl.float32, buffer=nl.sbuf)
        bad(t)
        return a

    with pytest.raises((ValueError, IndexError, TypeError)):
        _run(nki, k, np.zeros((1, 1), np.float32))


def test_permuted_view_cannot_reshape(nk):
    nki, nl, nisa = nk

    def k(a):
        a.permute((0, 2, 1)).reshape((4, 48))
        return a

    with pytest.raises(ValueError, match="without copying"):
        _run(nki, k, A)


def test_scalar_offset_tensor_and_runtime_scalar(nk):
    nki, nl, nisa = nk
    idx = np.array([[3]], np.int32)

    def k(a, i):
        it = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i)
        # row `i` of a[2] via a tensor-valued scalar_offset scaled by a.strides[1]
        v1 = a.ap([[1, 1], [1, 8]], offset=2 * 48, scalar_offset=it, indirect_dim=1)
        assert v1.is_indirect()
        # the same row through a dynamic select, and through nl.ds with a runtime scalar
        v2 = a.select(0, 2).select(0, it).expand_dim(0)
        s = _scalar.NkiScalar(3)
        v3 = a[2, nl.ds(s, 1), :]
        v4 = a.ap([[1, 1], [1, 8]], offset=2 * 48 + s * 8)
        return tuple(_copy_out(nl, nisa, v, (1, 8)) for v in (v1, v2, v3, v4))

    for o in _run(nki, k, A, idx):
        np.testing.assert_array_equal(o, A[2, 3:4])


def test_runtime_offset_read_is_a_dependence(nk):
    """The DMA through a scalar_offset view reads the index tile: it is scheduled after the
    instruction that wrote the index."""
    nki, nl, nisa = nk

    def k(a, i):
        it = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i)
        v = a.ap([[8, 1], [1, 8]], scalar_offset=it, indirect_dim=1)
        return _copy_out(nl, nisa, v, (1, 8))

    with simulate.measure(target="trn2") as m:
        o = _run(nki, k, A, np.array([[4]], np.int32))
    np.testing.assert_array_equal(o, A[0, 4:5])
    assert m.estimated_seconds > 0


def test_vector_offset_gather_and_scatter(nk):
    """``.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0)`` (nisa.dma_copy's
    "Vector indirection"): a per-partition row gather on src and scatter on dst, rows out of
    range skipped with oob_mode.skip (the gathered rows stay as they were, the scattered ones
    unwritten), the same numerics and DMA cost as legacy's ``t[idx[i_p, 0], i_f]``."""
    nki, nl, nisa = nk
    data = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    rows = np.array([[7], [0], [12], [3]], np.int32)          # 12: past the 10 rows

    def k(a, i):
        it = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i)
        got = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=got, value=-1.0)
        # columns 1..4 of the indexed rows: offset 1, the free pattern within a row
        src = a.ap(pattern=[[6, 4], [1, 4]], offset=1, vector_offset=it, indirect_dim=0)
        assert src.shape == (4, 4)
        nisa.dma_copy(dst=got, src=src, oob_mode=nisa.oob_mode.skip)
        out = nl.ndarray((10, 6), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        vals = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=vals, value=5.0)
        nisa.dma_copy(dst=out.ap(pattern=[[6, 4], [1, 6]], vector_offset=it, indirect_dim=0),
                      src=vals, oob_mode=nisa.oob_mode.skip)
        return _copy_out(nl, nisa, got, (4, 4)), out

    with simulate.measure(target="trn2") as m:
        got, out = _run(nki, k, data, rows)
    np.testing.assert_array_equal(got, [data[7, 1:5], data[0, 1:5], [-1.0] * 4, data[3, 1:5]])
    exp = data.copy()
    exp[[7, 0, 3]] = 5.0
    np.testing.assert_array_equal(out, exp)
    # the skipped row is neither read nor written: the index (4 int32), 3 rows of 4 and the
    # copy of a (60) read; a (60), 3 rows of 6 and got (16) written
    assert m.hbm_bytes_read == 4 * (4 + 3 * 4 + 60)
    assert m.hbm_bytes_written == 4 * (60 + 3 * 6 + 16)
    with pytest.raises(IndexError):
        _run(nki, lambda a, i: _gather_all(nl, nisa, a, i), data, rows)


def test_vector_offset_costs_what_legacy_indexing_does(nk):
    """A gather through ``.ap(vector_offset=)`` measures as legacy's ``t[idx[i_p, 0], i_f]``:
    the same bytes, DMA transfers, instructions and estimate."""
    nki, nl, nisa = nk
    from simulate import isa as lisa, language as lnl
    data = np.arange(300 * 64, dtype=np.float32).reshape(300, 64)
    rows = np.random.default_rng(0).permutation(300)[:128].reshape(128, 1).astype(np.int32)

    def k(a, i):
        it = nl.ndarray((128, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i)
        got = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=got, src=a.ap(pattern=[[64, 128], [1, 64]], vector_offset=it,
                                         indirect_dim=0))
        return _copy_out(nl, nisa, got, (128, 64))

    @simulate.jit
    def leg(a, i):
        it = lnl.ndarray((128, 1), lnl.int32, buffer=lnl.sbuf)
        lisa.dma_copy(dst=it, src=i)
        got = lnl.ndarray((128, 64), lnl.float32, buffer=lnl.sbuf)
        lisa.dma_copy(dst=got, src=a[it[lnl.arange(128)[:, None], 0], lnl.arange(64)[None, :]])
        out = lnl.ndarray((128, 64), lnl.float32, buffer=lnl.shared_hbm)
        lisa.dma_copy(dst=out, src=got)
        return out

    with simulate.measure(target="trn2") as m1:
        r1 = _run(nki, k, data, rows)
    with simulate.measure(target="trn2") as m2:
        r2 = leg(data, rows)
    np.testing.assert_array_equal(r1, data[rows[:, 0]])
    np.testing.assert_array_equal(r1, r2)
    assert (m1.hbm_bytes_read, m1.hbm_bytes_written) == (m2.hbm_bytes_read, m2.hbm_bytes_written)
    assert m1.instructions == m2.instructions
    assert m1.estimated_seconds == m2.estimated_seconds


def _gather_all(nl, nisa, a, i):
    """A gather of whole rows with the default oob_mode.error."""
    it = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=i)
    got = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=got, src=a.ap(pattern=[[6, 4], [1, 6]], vector_offset=it, indirect_dim=0))
    return _copy_out(nl, nisa, got, (4, 6))


def test_vector_offset_refusals(nk):
    nki, nl, nisa = nk
    data = np.zeros((10, 6), np.float32)

    def k(a, bad):
        it = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=it, value=0)
        sb = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        cases = {
            "on chip": lambda: sb.ap([[6, 4], [1, 6]], vector_offset=it),
            "partition walk": lambda: a.ap([[1, 4], [1, 6]], vector_offset=it),
            "beyond one": lambda: a.ap([[6, 4], [1, 8]], vector_offset=it),
            "mutually": lambda: a.ap([[6, 4], [1, 6]], vector_offset=it, scalar_offset=it),
        }
        view = cases[bad]
        view()
        return a

    for bad, err in (("on chip", ValueError), ("partition walk", ValueError),
                     ("beyond one", NotImplementedError), ("mutually", ValueError)):
        with pytest.raises(err, match="must be in HBM|partition walk|beyond one|mutually"):
            _run(nki, k, data, bad)


def test_nki_scalar_width_and_refusals():
    s = _scalar.NkiScalar(100000)
    assert (s * 100000).v == 1410065408                          # 32-bit wrap (NkiScalar page)
    assert (_scalar.NkiScalar(2 ** 31 - 1) + 1).v == -2 ** 31
    assert (_scalar.NkiScalar(100000, dtype="int64") * 100000).v == 10 ** 10
    with pytest.raises(TypeError):
        _scalar.NkiScalar(1, dtype="int64") < 2                  # noqa: B015
    with pytest.raises(TypeError):
        _scalar.NkiScalar(1) + _scalar.NkiScalar(1, dtype="int64")
    with pytest.raises(TypeError):
        if _scalar.NkiScalar(1):                                  # control flow on a scalar
            pass
    with pytest.raises(TypeError):
        int(_scalar.NkiScalar(1))
    r = _scalar.VirtualRegister(5)
    assert isinstance(r + 1, _scalar.NkiScalar) and not isinstance(r + 1,
                                                                   _scalar.VirtualRegister)
    r.set(7)
    assert r.v == 7
    with pytest.raises(ValueError):
        _scalar.VirtualRegister(1, frozen=True).set(2)


def test_while_loop_runs_until_zero_and_counts_once(nk):
    nki, nl, nisa = nk
    seen = []

    def k(a):
        acc = nl.zeros((1, 8), nl.float32, buffer=nl.sbuf)
        row = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=a[0, 0:1, :])
        reg = _scalar.VirtualRegister(4)

        def body(r):
            seen.append(r.v)
            nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)
            nxt = _scalar.VirtualRegister()
            nxt.set(r - 1)
            return nxt

        nl.while_loop(reg, body)
        nl.while_loop(_scalar.VirtualRegister(0), body)           # a true while: no iteration
        return _copy_out(nl, nisa, acc, (1, 8))

    o = _run(nki, k, A)
    assert seen == [4, 3, 2, 1, 0]        # the last 0: the zero-trip body, for its text only
    np.testing.assert_allclose(o, 4 * A[0, 0:1])      # ... whose add is not kept
    seen.clear()
    one = simulate.program_size(nki.jit(k), A)
    many_seen = list(seen)
    assert many_seen == [4, 0]            # each body is traced once (program text), even one
    #                                       whose condition is 0 at run time
    assert one is not None


def test_while_loop_rules(nk):
    nki, nl, nisa = nk

    def k(a):
        nl.while_loop(3, lambda r: r)
        return a

    with pytest.raises(TypeError, match="VirtualRegister"):
        _run(nki, k, A)

    def k2(a):
        nl.while_loop(_scalar.VirtualRegister(1), lambda r: None)
        return a

    with pytest.raises(TypeError, match="return"):
        _run(nki, k2, A)


def test_fori_loop_register_bound(nk):
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray((6, 8), nl.float32, buffer=nl.shared_hbm)
        z = nl.zeros((1, 8), nl.float32, buffer=nl.sbuf)
        for r in range(6):
            nisa.dma_copy(dst=out[r:r + 1, :], src=z)
        t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)

        def body(i):
            nisa.dma_copy(dst=t, src=a.ap([[8, 1], [1, 8]], offset=i * 8))
            nisa.dma_copy(dst=out.ap([[8, 1], [1, 8]], offset=i * 8), src=t)

        nl.fori_loop(1, _scalar.VirtualRegister(4), body)
        return out

    o = _run(nki, k, A)
    want = np.zeros((6, 8), np.float32)
    want[1:4] = A[0, 1:4]
    np.testing.assert_array_equal(o, want)


@pytest.mark.parametrize("use", [lambda nl: nl.arange(128), lambda nl: nl.mgrid[0:128, 0:4]])
def test_arange_mgrid_removed(nk, use):
    nki, nl, nisa = nk
    with pytest.raises(NotImplementedError, match="integer slices"):
        use(nl)


def test_nkiobject_dataclass_with_plain_class_attributes(nk):
    """nki-library declares ``@dataclass class P(nl.NKIObject): x = None`` (no annotation, so
    no dataclass field) and builds ``P(x=1)``: NKIObject's ``**kwargs`` set the attributes."""
    from dataclasses import dataclass
    nki, nl, nisa = nk

    @dataclass
    class P(nl.NKIObject):
        a: int = 0
        x = None

    p = P(a=2, x=5)
    assert (p.a, p.x) == (2, 5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        P(y=1)


def test_buffer_markers_and_lnc1_program_id(nk):
    nki, nl, nisa = nk
    seen = {}

    def k(a):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        seen["eq"] = (t.buffer == nl.sbuf, a.buffer == nl.sbuf, t.buffer == nl.psum)
        seen["pid"] = (nl.program_id(0), nl.num_programs(0))
        return _copy_out(nl, nisa, a, (2, 2))

    _run(nki, k, np.zeros((2, 2), np.float32))
    assert seen == {"eq": (True, False, False), "pid": (0, 1)}
