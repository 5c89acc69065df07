"""nisa.dma_compute (NKI 0.7): the static sum, the scatter and gather read-modify-writes (rows
out of bounds skipped), the HBM bytes and DMA cost, and the stub's restrictions as errors."""
import ml_dtypes
import numpy as np
import pytest

import simulate
from nki07_fixtures import nk  # noqa: F401 (fixture)

DATA = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
ROWS = np.array([[7], [0], [12], [3]], np.int32)          # 12: past the 10 rows


def _index(nl, nisa, i):
    it = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=i)
    return it


def _filled(nl, nisa, shape, value, dtype=None):
    t = nl.ndarray(shape, dtype or nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=value)
    return t


def _rows_view(a, it):
    return a.ap(pattern=[[6, 4], [1, 6]], vector_offset=it, indirect_dim=0)


def _copy_and_rows(nl, nisa, a, i):
    """A copy of ``a`` in a new HBM tensor, and its rows ``i`` (an indirect view)."""
    out = nl.ndarray((10, 6), nl.float32, buffer=nl.hbm)
    nisa.dma_copy(dst=out, src=a)
    return out, _rows_view(out, _index(nl, nisa, i))


def test_static_sum_in_fp32_cast_to_dst(nk):
    """Three sources (HBM and SBUF, bf16 and fp32) summed in fp32 into a bf16 HBM dst: the
    HBM bytes are the HBM sources' and dst's, the transfer one DMA of every source's bytes."""
    nki, nl, nisa = nk

    def k(a):
        half = _filled(nl, nisa, (10, 6), 0.25, nl.bfloat16)
        one = _filled(nl, nisa, (10, 6), 1.0)
        out = nl.ndarray((10, 6), nl.bfloat16, buffer=nl.hbm)
        nisa.dma_compute(dst=out, srcs=[a, half, one], reduce_op=nl.add, scales=[1.0] * 3)
        return out

    with simulate.measure(target="trn2") as m:
        out = nki.jit(k)(DATA)
    want = (DATA + 1.25).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert m.hbm_bytes_read == DATA.nbytes
    assert m.hbm_bytes_written == DATA.size * 2
    assert m.dma_transfers == 1


