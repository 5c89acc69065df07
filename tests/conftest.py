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


@pytest.fixture(autouse=True, scope="session")
def _no_spill():
    """The package's kernels hold to the hardware's SBUF and PSUM (a project rule: whatever the
    compiler does beyond them is slow), so the suite runs with the simulator's modeled spilling
    off and an overflowing allocation raises. Tests of the spilling model turn it on."""
    import importlib.util

    if importlib.util.find_spec("simulate") is None:
        yield
        return
    import simulate

    with simulate.spill(False):
        yield
