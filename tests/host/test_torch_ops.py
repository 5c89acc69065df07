"""Tests of host/torch_ops.py: the differentiable flash attention and the SDPA-compatible entry.

Two kinds of tests:

* **Plumbing** (``fake_kernels`` fixture): ``host.flash_attention`` and
  ``host.flash_attention_backward`` are replaced by the float64 references of host/reference.py
  rounded to the kernels' output dtypes. These check the torch side alone (dtype round trips,
  strides, autograd wiring, option passing, SDPA mask conversion and argument checks) and run in
  milliseconds.
* **End to end**: the kernels on the active backend (the CPU simulator in CI), checked
  against the float64 reference with the tolerance rule of docs/semantics.md, against PyTorch's
  own ``scaled_dot_product_attention`` through ``torch.autograd``, with
  ``torch.autograd.gradcheck``, and by training a tiny transformer block.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import host  # noqa: E402
from host import reference  # noqa: E402
from host import torch_ops  # noqa: E402
from host.torch_ops import flash_attention, scaled_dot_product_attention  # noqa: E402
from nki_kernels import nki as nki_backend  # noqa: E402
from nki_kernels.attention import backward, forward  # noqa: E402

from _torch_helpers import FakeKernels  # noqa: E402



# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _np(t):
    """float64 NumPy copy of a tensor (exact for every float dtype)."""
    return t.detach().to(torch.float64).numpy()


def _rand(*shape, dtype=torch.float32, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(requires_grad)


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, seed=0):
    return (_rand(B, Hq, Nq, D, dtype=dtype, seed=seed),
            _rand(B, Hkv, Nk, D, dtype=dtype, seed=seed + 1),
            _rand(B, Hkv, Nk, D, dtype=dtype, seed=seed + 2))


def _grads(out, do, *inputs):
    return torch.autograd.grad(out, inputs, do)


@pytest.fixture
def fake_kernels(monkeypatch):
    fake = FakeKernels()
    monkeypatch.setattr(host, "flash_attention", fake.forward, raising=False)
    monkeypatch.setattr(host, "flash_attention_backward", fake.backward, raising=False)
    return fake


def _ref_grads(q, k, v, do, **opts):
    o, lse = reference.attention_forward(q, k, v, **opts)
    return (o, lse) + tuple(reference.attention_backward(do, q, k, v, **opts))


# --------------------------------------------------------------------------------------------
# Plumbing: conversions and autograd wiring (reference-backed fake kernels)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plumbing_dtypes_round_trip_bit_exact(fake_kernels, dtype):
    q, k, v = _qkv(2, 4, 2, 5, 7, 8, dtype=dtype)
    do = _rand(2, 4, 5, 8, dtype=dtype, seed=9, requires_grad=False)
    o, lse = flash_attention(q, k, v, causal="top_left", return_lse=True)
    dq, dk, dv = _grads(o, do, q, k, v)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    # The arrays handed to the NumPy API carry the tensors' exact bits and dtype.
    fwd = fake_kernels.calls[0][1]
    assert fwd["q"].dtype.name == str(dtype).replace("torch.", "")
    np.testing.assert_array_equal(fwd["q"].astype(np.float64), _np(q))
    # ... and the results come back unchanged (same rounding as the fake applied).
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal="top_left")
    np.testing.assert_array_equal(_np(o), o_ref.astype(fwd["q"].dtype).astype(np.float64))
    np.testing.assert_array_equal(lse.detach().numpy(), lse_ref.astype(np.float32))
    bwd = fake_kernels.calls[1][1]
    np.testing.assert_array_equal(bwd["do"].astype(np.float64), _np(do))
    np.testing.assert_array_equal(bwd["o"].astype(np.float64), _np(o))


def test_plumbing_gradients_match_pytorch_autograd(fake_kernels):
    q, k, v = _qkv(2, 3, 3, 6, 9, 16, dtype=torch.float64)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    do = _rand(2, 3, 6, 16, seed=5, requires_grad=False)
    o = flash_attention(qf, kf, vf, mixed_precision=False)
    got = _grads(o, do, qf, kf, vf)
    o_t = F.scaled_dot_product_attention(q, k, v)
    want = _grads(o_t, do.double(), q, k, v)
    torch.testing.assert_close(o.double(), o_t, atol=1e-6, rtol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=0)


def test_plumbing_non_contiguous_inputs(fake_kernels):
    # (B, N, H, D) storage seen as (B, H, N, D), the usual layout after a projection.
    base = _rand(2, 7, 4, 8, seed=3, requires_grad=False)
    q = base.transpose(1, 2).requires_grad_()
    k = _rand(2, 9, 2, 8, seed=4).transpose(1, 2)
    v = _rand(2, 2, 8, 9, seed=5).transpose(-1, -2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    do = _rand(2, 4, 7, 8, seed=6, requires_grad=False).transpose(0, 0)
    o = flash_attention(q, k, v)
    dq, dk, dv = _grads(o, do, q, k, v)
    ref = _ref_grads(q, k, v, do)
    np.testing.assert_allclose(_np(o), ref[0], atol=1e-6)
    for g, r in zip((dq, dk, dv), ref[2:]):
        np.testing.assert_allclose(_np(g), r, atol=1e-5)


def test_plumbing_options_reach_the_kernels(fake_kernels):
    q, k, v = _qkv(2, 2, 1, 6, 8, 4)
    kv_lens = torch.tensor([8, 5], dtype=torch.int32)
    o = flash_attention(q, k, v, scale=0.3, causal=True, window=(3, -1), kv_lens=kv_lens,
                        q_lens=np.array([6, 4]), mixed_precision=False)
    o.sum().backward()
    for kind, call in fake_kernels.calls:
        assert call["scale"] == 0.3 and call["causal"] == "bottom_right"
        assert call["window"] == (3, -1)
        np.testing.assert_array_equal(call["kv_lens"], [8, 5])
        np.testing.assert_array_equal(call["q_lens"], [6, 4])
    assert fake_kernels.calls[0][1]["mixed_precision"] is False
    # Query rows past q_lens are zero and get zero gradients.
    assert torch.all(o[1, :, 4:] == 0) and torch.all(q.grad[1, :, 4:] == 0)


@pytest.mark.parametrize("lens", [[3, 6], (3, 6), np.array([3, 6]), torch.tensor([3, 6])])
def test_plumbing_lengths_forms(fake_kernels, lens):
    q, k, v = _qkv(2, 1, 1, 4, 6, 4)
    flash_attention(q, k, v, kv_lens=lens)
    np.testing.assert_array_equal(fake_kernels.calls[0][1]["kv_lens"], [3, 6])


def test_plumbing_lse_gradient(fake_kernels):
    """A gradient flowing into the returned LSE matches torch.logsumexp's."""
    q, k, v = _qkv(1, 4, 2, 5, 7, 8, dtype=torch.float64)
    w = _rand(1, 4, 5, seed=8, dtype=torch.float64, requires_grad=False)
    do = _rand(1, 4, 5, 8, seed=9, dtype=torch.float64, requires_grad=False)
    o, lse = flash_attention(q, k, v, causal="bottom_right", return_lse=True,
                             mixed_precision=False)
    got = torch.autograd.grad((o * do).sum() + (lse * w).sum(), (q, k, v))
    kx, vx = (x.repeat_interleave(2, dim=1) for x in (k, v))
    s = (q @ kx.transpose(-1, -2)) / np.sqrt(8)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(diagonal=2)
    s = s.masked_fill(~mask, float("-inf"))
    lse_t = torch.logsumexp(s, dim=-1)
    o_t = torch.softmax(s, dim=-1) @ vx
    want = torch.autograd.grad((o_t * do).sum() + (lse_t * w).sum(), (q, k, v))
    torch.testing.assert_close(lse, lse_t, atol=1e-6, rtol=0)
    for g, t in zip(got, want):
        torch.testing.assert_close(g, t, atol=1e-5, rtol=0)


