"""The benchmarks' quick mode runs end to end (so it cannot rot), writes a results file
with machine, torch version and date, and the tables' generator touches only its block of
the docs page (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import readme
from benchmarks.render import markdown_results
from benchmarks.run import main

ROOT = Path(__file__).resolve().parent.parent

FIGURES = {"a_overhead", "a_profile", "b_sim_speed", "c_accuracy", "c_loops", "d_peers",
           "e_whatif"}


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


def test_measuring_loops_changes_nothing(quick):
    """On loops the tracker matches the profiler, and the profiler's own peak is the same
    with and without memmagic measuring (measuring keeps no graph alive)."""
    _, data = quick
    rows = data["figures"]["c_loops"]["rows"]
    assert {r["loop"] for r in rows} == {"forward x4, total += loss.item()",
                                         "forward x4, total += loss", "train x3"}
    for row in rows:
        if row["status"] == "n/a":
            continue
        assert abs(row["error"]) <= 0.001, row
        # up to a few 8-byte scalar tensors: what any dispatch mode costs (see the figure)
        assert abs(row["profiler_measured"] - row["profiler"]) <= 64, row
    by = {(r["case"], r["precision"], r["loop"]): r for r in rows}
    for (case, prec, loop), r in by.items():
        if loop == "forward x4, total += loss" and r["status"] != "n/a":
            item = by[(case, prec, "forward x4, total += loss.item()")]
            assert r["tracker"] > item["tracker"], (case, prec)


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
            t = row["timing"]  # the ratios stored are rounded: recompute them from the times
            speedups = sorted(a / b for a, b in zip(t["a_s"], t["b_s"]))
            assert row["speedup"] == pytest.approx(speedups[len(speedups) // 2], rel=1e-3)
    for row in data["figures"]["d_peers"]["rows"]:
        assert isinstance(row["sim"], int) or row["sim"].startswith("sim failed"), row


def test_docs_page_replaces_only_its_block(quick, tmp_path, capsys):
    out, _ = quick
    before, after = "# title\n\nintro\n\n", "\n\n## Layout\nrest\n"
    md = tmp_path / "benchmarks.md"
    md.write_text(f"{before}{readme.START}\nold table\n{readme.END}{after}")
    args = ["--results", str(out), "--docs", str(md), "--include-quick"]
    assert readme.main(args) == 0
    text = md.read_text()
    assert text.startswith(before + readme.START) and text.endswith(readme.END + after)
    assert "old table" not in text and "| case |" in text and "| figure | result |" in text
    assert "torch " + torch.__version__ in text and "Taken on" in text
    # the folded tables are markdown inside HTML: marked for mkdocs' md_in_html
    assert '<details markdown="1"><summary>' in text
    # without markers: printed, file untouched (--readme: the option's old name)
    md.write_text("no markers here\n")
    capsys.readouterr()
    assert readme.main(["--results", str(out), "--readme", str(md), "--include-quick"]) == 0
    assert md.read_text() == "no markers here\n"
    assert "| case |" in capsys.readouterr().out
    # quick results are not docs material unless asked for
    assert readme.latest_results(out) == []


def test_docs_benchmarks_page_is_the_results_files():
    """docs/benchmarks.md holds what `python -m benchmarks.readme` (its default target) writes
    from results/: regenerate it after adding a results file."""
    assert readme.DOCS_PAGE == ROOT / "docs" / "benchmarks.md"
    text = readme.DOCS_PAGE.read_text(encoding="utf-8")
    start = text.index(readme.START) + len(readme.START) + 1
    assert text[start:text.index(readme.END)] == markdown_results(readme.latest_results(ROOT / "results"))


def test_readme_takes_the_newest_run_of_each_figure(tmp_path):
    def results(name, date, figures):
        (tmp_path / f"{name}.json").write_text(json.dumps({
            "name": name, "kind": "cpu", "quick": False, "date": date, "figures": {
                k: {"key": k, "title": k, "rows": [], "status": "n/a"} for k in figures}}))
    results("cpu-old", "2026-01-01T00:00:00", ["a_overhead", "c_accuracy"])
    results("cpu-new", "2026-02-01T00:00:00", ["c_accuracy", "c_loops"])
    got = {(r["file"], k) for r in readme.latest_results(tmp_path) for k in r["figures"]}
    assert got == {("results/cpu-old.json", "a_overhead"), ("results/cpu-new.json", "c_accuracy"),
                   ("results/cpu-new.json", "c_loops")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on CPU-only machines")
def test_gpu_mode_skips_cleanly_without_cuda(tmp_path, capsys):
    assert main(["--gpu", "--out", str(tmp_path)]) == 0
    assert "skipped" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_against_measures_with_the_other_commits_memmagic():
    """--against REV: the child processes import REV's memmagic (extracted) and this tree's."""
    from benchmarks.against import ROOT, Against

    against = Against("HEAD")
    try:
        this, other = against.pair("memmagic_file", {}, 0)
        assert Path(this["file"]).resolve() == (ROOT / "memmagic" / "__init__.py").resolve()
        assert Path(other["file"]).resolve() == (against.dir / "memmagic" / "__init__.py").resolve()
        assert against.label in against.method
    finally:
        against.close()
    assert not against.dir.exists()
    with pytest.raises(SystemExit, match="not a commit"):
        Against("no-such-revision")


def test_doctor_scale_row_runs_the_script_out_of_memory_and_counts_the_doctors_rows():
    from benchmarks import figures
    from benchmarks.run import QUICK_SKIPS, _parser, _selected

    assert "s" in _selected(_parser().parse_args(["--only", "s"]))
    assert "s" in QUICK_SKIPS  # a full run or --only: it takes seconds per case
    case = next(iter(figures.DOCTOR_CASES))
    row = figures.doctor_scale_row(case)
    assert row["exit"] == 1  # the script ran out of memory on the T4
    assert row["rows"] >= 4 and 1 <= row["fits"] < row["rows"]
    assert row["wall_s"] > 0 and row["rss_mib"] > 100


def test_a_figure_of_its_own_module_runs_its_rows_in_a_fresh_process():
    """``module:function`` rows (figures 3p and 3g live in modules of their own): the child
    process imports the module and returns the row; the panel figure judges answers equal
    only where both are whole."""
    from benchmarks.against import _child
    from benchmarks.panel_scale import _same
    from benchmarks.run import QUICK_SKIPS

    assert {"p", "g"} <= QUICK_SKIPS
    row = _child(None, "generate_scale:generate_row", {"tokens": 2}, 1)
    assert row["tokens"] == 2 and row["error"] is None and row["wall_s"] > 0
    assert row["peak"] > 2 * 1.1e9  # the fp16 weights of a 1.1B model
    sample = _child(None, "generate_scale:sample_row", {"tokens": 2}, 1)
    assert sample["error"] is None and sample["sample"] and sample["wall_s"] > 0
    run = {"peak": 5, "reserved": 8, "fits": True, "ran_out": False}
    assert _same(run, dict(run)) == "yes"
    assert _same(run, {**run, "reserved": 9}) == "NO"
    assert _same({**run, "fits": False, "ran_out": True}, {**run, "fits": False}).startswith("n/a")
