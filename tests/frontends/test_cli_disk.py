"""``python -m memmagic run`` and the disk: a script that writes, appends, removes, renames,
changes permissions, links, truncates, uses tempfile, shutil, pathlib, numpy, torch.save and
safetensors sees its own changes (it asserts so itself), and the real tree is byte for
byte, mode for mode and time for time what it was."""

from __future__ import annotations

import os
import stat
import textwrap

import pytest

from memmagic.frontends import cli

TREE = {
    "data/train.bin": bytes(range(256)) * 4,
    "data/labels.txt": b"cat\ndog\n",
    "ckpt/old.pt": b"old checkpoint",
    "ckpt/keep.pt": b"keep me",
    "logs/run.log": b"line1\n",
    "old_run/a.txt": b"a",
    "old_run/sub/b.txt": b"b",
    "perm.txt": b"permissions",
}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A real tree (files, folders, an empty folder, a symlink) the scripts run in."""
    root = tmp_path / "tree"
    for rel, data in TREE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "empty_dir").mkdir()
    (root / "link_to_log").symlink_to("logs/run.log")
    os.utime(root / "perm.txt", (1_000_000, 1_000_000))
    monkeypatch.chdir(root)
    return root


def snapshot(root) -> dict:
    """Every path under ``root``: its type, mode, owner, size, mtime, bytes or link target."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(folder, name)
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                body = os.readlink(p)
            elif stat.S_ISREG(s.st_mode):
                with open(p, "rb") as f:
                    body = f.read()
            else:
                body = None
            out[os.path.relpath(p, root)] = (s.st_mode, s.st_uid, s.st_gid, s.st_size,
                                             s.st_mtime_ns, s.st_nlink, body)
    s = os.stat(root)
    out["."] = (s.st_mode, s.st_mtime_ns)
    return out


def run_script(tree, source: str, *options: str) -> int:
    """``python -m memmagic run [options] script.py`` on ``source``, in the tree."""
    (tree.parent / "script.py").write_text(textwrap.dedent(source))
    return cli.main(["run", *options, str(tree.parent / "script.py")])


WRITERS = '''
    import io, os, pathlib, shutil, tempfile
    import numpy as np

    with open("logs/run.log", "a") as f:
        f.write("line2\\n")
    assert open("logs/run.log").read() == "line1\\nline2\\n"
    assert open("link_to_log").read() == "line1\\nline2\\n"  # through the real link
    with open("new.txt", "w") as f:
        f.write("new")
    try:
        open("new.txt", "x")
    except FileExistsError:
        pass
    else:
        raise AssertionError("x mode over a file the script wrote")
    with open("perm.txt", "r+") as f:
        f.write("P")
    assert open("perm.txt").read() == "Permissions"
    io.FileIO("fileio.bin", "w").write(b"abc")
    assert open("fileio.bin", "rb").read() == b"abc"
    fd = os.open("osopen.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"x")
    os.close(fd)
    fd = os.open("data/labels.txt", os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"cow\\n")
    os.close(fd)
    assert open("data/labels.txt").read() == "cat\\ndog\\ncow\\n"
    pathlib.Path("ckpt/notes.md").write_text("n")
    pathlib.Path("ckpt/keep.pt").touch()
    assert sorted(os.listdir("ckpt")) == ["keep.pt", "notes.md", "old.pt"]
    fd, name = tempfile.mkstemp()
    os.write(fd, b"t")
    os.close(fd)
    assert open(name).read() == "t"
    temp = tempfile.mkdtemp()
    pathlib.Path(temp, "f").write_text("f")
    assert os.listdir(temp) == ["f"]
    with tempfile.NamedTemporaryFile("w", delete=False) as f:
        f.write("n")
    with tempfile.TemporaryDirectory() as d:
        pathlib.Path(d, "x").write_text("x")
    with tempfile.TemporaryFile() as t:
        t.write(b"x")
    print("TEMP", name, temp, f.name, d)
    shutil.copy("data/labels.txt", "copy.txt")
    shutil.copy2("perm.txt", "ckpt/perm2.txt")
    shutil.copyfile("ckpt/keep.pt", "ckpt/keep2.pt")
    shutil.copytree("old_run", "old_run_copy")
    assert sorted(os.listdir("old_run_copy")) == ["a.txt", "sub"]
    assert open("old_run_copy/sub/b.txt").read() == "b"
    np.save("arr.npy", np.arange(4))
    assert np.load("arr.npy").tolist() == [0, 1, 2, 3]
    m = np.memmap("data/train.bin", dtype=np.uint8)  # mode r+
    m[0] = 255
    m.flush()
    assert m[0] == 255
    w = np.memmap("mm.bin", dtype=np.uint8, mode="w+", shape=(8,))
    w[:] = 7
    w.flush()
    del w
    assert np.fromfile("mm.bin", dtype=np.uint8).tolist() == [7] * 8
    np.arange(3, dtype=np.uint8).tofile("tofile.bin")
    assert os.path.getsize("tofile.bin") == 3
    np.savetxt("data/saved.txt", np.arange(3))
    assert np.loadtxt("data/saved.txt").tolist() == [0.0, 1.0, 2.0]
    import gzip, tarfile, zipfile
    with gzip.open("logs/run.log.gz", "wb") as g:
        g.write(b"zipped")
    assert gzip.open("logs/run.log.gz").read() == b"zipped"
    with tarfile.open("old_run.tar", "w") as t:
        t.add("old_run")
    assert sorted(tarfile.open("old_run.tar").getnames())[-1] == "old_run/sub/b.txt"
    with zipfile.ZipFile("ckpt.zip", "w") as z:
        z.write("ckpt/keep.pt")
    assert zipfile.ZipFile("ckpt.zip").read("ckpt/keep.pt") == b"keep me"
    print("script ok")
'''

