"""Helpers shared by the torch tests (not collected by pytest): reference-backed fake kernels
and the per-rank worker of the ring-attention tests (importable by spawned processes)."""
from __future__ import annotations

import os
from datetime import timedelta

import numpy as np

import host
from host import reference


class FakeKernels:
    """host.flash_attention(_backward) replaced by the float64 references, recording each call.

    Outputs are rounded to the dtypes the NumPy API promises (o in q's dtype, lse float32), so
    the torch plumbing can be checked bit for bit without the simulator.
    """

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, *, scale=None, causal=None, window=None, kv_lens=None,
                q_lens=None, mixed_precision=True, return_lse=False):
        self.calls.append(("fwd", dict(q=q, k=k, v=v, scale=scale, causal=causal, window=window,
                                       kv_lens=kv_lens, q_lens=q_lens,
                                       mixed_precision=mixed_precision)))
        o, lse = reference.attention_forward(q, k, v, scale=scale, causal=causal, window=window,
                                             kv_lens=kv_lens, q_lens=q_lens)
        o, lse = o.astype(q.dtype), lse.astype(np.float32)
        return (o, lse) if return_lse else o

    def backward(self, do, q, k, v, o, lse, *, scale=None, causal=None, window=None,
                 kv_lens=None, q_lens=None, mixed_precision=True):
        self.calls.append(("bwd", dict(do=do, o=o, lse=lse, scale=scale, causal=causal,
                                       window=window, kv_lens=kv_lens, q_lens=q_lens)))
        dq, dk, dv = reference.attention_backward_from_lse(
            do, q, k, v, o, lse, scale=scale, causal=causal, window=window, kv_lens=kv_lens,
            q_lens=q_lens)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    def install_into(self, monkeypatch):
        """Patch the host module for one test (undone by pytest's monkeypatch)."""
        monkeypatch.setattr(host, "flash_attention", self.forward, raising=False)
        monkeypatch.setattr(host, "flash_attention_backward", self.backward, raising=False)
        return self

    def install(self):
        """Patch the host module in this process (for spawned workers; tests use monkeypatch)."""
        host.flash_attention = self.forward
        host.flash_attention_backward = self.backward
        return self


def ring_case_inputs(case):
    """Full-sequence q, k, v, do (float64 torch tensors) of a ring test case, seeded."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    B, Hq, Hkv, N, D = case["B"], case["Hq"], case["Hkv"], case["N"], case["D"]
    q = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64)
    return q, k, v, do


def ring_worker(rank, world, port, outdir, fake, cases):
    """One rank of the ring tests: run every case on this rank's shard and save the results."""
    import torch
    import torch.distributed as dist

    from host.distributed import ring_attention

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        if fake:
            FakeKernels().install()
        for case in cases:
            dtype = getattr(torch, case["dtype"])
            q, k, v, do = ring_case_inputs(case)
            n = case["N"] // world
            shard = slice(rank * n, (rank + 1) * n)
            qs, ks, vs = (x[:, :, shard].to(dtype).requires_grad_() for x in (q, k, v))
            o = ring_attention(qs, ks, vs, causal=case["causal"],
                               mixed_precision=case["mixed_precision"])
            dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), do[:, :, shard].to(dtype))
            np.savez(os.path.join(outdir, f"{case['name']}_{rank}.npz"),
                     **{name: t.detach().to(torch.float64).numpy()
                        for name, t in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv))})
    finally:
        dist.destroy_process_group()
