"""The what-if panel in a real kernel: the comm message a browser sends when a slider
moves re-runs the cell (after the debounce) and updates the panel's state."""

from __future__ import annotations

import time

import nbformat
import pytest
from nbclient import NotebookClient

from tests.whatif.test_engine import HANDLES


def _text(cell) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")
                   for o in cell.outputs)


@pytest.mark.slow
def test_a_slider_comm_message_re_runs_the_cell():
    cells = [
        nbformat.v4.new_code_cell("%load_ext memmagic"),
        nbformat.v4.new_code_cell("%%gpumem --whatif --batch-size 8 --gpu T4 -v panel\n" + HANDLES),
        nbformat.v4.new_code_cell("s = panel.controls['batch_size']\n"
                                  "print(s.model_id, s.options.index(32), panel.debounce_s)"),
        nbformat.v4.new_code_cell("print(repr(panel), panel.runs, panel.setting.batch_size)"),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": "."}})
    with client.setup_kernel():
        for i in range(3):
            client.execute_cell(nb.cells[i], i)
        shown = nb.cells[1].outputs
        assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in shown)
        model_id, index, debounce = _text(nb.cells[2]).split()
        # what JupyterLab sends when the slider is released on 32
        msg = client.kc.session.msg("comm_msg", {
            "comm_id": model_id,
            "data": {"method": "update", "state": {"index": int(index)}, "buffer_paths": []}})
        client.kc.shell_channel.send(msg)
        time.sleep(float(debounce) + 0.2)
        client.execute_cell(nb.cells[3], 3)
    out = _text(nb.cells[3])
    assert out.startswith("<memmagic what-if: batch 32, on T4 -> peak ")
    assert "(baseline 67.92 MiB), fits T4>" in out
    assert out.split()[-2:] == ["2", "32"]  # one re-run, of batch 32
