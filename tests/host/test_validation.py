"""Every error path of host/validation.py, with the message it gives.

Each message must name the argument, show what was given and say what is allowed.
"""
import math
import re

import ml_dtypes
import numpy as np
import pytest

from host import reference as R
from host import validation as V

BF16 = np.dtype(ml_dtypes.bfloat16)


def arr(*shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


def qkv(B=2, Hq=4, Hkv=2, Nq=5, Nk=7, D=8, dtype=np.float32):
    return arr(B, Hq, Nq, D, dtype=dtype), arr(B, Hkv, Nk, D, dtype=dtype), arr(B, Hkv, Nk, D,
                                                                                 dtype=dtype)


def test_limits_are_named_constants():
    assert V.MAX_HEAD_DIM == 256
    assert V.MAX_DECODE_TOKENS == 128
    assert [d.name for d in V.FLOAT_DTYPES] == ["float32", "bfloat16", "float16"]


# ------------------------------------------------------------------------------------------
# check_array / check_int / normalize_dtype
# ------------------------------------------------------------------------------------------


def test_check_array_rejects_non_arrays():
    with pytest.raises(TypeError, match=r"^q: expected a numpy.ndarray or torch.Tensor, "
                                        r"got \[1.0, 2.0\] \(list\)$"):
        V.check_array("q", [1.0, 2.0])
    with pytest.raises(TypeError, match=r"x: expected a numpy.ndarray or torch.Tensor, got None"):
        V.check_array("x", None)


def test_check_array_rank():
    with pytest.raises(ValueError, match=re.escape(
            "q: expected a 4-D array of shape (B, Hq, Nq, D), got a 3-D array of shape (2, 3, 4)")):
        V.check_array("q", arr(2, 3, 4), ndim=4, layout="(B, Hq, Nq, D)")
    with pytest.raises(ValueError, match=re.escape("x: expected a 2-D array, got a 0-D array")):
        V.check_array("x", np.ones((), dtype=np.float32), ndim=2)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.bool_, np.complex64])
def test_check_array_dtype(dtype):
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=re.escape(
            f"q: dtype {name} is not supported; allowed: float32, bfloat16, float16")):
        V.check_array("q", arr(2, dtype=dtype))


def test_check_array_accepts_allowed_dtypes_and_returns_input():
    for dtype in (np.float32, BF16, np.float16):
        x = arr(3, dtype=dtype)
        assert V.check_array("x", x, ndim=1) is x
    assert V.check_array("x", arr(3, dtype=np.int8), dtypes=None) is not None


def test_check_array_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert V.check_array("x", t, ndim=2) is t
    with pytest.raises(TypeError, match=r"x: dtype float64 is not supported; allowed: float32, "):
        V.check_array("x", torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=re.escape("x: expected a 1-D array, got a 2-D array of "
                                                   "shape (2, 3)")):
        V.check_array("x", t, ndim=1)


def test_check_int():
    assert V.check_int("n", np.int64(3), minimum=1) == 3
    with pytest.raises(TypeError, match=r"n: expected an int, got True \(bool\)"):
        V.check_int("n", True)
    with pytest.raises(TypeError, match=r"n: expected an int, got 2.0 \(float\)"):
        V.check_int("n", 2.0)
    with pytest.raises(ValueError, match=re.escape("n: expected an int in [1, 5], got 6")):
        V.check_int("n", 6, minimum=1, maximum=5)
    with pytest.raises(ValueError, match=re.escape("n: expected an int in [1, inf], got 0")):
        V.check_int("n", 0, minimum=1)


def test_normalize_dtype():
    assert V.normalize_dtype("dtype", "bfloat16") == BF16
    assert V.normalize_dtype("dtype", ml_dtypes.bfloat16) == BF16
    assert V.normalize_dtype("dtype", np.float16) == np.dtype(np.float16)
    assert V.normalize_dtype("dtype", np.dtype("float32")) == np.dtype(np.float32)
    with pytest.raises(TypeError, match=r"dtype: expected one of float32, bfloat16, float16, "
                                        r"got 'float64' \(str\)"):
        V.normalize_dtype("dtype", "float64")
    with pytest.raises(TypeError, match=r"out_dtype: expected one of float32, bfloat16, float16, "
                                        r"got <class 'float'> \(type\)"):
        V.normalize_dtype("out_dtype", float)


