"""``neuronxcc.nki.typing`` (``nt``): parameter annotations.

``nt.tensor`` / ``nt.tensor[128, 512]`` mark tensor parameters (no effect);
``nt.mutable_tensor`` marks a kernel input the kernel may write (2.21+ convention A kernels
must then also return it). Local-variable annotations are not evaluated by Python, so
``x: nt.tensor[...] = expr`` shape checks are not simulated.
"""

from __future__ import annotations


class _TensorAnnotation:
    def __init__(self, name, mutable, shape=None):
        self._name = name
        self._nki_mutable = mutable
        self.shape = shape

    def __getitem__(self, shape):
        if not isinstance(shape, tuple):
            shape = (shape,)
        return _TensorAnnotation(self._name, self._nki_mutable, shape)

    def __call__(self, *a, **k):
        return self

    def __repr__(self):
        return f"nt.{self._name}" + (f"{list(self.shape)}" if self.shape else "")


tensor = _TensorAnnotation("tensor", False)
mutable_tensor = _TensorAnnotation("mutable_tensor", True)
