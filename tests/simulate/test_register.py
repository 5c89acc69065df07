"""register_as_neuronxcc(): third-party legacy kernels run unchanged (realistic doc kernels)."""
import importlib
import sys

import ml_dtypes
import numpy as np
import pytest

import simulate


@pytest.fixture(scope="module")
def doc():
    """Register the aliases, import the doc-style kernels, and clean up afterwards."""
    simulate.register_as_neuronxcc()
    sys.modules.pop("nki_doc_kernels", None)
    mod = importlib.import_module("nki_doc_kernels")
    yield mod
    sys.modules.pop("nki_doc_kernels", None)
    simulate.unregister_neuronxcc()


def test_aliases_resolve_to_simulator(doc):
    import neuronxcc.nki as nki
    import neuronxcc.nki.language as nl
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.typing as nt
    import neuronxcc.nki.compiler as ncc
    from neuronxcc import nki as nki2
    from neuronxcc.nki.language import par_dim
    assert nki is simulate and nki2 is simulate and nl is simulate.language
    assert nisa is simulate.isa and nt is simulate.typing and ncc is simulate.compiler
    assert par_dim is simulate.language.par_dim
    assert simulate.register_as_neuronxcc() is simulate          # idempotent


def test_spmd_tensor_add(doc, rng):
    a = rng.standard_normal((256, 1024)).astype(np.float32)
    b = rng.standard_normal((256, 1024)).astype(np.float32)
    np.testing.assert_array_equal(doc.nki_tensor_add(a, b), a + b)
    with simulate.measure() as m:
        doc.nki_tensor_add(a, b)
    assert m.kernels[0].grid == (2, 2)
    assert m.hbm_bytes_read == 2 * a.nbytes and m.hbm_bytes_written == a.nbytes


@pytest.mark.parametrize("kernel", ["nki_matmul_tiled_", "nki_matmul_isa_"])
def test_k_tiled_matmul(doc, kernel, rng):
    lhsT = rng.standard_normal((512, 256)).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((512, 1024)).astype(ml_dtypes.bfloat16)
    out = getattr(doc, kernel)(lhsT, rhs)
    ref = lhsT.astype(np.float64).T @ rhs.astype(np.float64)
    # bf16 inputs are exact products in fp32; the fp32 PSUM sum differs from float64 only by
    # accumulation rounding, then the tiled_ kernel rounds the result to bf16 (its dtype)
    if kernel == "nki_matmul_tiled_":
        assert out.dtype == ml_dtypes.bfloat16
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2 ** -8, atol=1e-3)
    else:
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [1, 17, 128, 129, 300])
def test_masked_softmax(doc, n, rng):
    x = rng.standard_normal((n, 200)).astype(np.float32) * 4
    with simulate.measure() as m:
        y = doc.softmax_rows_kernel(x)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert m.hbm_bytes_read == x.nbytes and m.hbm_bytes_written == x.nbytes


@pytest.mark.parametrize("n,h", [(128, 512), (200, 1024), (77, 256)])
def test_layernorm_bn_stats(doc, n, h, rng):
    x = rng.standard_normal((n, h)).astype(np.float32)
    g = rng.standard_normal(h).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    y = doc.nki_layernorm_kernel_v2(x, 1e-5, g, b)
    mu = x.mean(1, keepdims=True)
    ref = (x - mu) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_legacy_pass_by_reference_output(doc, rng):
    import neuronxcc.nki as nki
    a = rng.standard_normal((64, 32)).astype(np.float32)
    c = np.zeros_like(a)
    nki.simulate_kernel(doc.legacy_add_kernel, a, a, c)
    np.testing.assert_array_equal(c, 2 * a)


def test_refuses_when_real_neuronxcc_installed(tmp_path, monkeypatch):
    simulate.unregister_neuronxcc()
    pkg = tmp_path / "neuronxcc"
    (pkg / "nki").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nki" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        with pytest.raises(RuntimeError, match="real neuronx-cc"):
            simulate.register_as_neuronxcc()
    finally:
        sys.modules.pop("neuronxcc", None)


def test_unregister_removes_aliases():
    simulate.register_as_neuronxcc()
    simulate.unregister_neuronxcc()
    assert "neuronxcc.nki" not in sys.modules
    simulate.unregister_neuronxcc()                                # no-op when not registered