def test_normalize_dtype_torch():
    torch = pytest.importorskip("torch")
    assert V.normalize_dtype("dtype", torch.bfloat16) == BF16
    with pytest.raises(TypeError, match=r"dtype: expected one of .*got torch.float64"):
        V.normalize_dtype("dtype", torch.float64)


# ------------------------------------------------------------------------------------------
# check_attention_inputs
# ------------------------------------------------------------------------------------------


def test_attention_inputs_ok():
    dims = V.check_attention_inputs(*qkv(D=256))
    assert dims == V.AttentionShape(B=2, Hq=4, Hkv=2, Nq=5, Nk=7, D=256)
    assert dims.group == 2
    assert V.check_attention_inputs(*qkv(Hq=6, Hkv=1, Nq=1, Nk=1, D=1)).group == 6


@pytest.mark.parametrize("which,index,label", [
    ("q", 0, "batch size B"), ("q", 1, "query heads Hq"), ("q", 2, "query length Nq"),
    ("k", 1, "kv heads Hkv"), ("k", 2, "key length Nk"),
])
def test_attention_inputs_empty_dims(which, index, label):
    q, k, v = qkv(Hkv=4)
    shapes = {"q": list(q.shape), "k": list(k.shape)}
    shapes[which][index] = 0
    q = arr(*shapes["q"])
    if which == "k":
        k = v = arr(*shapes["k"])
    elif index == 0:
        k = v = arr(0, *k.shape[1:])
    shape = tuple(shapes[which])
    with pytest.raises(ValueError, match=re.escape(f"{which}: {label} must be >= 1, got 0 "
                                                   f"(shape {shape})")):
        V.check_attention_inputs(q, k, v)


@pytest.mark.parametrize("D", [0, 257, 512])
def test_attention_inputs_head_dim(D):
    with pytest.raises(ValueError, match=re.escape(
            f"q: head dim D must be in [1, 256], got D={D} (shape (2, 4, 5, {D}))")):
        V.check_attention_inputs(*qkv(D=D))


def test_attention_inputs_head_dim_unbounded_for_references():
    assert V.check_attention_inputs(*qkv(D=300), max_head_dim=None).D == 300


def test_attention_inputs_k_must_match_q():
    q, _, v = qkv(B=2, D=64)
    with pytest.raises(ValueError, match=re.escape(
            "k: expected shape (B, Hkv, Nk, D) with B=2 and D=64 matching q, got (2, 4, 100, 32)")):
        V.check_attention_inputs(q, arr(2, 4, 100, 32), v)
    with pytest.raises(ValueError, match=re.escape(
            "k: expected shape (B, Hkv, Nk, D) with B=2 and D=64 matching q, got (3, 2, 7, 64)")):
        V.check_attention_inputs(q, arr(3, 2, 7, 64), v)


def test_attention_inputs_v_must_match_k():
    q, k, _ = qkv()
    with pytest.raises(ValueError, match=re.escape(
            "v: expected the same shape as k (2, 2, 7, 8) (B, Hkv, Nk, D), got (2, 2, 6, 8)")):
        V.check_attention_inputs(q, k, arr(2, 2, 6, 8))


def test_attention_inputs_gqa_divisibility():
    q, k, v = qkv(Hq=6, Hkv=4)
    with pytest.raises(ValueError, match=re.escape(
            "k: Hkv=4 kv heads must divide q's Hq=6 query heads (GQA: query head h reads kv head "
            "h // (Hq // Hkv)); got q (2, 6, 5, 8) and k (2, 4, 7, 8)")):
        V.check_attention_inputs(q, k, v)


def test_attention_inputs_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape(
            "k: expected a 4-D array of shape (B, Hkv, Nk, D), got a 3-D array of shape (2, 7, 8)")):
        V.check_attention_inputs(q, arr(2, 7, 8), v)
    with pytest.raises(ValueError, match=r"^v: expected a 4-D array of shape \(B, Hkv, Nk, D\)"):
        V.check_attention_inputs(q, k, arr(2, 2, 7, 8, 1))


