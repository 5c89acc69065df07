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
