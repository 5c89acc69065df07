"""The measurement scripts under benchmarks/ run (small sizes; AWS's kernels are not fetched in
CI, so the side-by-side runs nki-flash's half)."""
import importlib.util
import os

import pytest

from nki_kernels.nki import BACKEND

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
pytestmark = pytest.mark.skipif(BACKEND != "simulate", reason="needs the bundled simulator")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_program_size_table(capsys, tmp_path):
    out = tmp_path / "ps.json"
    _load("program_size").main(["--max-n", "2048", "--d", "64", "--json", str(out)])
    import json
    rows = json.loads(out.read_text())
    assert [r["N"] for r in rows] == [1024, 2048]
    assert all(0 < r[k] < 20000 for r in rows for k in r if k != "N")
    assert "| 2K |" in capsys.readouterr().out


def test_side_by_side_without_aws(capsys):
    _load("aws_side_by_side").main(["--n", "256", "--d", "64", "--samples", ""])
    text = capsys.readouterr().out
    assert text.count("nki-flash forward") == 2 and "AWS" not in text.split("\n", 2)[2]


def test_acceptance_runner_needs_a_checkout(capsys):
    with pytest.raises(SystemExit) as e:
        _load("aws_acceptance").main(["--samples", "/nonexistent"])
    assert e.value.code == 2
    assert "--samples must be a checkout" in capsys.readouterr().err


def test_acceptance_runner_reads_aws_latency_figures():
    figure = _load("aws_acceptance")._figure
    assert figure("t.py::T::test_attention_for_SD_perf[1-4096-128-float32-675]") == 675.0
    assert figure("t.py::T::test_pool_perf[1-64-56-56-7-float32-68.25]") == 68.25
    assert figure("t.py::T::test_numerical[1-4096-128-float32]") is None


def test_score_mods_table(capsys, tmp_path):
    out = tmp_path / "mods.json"
    _load("score_mods").main(["--n", "256", "--d", "64", "--cache", "512", "--json", str(out)])
    import json
    rows = json.loads(out.read_text())
    prefill = {r["modifiers"]: r for r in rows if "forward" in r}
    assert set(prefill) == {"none", "softcap", "alibi", "sinks", "all three"}
    for r in prefill.values():
        for key in ("forward", "forward_causal", "backward"):
            assert 0 < r[key][0] <= r[key][1]          # bound <= estimate
    # the sinks only change the online softmax's initial state (plus a fixed setup: 256 keys)
    for key in ("forward", "backward"):
        assert abs(prefill["sinks"][key][0] / prefill["none"][key][0] - 1) < 0.10
    assert "decode" in capsys.readouterr().out


NKILIB = os.environ.get("NKILIB_CHECKOUT", "/tmp/nkilib")


@pytest.mark.skipif(not os.path.isdir(os.path.join(NKILIB, "src", "nkilib_src")),
                    reason="needs an aws-neuron/nki-library checkout (NKILIB_CHECKOUT)")
def test_nkilib_side_by_side_all_kernels(capsys):
    _load("nkilib_side_by_side").main([
        NKILIB, "--kernel", "cte", "bwd", "tkg", "--n", "256", "--d", "128", "--causal", "yes",
        "--extras", "--extras-n", "256", "--decode", "1x512", "--hq", "4", "--hkv", "2"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")
            and r[2].isdigit()]
    assert len(rows) == 6                  # cte causal + three extras, bwd, tkg
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert cells[-1].endswith("/ nki") and float(cells[-2]) > 0


def test_kvcache_benchmark_small(capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))      # its _common
    bench = _load("kvcache")
    rows = bench.main(["--tokens", "65", "--seq", "256", "--hq", "4", "--hkv", "1", "--dim",
                       "32", "--page-sizes", "32"])
    assert [r["case"] for r in rows] == ["flash_attention contiguous", "with_kvcache contiguous",
                                        "with_kvcache paged 32"]
    assert rows[2]["read"] - rows[1]["read"] == 4 * (256 + 1)     # one table entry a key
    rows = bench.main(["--threshold", "--tokens", "8", "--seq", "128", "--hq", "4", "--hkv",
                       "1", "--dim", "32"])
    assert rows[0]["T"] == 8 and rows[0]["decode"]["estimated_us"] > 0
    assert "decode kernels vs prefill forward" in capsys.readouterr().out


def test_block_sparse_random_patterns(capsys, tmp_path):
    bench = _load("block_sparse")
    mask = bench.random_pattern(4, 0.01, seed=3)
    assert mask.shape == (1, 1, 4, 4) and mask.any(axis=-1).all()   # a block per query tile
    bench.main(["--n", "256", "--d", "64", "--passes", "fwd", "--forms", "index", "--no-fixed",
                "--no-band", "--random", "0.5", "--out", str(tmp_path)])
    import json
    rows = json.loads((tmp_path / "block_sparse.json").read_text())["rows"]
    assert [(r["pattern"], r["form"], r["pass_"]) for r in rows] == [("random", "index", "fwd")]
    assert rows[0]["density"] == float(bench.random_pattern(2, 0.5, seed=1).mean())
    with pytest.raises(SystemExit, match="--random"):
        bench.random_pattern(2, 1.5, seed=1)


def test_block_sparse_gqa_inputs(tmp_path):
    """``--hq``: query heads sharing the one kv head, the pattern broadcast over them."""
    bench = _load("block_sparse")
    q, k, v, do = bench.inputs(256, 64, hq=2)
    assert q.shape == do.shape == (1, 2, 256, 64) and k.shape == v.shape == (1, 1, 256, 64)
    bench.main(["--n", "256", "--d", "64", "--passes", "fwd", "--forms", "index", "--no-fixed",
                "--hq", "2", "--out", str(tmp_path)])
    import json
    out = json.loads((tmp_path / "block_sparse.json").read_text())
    assert [(r["pattern"], r["Hq"]) for r in out["rows"]] == [("band+strided", 2)]
    assert out["dense"][0]["Hq"] == 2