def test_attention_inputs_mixed_dtypes_are_an_error():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=re.escape(
            "k: dtype float16 does not match q's dtype float32; all inputs must share one dtype "
            "(cast explicitly before calling)")):
        V.check_attention_inputs(q, k.astype(np.float16), v)
    with pytest.raises(TypeError, match=r"^v: dtype bfloat16 does not match q's dtype float32"):
        V.check_attention_inputs(q, k, v.astype(BF16))
    V.check_attention_inputs(q, k.astype(np.float16), v, same_dtype=False)


def test_attention_inputs_float64_is_rejected_for_kernels():
    with pytest.raises(TypeError, match=r"^q: dtype float64 is not supported; allowed: float32, "
                                        r"bfloat16, float16$"):
        V.check_attention_inputs(*qkv(dtype=np.float64))
    V.check_attention_inputs(*qkv(dtype=np.float64), dtypes=V.REFERENCE_DTYPES)


def test_attention_backward_inputs():
    q, k, v = qkv()
    lse = arr(2, 4, 5)
    assert V.check_attention_backward_inputs(q, q, k, v, q, lse).group == 2
    with pytest.raises(ValueError, match=re.escape(
            "do: expected the same shape as q (2, 4, 5, 8), got (2, 4, 6, 8)")):
        V.check_attention_backward_inputs(arr(2, 4, 6, 8), q, k, v, q, lse)
    with pytest.raises(ValueError, match=re.escape(
            "o: expected the same shape as q (2, 4, 5, 8), got (2, 4, 5, 7)")):
        V.check_attention_backward_inputs(q, q, k, v, arr(2, 4, 5, 7), lse)
    with pytest.raises(TypeError, match=r"^do: dtype bfloat16 does not match q's dtype float32"):
        V.check_attention_backward_inputs(q.astype(BF16), q, k, v, q, lse)
    with pytest.raises(TypeError, match=r"^o: dtype float16 does not match q's dtype float32"):
        V.check_attention_backward_inputs(q, q, k, v, q.astype(np.float16), lse)
    with pytest.raises(ValueError, match=re.escape(
            "lse: expected shape (B, Hq, Nq) = (2, 4, 5) matching q, got (2, 4, 6)")):
        V.check_attention_backward_inputs(q, q, k, v, q, arr(2, 4, 6))
    with pytest.raises(ValueError, match=re.escape(
            "lse: expected a 3-D array of shape (B, Hq, Nq), got a 4-D array")):
        V.check_attention_backward_inputs(q, q, k, v, q, arr(2, 4, 5, 1))
    with pytest.raises(TypeError, match=r"^lse: dtype bfloat16 is not supported; allowed: float32$"):
        V.check_attention_backward_inputs(q, q, k, v, q, lse.astype(BF16))


# ------------------------------------------------------------------------------------------
# Options: causal, window, lengths, scale
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given,want", [
    (None, None), (False, None), (np.False_, None), (True, "bottom_right"),
    (np.True_, "bottom_right"), ("top_left", "top_left"), ("bottom_right", "bottom_right"),
])
def test_normalize_causal(given, want):
    assert V.normalize_causal(given) == want


def test_normalize_causal_errors():
    allowed = re.escape("expected None, False, True (= 'bottom_right'), 'top_left' or "
                        "'bottom_right'")
    with pytest.raises(ValueError, match=f"^causal: {allowed}, got 'TopLeft'$"):
        V.normalize_causal("TopLeft")
    with pytest.raises(TypeError, match=f"^causal: {allowed}, got 1 \\(int\\)$"):
        V.normalize_causal(1)
    with pytest.raises(TypeError, match=f"^causal: {allowed}, got 0 \\(int\\)$"):
        V.normalize_causal(0)


@pytest.mark.parametrize("given,want", [
    (None, None), ((-1, -1), None), ([-1, -1], None), ((2, 0), (2, 0)), ([0, -1], (0, -1)),
    ((np.int64(3), np.int32(1)), (3, 1)),
])
def test_normalize_window(given, want):
    got = V.normalize_window(given)
    assert got == want
    if got is not None:
        assert all(type(x) is int for x in got)


