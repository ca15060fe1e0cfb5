"""A simulated run never empties a file it opens to overwrite: what it writes replaces the
file when closed, as the write would; with nothing written (a simulated torch.save), the
file is left as it was, and the report says so."""

from __future__ import annotations

import builtins
import io
import os

import torch

import memmagic


def _run(fn):
    return memmagic.measure(fn, backend="sim", gpu="T4")


def test_a_checkpoint_saved_through_a_file_object_is_left_as_it_was(tmp_path):
    ckpt = tmp_path / "model.pt"
    ckpt.write_bytes(b"weights of a real run")
    os.chmod(ckpt, 0o640)

    def save():
        model = torch.nn.Linear(64, 64).cuda()
        with open(ckpt, "wb") as f:
            assert f.name == ckpt
            torch.save(model.state_dict(), f)

    r = _run(save)
    assert ckpt.read_bytes() == b"weights of a real run"
    assert any(n.startswith(f"{ckpt}: opened to be overwritten and nothing written") for n in r.notes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no file left beside it
    import _io

    assert builtins.open is io.open is _io.open  # put back after the run


def test_what_a_run_writes_over_a_file_replaces_it_as_the_write_would(tmp_path):
    log, fresh, appended = tmp_path / "log.txt", tmp_path / "new.txt", tmp_path / "more.txt"
    log.write_text("an old log\n")
    appended.write_text("kept\n")
    os.chmod(log, 0o600)

    def write():
        with open(log, "w") as f:
            f.write("step 1\n")
        fresh.write_text("made by the run\n")  # pathlib goes through io.open
        with open(appended, "a") as f:
            f.write("added\n")
        dropped = open(tmp_path / "more.txt", "w")  # overwritten, never closed: as Python,
        dropped.write("last\n")                     # its data lands when it is collected
        del dropped

    r = _run(write)
    assert log.read_text() == "step 1\n" and (log.stat().st_mode & 0o777) == 0o600
    assert fresh.read_text() == "made by the run\n"
    assert appended.read_text() == "last\n"
    assert not [n for n in r.notes if "opened to be overwritten" in n]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "more.txt", "new.txt"]
