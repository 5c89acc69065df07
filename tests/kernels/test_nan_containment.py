"""A non-finite key a row cannot see never reaches that row (the forward's band masks select
rather than add): the rows before a NaN key under a causal mask, or outside its window, give
exactly what they give when that key is finite. Dense and block-sparse forwards."""
import numpy as np
import pytest

import host
from nki_kernels.nki import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "simulate", reason="simulator runs")


def _qkv(Nq, Nk, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 2, Nq, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, Nk, 32)).astype(np.float32)
    v = rng.standard_normal((1, 1, Nk, 32)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("kw, hidden", [
    (dict(causal="top_left"), slice(0, 250)),                  # rows before key 250
    (dict(window=(20, 20)), slice(0, 229)),                     # rows farther than 20 away
    (dict(causal="top_left", block_mask=np.tril(np.ones((3, 3), bool))[None, None]),
     slice(0, 250)),
])
def test_a_non_finite_hidden_key_does_not_reach_the_rows_that_cannot_see_it(kw, hidden, bad):
    q, k, v = _qkv(300, 300)
    clean = host.flash_attention(q, k, v, mixed_precision=False, **kw)
    k[0, 0, 250] = bad
    got = host.flash_attention(q, k, v, mixed_precision=False, **kw)
    np.testing.assert_array_equal(got[:, :, hidden], clean[:, :, hidden])
    assert np.isfinite(got[:, :, hidden]).all()