def test_normalize_window_errors():
    with pytest.raises(TypeError, match=re.escape(
            "window: expected None or a (left, right) pair of ints (-1 = unbounded), got 4 (int)")):
        V.normalize_window(4)
    with pytest.raises(TypeError, match=r"^window: expected None or a \(left, right\) pair .*"
                                        r"got array\(\[1, 2\]\) \(ndarray\)$"):
        V.normalize_window(np.array([1, 2]))
    with pytest.raises(ValueError, match=re.escape(
            "window: expected a (left, right) pair of ints (-1 = unbounded), got 3 values (1, 2, 3)")):
        V.normalize_window((1, 2, 3))
    with pytest.raises(TypeError, match=re.escape("window: left must be an int >= -1, got 1.5 (float)")):
        V.normalize_window((1.5, 0))
    with pytest.raises(TypeError, match=re.escape("window: right must be an int >= -1, got True (bool)")):
        V.normalize_window((0, True))
    with pytest.raises(ValueError, match=re.escape("window: left must be >= -1 (-1 = unbounded), got -2")):
        V.normalize_window((-2, 0))
    with pytest.raises(ValueError, match=re.escape("window: right must be >= -1 (-1 = unbounded), got -5")):
        V.normalize_window((0, -5))


def test_check_lengths_accepts_ints():
    assert V.check_lengths("q_lens", None, 2, 5) is None
    for given in ([3, 0], (3, 0), np.array([3, 0], dtype=np.int32), np.array([3, 0], np.uint8)):
        got = V.check_lengths("q_lens", given, 2, 5)
        assert got.dtype == np.int64 and got.tolist() == [3, 0]
    source = np.array([1, 2])
    got = V.check_lengths("kv_lens", source, 2, 5)
    got[0] = 5
    assert source[0] == 1  # a copy, never a view of the caller's array


def test_check_lengths_torch():
    torch = pytest.importorskip("torch")
    assert V.check_lengths("kv_lens", torch.tensor([4, 1]), 2, 5).tolist() == [4, 1]
    with pytest.raises(TypeError, match=r"^kv_lens: expected an integer array, got dtype float32$"):
        V.check_lengths("kv_lens", torch.tensor([4.0, 1.0]), 2, 5)


@pytest.mark.parametrize("lens,dtype", [
    (np.array([1.0, 2.0]), "float64"), (np.array([True, False]), "bool"),
    (np.array([1, 2], dtype=np.float32), "float32"),
])
def test_check_lengths_rejects_non_integer_arrays(lens, dtype):
    with pytest.raises(TypeError, match=f"^q_lens: expected an integer array, got dtype {dtype}$"):
        V.check_lengths("q_lens", lens, 2, 5)


def test_check_lengths_errors():
    with pytest.raises(TypeError, match=re.escape("kv_lens: expected integers, got 2.0 (float) at "
                                                  "index 1")):
        V.check_lengths("kv_lens", [1, 2.0], 2, 5)
    with pytest.raises(TypeError, match=re.escape("kv_lens: expected integers, got True (bool) at "
                                                  "index 0")):
        V.check_lengths("kv_lens", [True, 2], 2, 5)
    with pytest.raises(TypeError, match=re.escape(
            "kv_lens: expected None, a 1-D integer array or a list of ints, got 3 (int)")):
        V.check_lengths("kv_lens", 3, 1, 5)
    with pytest.raises(ValueError, match=re.escape(
            "q_lens: expected a 1-D array of length B=2, got shape (2, 1)")):
        V.check_lengths("q_lens", np.array([[1], [2]]), 2, 5)
    with pytest.raises(ValueError, match=re.escape(
            "q_lens: expected length B=2 (one per sequence), got length 3")):
        V.check_lengths("q_lens", [1, 2, 3], 2, 5)
    with pytest.raises(ValueError, match=re.escape(
            "kv_lens: values must be in [0, Nk=5], got 6 at index 1")):
        V.check_lengths("kv_lens", [5, 6], 2, 5, upper_name="Nk")
    with pytest.raises(ValueError, match=re.escape("kv_lens: values must be in [0, 5], got -1 at "
                                                   "index 0")):
        V.check_lengths("kv_lens", np.array([-1, 2]), 2, 5)


def test_check_scale():
    assert V.check_scale(None, 64) == 1 / 8
    assert V.check_scale(None, 2) == 1 / math.sqrt(2)
    assert V.check_scale(0.5, 64) == 0.5 and V.check_scale(2, 64) == 2.0
    assert V.check_scale(np.float32(0.25), 64) == 0.25
    assert V.check_scale(-1.0, 4) == -1.0 and V.check_scale(0.0, 4) == 0.0
    for bad in (True, "0.5", 1j, np.array(0.5), [0.5]):
        with pytest.raises(TypeError, match=r"^scale: expected None or a finite real number, got "):
            V.check_scale(bad, 64)
    for bad in (math.inf, -math.inf, math.nan, np.float32("nan")):
        with pytest.raises(ValueError, match=r"^scale: expected a finite real number, got "
                                             r"(-?inf|nan)$"):
            V.check_scale(bad, 64)


