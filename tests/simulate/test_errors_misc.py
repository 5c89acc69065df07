"""Remaining documented error paths (spec §13): type, message and docs anchor."""
import numpy as np
import pytest

import simulate as nki
import simulate.language as nl
import simulate.isa as nisa


def _run(body, *arrays):
    def kernel(*hbm):
        body(*hbm)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, 0.0)
        return out
    return nki.jit(kernel)(*(arrays or (np.ones((4, 4), np.float32),)))


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="Unsupported dtype") as e:
        _run(lambda a: nl.zeros((4, 4), np.float64))
    assert e.value.nki_error == "err_unsupported_dtype_value"


def test_index_plus_float():
    with pytest.raises(TypeError, match="tile_index can only add with integer scalar") as e:
        _run(lambda a: nl.arange(4)[:, None] + 0.5)
    assert e.value.nki_error == "err_tile_index_add_non_integer_scalar"


def test_indirect_index_tile_must_be_in_sbuf():
    def body(d, ix):
        it = nl.zeros((4, 1), nl.int32, buffer=nl.psum)
        nl.load(d[it, nl.arange(4)[None, :]])
    with pytest.raises(SyntaxError, match="Indirect indices tile must be on SBUF."):
        _run(body, np.ones((8, 4), np.float32), np.zeros((4, 1), np.int32))


def test_atomic_rmw_rules():
    def not_dynamic(d, v):
        nl.atomic_rmw(d[0:2, :], value=nl.load(v), op=np.add)
    with pytest.raises(SyntaxError, match="only supports indirect dynamic indexing"):
        _run(not_dynamic, np.zeros((4, 4), np.float32), np.ones((2, 4), np.float32))

    def not_add(d, v):
        it = nl.zeros((2, 1), nl.int32)
        nl.atomic_rmw(d[it, nl.arange(4)[None, :]], value=nl.load(v), op=np.multiply)
    with pytest.raises(SyntaxError, match="only supports 'add'"):
        _run(not_add, np.zeros((4, 4), np.float32), np.ones((2, 4), np.float32))


def test_expand_dims_before_partition_and_assert_shape():
    with pytest.raises(ValueError, match="Cannot expand dims before partition dimension"):
        _run(lambda a: nl.expand_dims(nl.zeros((4, 4), nl.float32), 0))
    with pytest.raises(TypeError, match=r"does not match the expected shape of \[4, 5\]") as e:
        _run(lambda a: nl.load(a).assert_shape((4, 5)))
    assert e.value.nki_error == "err_annotation_shape_mismatch"


def test_gen3_only_hwdge_and_cpu_only_apis():
    def hw(a):
        t = nl.ndarray((4, 4), nl.float32)
        nisa.dma_copy(dst=t, src=a, dge_mode=nisa.dge_mode.hwdge)
    with pytest.raises(SyntaxError, match="hwdge requires min target trn2"):
        nki.jit(hw, platform_target="trn1", kernel_return=False)(np.ones((4, 4), np.float32))
    with pytest.raises(NotImplementedError):
        _run(lambda a: nl.all_reduce(nl.load(a), np.add, program_axes=[0]))


def test_error_url_and_class_hierarchy():
    with pytest.raises(nki.NKIError) as e:
        _run(lambda a: nl.exp(a))
    assert str(e.value).splitlines()[-1] == (
        "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/nki/api/"
        "nki.errors.html#err-unsupported-memory")