REMOVERS = '''
    import glob, os, pathlib, shutil

    os.remove("ckpt/old.pt")
    assert not os.path.exists("ckpt/old.pt") and sorted(os.listdir("ckpt")) == ["keep.pt"]
    try:
        open("ckpt/old.pt")
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("a removed file opened")
    os.rename("logs/run.log", "logs/run.log.1")
    assert open("logs/run.log.1").read() == "line1\\n" and not os.path.exists("logs/run.log")
    assert os.path.islink("link_to_log") and not os.path.exists("link_to_log")  # dangling
    shutil.rmtree("old_run")
    assert not os.path.exists("old_run")
    assert not any("old_run" in folder for folder, _, _ in os.walk("."))
    os.rmdir("empty_dir")
    os.makedirs("a/b/c")
    os.removedirs("a/b/c")
    assert not os.path.exists("a")
    os.replace("perm.txt", "ckpt/keep.pt")
    assert open("ckpt/keep.pt").read() == "permissions"
    shutil.move("data", "moved_data")
    assert sorted(os.listdir("moved_data")) == ["labels.txt", "train.bin"]
    assert not os.path.exists("data")
    pathlib.Path("moved_data/labels.txt").rename("labels2.txt")
    pathlib.Path("labels2.txt").unlink()
    os.renames("moved_data/train.bin", "deep/er/train.bin")
    assert not os.path.exists("moved_data")  # os.renames removes the emptied folder
    assert glob.glob("**/*.bin", recursive=True) == ["deep/er/train.bin"]
    assert open("deep/er/train.bin", "rb").read(3) == bytes([0, 1, 2])
    assert sorted(os.listdir(".")) == ["ckpt", "deep", "link_to_log", "logs"]
    print("script ok")
'''

CHANGERS = '''
    import os, pathlib, stat

    os.chmod("perm.txt", 0)
    assert stat.S_IMODE(os.stat("perm.txt").st_mode) == 0
    os.chmod("ckpt", 0o700)
    assert stat.S_IMODE(os.stat("ckpt").st_mode) == 0o700
    assert sorted(os.listdir("ckpt")) == ["keep.pt", "old.pt"]
    os.utime("ckpt/keep.pt", (1, 1))
    assert os.stat("ckpt/keep.pt").st_mtime == 1
    uid = 4242 if os.getuid() == 0 else os.getuid()
    os.chown("logs/run.log", uid, -1)
    assert os.stat("logs/run.log").st_uid == uid
    os.truncate("data/labels.txt", 3)
    assert open("data/labels.txt").read() == "cat"
    os.symlink("ckpt/keep.pt", "latest.pt")
    assert os.readlink("latest.pt") == "ckpt/keep.pt" and open("latest.pt").read() == "keep me"
    os.link("logs/run.log", "hard.log")
    assert os.stat("hard.log").st_nlink == 2
    with open("hard.log", "a") as f:
        f.write("via the link")
    assert open("logs/run.log").read() == "line1\\nvia the link"
    pathlib.Path("p_link").symlink_to("perm.txt")
    pathlib.Path("p_hard").hardlink_to("ckpt/old.pt")
    os.mkfifo("fifo")
    assert stat.S_ISFIFO(os.stat("fifo").st_mode)
    pathlib.Path("ckpt/old.pt").chmod(0o600)
    assert stat.S_IMODE(os.lstat("p_hard").st_mode) == 0o600
    print("script ok")
'''

