"""Random attention inputs shared by the kernel tests of this folder."""
import numpy as np


def attention_inputs(B, Hq, Hkv, Nq, Nk, D, dtype=np.float32, seed=0):
    """``q, k, v, do``: standard normal ``(B, Hq, Nq, D)``, ``(B, Hkv, Nk, D)`` x2 and
    ``(B, Hq, Nq, D)`` in ``dtype``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    do = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
    return q, k, v, do
