"""Context parallelism: ring attention over :mod:`torch.distributed`, merged by log-sum-exp.

Each rank of a process group holds one contiguous shard of the sequence: rank ``r`` (its rank in
``group``) holds positions ``r * N .. (r + 1) * N - 1`` of q, k and v. The K/V shards travel
around the ring (rank r sends to ``r + 1`` and receives from ``r - 1``, point-to-point, the next
transfer in flight while the current shard is computed), and every rank runs the flash forward
kernel on (its queries, the visiting keys/values) with ``return_lse=True``. The partial outputs
are merged by their LSEs (the split-KV merge, seed 003: ``o = sum_s exp(lse_s - lse) o_s``,
``lse = log sum_s exp(lse_s)``), which is exact: the result equals single-device attention over
the whole sequence up to rounding.

Causal masking on the global positions: with equal shard lengths a visiting shard ``s`` is fully
visible to rank r's queries when ``s < r``, causal within the shard when ``s == r``, and
invisible (skipped: no kernel call) when ``s > r``. Contiguous sharding therefore leaves the
last rank with the most work under a causal mask (zig-zag sharding would balance it; not done).

The backward is a second ring pass: K/V travel again together with fp32 dK/dV accumulators; for
each visiting shard the flash backward kernel runs with the *global* o and LSE (so
``P = exp(S - lse)`` are the global probabilities and ``D = rowsum(dO * O)`` the global
correction), dQ accumulates locally, and the dK/dV accumulators take one more hop at the end so
that each lands on the rank that owns its shard.

Runs on CPU tensors with any backend that has point-to-point ``isend``/``irecv`` (gloo in the
tests). XLA tensors are refused: on Neuron devices the ring exchange belongs inside the kernel
(NKI collectives, as neuronx-distributed's ring attention does), not in torch.distributed.

torch is imported by this module (and host.torch_ops) only.
"""
from __future__ import annotations

from typing import Optional

try:
    import torch
    import torch.distributed as dist
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "host.distributed needs PyTorch; install it with pip install 'nki-flash[torch]'"
    ) from _exc

from host import torch_ops as _ops
from host import validation as _v

__all__ = ["ring_attention"]

#: Fields of the per-rank record compared across ranks before the ring starts (sent as one
#: float64 tensor: the integers are exact, ``scale`` is compared bit for bit).
_META_FIELDS = ("B", "Hq", "Hkv", "Nq", "Nk", "D", "dtype", "causal", "mixed_precision", "scale")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CAUSALS = (None, _v.CAUSAL_TOP_LEFT, _v.CAUSAL_BOTTOM_RIGHT)


def _meta(dims, q, opts) -> list:
    """This rank's record, in the order of _META_FIELDS."""
    return [dims.B, dims.Hq, dims.Hkv, dims.Nq, dims.Nk, dims.D, _DTYPES.index(q.dtype),
            _CAUSALS.index(opts.causal), int(opts.mixed_precision), float(opts.scale)]


def _describe_field(field: str, value) -> str:
    """A record entry in words (dtype and causal names, not codes)."""
    if field == "dtype":
        return str(_DTYPES[int(value)]).replace("torch.", "")
    if field == "causal":
        return repr(_CAUSALS[int(value)])
    if field == "mixed_precision":
        return str(bool(value))
    if field == "scale":
        return repr(float(value))
    return str(int(value))


def _mismatch_message(rank: int, other_rank: int, mine, theirs) -> Optional[str]:
    """None when the two records agree, else the error message naming what differs."""
    diffs = [f"{f}: {_describe_field(f, a)} here, {_describe_field(f, b)} on rank {other_rank}"
             for f, a, b in zip(_META_FIELDS, mine, theirs) if float(a) != float(b)]
    if not diffs:
        return None
    return (f"ring_attention: every rank must call with equal shard shapes and the same options; "
            f"rank {rank} and rank {other_rank} differ in " + "; ".join(diffs))


class _Ring:
    """This rank's place in the ring of ``group``: its rank, the world size and the peers."""

    def __init__(self, group):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "group: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given process group")
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def shift(self, tensor: "torch.Tensor"):
        """Start sending ``tensor`` to the next rank and receiving its twin from the previous.

        Returns ``(buffer, works)``; the buffer is valid after ``wait(works)``.
        """
        buf = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        return buf, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()

    def source(self, step: int) -> int:
        """Group rank whose K/V shard this rank holds at ring step ``step``."""
        return (self.rank - step) % self.size


def _step_causal(causal: Optional[str], src: int, rank: int):
    """Causal option for (rank's queries, shard src's keys); False means "skip, nothing visible"."""
    if causal is None or src < rank:
        return None
    if src == rank:
        return _v.CAUSAL_TOP_LEFT  # square diagonal block: both alignments coincide
    return False


def _merge(o_acc, lse_acc, o_s, lse_s):
    """Merge a partial result into the fp32 accumulators by log-sum-exp (-inf = empty)."""
    m = torch.maximum(lse_acc, lse_s)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_acc - m_safe)
    w_b = torch.exp(lse_s - m_safe)
    l = w_a + w_b
    l_safe = torch.where(l > 0, l, torch.ones_like(l))
    o = (w_a[..., None] * o_acc + w_b[..., None] * o_s) / l_safe[..., None]
    lse = torch.where(l > 0, m_safe + torch.log(l_safe), torch.full_like(l, float("-inf")))
    return o, lse