TORCH = '''
    import os, torch

    os.makedirs("runs/r1")
    torch.save({"step": 3, "name": "r1"}, "runs/r1/meta.pt")  # no tensors: really saved
    assert torch.load("runs/r1/meta.pt") == {"step": 3, "name": "r1"}
    assert os.path.getsize("runs/r1/meta.pt") > 0
    torch.save({"x": 1}, "ckpt/old.pt")  # over a real file
    assert torch.load("ckpt/old.pt") == {"x": 1}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Linear(4, 4).to(device)
    torch.save(model.state_dict(), "ckpt/model.pt")
    assert torch.load("ckpt/model.pt")["weight"].shape == (4, 4)
    if device == "cpu":  # real tensors: their bytes are written and read back
        from safetensors.torch import load_file, save_file

        assert torch.equal(torch.load("ckpt/model.pt", mmap=True)["weight"], model.weight)
        save_file({"w": torch.ones(2)}, "ckpt/w.safetensors")
        assert load_file("ckpt/w.safetensors")["w"].tolist() == [1.0, 1.0]
        scripted = torch.jit.script(torch.nn.ReLU())
        torch.jit.save(scripted, "ckpt/relu.pt")
        assert torch.jit.load("ckpt/relu.pt")(torch.tensor([-1.0])).item() == 0.0
    print("script ok")
'''


@pytest.mark.parametrize("source, options", [
    (WRITERS, ("--gpu", "T4")),
    (REMOVERS, ("--gpu", "T4")),
    (CHANGERS, ("--gpu", "T4")),
    (TORCH, ("--gpu", "T4")),
    (TORCH, ("--backend", "cpu")),
], ids=["writers", "removers", "changers", "torch-sim", "torch-cpu"])
def test_the_script_sees_its_changes_and_the_disk_keeps_none(tree, source, options, capsys,
                                                             clean_state):
    if "safetensors" in source and "cpu" in options:
        pytest.importorskip("safetensors")
    before = snapshot(tree)
    rc = run_script(tree, source, *options)
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "script ok" in out.out
    assert snapshot(tree) == before
    assert "(nothing on disk was changed)" in out.out
    for line in out.out.splitlines():
        if line.startswith("TEMP "):  # tempfile's files and folders stayed off the disk too
            assert not any(os.path.lexists(p) for p in line.split()[1:])


def test_the_note_says_what_the_script_changed(tree, capsys, clean_state):
    run_script(tree, REMOVERS, "--gpu", "T4")
    note = next(line for line in capsys.readouterr().out.splitlines()
                if "nothing on disk was changed" in line)
    assert "deleted ckpt/old.pt, old_run, empty_dir, data" in note
    assert "renamed logs/run.log to logs/run.log.1" in note
    assert "data/train.bin to deep/er/train.bin" in note  # where it was on the disk


def test_a_script_pickles_its_own_functions_for_a_forked_pool(tree, capsys, clean_state):
    """The script's functions are found in its ``__main__`` by pickle; the workers write
    to the scratch disk too, and the script reads what they wrote."""
    before = snapshot(tree)
    rc = run_script(tree, '''
        import multiprocessing as mp

        def square(x):
            with open(f"logs/square{x}.txt", "w") as f:
                f.write(str(x * x))
            return x * x

        if __name__ == "__main__":
            with mp.get_context("fork").Pool(2) as pool:
                print("squares", pool.map(square, range(4)))
            print("read back", open("logs/square3.txt").read())
    ''', "--gpu", "T4")
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "squares [0, 1, 4, 9]" in out.out and "read back 9" in out.out
    assert snapshot(tree) == before


@pytest.mark.parametrize("call, says", [
    ("fd = os.open('perm.txt', os.O_RDONLY)\nos.fchmod(fd, 0)", "os.fchmod() on descriptor"),
    ("fd = os.open('ckpt', os.O_RDONLY)\nos.unlink('old.pt', dir_fd=fd)", "dir_fd="),
    ("import torch.multiprocessing as tmp\ntmp.spawn(print, nprocs=1)", "'spawn'"),
], ids=["fchmod", "dir_fd", "mp.spawn"])
def test_what_cannot_be_kept_off_the_disk_is_refused_in_one_line(tree, call, says, capsys,
                                                                clean_state):
    before = snapshot(tree)
    rc = run_script(tree, f"import os\nprint('started')\n{call}\nprint('after')\n",
                    "--gpu", "T4")
    out = capsys.readouterr()
    assert rc == 2
    assert len(out.err.strip().splitlines()) == 1 and says in out.err
    assert out.err.startswith("memmagic: ") and "script.py line 4: " in out.err
    assert "after" not in out.out
    assert snapshot(tree) == before


def test_a_program_the_script_starts_is_not_started(tree, capsys, clean_state):
    before = snapshot(tree)
    rc = run_script(tree, '''
        import os, subprocess
        try:
            subprocess.run(["rm", "-rf", "ckpt"])
        except FileNotFoundError:
            print("no rm here")
        assert os.system("touch made_by_shell") == 127 << 8
    ''', "--gpu", "T4")
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "no rm here" in out.out and "refused to do: started the program 'rm -rf ckpt'" in out.out
    assert snapshot(tree) == before
