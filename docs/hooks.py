"""mkdocs hooks (mkdocs.yml ``hooks:``): the README is the site's front page, and the course
notebooks' widgets show as the HTML they stored.

README.md links to the reference pages as ``docs/PAGE.md`` (so the links work on GitHub) and
to the course as ``notebooks/NN_name.ipynb``; on the site the pages sit at the root and the
notebooks under ``notebooks/`` (docs/notebooks links to ../notebooks), so only the
``docs/`` prefix goes.

A widget output (the what-if panel) keeps, beside its widget view, the HTML a front end
without widgets shows: the chart and the numbers as they stood. A static page has no
kernel, and drawing the view would load a widget manager from a CDN each time the page is
opened (nothing at all where that is not reachable), so the site shows that HTML.
Nothing here is imported by memmagic or its tests.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from mkdocs.structure.files import File

README = Path(__file__).resolve().parent.parent / "README.md"
_DOCS_LINK = re.compile(r"\]\(docs/")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def index_markdown(readme: str) -> str:
    """The README's text with its ``](docs/...)`` links made relative to docs/."""
    return _DOCS_LINK.sub("](", readme)


def without_widget_views(nb):
    """A copy of the notebook whose outputs show their stored HTML / text instead of a
    widget view (outputs that hold nothing else keep theirs), with no widget state."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data and len(data) > 1:
                del data[WIDGET_VIEW]
    return nb


def on_config(config):
    from mkdocs_jupyter import nbconvert2  # the docs extra (pyproject.toml)

    base = nbconvert2.HTMLExporter
    if not getattr(base, "_memmagic_static", False):
        class StaticWidgetsExporter(base):
            _memmagic_static = True

            def from_notebook_node(self, nb, resources=None, **kw):
                return super().from_notebook_node(without_widget_views(nb), resources, **kw)

        nbconvert2.HTMLExporter = StaticWidgetsExporter
    return config


def on_files(files, config):
    if files.get_file_from_path("index.md") is not None:
        raise ValueError("docs/index.md must not exist: the site's front page is README.md")
    files.append(File.generated(config, "index.md",
                                content=index_markdown(README.read_text(encoding="utf-8"))))
    return files


def on_serve(server, config, builder):
    server.watch(str(README))
    return server
