"""nki-flash host API: validated NumPy entry points that launch the NKI kernels.

Attention (shapes ``(B, H, N, D)``; semantics in docs/semantics.md):

- :func:`flash_attention` — prefill forward, returns ``o`` (and ``lse`` with ``return_lse``).
- :func:`flash_attention_backward` — ``(dq, dk, dv)`` from ``do``, the inputs, ``o`` and ``lse``.
- :func:`flash_decode` — split-KV decoding of T new tokens against a KV cache.
- :func:`flash_attention_with_kvcache` — any T over a (paged) KV cache: chunked prefill.
- :func:`attention_unfused` — standard attention that writes S and P to HBM (the baseline).

Fused kernels: :func:`linear_gelu` (GELU(x @ W + b)), :func:`online_softmax`.

Planning and IO helpers (what the kernels will do, without running them):
:func:`plan_attention_forward`, :func:`plan_attention_backward`, :func:`plan_flash_decode`,
:func:`flash_attention_backward_hbm_bytes`, :func:`flash_decode_hbm_bytes`.

PyTorch wrappers live in :mod:`host.torch_ops` and :mod:`host.distributed` (torch is optional and
imported only there); float64 references in :mod:`host.reference`.
"""
from host._version import __version__

#: The public NumPy API, loaded from :mod:`host.api` on first use (PEP 562), so that importing
#: ``host`` (e.g. by the ``nki-flash`` command, whose ``--help`` and error reporting must work
#: before the NKI backend is bound) does not bind the backend.
_API = (
    "attention_unfused",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_backward_hbm_bytes",
    "flash_attention_with_kvcache",
    "flash_decode",
    "flash_decode_hbm_bytes",
    "linear_gelu",
    "online_softmax",
    "plan_attention_backward",
    "plan_attention_forward",
    "plan_flash_decode",
)

__all__ = ["__version__", *_API]


def __getattr__(name):
    if name in _API:
        from host import api

        return getattr(api, name)
    raise AttributeError(f"module 'host' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))