# ------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------


def dec(B=2, Hq=4, Hkv=2, T=3, S_max=16, D=8, dtype=np.float32):
    return arr(B, Hq, T, D, dtype=dtype), arr(B, Hkv, S_max, D, dtype=dtype), arr(
        B, Hkv, S_max, D, dtype=dtype)


def test_decode_inputs_ok():
    tree = np.eye(3, dtype=bool)
    got = V.check_decode_inputs(*dec(), [3, 16], tree)
    assert (got.B, got.Hq, got.Hkv, got.T, got.S_max, got.D, got.group) == (2, 4, 2, 3, 16, 8, 2)
    assert got.cache_lens.tolist() == [3, 16]
    assert got.tree_mask is not tree and got.tree_mask.tolist() == tree.tolist()
    assert V.check_decode_inputs(*dec(T=128, S_max=128), [128, 128]).tree_mask is None


def test_decode_inputs_token_count():
    with pytest.raises(ValueError, match=re.escape(
            "q: T (new tokens per sequence) must be in [1, 128], got T=129 (shape (2, 4, 129, 8))")):
        V.check_decode_inputs(*dec(T=129, S_max=200), [129, 129])
    with pytest.raises(ValueError, match=re.escape(
            "q: T (new tokens per sequence) must be in [1, 128], got T=0")):
        V.check_decode_inputs(*dec(T=0), [1, 1])


def test_decode_inputs_shapes():
    q, kc, vc = dec()
    with pytest.raises(ValueError, match=re.escape(
            "q: expected a 4-D array of shape (B, Hq, T, D), got a 3-D array of shape (4, 3, 8)")):
        V.check_decode_inputs(arr(4, 3, 8), kc, vc, [3, 3])
    with pytest.raises(ValueError, match=re.escape(
            "k_cache: expected shape (B, Hkv, S_max, D) with B=2 and D=8 matching q, got (2, 2, 16, 4)")):
        V.check_decode_inputs(q, arr(2, 2, 16, 4), vc, [3, 3])
    with pytest.raises(ValueError, match=re.escape(
            "v_cache: expected the same shape as k_cache (2, 2, 16, 8), got (2, 2, 15, 8)")):
        V.check_decode_inputs(q, kc, arr(2, 2, 15, 8), [3, 3])
    with pytest.raises(ValueError, match=re.escape("k_cache: cache size S_max must be >= 1, got 0")):
        V.check_decode_inputs(q, arr(2, 2, 0, 8), arr(2, 2, 0, 8), [3, 3])
    with pytest.raises(ValueError, match=re.escape(
            "k_cache: Hkv=3 kv heads must divide q's Hq=4 query heads")):
        V.check_decode_inputs(q, arr(2, 3, 16, 8), arr(2, 3, 16, 8), [3, 3])
    with pytest.raises(ValueError, match=re.escape("q: head dim D must be in [1, 256], got D=300")):
        V.check_decode_inputs(*dec(D=300), [3, 3])


def test_decode_inputs_dtypes():
    q, kc, vc = dec()
    with pytest.raises(TypeError, match=r"^k_cache: dtype bfloat16 does not match q's dtype float32"):
        V.check_decode_inputs(q, kc.astype(BF16), vc, [3, 3])
    with pytest.raises(TypeError, match=r"^v_cache: dtype float16 does not match q's dtype float32"):
        V.check_decode_inputs(q, kc, vc.astype(np.float16), [3, 3])


