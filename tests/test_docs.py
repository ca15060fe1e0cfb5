"""The documentation: the README is a front page that links every reference page in docs/
and every course notebook, the generated tables live on the docs pages, and the site
builds with ``mkdocs build --strict`` (a broken link, a missing anchor or a page left out
of the nav fails it). The pages' code blocks are run by tests/test_readme.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _links(text: str) -> set[str]:
    return set(re.findall(r"\]\(([^)#\s]+)", text))


def test_the_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert "```bash\nbash scripts/quickstart.sh\n```" in text
    assert "```bash\n.venv/bin/python -m pytest\n```" in text
    links = _links(text)
    assert {f"docs/{p}" for p in PAGES} <= links, "the README links every reference page"
    assert {f"notebooks/{n}" for n in NOTEBOOKS} <= links, "the course table links every notebook"
    assert all((ROOT / link).exists() for link in links if "://" not in link), links


def test_every_reference_topic_has_its_page():
    assert set(PAGES) >= {"magic.md", "trace.md", "whatif.md", "scripts.md", "budgets.md",
                          "doctor.md", "several-gpus.md", "simulated-gpu.md", "numbers.md",
                          "fidelity.md", "front-ends.md", "benchmarks.md", "architecture.md"}
    assert not (DOCS / "index.md").exists(), "the site's front page is README.md (docs/hooks.py)"
    # the course is rendered through this link, not copied
    assert (DOCS / "notebooks").is_symlink() and (DOCS / "notebooks").resolve() == ROOT / "notebooks"


def test_the_generated_tables_live_on_the_docs_pages():
    from benchmarks import gpu_check, readme

    assert readme.DOCS_PAGE == DOCS / "benchmarks.md"
    assert gpu_check.FIDELITY_PAGE == DOCS / "fidelity.md"
    for page, start, end in ((readme.DOCS_PAGE, readme.START, readme.END),
                             (gpu_check.FIDELITY_PAGE, gpu_check.FIDELITY_START, gpu_check.FIDELITY_END)):
        text = page.read_text(encoding="utf-8")
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
    readme_text = README.read_text(encoding="utf-8")
    for marker in (readme.START, gpu_check.FIDELITY_START):
        assert marker not in readme_text


def _mkdocs_or_skip() -> None:
    """Skip without the docs extra, except under CI=true (CI installs it: .ci/run)."""
    missing = [m for m in ("mkdocs", "material", "mkdocs_jupyter") if _absent(m)]
    if not missing:
        return
    why = (f"{', '.join(missing)} not installed: pip install -c .ci/constraints.txt "
           f"-e \".[docs]\"")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the docs build cannot run in CI (CI=true): {why}", pytrace=False)
    pytest.skip(why)


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path):
    _mkdocs_or_skip()
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    assert "WARNING" not in log, log
    index = (site / "index.html").read_text(encoding="utf-8")
    assert 'id="quick-start"' in index and 'href="magic/"' in index  # the README, relinked
    for name in NOTEBOOKS:
        assert (site / "notebooks" / name.removesuffix(".ipynb") / "index.html").is_file(), name
    # the what-if panel shows the HTML it stored, with no widget manager fetched from a CDN
    panel = (site / "notebooks" / "15_whatif_playground" / "index.html").read_text(encoding="utf-8")
    assert "the what-if panel as it stood" in panel and "unpkg.com" not in panel
    # the benchmark tables folded in <details> are rendered, not left as markdown text
    bench = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert bench.count("<details") >= 5 and "| case |" not in bench
