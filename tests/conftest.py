"""Fixtures shared by every test package."""
import pytest


@pytest.fixture
def strict_sim():
    """Run the test with strict simulation on (simulate.strict): symbolic loop indices and
    program ids, compile-time loop bounds, PSUM accumulation groups. Skipped on a real
    neuronx-cc backend (its own tracer is the judge there)."""
    from nki_kernels.nki import BACKEND

    if BACKEND != "simulate":
        pytest.skip("strict mode is a simulator switch")
    import simulate

    with simulate.strict():
        yield