def _check_same_everywhere(ring: _Ring, dims, q, opts) -> None:
    """All ranks must call with the same shapes and options (else the ring would hang or lie)."""
    mine = torch.tensor(_meta(dims, q, opts), dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(ring.size)]
    dist.all_gather(everyone, mine, group=ring.group)
    for other_rank, theirs in enumerate(everyone):
        message = _mismatch_message(ring.rank, other_rank, mine.tolist(), theirs.tolist())
        if message is not None:
            raise ValueError(message)


class _RingAttentionFunction(torch.autograd.Function):
    """forward(q, k, v, ring, executor, options) -> o (this rank's shard)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, executor, opts):
        in_dtype = q.dtype
        cdt = _ops._compute_dtype(q, opts.mixed_precision)
        qc, kc, vc = (x.detach().to(cdt).contiguous() for x in (q, k, v))
        B, Hq, N, D = qc.shape
        o_acc = torch.zeros(B, Hq, N, D, dtype=torch.float32)
        lse_acc = torch.full((B, Hq, N), float("-inf"), dtype=torch.float32)
        kv = torch.stack([kc, vc])
        for step in range(ring.size):
            works = None
            if step < ring.size - 1:
                kv_next, works = ring.shift(kv)
            causal = _step_causal(opts.causal, ring.source(step), ring.rank)
            if causal is not False:
                o_s, lse_s = executor.forward(qc, kv[0], kv[1], opts._replace(causal=causal))
                o_acc, lse_acc = _merge(o_acc, lse_acc, o_s.to(torch.float32), lse_s)
            if works is not None:
                ring.wait(works)
                kv = kv_next
        o = o_acc.to(cdt)
        ctx.save_for_backward(qc, kc, vc, o, lse_acc)
        ctx.ring, ctx.executor, ctx.opts, ctx.in_dtype = ring, executor, opts, in_dtype
        return o.to(in_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        ring, ex, opts = ctx.ring, ctx.executor, ctx.opts
        do = grad_o.to(o.dtype).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32)
        for step in range(ring.size):
            kv_works = None
            if step < ring.size - 1:
                kv_next, kv_works = ring.shift(kv)
            causal = _step_causal(opts.causal, ring.source(step), ring.rank)
            if causal is not False:
                dq_s, dk_s, dv_s = ex.backward(do, q, kv[0], kv[1], o, lse,
                                               opts._replace(causal=causal))
                dq += dq_s.to(torch.float32)
                dkv[0] += dk_s.to(torch.float32)
                dkv[1] += dv_s.to(torch.float32)
            # The accumulators follow their shard; one extra hop after the last step brings
            # each home to the rank that owns it.
            dkv_next, dkv_works = ring.shift(dkv)
            ring.wait(dkv_works)
            dkv = dkv_next
            if kv_works is not None:
                ring.wait(kv_works)
                kv = kv_next
        out = ctx.in_dtype
        return dq.to(out), dkv[0].to(out), dkv[1].to(out), None, None, None


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, mixed_precision=True):
    """Attention over a sequence sharded across the ranks of ``group`` (context parallelism).

    Parameters
    ----------
    q : torch.Tensor (B, Hq, N, D)
        This rank's query shard: global positions ``rank * N .. rank * N + N - 1``, with
        ``rank = torch.distributed.get_rank(group)``.
    k, v : torch.Tensor (B, Hkv, Nk, D)
        This rank's key/value shard (same positions when ``Nk == N``). ``Hq % Hkv == 0``.
        CPU tensors; dtypes as in :func:`host.torch_ops.flash_attention`. Every rank must pass
        the same shapes, dtype and options (checked with one small all_gather).
    group : torch.distributed.ProcessGroup, optional
        Default: the world group. Needs point-to-point isend/irecv (e.g. gloo).
    causal : None, False, True, "top_left" or "bottom_right"
        Causal mask on the *global* positions. Requires ``Nk == N`` (self-attention over one
        sequence), where the two alignments coincide.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    mixed_precision : bool
        As in :func:`host.torch_ops.flash_attention`.

    Returns
    -------
    torch.Tensor (B, Hq, N, D)
        This rank's shard of the output, in q's dtype; differentiable with respect to q, k and v
        (the backward is a ring pass too; every rank must run it).

    Notes
    -----
    Each rank makes at most ``world_size`` forward kernel calls (fewer under ``causal``) and as
    many backward calls. Partial outputs are merged in float32 after being rounded to the
    compute dtype by the kernel, so low-precision results differ from the single-device ones by
    about one rounding of o.
    """
    dims, opts = _ops._validate(q, k, v, scale=scale, causal=causal, window=None, kv_lens=None,
                                q_lens=None, mixed_precision=mixed_precision)
    kind = _ops._device_kind(q, k, v)
    if kind != _ops._DEVICE_CPU:
        raise ValueError(
            f"q: ring_attention takes CPU tensors (torch.distributed point-to-point between "
            f"processes), got device {q.device}; on Neuron devices use an in-kernel ring "
            f"(neuronx-distributed's ring attention)"
        )
    if opts.causal is not None and dims.Nq != dims.Nk:
        raise ValueError(
            f"causal: a causal ring needs equal query and key shard lengths (self-attention over "
            f"one sequence), got Nq={dims.Nq} and Nk={dims.Nk}"
        )
    ring = _Ring(group)
    _check_same_everywhere(ring, dims, q, opts)
    return _RingAttentionFunction.apply(q, k, v, ring, _ops._EXECUTORS[kind], opts)