def test_plumbing_unused_lse_costs_no_extra_kernel_calls(fake_kernels):
    q, k, v = _qkv(1, 2, 1, 4, 5, 8)
    o, lse = flash_attention(q, k, v, return_lse=True)
    o.sum().backward()
    assert [kind for kind, _ in fake_kernels.calls] == ["fwd", "bwd"]
    fake_kernels.calls.clear()
    o, lse = flash_attention(q, k, v, return_lse=True)
    (o.sum() + lse.sum()).backward()
    # the lse's gradient is one more backward call (v = 0, D = -g)
    assert [kind for kind, _ in fake_kernels.calls] == ["fwd", "bwd", "bwd"]


def test_plumbing_float64_gradcheck(fake_kernels):
    q, k, v = _qkv(1, 2, 1, 3, 4, 4, dtype=torch.float64)

    def fn(q, k, v):
        o, lse = flash_attention(q, k, v, causal="top_left", return_lse=True,
                                 mixed_precision=False)
        return o, lse

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_plumbing_no_grad_and_inference(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    with torch.no_grad():
        o = flash_attention(q, k, v)
    assert not o.requires_grad
    with torch.inference_mode():
        o2 = flash_attention(q.detach(), k.detach(), v.detach())
    torch.testing.assert_close(o, o2)


def test_plumbing_double_backward_is_refused(fake_kernels):
    """The backward runs kernels outside autograd, so a second derivative must raise, not be 0."""
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    o = flash_attention(q, k, v)
    (dq,) = torch.autograd.grad((o ** 2).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        dq.sum().backward()


# --------------------------------------------------------------------------------------------
# flash_attention: errors
# --------------------------------------------------------------------------------------------


def test_error_float64_needs_full_precision(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"q: dtype float64 needs mixed_precision=False"):
        flash_attention(q, k, v)


def test_error_unsupported_dtype_and_mixed_dtypes(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    with pytest.raises(TypeError, match=r"q: dtype int32 is not supported"):
        flash_attention(q.detach().to(torch.int32), k, v)
    with pytest.raises(TypeError, match=r"k: dtype bfloat16 does not match q's dtype float32"):
        flash_attention(q, k.to(torch.bfloat16), v)


def test_error_not_a_tensor_and_shapes(fake_kernels):
    q, k, v = _qkv(1, 4, 3, 3, 3, 4)
    with pytest.raises(TypeError, match=r"q: expected a torch.Tensor, got"):
        flash_attention(_np(q), k, v)
    with pytest.raises(ValueError, match=r"k: Hkv=3 kv heads must divide q's Hq=4"):
        flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"q: expected a 4-D array"):
        flash_attention(q[0], k, v)


def test_error_device(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    with pytest.raises(ValueError, match=r"q: device meta is not supported; allowed: cpu"):
        flash_attention(q.to("meta"), k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match=r"v: expected the same device as q \(cpu\), got meta"):
        flash_attention(q, k, v.to("meta"))


def test_error_options(fake_kernels):
    q, k, v = _qkv(2, 1, 1, 3, 3, 4)
    with pytest.raises(ValueError, match=r"causal: expected None, False, True"):
        flash_attention(q, k, v, causal="top")
    with pytest.raises(TypeError, match=r"kv_lens: expected an integer tensor, got dtype float32"):
        flash_attention(q, k, v, kv_lens=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"kv_lens: values must be in \[0, Nk=3\], got 4"):
        flash_attention(q, k, v, kv_lens=torch.tensor([1, 4]))
    with pytest.raises(TypeError, match=r"mixed_precision: expected True or False"):
        flash_attention(q, k, v, mixed_precision=1)
    with pytest.raises(TypeError, match=r"return_lse: expected True or False"):
        flash_attention(q, k, v, return_lse="yes")


# --------------------------------------------------------------------------------------------
# SDPA wrapper: semantics against PyTorch's SDPA (fake kernels: exact references)
# --------------------------------------------------------------------------------------------


def _sdpa_both(q, k, v, **kw):
    """Our SDPA and PyTorch's on the same float64 inputs: outputs and gradients."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ours = scaled_dot_product_attention(qf, kf, vf, mixed_precision=False, **kw)
    theirs = F.scaled_dot_product_attention(q64, k64, v64, **kw)
    do = _rand(*theirs.shape, dtype=torch.float64, seed=42, requires_grad=False)
    g_ours = _grads(ours, do.float(), qf, kf, vf)
    g_theirs = _grads(theirs, do, q64, k64, v64)
    return (ours,) + g_ours, (theirs,) + g_theirs


def _assert_close_all(got, want, atol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=0)


@pytest.mark.parametrize("shape_q,shape_kv", [
    ((5, 4), (7, 4)),                       # (L, E): one head, one sequence
    ((3, 5, 4), (3, 7, 4)),                 # (H, L, E)
    ((2, 3, 5, 4), (2, 3, 7, 4)),           # (B, H, L, E)
    ((2, 2, 3, 5, 4), (2, 2, 3, 7, 4)),     # two batch dims
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_batch_dims_and_causal(fake_kernels, shape_q, shape_kv, is_causal):
    q, k, v = _rand(*shape_q, seed=1), _rand(*shape_kv, seed=2), _rand(*shape_kv, seed=3)
    got, want = _sdpa_both(q, k, v, is_causal=is_causal, scale=0.7)
    _assert_close_all(got, want, 1e-5)
    assert fake_kernels.calls[0][1]["causal"] == ("top_left" if is_causal else None)


@pytest.mark.parametrize("L,S", [(5, 9), (9, 5)])
def test_sdpa_is_causal_is_top_left(fake_kernels, L, S):
    q, k, v = _rand(1, 2, L, 8, seed=1), _rand(1, 2, S, 8, seed=2), _rand(1, 2, S, 8, seed=3)
    got, want = _sdpa_both(q, k, v, is_causal=True)
    _assert_close_all(got, want, 1e-5)


def test_sdpa_gqa(fake_kernels):
    q, k, v = _qkv(2, 8, 2, 6, 6, 8)
    got, want = _sdpa_both(q, k, v, enable_gqa=True, is_causal=True)
    _assert_close_all(got, want, 1e-5)


def _key_padding(kv_lens, S):
    return torch.arange(S)[None, :] < torch.tensor(kv_lens)[:, None]


@pytest.mark.parametrize("form", ["b11s", "bs_broadcast_3d", "full"])
def test_sdpa_key_padding_mask_becomes_kv_lens(fake_kernels, form):
    B, H, L, S = 3, 2, 4, 6
    keep = _key_padding([6, 3, 1], S)
    mask = {"b11s": keep[:, None, None, :],
            "bs_broadcast_3d": keep[:, None, None, :].expand(B, 1, L, S),
            "full": keep[:, None, None, :].expand(B, H, L, S).clone()}[form]
    q, k, v = _qkv(B, H, H, L, S, 8)
    got, want = _sdpa_both(q, k, v, attn_mask=mask)
    _assert_close_all(got, want, 1e-5)
    call = fake_kernels.calls[0][1]
    np.testing.assert_array_equal(call["kv_lens"], [6, 3, 1])
    assert call["causal"] is None and call["q_lens"] is None and call["window"] is None


@pytest.mark.parametrize("L,S,align", [(6, 6, "top_left"), (4, 7, "top_left"),
                                       (4, 7, "bottom_right"), (7, 4, "bottom_right")])
def test_sdpa_triangular_mask_becomes_causal(fake_kernels, L, S, align):
    diag = 0 if align == "top_left" else S - L
    mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=diag)
    q, k, v = _qkv(2, 2, 2, L, S, 8)
    got, want = _sdpa_both(q, k, v, attn_mask=mask)
    _assert_close_all(got, want, 1e-5)
    call = fake_kernels.calls[0][1]
    assert call["causal"] == align or (L == S and call["causal"] in ("top_left", "bottom_right"))
    assert call["kv_lens"] is None


def test_sdpa_float_mask_of_zero_and_neg_inf(fake_kernels):
    L = S = 5
    keep = torch.ones(L, S, dtype=torch.bool).tril()
    mask = torch.zeros(L, S).masked_fill(~keep, float("-inf"))
    q, k, v = _qkv(1, 2, 2, L, S, 8)
    qf, kf, vf = (x.detach() for x in (q, k, v))
    ours = scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, mixed_precision=False)
    theirs = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert fake_kernels.calls[0][1]["causal"] in ("top_left", "bottom_right")


def test_sdpa_causal_padding_and_window_combinations(fake_kernels):
    """Causal LM with right padding and a sliding window: one mask, three kernel options."""
    B, L = 3, 8
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    causal = j <= i
    band = j >= i - 2
    pad = _key_padding([8, 5, 2], L)[:, None, None, :]
    q, k, v = _qkv(B, 2, 2, L, L, 8)
    for mask, want_window in ((causal & pad, None), (causal & band & pad, (2, -1))):
        fake_kernels.calls.clear()
        got, want = _sdpa_both(q, k, v, attn_mask=mask)
        _assert_close_all(got, want, 1e-5)
        call = fake_kernels.calls[0][1]
        assert call["causal"] == "top_left" and call["window"] == want_window
        np.testing.assert_array_equal(call["kv_lens"], [8, 5, 2])


def test_sdpa_query_padding_rows(fake_kernels):
    """Trailing all-False query rows become q_lens; PyTorch gives 0 for such rows, as we do."""
    B, L, S = 2, 5, 6
    qmask = torch.arange(L)[None, :, None] < torch.tensor([5, 3])[:, None, None]
    kmask = _key_padding([6, 4], S)[:, None, :]
    mask = (qmask & kmask)[:, None]
    q, k, v = _qkv(B, 2, 2, L, S, 8)
    got, want = _sdpa_both(q, k, v, attn_mask=mask)
    _assert_close_all(got, want, 1e-5)
    call = fake_kernels.calls[0][1]
    np.testing.assert_array_equal(call["q_lens"], [5, 3])
    np.testing.assert_array_equal(call["kv_lens"], [6, 4])


def test_sdpa_all_true_mask_is_no_mask(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 4, 4)
    scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 4, dtype=torch.bool))
    call = fake_kernels.calls[0][1]
    assert call["causal"] is None and call["kv_lens"] is None and call["q_lens"] is None


# --------------------------------------------------------------------------------------------
# SDPA wrapper: error paths (each names the argument, what was given and what is allowed)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,err,match", [
    (1.0, ValueError, r"dropout_p: expected a probability in \[0, 1\), got 1.0"),
    (-0.5, ValueError, r"dropout_p: expected a probability"),
    (True, TypeError, r"dropout_p: expected a float"),
])
def test_sdpa_error_dropout(fake_kernels, p, err, match):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    with pytest.raises(err, match=match):
        scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert not fake_kernels.calls


def test_dropout_through_torch_matches_the_numpy_api_and_reproduces():
    """SDPA with dropout_p: the seed comes from torch's generator (torch.manual_seed makes it
    reproducible); forward and gradients equal the NumPy API's with that seed."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 16)
    torch.manual_seed(3)
    o1 = scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True,
                                      mixed_precision=False)
    o1.sum().backward()
    g1 = [x.grad.clone() for x in (q, k, v)]
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item())
    o_np, lse = host.flash_attention(*(x.detach().numpy() for x in (q, k, v)), causal="top_left",
                                     mixed_precision=False, dropout_p=0.25, seed=seed,
                                     return_lse=True)
    np.testing.assert_allclose(o1.detach().numpy(), o_np, atol=1e-6)
    grads = host.flash_attention_backward(np.ones_like(o_np), *(x.detach().numpy()
                                          for x in (q, k, v)), o_np, lse, causal="top_left",
                                          mixed_precision=False, dropout_p=0.25, seed=seed)
    for a, b in zip(g1, grads):
        np.testing.assert_allclose(a.numpy(), b, atol=1e-5)
    torch.manual_seed(4)
    o2 = scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True,
                                      mixed_precision=False)
    assert not torch.allclose(o1, o2)


