"""``nki.typing`` (``nt``, NKI 0.3+): ``nt.tensor[shape]`` annotates a kernel's tensor
parameters (migration guide, "nki.typing module"; release notes 2.29). Same object as the
legacy ``neuronxcc.nki.typing.tensor``: an annotation, not checked at launch."""

from __future__ import annotations

from ..typing import tensor  # noqa: F401

__all__ = ["tensor"]
