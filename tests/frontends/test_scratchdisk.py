"""The scratch disk a script runs over (memmagic/frontends/scratchdisk): the view's rules, and that
what it installs is put back, also after an exception and a KeyboardInterrupt."""

from __future__ import annotations

import builtins
import errno
import io
import os
import posix
import shutil
import signal
import subprocess
import sys

import pytest

from memmagic.frontends.scratchdisk import ProgramRefused, RefusedCall, ScratchDisk


@pytest.fixture
def tree(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.txt").write_text("real")
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "sub" / "g.txt").write_text("g")
    (tmp_path / "to_d").symlink_to("d")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _originals() -> dict:
    return {"open": builtins.open, "io.open": io.open, "FileIO": io.FileIO, "stat": os.stat,
            "rename": os.rename, "system": os.system, "rmtree": shutil.rmtree,
            "execute": subprocess.Popen._execute_child, "bytecode": sys.dont_write_bytecode,
            "cwd": os.getcwd()}


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_everything_is_put_back_after_an_error(tree, error):
    before = _originals()
    disk = ScratchDisk()
    with pytest.raises(error):
        with disk.installed():
            open("d/new.txt", "w").write("x")
            os.chdir("d")
            raise error
    assert _originals() == before
    assert not os.path.exists(disk.view.root)  # the scratch directory is gone
    assert sorted(os.listdir("d")) == ["f.txt", "sub"]


def test_a_removed_folder_made_again_is_empty(tree):
    with ScratchDisk().installed():
        shutil.rmtree("d")
        os.mkdir("d")
        assert os.listdir("d") == [] and not os.path.exists("d/f.txt")
        open("d/f.txt", "w").write("new")
        assert open("d/f.txt").read() == "new"
    assert (tree / "d" / "f.txt").read_text() == "real"


def test_a_renamed_folder_keeps_what_was_in_it_and_takes_more(tree):
    with ScratchDisk().installed():
        os.rename("d", "e")
        open("e/sub/h.txt", "w").write("h")
        os.remove("e/f.txt")
        assert sorted(os.listdir("e")) == ["sub"]
        assert sorted(os.listdir("e/sub")) == ["g.txt", "h.txt"]
        assert open("e/sub/g.txt").read() == "g"  # read where it lies, not copied
        assert not os.path.exists("d") and not os.path.exists("to_d/f.txt")
    assert sorted(os.listdir(tree / "d")) == ["f.txt", "sub"]


def test_writes_through_a_linked_folder_land_in_the_folder(tree):
    with ScratchDisk().installed():
        open("to_d/new.txt", "w").write("n")
        assert open("d/new.txt").read() == "n"
        assert "new.txt" in os.listdir("d") and os.path.islink("to_d")
    assert not (tree / "d" / "new.txt").exists()


def test_the_kernels_errors(tree):
    with ScratchDisk().installed():
        with pytest.raises(OSError) as exc:
            os.rmdir("d")
        assert exc.value.errno == errno.ENOTEMPTY
        with pytest.raises(IsADirectoryError):
            os.remove("d")
        with pytest.raises(FileNotFoundError) as missing:
            open("nowhere/x.txt", "w")
        assert missing.value.filename == "nowhere/x.txt"
        with pytest.raises(FileExistsError):
            os.mkdir("d")
        os.mkdir("empty")
        with pytest.raises(OSError) as exc:
            os.rename("empty", "d")  # onto a folder that is not empty
        assert exc.value.errno == errno.ENOTEMPTY


def test_what_cannot_be_kept_off_the_disk_is_refused(tree):
    with ScratchDisk().installed():
        fd = os.open("d/f.txt", os.O_RDONLY)
        try:
            with pytest.raises(RefusedCall, match="os.fchmod"):
                os.fchmod(fd, 0)
        finally:
            os.close(fd)
        with pytest.raises(ProgramRefused):
            subprocess.run(["touch", "d/made"])
    assert not (tree / "d" / "made").exists()
    assert (tree / "d" / "f.txt").stat().st_mode & 0o777 != 0


def test_a_function_bound_by_name_in_one_run_serves_the_next(tree):
    with ScratchDisk().installed():
        from os import remove  # bound to the replacement, as a module imported in a run does
    with ScratchDisk().installed():
        remove("d/f.txt")
        assert not os.path.exists("d/f.txt")
    assert (tree / "d" / "f.txt").exists()
    remove("d/f.txt")  # outside a run: the real function
    assert not (tree / "d" / "f.txt").exists() and remove is not posix.remove


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_a_script_run_puts_back_main_argv_path_and_the_alarm(tmp_path, error, clean_state):
    from memmagic.frontends.scriptrun import ScriptRun, load_script

    script = tmp_path / "s.py"
    script.write_text(f"import sys\nx = 1\nassert sys.modules['__main__'].x == 1\n"
                      f"raise {error.__name__}\n")
    import torch

    main, argv, path = sys.modules["__main__"], list(sys.argv), list(sys.path)
    init = torch.optim.Optimizer.__init__
    alarm = signal.getsignal(signal.SIGALRM)
    _, code = load_script(script)
    run = ScriptRun(code, script, ["--a"], steps=1, time_limit_s=60)
    with pytest.raises(error):
        run({})
    assert sys.modules["__main__"] is main and sys.argv == argv and sys.path == path
    assert signal.getsignal(signal.SIGALRM) is alarm
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert torch.optim.Optimizer.__init__ is init