def test_sdpa_error_is_causal_with_mask(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"is_causal: is_causal=True cannot be combined with "
                                         r"attn_mask .*shape \(3, 3\)"):
        scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)


def test_sdpa_error_gqa_needs_enable_gqa(fake_kernels):
    q, k, v = _qkv(1, 4, 2, 3, 3, 4)
    with pytest.raises(ValueError, match=r"enable_gqa: query has Hq=4 heads and key/value Hkv=2; "
                                         r".*got enable_gqa=False"):
        scaled_dot_product_attention(q, k, v)
    q, k, v = _qkv(1, 4, 3, 3, 3, 4)
    with pytest.raises(ValueError, match=r"key: Hkv=3 kv heads must divide query's Hq=4"):
        scaled_dot_product_attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("mask,pattern", [
    (torch.tensor([[True, False, True], [True, True, False], [False, True, True]]),
     r"attn_mask: this bool mask of shape \(3, 3\) is not one the "
                             r"kernels can apply\. Supported attn_mask forms"),
    (torch.ones(3, 3, dtype=torch.bool).triu(), r"attn_mask: this bool mask"),
    (torch.zeros(3, 3).fill_(-1e9), r"attn_mask: a float mask must hold only 0.0 .* and -inf "
                                    r".*got the value -1000000000.0"),
    (torch.randn(3, 3), r"attn_mask: a float mask must hold only 0.0"),
    (torch.ones(3, 3, dtype=torch.int64), r"attn_mask: dtype int64 is not supported; allowed: "
                                          r"bool or query's dtype float32"),
    (torch.ones(3, 3, dtype=torch.float16), r"attn_mask: dtype float16 is not supported"),
    (torch.ones(2, 3, dtype=torch.bool), r"attn_mask: shape \(2, 3\) is not broadcastable to "
                                         r"the attention shape \(\.\.\., H, L, S\) = \(1, 2, 3, 3\)"),
    (torch.stack([torch.ones(3, 3, dtype=torch.bool),
                  torch.ones(3, 3, dtype=torch.bool).tril()])[None],
     r"attn_mask: the mask differs between heads \(shape \(1, 2, 3, 3\)\)"),
    ("not a tensor", r"attn_mask: expected a torch.Tensor, got 'not a tensor' \(str\)"),
])
def test_sdpa_error_masks(fake_kernels, mask, pattern):
    q, k, v = _qkv(1, 2, 2, 3, 3, 4)
    err = TypeError if isinstance(mask, str) or mask.dtype in (torch.int64, torch.float16) \
        else ValueError
    with pytest.raises(err, match=pattern):
        scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not fake_kernels.calls


