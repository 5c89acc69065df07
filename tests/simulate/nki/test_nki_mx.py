"""nki.* pieces added for AWS's own examples: ``nki.typing`` (the SDK's average_pool2d example
imports it) and the MX instructions of NeuronCore-v4 (``nisa.quantize_mx``,
``nisa.nc_matmul_mx``, the ``*_x4`` packed dtypes, ``.ap(dtype=)`` reinterpretation of raw
integer storage). Values against NumPy written here from the stub's docstrings."""
import ml_dtypes
import numpy as np
import pytest

import simulate
from nki07_fixtures import nk  # noqa: F401 (nk: fixture)


def test_typing_tensor_annotation(nk):
    nki, nl, nisa = nk
    import nki.typing as nt
    from nki.typing import tensor

    @nki.jit
    def k(x: nt.tensor[4, 8]):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    assert np.array_equal(k(x), x)
    assert tensor is nt.tensor and repr(nt.tensor[4, 8]) == "nt.tensor[4, 8]"
