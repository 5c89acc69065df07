"""Fixture for the nki.* (NKI 0.7) front end tests (imported by each test module: a conftest.py
here would shadow tests/simulate/conftest.py, which other tests import by name): the ``nki`` aliases are registered for
the test and removed afterwards."""
import pytest

import simulate


@pytest.fixture
def nk():
    """(nki, nl, nisa) of the simulator's nki.* front end, via ``import nki``."""
    simulate.register_as_nki()
    import nki
    import nki.isa as nisa
    import nki.language as nl
    yield nki, nl, nisa
    simulate.unregister_nki()


def tile_kernel(nki, nl, nisa, body, shape_out, dtype_out=None):
    """A jit kernel that loads its inputs into SBUF, runs ``body(nl, nisa, *tiles) -> sbuf
    tile`` and stores the result."""
    @nki.jit
    def k(*arrays):
        out = nl.ndarray(shape_out, dtype=dtype_out or arrays[0].dtype, buffer=nl.shared_hbm)
        tiles = []
        for a in arrays:
            t = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=a)
            tiles.append(t)
        r = body(nl, nisa, *tiles)
        nisa.dma_copy(dst=out, src=r)
        return out
    return k