def test_sdpa_error_mask_requiring_grad(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 3, 4)
    mask = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"attn_mask: a float mask that requires grad"):
        scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_sdpa_error_shapes(fake_kernels):
    q, k, v = _qkv(2, 2, 2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"value: head dim Ev=4 different from query's E=8"):
        scaled_dot_product_attention(q, k, v[..., :4])
    with pytest.raises(ValueError, match=r"key: batch dims \(1,\) must equal query's \(2,\)"):
        scaled_dot_product_attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"key: expected 4 dims like query"):
        scaled_dot_product_attention(q, k[0], v[0])
    with pytest.raises(ValueError, match=r"value: expected shape \(\.\.\., Hkv, S, Ev\)"):
        scaled_dot_product_attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match=r"query: expected shape \(\.\.\., Hq, L, E\) with at "
                                         r"least 2 dims, got \(8,\)"):
        scaled_dot_product_attention(q[0, 0, 0], k, v)
    with pytest.raises(TypeError, match=r"is_causal: expected True or False, got 1 \(int\)"):
        scaled_dot_product_attention(q, k, v, is_causal=1)


def test_sdpa_mask_shared_by_the_batch_gives_per_sequence_lengths(fake_kernels):
    """A (L, S) mask broadcast over B: the options found once are repeated for every sequence."""
    B, L, S = 3, 4, 6
    mask = _key_padding([4], S).expand(L, S)
    q, k, v = _qkv(B, 2, 2, L, S, 8)
    got, want = _sdpa_both(q, k, v, attn_mask=mask)
    _assert_close_all(got, want, 1e-5)
    np.testing.assert_array_equal(fake_kernels.calls[0][1]["kv_lens"], [4, 4, 4])


