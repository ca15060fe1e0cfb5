"""The benchmarks' quick mode runs end to end (so it cannot rot), writes a results file
with machine, torch version and date, and the README generator touches only its block."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import readme
from benchmarks.run import main

FIGURES = {"a_overhead", "a_profile", "b_sim_speed", "c_accuracy", "d_peers", "e_whatif"}


def _sim_available() -> bool:
    try:
        from memmagic.backends.sim import SimBackend  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    assert main(["--quick", "--out", str(out)]) == 0
    files = list(out.glob("quick-cpu-*.json"))
    assert len(files) == 1
    return out, json.loads(files[0].read_text())


def test_quick_results_say_where_and_when(quick):
    _, data = quick
    assert data["quick"] is True and data["kind"] == "cpu"
    assert data["machine"]["torch"] == torch.__version__
    assert data["machine"]["cpu"] and data["machine"]["cores"] >= 1
    assert data["date"][:2] == "20"
    assert set(data["figures"]) == FIGURES
    for fig in data["figures"].values():
        assert fig["target"] and fig["status"] in ("pass", "miss", "n/a")
        assert fig["rows"], fig["key"]


def test_speed_figures_are_paired_ratios(quick):
    _, data = quick
    for row in data["figures"]["a_overhead"]["rows"]:
        t = row["timing"]
        assert len(t["a_s"]) == len(t["b_s"]) >= 3
        assert row["ratio"] == pytest.approx(t["median_ratio"], rel=1e-3)
        assert row["status"] in ("pass", "miss")


def test_cpu_tracker_matches_profiler(quick):
    """3c is a memory figure, not a timing: deterministic, so it is asserted."""
    _, data = quick
    rows = data["figures"]["c_accuracy"]["rows"]
    assert rows
    for row in rows:
        assert abs(row["error"]) <= 0.001, row


def test_sim_rows_never_invent_numbers(quick):
    _, data = quick
    if _sim_available():
        pytest.skip("the simulated backend is present")
    for key, col in (("b_sim_speed", "sim_s"), ("d_peers", "sim"), ("e_whatif", "latency_s")):
        for row in data["figures"][key]["rows"]:
            assert isinstance(row[col], str) and "sim backend not available" in row[col]


def test_sim_rows_hold_numbers_once_the_simulator_works(quick):
    _, data = quick
    if not _sim_available():
        pytest.skip("the simulated backend is not there yet")
    for row in data["figures"]["b_sim_speed"]["rows"]:
        assert isinstance(row["sim_s"], float) or row["sim_s"].startswith("sim failed"), row
        if isinstance(row["sim_s"], float):
            assert row["speedup"] == pytest.approx(
                sorted(1 / r for r in row["timing"]["ratios"])[len(row["timing"]["ratios"]) // 2], rel=1e-3)
    for row in data["figures"]["d_peers"]["rows"]:
        assert isinstance(row["sim"], int) or row["sim"].startswith("sim failed"), row


def test_readme_replaces_only_its_block(quick, tmp_path, capsys):
    out, _ = quick
    before, after = "# title\n\nintro\n\n", "\n\n## Layout\nrest\n"
    md = tmp_path / "README.md"
    md.write_text(f"{before}{readme.START}\nold table\n{readme.END}{after}")
    args = ["--results", str(out), "--readme", str(md), "--include-quick"]
    assert readme.main(args) == 0
    text = md.read_text()
    assert text.startswith(before + readme.START) and text.endswith(readme.END + after)
    assert "old table" not in text and "| case |" in text and "| figure | result |" in text
    assert "torch " + torch.__version__ in text and "Taken on" in text
    # without markers: printed, file untouched
    md.write_text("no markers here\n")
    capsys.readouterr()
    assert readme.main(args) == 0
    assert md.read_text() == "no markers here\n"
    assert "| case |" in capsys.readouterr().out
    # quick results are not README material unless asked for
    assert readme.latest_results(out) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on CPU-only machines")
def test_gpu_mode_skips_cleanly_without_cuda(tmp_path, capsys):
    assert main(["--gpu", "--out", str(tmp_path)]) == 0
    assert "skipped" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