def test_decode_inputs_cache_lens():
    with pytest.raises(TypeError, match=re.escape(
            "cache_lens: required, a (B,) = (2,) integer array with T <= value <= S_max")):
        V.check_decode_inputs(*dec(), None)
    with pytest.raises(ValueError, match=re.escape(
            "cache_lens: each value must be in [T=3, S_max=16] (the cache already holds the T new "
            "tokens), got 2 at index 1")):
        V.check_decode_inputs(*dec(), [3, 2])
    with pytest.raises(ValueError, match=re.escape(
            "cache_lens: values must be in [0, S_max=16], got 17 at index 0")):
        V.check_decode_inputs(*dec(), [17, 3])
    with pytest.raises(TypeError, match=r"^cache_lens: expected an integer array, got dtype float64"):
        V.check_decode_inputs(*dec(), np.array([3.0, 4.0]))
    with pytest.raises(ValueError, match=re.escape(
            "cache_lens: expected length B=2 (one per sequence), got length 1")):
        V.check_decode_inputs(*dec(), [3])


def test_decode_inputs_tree_mask():
    with pytest.raises(TypeError, match=re.escape(
            "tree_mask: expected dtype bool, got int64 (no implicit cast; pass mask.astype(bool) or "
            "mask != 0)")):
        V.check_decode_inputs(*dec(), [3, 3], np.eye(3, dtype=np.int64))
    with pytest.raises(ValueError, match=re.escape(
            "tree_mask: expected shape (T, T) = (3, 3) matching q's T, got (3, 4)")):
        V.check_decode_inputs(*dec(), [3, 3], np.ones((3, 4), dtype=bool))
    with pytest.raises(ValueError, match=re.escape(
            "tree_mask: expected a 2-D array of shape (T, T), got a 3-D array of shape (2, 3, 3)")):
        V.check_decode_inputs(*dec(), [3, 3], np.ones((2, 3, 3), dtype=bool))
    no_diag = np.ones((3, 3), dtype=bool)
    no_diag[1, 1] = False
    with pytest.raises(ValueError, match=re.escape(
            "tree_mask: the diagonal must be all True (every new token sees itself), got False at "
            "[1, 1]")):
        V.check_decode_inputs(*dec(), [3, 3], no_diag)
    with pytest.raises(TypeError, match=r"^tree_mask: expected a numpy.ndarray or torch.Tensor"):
        V.check_decode_inputs(*dec(), [3, 3], [[True]])


# ------------------------------------------------------------------------------------------
# linear_gelu, softmax, merge
# ------------------------------------------------------------------------------------------


def test_linear_gelu_inputs():
    got = V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16), arr(16), "tanh")
    assert got == V.LinearGeluShape(M=4, K=8, N=16, approximate="tanh")
    with pytest.raises(ValueError, match=re.escape(
            "w: expected shape (K, N) with K=8 matching x's last dim, got (16, 8)")):
        V.check_linear_gelu_inputs(arr(4, 8), arr(16, 8), arr(8))
    with pytest.raises(ValueError, match=re.escape(
            "b: expected shape (N,) = (16,) matching w's last dim, got (8,)")):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16), arr(8))
    with pytest.raises(ValueError, match=re.escape(
            "b: expected a 1-D array of shape (N,), got a 2-D array of shape (1, 16)")):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16), arr(1, 16))
    with pytest.raises(ValueError, match=re.escape(
            "x: expected a 2-D array of shape (M, K), got a 3-D array of shape (2, 4, 8)")):
        V.check_linear_gelu_inputs(arr(2, 4, 8), arr(8, 16), arr(16))
    with pytest.raises(ValueError, match=re.escape("x: rows M must be >= 1, got 0 (shape (0, 8))")):
        V.check_linear_gelu_inputs(arr(0, 8), arr(8, 16), arr(16))
    with pytest.raises(ValueError, match=re.escape("w: output features N must be >= 1, got 0")):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 0), arr(0))
    with pytest.raises(TypeError, match=r"^w: dtype bfloat16 does not match x's dtype float32"):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16, dtype=BF16), arr(16))
    with pytest.raises(TypeError, match=r"^b: expected a numpy.ndarray or torch.Tensor, got None"):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16), None)
    with pytest.raises(ValueError, match=r"^approximate: expected 'none' or 'tanh', got 'erf'$"):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16), arr(16), "erf")
    with pytest.raises(TypeError, match=r"^approximate: expected 'none' or 'tanh', got None"):
        V.check_linear_gelu_inputs(arr(4, 8), arr(8, 16), arr(16), None)