def test_sdpa_row_broadcast_mask_that_is_not_a_prefix(fake_kernels):
    q, k, v = _qkv(1, 1, 1, 3, 4, 4)
    mask = torch.tensor([False, False, True, True])[None, None, None, :]
    with pytest.raises(ValueError, match=r"attn_mask: this bool mask of shape \(1, 1, 1, 4\)"):
        scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --------------------------------------------------------------------------------------------
# End to end: the kernels on the active backend (the CPU simulator in CI)
# --------------------------------------------------------------------------------------------

#: (id, B, Hq, Hkv, Nq, Nk, D, options): odd lengths, Nq != Nk both ways, GQA and MQA, both
#: causal alignments, a sliding window, a padded batch (one sequence empty of keys).
GRAD_CASES = [
    ("odd_lengths", 1, 2, 2, 17, 33, 16, {}),
    ("gqa_bottom_right", 2, 4, 2, 20, 37, 16, dict(causal="bottom_right")),
    ("mqa_top_left_long_q", 1, 4, 1, 37, 20, 16, dict(causal="top_left")),
    ("window", 1, 2, 2, 40, 40, 16, dict(causal=True, window=(7, -1))),
    ("padded", 3, 2, 1, 24, 30, 16, dict(causal=True, kv_lens=[30, 11, 0], q_lens=[24, 9, 5])),
]
#: (torch dtype, mixed_precision, matmul operand dtype of the baseline).
PRECISIONS = [
    (torch.float32, True, "bfloat16"),
    (torch.bfloat16, True, "bfloat16"),
    (torch.float32, False, "float32"),
]


def _precision_id(p):
    return f"{str(p[0]).replace('torch.', '')}{'' if p[1] else '_fullprec'}"


