"""Device code of nki-flash: NKI kernels only.

Kernels reach the NKI API through :mod:`nki_kernels.nki` alone, so the same source runs on the
real ``neuronxcc.nki`` (Trainium, or its bundled simulator) and on the package's own CPU simulator
(:mod:`simulate`).
"""