def test_softmax_input():
    assert V.check_softmax_input(arr(3, 5)) == (3, 5)
    with pytest.raises(ValueError, match=re.escape(
            "x: expected a 2-D array of shape (M, N), got a 1-D array of shape (5,)")):
        V.check_softmax_input(arr(5))
    with pytest.raises(ValueError, match=re.escape("x: row length N must be >= 1, got 0 (shape (3, 0))")):
        V.check_softmax_input(arr(3, 0))
    with pytest.raises(TypeError, match=r"^x: dtype int64 is not supported"):
        V.check_softmax_input(np.zeros((3, 5), dtype=np.int64))


def test_merge_inputs():
    assert V.check_merge_inputs(np.zeros((2, 3, 4)), np.zeros((2, 3))) == (2, 3, 4)
    with pytest.raises(ValueError, match=re.escape(
            "o_parts: expected an array of shape (S, ..., D) with at least 2 dims, got shape (4,)")):
        V.check_merge_inputs(np.zeros(4), np.zeros(()))
    with pytest.raises(ValueError, match=re.escape(
            "o_parts: the number of splits S must be >= 1, got shape (0, 4)")):
        V.check_merge_inputs(np.zeros((0, 4)), np.zeros(0))
    with pytest.raises(ValueError, match=re.escape(
            "lse_parts: expected shape (2, 3) (o_parts' shape without its last dim), got (2, 4)")):
        V.check_merge_inputs(np.zeros((2, 3, 4)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match=re.escape(
            "lse_parts: values must be finite or -inf (an empty split), got nan at (1, 0)")):
        V.check_merge_inputs(np.zeros((2, 3, 4)), np.array([[0, 0, 0], [np.nan, 0, 0]]))
    with pytest.raises(ValueError, match=re.escape(
            "lse_parts: values must be finite or -inf (an empty split), got inf at (0, 2)")):
        V.check_merge_inputs(np.zeros((2, 3, 4)), np.array([[0, 0, np.inf], [0, 0, 0]]))


# ------------------------------------------------------------------------------------------
# The references go through the same validators
# ------------------------------------------------------------------------------------------


def test_reference_entry_points_validate():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^causal: expected None, False, True"):
        R.attention_forward(q, k, v, causal="upper")
    with pytest.raises(ValueError, match=r"^kv_lens: values must be in \[0, Nk=7\], got 8"):
        R.attention_forward(q, k, v, kv_lens=[8, 1])
    with pytest.raises(ValueError, match=r"^k: Hkv=3 kv heads must divide q's Hq=4"):
        R.attention_forward(q, arr(2, 3, 7, 8), arr(2, 3, 7, 8))
    with pytest.raises(TypeError, match=r"^dtype: expected one of float32, bfloat16, float16, "
                                        r"got 'float64'"):
        R.attention_baseline_lowp(q, k, v, dtype="float64")
    with pytest.raises(ValueError, match=re.escape("cache_len: expected an int in [4, 10], got 2")):
        R.decode_mask(4, 2, 10)
    with pytest.raises(ValueError, match=r"^tree_mask: the diagonal must be all True"):
        R.decode(*dec(), cache_lens=[3, 3], tree_mask=np.zeros((3, 3), dtype=bool))
    with pytest.raises(ValueError, match=re.escape("nq: expected an int in [1, inf], got 0")):
        R.attention_mask(0, 3)
    with pytest.raises(ValueError, match=r"^approximate: expected 'none' or 'tanh', got 'fast'"):
        R.linear_gelu(arr(2, 3), arr(3, 4), arr(4), approximate="fast")
    with pytest.raises(ValueError, match=r"^lse_parts: values must be finite or -inf"):
        R.merge_partials(np.zeros((1, 2)), np.array([np.nan]))
    with pytest.raises(ValueError, match=re.escape("itemsize: expected an int in [1, inf], got 0")):
        R.io_lower_bound_bytes(1, 1, 1, 1, 1, 1, 0)
    # references accept float64 and mixed dtypes, and D beyond the kernel limit
    R.attention_forward(q.astype(np.float64), k, v.astype(BF16))
    R.attention_forward(*qkv(D=300))


def test_describe_truncates_long_values():
    text = V.describe(list(range(1000)))
    assert text.endswith("... (list)") and len(text) < 80
    with pytest.raises(TypeError, match=r"^q: expected a numpy.ndarray or torch.Tensor, got "
                                        r"\[0, 1, 2, .*\.\.\. \(list\)$"):
        V.check_array("q", list(range(1000)))