@pytest.mark.parametrize("precision", PRECISIONS, ids=_precision_id)
@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients_within_tolerance_rule(case, precision):
    """o, lse, dq, dk, dv against the float64 reference, tolerance rule of docs/semantics.md.

    Each error must be <= 2 x the error of the plain low-precision implementation in the same
    matmul precision (host.reference.*_baseline_lowp) + 1e-3 (bf16) / 1e-5 (fp32).
    """
    _, B, Hq, Hkv, Nq, Nk, D, opts = case
    dtype, mixed, mm = precision
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, seed=11)
    do = _rand(B, Hq, Nq, D, dtype=dtype, seed=12, requires_grad=False)
    o, lse = flash_attention(q, k, v, mixed_precision=mixed, return_lse=True, **opts)
    got = (o,) + _grads(o, do, q, k, v)
    ref = _ref_grads(q, k, v, do, **opts)
    ref = (ref[0],) + ref[2:]
    out = str(dtype).replace("torch.", "")
    base = (reference.attention_baseline_lowp(q, k, v, dtype=mm, out_dtype=out, **opts),) + tuple(
        reference.attention_backward_baseline_lowp(do, q, k, v, dtype=mm, out_dtype=out, **opts))
    floor = reference.atol_floor(mm)
    for name, g, r, b in zip(("o", "dq", "dk", "dv"), got, ref, base):
        err = reference.max_abs_err(g, r)
        tol = reference.tolerance(r, b, floor=floor)
        assert err <= tol, f"{name}: max abs error {err:.3g} > tolerance {tol:.3g}"
    lse_ref = reference.attention_forward(q, k, v, **opts)[1]
    assert reference.max_abs_err(lse, lse_ref) <= (2e-2 if mm == "bfloat16" else 1e-4)


def _torch_sdpa_grads(q, k, v, do, dtype, **kw):
    qq, kk, vv = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    o = F.scaled_dot_product_attention(qq, kk, vv, **kw)
    return (o,) + _grads(o, do.to(dtype), qq, kk, vv)


@pytest.mark.parametrize("dtype,mixed", [(torch.float32, False), (torch.float32, True),
                                         (torch.bfloat16, True)],
                         ids=["float32_fullprec", "float32", "bfloat16"])
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(enable_gqa=True),
                                dict(attn_mask="padding")], ids=["causal", "gqa", "padding_mask"])
def test_sdpa_against_pytorch_sdpa_autograd(kw, dtype, mixed):
    """Our SDPA vs torch.nn.functional.scaled_dot_product_attention through torch.autograd.

    Same inputs; PyTorch's float64 result is the truth; ours must err at most 2 x PyTorch's own
    error in the matmul precision we run (its float32 result for fp32 operands, its bfloat16
    result for bf16 operands) + the floor (1e-5 fp32, 1e-3 bf16).
    """
    B, Hq, L, S, E = 2, 4, 19, 23, 16
    Hkv = 2 if kw.get("enable_gqa") else Hq
    kw = dict(kw)
    if kw.get("attn_mask") == "padding":
        kw["attn_mask"] = _key_padding([23, 7], S)[:, None, None, :]
    q, k, v = (x.detach() for x in _qkv(B, Hq, Hkv, L, S, E, dtype=torch.float64, seed=21))
    do = _rand(B, Hq, L, E, dtype=torch.float64, seed=22, requires_grad=False)
    truth = _torch_sdpa_grads(q, k, v, do, torch.float64, **kw)
    mm = torch.float32 if (dtype == torch.float32 and not mixed) else torch.bfloat16
    base = _torch_sdpa_grads(q, k, v, do, mm, **kw)
    qq, kk, vv = (x.to(dtype).requires_grad_() for x in (q, k, v))
    o = scaled_dot_product_attention(qq, kk, vv, mixed_precision=mixed, **kw)
    ours = (o,) + _grads(o, do.to(dtype), qq, kk, vv)
    floor = 1e-5 if mm == torch.float32 else 1e-3
    for name, g, t, b in zip(("o", "dq", "dk", "dv"), ours, truth, base):
        err = reference.max_abs_err(g, t)
        tol = 2 * reference.max_abs_err(b, t) + floor
        assert err <= tol, f"{name}: max abs error {err:.3g} > 2 x PyTorch's {tol:.3g}"


@pytest.mark.parametrize("opts", [dict(causal="top_left"),
                                  dict(causal="bottom_right", kv_lens=[5, 3], q_lens=[3, 2])],
                         ids=["top_left", "bottom_right_padded"])
def test_gradcheck_tiny(opts):
    """torch.autograd.gradcheck on the kernels (float64 in, float32 matmuls inside).

    Finite differences of a float32 computation: eps=1e-3 keeps the rounding noise
    (~1e-7 / eps) and the truncation error (~eps^2) both near 1e-4, hence atol=rtol=2e-3.
    """
    B = 2 if "kv_lens" in opts else 1
    q, k, v = _qkv(B, 2, 1, 3, 5, 4, dtype=torch.float64, seed=31)

    def fn(q, k, v):
        o, lse = flash_attention(q, k, v, mixed_precision=False, return_lse=True, **opts)
        # Rows past q_lens have lse = -inf, where finite differences are undefined.
        return o, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    # fast_mode: one random projection of the Jacobian (a few kernel calls, not one per entry).
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=2e-3,
                                    fast_mode=True)


