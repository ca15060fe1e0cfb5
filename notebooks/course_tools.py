"""The snippets several course notebooks share, as importable code.

Each notebook keeps its own copy in a cell, so a student reads (and can change) the code
where it runs; this module is the one definition of each, and
``tests/course/test_notebook_sources.py`` checks that every copy in ``notebooks/src/`` is
character for character the same. Change a snippet here and in the sources together.

    import course_tools                      # from notebooks/ (a notebook's working directory)
    course_tools.bars({"fp32": r1, "amp": r2}, "peaks")
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from torch import nn

__all__ = ["SETUP", "bars", "make_cnn"]

# The first code cell of every course notebook from 02 on (magics included, so it stays text).
SETUP = """\
%load_ext memmagic
%matplotlib inline
import torch
from torch import nn
import matplotlib.pyplot as plt
torch.manual_seed(0)
from memmagic import format_bytes"""


# A chart of several reports side by side (02, 04, 05, 06, 07, 09): one stacked bar per
# report, MiB by category at its peak.
def bars(reports, title):
    """One bar per report: its peak in MiB, split by category."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(reports)))
    for i, report in enumerate(reports.values()):
        left = 0.0
        for j, (category, nbytes) in enumerate(report.breakdown.items()):
            ax.barh(i, nbytes / 2**20, left=left, color=f"C{j}", label=category if i == 0 else None)
            left += nbytes / 2**20
    ax.set_yticks(range(len(reports)), list(reports))
    ax.invert_yaxis()
    ax.set_xlabel("MiB at the peak")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), frameon=False)
    plt.show()


# The small CNN of 03 and 04, for 32x32 images (CIFAR-sized) and 10 classes.
def make_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 8 * 8, 512), nn.ReLU(), nn.Linear(512, 10))