def test_scatter_rmw_adds_into_the_indexed_rows_and_skips_out_of_bounds(nk):
    """Scatter RMW ``dst(HBM)[rows] += src(SBUF)``: the in-bounds rows get the sum, the row past
    the end is neither read nor written (oob_mode.skip); dst's rows read and written once."""
    nki, nl, nisa = nk

    def k(a, i):
        out, rows = _copy_and_rows(nl, nisa, a, i)
        nisa.dma_compute(dst=rows, srcs=[rows, _filled(nl, nisa, (4, 6), 0.5)],
                         reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
        return out

    with simulate.measure(target="trn2") as m:
        out = nki.jit(k)(DATA, ROWS)
    want = DATA.copy()
    want[[7, 0, 3]] += 0.5
    np.testing.assert_array_equal(out, want)
    # the copy (60 read and written), the index (4 read), three rows of 6 read and written
    assert m.hbm_bytes_read == 4 * (60 + 4 + 3 * 6)
    assert m.hbm_bytes_written == 4 * (60 + 3 * 6)
    with pytest.raises(IndexError):                # oob_mode.error refuses row 12
        nki.jit(lambda a, i: _scatter_error(nl, nisa, a, i))(DATA, ROWS)


def _scatter_error(nl, nisa, a, i):
    out, rows = _copy_and_rows(nl, nisa, a, i)
    nisa.dma_compute(dst=rows, srcs=[_filled(nl, nisa, (4, 6), 0.5), rows], reduce_op=nl.add)
    return out


def test_gather_rmw_adds_the_indexed_rows_into_sbuf(nk):
    """Gather RMW ``dst(SBUF) += src(HBM)[rows]``: a skipped row keeps dst's value."""
    nki, nl, nisa = nk

    def k(a, i):
        acc = _filled(nl, nisa, (4, 6), 2.0)
        nisa.dma_compute(dst=acc, srcs=[_rows_view(a, _index(nl, nisa, i)), acc],
                         reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
        out = nl.ndarray((4, 6), nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out

    with simulate.measure(target="trn2") as m:
        out = nki.jit(k)(DATA, ROWS)
    np.testing.assert_array_equal(out, [DATA[7] + 2, DATA[0] + 2, [2.0] * 6, DATA[3] + 2])
    assert m.hbm_bytes_read == 4 * (4 + 3 * 6)


def test_rmw_costs_a_dma_of_twice_a_copys_bytes(nk):
    """The scatter RMW of 128 rows of 64 fp32 is one DMA moving dst's rows in and the SBUF
    operand: its modeled DMA time is that of a copy of twice the bytes (a guess,
    simulate._dma_compute)."""
    nki, nl, nisa = nk
    rows = np.random.default_rng(0).permutation(300)[:128].reshape(128, 1).astype(np.int32)
    data = np.zeros((300, 64), np.float32)

    def k(a, i, rmw):
        out = nl.ndarray((300, 64), nl.float32, buffer=nl.hbm)
        it = nl.ndarray((128, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=i)
        view = out.ap(pattern=[[64, 128], [1, 64]], vector_offset=it, indirect_dim=0)
        val = _filled(nl, nisa, (128, 64), 1.0)
        if rmw:
            nisa.dma_compute(dst=view, srcs=[view, val], reduce_op=nl.add)
        else:
            nisa.dma_copy(dst=view, src=val)
        return out

    busy = []
    for rmw in (False, True):
        with simulate.measure(target="trn2") as m:
            nki.jit(lambda a, i: k(a, i, rmw))(data, rows)
        busy.append(m)
    copy, rmw = busy
    assert rmw.hbm_bytes_read - copy.hbm_bytes_read == 128 * 64 * 4
    assert rmw.hbm_bytes_written == copy.hbm_bytes_written
    assert rmw.dma_transfers == copy.dma_transfers
    data_seconds = [sum(k.dma_data_seconds for k in x.kernels) for x in (copy, rmw)]
    bw = simulate._hw.get_target("trn2").dma_bytes_per_s
    assert data_seconds[1] - data_seconds[0] == pytest.approx(128 * 64 * 4 / bw)


@pytest.mark.parametrize("case, match", [
    ("srcs17", r"'srcs' holds 17 tensors; at most 16"),
    ("multiply", r"'reduce_op' multiply is not supported \(supported: add\)"),
    ("scales", r"'scales' must be None or 2 values all 1.0"),
    ("count", r"'srcs\[1\]' \[4, 5\] holds 20 elements, dst \[4, 6\] 24"),
    ("not_unique", r"unique_indices=False is not supported"),
    ("repeated", r"unique_indices=True but the indirect access .* repeats rows"),
    ("three", r"read-modify-write \(an indirect operand\) takes exactly 2 sources, got 3"),
    ("no_match", r"needs one of the two read-modify-write forms"),
])
def test_restrictions_of_the_stub_are_errors(nk, case, match):
    nki, nl, nisa = nk

    def k(a, i):
        out, rows = _copy_and_rows(nl, nisa, a, i)
        x = _filled(nl, nisa, (4, 6), 1.0)
        kw = dict(dst=x, srcs=[x, x], reduce_op=nl.add)
        if case == "srcs17":
            kw["srcs"] = [x] * 17
        elif case == "multiply":
            kw["reduce_op"] = nl.multiply
        elif case == "scales":
            kw["scales"] = [1.0, 2.0]
        elif case == "count":
            kw["srcs"] = [x, _filled(nl, nisa, (4, 5), 1.0)]
        elif case == "not_unique":
            kw["unique_indices"] = False
        elif case in ("repeated", "three"):
            kw = dict(dst=rows, srcs=[rows, x] + ([x] if case == "three" else []),
                      reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
        else:
            kw = dict(dst=rows, srcs=[x, x], reduce_op=nl.add, oob_mode=nisa.oob_mode.skip)
        nisa.dma_compute(**kw)
        return out

    rows = np.array([[1], [4], [1], [2]], np.int32) if case == "repeated" else ROWS
    with pytest.raises(Exception, match=match):
        nki.jit(k)(DATA, rows)


@pytest.mark.parametrize("offset", ["fori_ds", "fori_slice", "register_ap", "tensor_ap",
                                    "unrolled"])
def test_static_mode_needs_compile_time_addresses(nk, offset):
    """The stub: "Both srcs and dst tensors must have compile-time known addresses (unless using
    vector_offset for indirect access)": a row chosen by a fori_loop index, a register or an
    index tensor is refused in static mode; a Python (unrolled) loop's int is a compile-time
    address."""
    nki, nl, nisa = nk

    def k(a):
        out = nl.ndarray((10, 6), nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=a)
        one = _filled(nl, nisa, (1, 6), 1.0)

        def add_row(dst):
            nisa.dma_compute(dst=dst, srcs=[dst, one], reduce_op=nl.add)

        if offset == "fori_ds":
            nl.fori_loop(0, 2, lambda i: add_row(out[nl.ds(i, 1), :]))
        elif offset == "fori_slice":
            nl.fori_loop(0, 2, lambda i: add_row(out[i:i + 1, :]))
        elif offset in ("register_ap", "tensor_ap"):
            t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
            nisa.iota(dst=t, pattern=[[0, 1]], offset=1)
            if offset == "register_ap":
                reg = nisa.register_alloc()
                nisa.register_load(reg, t)
                t = reg
            add_row(out.ap(pattern=[[6, 1], [1, 6]], scalar_offset=t, indirect_dim=0))
        else:
            for i in range(2):
                add_row(out[i:i + 1, :])
        return out

    if offset != "unrolled":
        with pytest.raises(ValueError, match="compile-time known addresses"):
            nki.jit(k)(DATA)
        return
    want = DATA.copy()
    want[:2] += 1
    np.testing.assert_array_equal(nki.jit(k)(DATA), want)