def test_lse_gradient_on_the_kernels():
    """A loss using both o and the returned LSE: gradients match torch.logsumexp's autograd.

    float32 matmuls; PyTorch's float64 math is the truth; tolerance 2e-5 (float32 rounding of
    three kernel calls; observed 7e-7).
    """
    q, k, v = _qkv(2, 4, 2, 13, 21, 16, dtype=torch.float32, seed=51)
    w = _rand(2, 4, 13, seed=52, requires_grad=False)
    do = _rand(2, 4, 13, 16, seed=53, requires_grad=False)
    o, lse = flash_attention(q, k, v, causal="bottom_right", return_lse=True,
                             mixed_precision=False)
    got = torch.autograd.grad((o * do).sum() + (lse * w).sum(), (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    kx, vx = (x.repeat_interleave(2, dim=1) for x in (k64, v64))
    s = (q64 @ kx.transpose(-1, -2)) / 4.0
    s = s.masked_fill(~torch.ones(13, 21, dtype=torch.bool).tril(diagonal=8), float("-inf"))
    o_t, lse_t = torch.softmax(s, dim=-1) @ vx, torch.logsumexp(s, dim=-1)
    want = torch.autograd.grad((o_t * do.double()).sum() + (lse_t * w.double()).sum(),
                               (q64, k64, v64))
    for name, g, t in zip(("dq", "dk", "dv"), got, want):
        err = reference.max_abs_err(g, t)
        assert err <= 2e-5, f"{name}: error {err:.3g}"


def test_import_host_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, host; assert 'torch' not in sys.modules, 'host imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


class TinyBlock(torch.nn.Module):
    """Embedding, one pre-norm causal self-attention layer, an MLP, and a language-model head."""

    def __init__(self, attention, vocab=32, n_ctx=24, d_model=32, n_heads=2):
        super().__init__()
        self.attention, self.n_heads = attention, n_heads
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(n_ctx, d_model)
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(),
                                       torch.nn.Linear(4 * d_model, d_model))
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens):
        B, N = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(N))
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        # (B, N, H*Dh) -> (B, H, N, Dh): non-contiguous views, as in real models.
        q, k, v = (t.view(B, N, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        a = self.attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, -1))
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def _train(attention, steps=20, seed=0, B=4, N=24, vocab=32):
    torch.manual_seed(seed)
    model = TinyBlock(attention, vocab=vocab, n_ctx=N)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        # Learnable: each sequence counts up by a random stride mod vocab.
        start = torch.randint(0, vocab, (B, 1), generator=g)
        stride = torch.randint(1, 4, (B, 1), generator=g)
        tokens = (start + stride * torch.arange(N + 1)) % vocab
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("mixed,tol", [(False, 1e-5), (True, 1e-3)],
                         ids=["fp32_matmuls", "bf16_matmuls"])
def test_tiny_transformer_training_matches_pytorch_sdpa(mixed, tol):
    """20 Adam steps of a tiny causal LM (N=24, d_model=32, 2 heads of D=16) with our SDPA and
    with PyTorch's: identical init and data; the loss curves must agree to ``tol`` at every
    step (fp32 matmuls: float32 rounding only; bf16 matmuls: bf16 rounding of the attention
    operands, drifting through 20 optimizer steps), and training must make progress."""

    def ours(q, k, v, is_causal):
        return scaled_dot_product_attention(q, k, v, is_causal=is_causal, mixed_precision=mixed)

    ref = _train(F.scaled_dot_product_attention)
    got = _train(ours)
    diff = np.abs(got - ref)
    assert diff.max() <= tol, f"loss curves differ by up to {diff.max():.3g} (tol {tol}):\n" \
                              f"ours  {np.round(got, 5)}\ntorch {np.round(ref, 5)}"
    assert ref[-1] < 0.8 * ref[0]


# --------------------------------------------------------------------------------------------
# The XLA path's launch code, on the simulator
# --------------------------------------------------------------------------------------------


class _SimulatedXlaLaunch:
    """Stands in for an ``@nki.jit`` kernel called on XLA tensors: ``kernel[grid](tensors)``.

    torch-neuronx would trace the call into the XLA graph; here the same call runs the kernel
    on the simulator (``nki.simulate_kernel``) on the tensors' NumPy views and returns tensors,
    so the XLA executor's launch code (grid, argument order, compile-time options, tiles) is
    exercised for real. The tracing itself is not.
    """

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []
        self.compile_keys = []   # what a compilation depends on: grid, shapes, static options

    @staticmethod
    def _np(x):
        if x is None:
            return None
        if x.dtype == torch.bfloat16:
            return x.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.detach().contiguous().numpy()

    @staticmethod
    def _torch(a):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    def on(self, api):
        """A port kernel pinned to a namespace (host.api.plan_attention_forward)."""
        pinned = _SimulatedXlaLaunch(self.kernel.on(api))
        pinned.grids, pinned.compile_keys = self.grids, self.compile_keys
        return pinned

    def __getitem__(self, grid):
        from host._launch import launch

        def call(*args, **kwargs):
            self.grids.append(grid)
            self.compile_keys.append((grid, tuple(
                (None if a is None else (tuple(a.shape), str(a.dtype)))
                for a in args + tuple(kwargs.values()) if a is None or isinstance(
                    a, torch.Tensor)), repr(sorted((n, a) for n, a in kwargs.items()
                                                   if not isinstance(a, torch.Tensor)))))
            kwargs = {key: self._np(a) if isinstance(a, torch.Tensor) else a
                      for key, a in kwargs.items()}
            outs = launch(self.kernel, grid, *(self._np(a) for a in args), **kwargs)
            return tuple(self._torch(o) for o in outs)

        return call


@pytest.mark.parametrize("dtype,mixed,mm", [(torch.float32, False, "float32"),
                                            (torch.bfloat16, True, "bfloat16")],
                         ids=["float32_fullprec", "bfloat16"])
def test_xla_executor_launches_the_kernels(monkeypatch, dtype, mixed, mm):
    """The XLA path's launch code drives the real kernels (simulated) to correct gradients."""
    fwd = _SimulatedXlaLaunch(forward.flash_attention_fwd)
    bwd = _SimulatedXlaLaunch(backward.flash_attn_bwd)
    monkeypatch.setattr(forward, "flash_attention_fwd", fwd)
    monkeypatch.setattr(backward, "flash_attn_bwd", bwd)
    # the custom ops with the XLA executor on CPU tensors
    monkeypatch.setitem(torch_ops._EXECUTORS, torch_ops._DEVICE_CPU, torch_ops._XlaKernels())
    B, Hq, Hkv, Nq, Nk, D = 2, 4, 2, 19, 23, 16
    opts = dict(causal="bottom_right", kv_lens=[23, 9], q_lens=[19, 6])
    q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=dtype, seed=41)
    do = _rand(B, Hq, Nq, D, dtype=dtype, seed=42, requires_grad=False)
    o = flash_attention(q, k, v, mixed_precision=mixed, **opts)
    got = (o,) + _grads(o, do, q, k, v)
    # the grids follow the default LNC of the active target (trn2: both cores) and the
    # namespace the kernels trace through (runtime lengths: nki.* where auto selects it)
    lnc = 2 if nki_backend.active_target() == "trn2" else 1
    assert fwd.grids == [forward.forward_grid(B, Hkv, lnc, api=nki_backend.select_api())[0]]
    assert [repr(g) for g in bwd.grids] == [repr(backward.backward_grid(
        B, Hkv, lnc, api=nki_backend.select_api()))]
    ref = _ref_grads(q, k, v, do, **opts)
    ref = (ref[0],) + ref[2:]
    out = str(dtype).replace("torch.", "")
    base = (reference.attention_baseline_lowp(q, k, v, dtype=mm, out_dtype=out, **opts),) + tuple(
        reference.attention_backward_baseline_lowp(do, q, k, v, dtype=mm, out_dtype=out, **opts))
    for name, g, r, b in zip(("o", "dq", "dk", "dv"), got, ref, base):
        err = reference.max_abs_err(g, r)
        tol = reference.tolerance(r, b, floor=reference.atol_floor(mm))
        assert g.dtype == dtype and err <= tol, f"{name}: error {err:.3g} > tolerance {tol:.3g}"


def test_xla_backward_takes_runtime_lengths(monkeypatch):
    """A padded batch whose lengths change every step (0 and full included) launches one
    compiled backward: the same grid, tensor shapes and static options, the lengths passed as
    (B,) int32 device tensors; each step's gradients are right."""
    fwd = _SimulatedXlaLaunch(forward.flash_attention_fwd)
    bwd = _SimulatedXlaLaunch(backward.flash_attn_bwd)
    monkeypatch.setattr(forward, "flash_attention_fwd", fwd)
    monkeypatch.setattr(backward, "flash_attn_bwd", bwd)
    monkeypatch.setitem(torch_ops._EXECUTORS, torch_ops._DEVICE_CPU, torch_ops._XlaKernels())
    B, Hq, Hkv, Nq, Nk, D = 2, 2, 1, 21, 30, 16
    steps = [([21, 0], [30, 11]), ([5, 21], [0, 30]), ([13, 8], [17, 29])]
    for step, (q_lens, kv_lens) in enumerate(steps):
        opts = dict(causal="top_left", q_lens=torch.tensor(q_lens), kv_lens=torch.tensor(kv_lens))
        q, k, v = _qkv(B, Hq, Hkv, Nq, Nk, D, dtype=torch.float32, seed=50 + step)
        do = _rand(B, Hq, Nq, D, dtype=torch.float32, seed=60 + step, requires_grad=False)
        o = flash_attention(q, k, v, mixed_precision=False, **opts)
        got = _grads(o, do, q, k, v)
        ref = _ref_grads(q, k, v, do, causal="top_left", q_lens=q_lens, kv_lens=kv_lens)[2:]
        base = reference.attention_backward_baseline_lowp(
            do, q, k, v, dtype="float32", out_dtype="float32", causal="top_left",
            q_lens=q_lens, kv_lens=kv_lens)
        for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, base):
            err = reference.max_abs_err(g, r)
            tol = reference.tolerance(r, b, floor=reference.atol_floor("float32"))
            assert torch.isfinite(g).all() and err <= tol, f"step {step} {name}: {err:.3g}"
    assert len(set(bwd.compile_keys)) == 1 and len(bwd.compile_keys) == len(steps)
    assert len(set(fwd.compile_keys)) == 1


@pytest.mark.parametrize("dtype,given,expected", [
    (torch.float32, None, False),       # a drop-in keeps PyTorch's float32 precision
    (torch.float32, True, True),        # bf16 operands only when asked
    (torch.bfloat16, None, True),
])
def test_sdpa_precision_default_follows_pytorch(fake_kernels, dtype, given, expected):
    q, k, v = (x.to(dtype) for x in _qkv(1, 2, 2, 5, 5, 8))
    kw = {} if given is None else {"mixed_precision": given}
    scaled_dot_product_attention(q, k, v, **kw)
    assert fake_kernels.calls[0][1]["mixed_precision"] is expected


@pytest.mark.skipif(__import__("nki_kernels.nki").nki.BACKEND != "simulate",
                    reason="runs the real kernels on the simulator")
def test_sdpa_float32_default_error_is_pytorch_like():
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 130, 64, generator=g) for _ in range(3))
    err = (scaled_dot_product_attention(q, k, v, is_causal=True)
           - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item()
    assert err < 1e-5
