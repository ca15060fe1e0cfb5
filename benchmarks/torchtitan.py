"""Figure 3t: torchtitan's own trainer on simulated H100s, beside the memory torchtitan
publishes for the same setup.

The published figures (``benchmarks/llama3_h100_202412_torchtitan.md`` in pytorch/torchtitan,
December 2024): Llama 3.1 8B, FSDP, local batch 2 x 8192 tokens, selective activation
checkpointing, no torch.compile, H100s with 96 GB; the memory column is torchtitan's memory
monitor, ``torch.cuda.max_memory_reserved()`` read at step 90. Each row here runs
``python -m memmagic run --world-size N -m torchtitan.train`` with the trainer's own
``llama3_8b.toml`` in a fresh process and compares the reserved peak.

The trainer comes from a checkout of torchtitan given with ``--torchtitan DIR`` (pure
Python, put first on the path: nothing is installed; v0.2.0 is the release that runs past
its first step on this torch: 0.3.0 calls ``torch.distributed.set_timeout``, which torch
2.13 lacks, after step 1, on a GPU as here). Its data: a ``c4_test``-shaped file of JSON
lines written here (the packed 8192-token samples do not depend on the words), its Hugging
Face cache built before the run (pyarrow writes it from C++, outside the run's scratch disk).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import Figure

__all__ = ["torchtitan_figure", "PUBLISHED"]

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
STEPS = 3  # step 1 makes AdamW's state; steps 2 and 3 run with it, as step 90 does
# (label, GPUs, published GiB): torchtitan's Table 1 and Table 3, the rows without compile
PUBLISHED = [("Table 1: FSDP, 8 GPUs", 8, 82.4), ("Table 3: FSDP, 128 GPUs", 128, 67.0)]
_SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


def _workdir(repo: Path, work: Path) -> dict[str, str]:
    """The run's data and environment: the tokenizer from the checkout, a c4_test file of
    JSON lines, and its datasets cache built once."""
    tok = work / "tokenizer"
    tok.mkdir()
    for f in (repo / "tests" / "assets" / "tokenizer").iterdir():
        (tok / f.name).write_bytes(f.read_bytes())
    data = work / "c4_test"
    data.mkdir()
    rng = random.Random(0)
    words = ("the of and to in a is that for it as was with be by on not he this are or "
             "his from at which but have an they you were").split()
    with open(data / "data.json", "w", encoding="utf-8") as f:
        for _ in range(2000):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(400))}) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), str(ROOT)]),
               HF_DATASETS_CACHE=str(work / "hf"), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", "import datasets, sys; "
                    "datasets.load_dataset(sys.argv[1], split='train')", str(data)],
                   env=env, check=True, capture_output=True, timeout=600)
    return env


def _row(label: str, gpus: int, published: float, repo: Path, work: Path,
         env: dict[str, str]) -> dict[str, Any]:
    out = work / f"rank0-of-{gpus}.json"
    config = repo / "torchtitan" / "models" / "llama3" / "train_configs" / "llama3_8b.toml"
    cmd = [sys.executable, "-m", "memmagic", "run", "--gpu", "H100", "--gpu-memory", "96GiB",
           "--world-size", str(gpus), "--steps", str(STEPS), "--json", str(out),
           "-m", "torchtitan.train", "--job.config_file", str(config),
           "--profiling.no-enable_profiling", "--training.local_batch_size", "2",
           "--model.hf_assets_path", str(work / "tokenizer"), "--training.dataset", "c4_test",
           "--training.dataset_path", str(work / "c4_test"), "--job.dump_folder",
           str(work / "outputs")]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    row: dict[str, Any] = {"case": label, "published_gib": f"{published:.1f}", "wall_s": wall}
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**row, "status": "n/a", "sim_reserved_gib": f"failed: {tail[0][:160]}"}
    report = json.loads(out.read_text(encoding="utf-8"))
    reserved = report["reserved_peak"] / GIB
    stopped = any(f"stopped after {STEPS} optimizer step" in n for n in report.get("notes", ()))
    return {**row, "sim_peak_gib": f"{report['peak'] / GIB:.2f}",
            "sim_reserved_gib": f"{reserved:.2f}", "error": (reserved - published) / published,
            "steps": f"{STEPS}" if stopped else "fewer (the trainer ended first)",
            "status": "n/a"}


def torchtitan_figure(repo: Path | None) -> Figure:
    """Figure 3t: one row per published setup; without a checkout, one row saying so."""
    fig = Figure(
        "t_torchtitan", "3t. torchtitan's trainer on simulated H100s beside its published memory",
        f"python -m memmagic run --gpu H100 --gpu-memory 96GiB --world-size N --steps {STEPS} "
        "-m torchtitan.train --job.config_file llama3_8b.toml (torchtitan's own: Llama 3.1 8B, "
        "seq 8192, selective AC, FSDP over every GPU) --training.local_batch_size 2, rank 0, "
        "in a fresh process each; the published figure is torchtitan's memory monitor "
        f"(max reserved) on real H100s ({_SOURCE}, Tables 1 and 3, FSDP without compile)",
        "none: the error is reported, not judged (the published runs used December 2024's "
        "torch and torchtitan)",
        [("case", "setup", "text"), ("published_gib", "published GiB", "text"),
         ("sim_reserved_gib", "simulated reserved GiB", "text"), ("error", "error", "pct"),
         ("sim_peak_gib", "simulated allocated GiB", "text"), ("steps", "steps run", "text"),
         ("wall_s", "wall", "s"), ("status", "target", "text")],
        metric=("error", "pct"),
        notes=["Both sides are PyTorch's allocator (max reserved): NCCL's own buffers are "
               "outside it on a GPU too. The published runs used December 2024's torch and "
               "torchtitan, these torch 2.13 and the checkout named below: the error is the "
               "whole difference, what those versions changed included."],
    )
    if repo is None or not (repo / "torchtitan" / "train.py").is_file():
        fig.rows.append({"case": "not run", "status": "n/a", "sim_reserved_gib":
                         "give --torchtitan DIR: a checkout of pytorch/torchtitan (v0.2.0)"})
        return fig
    fig.notes.append(f"torchtitan from {repo} ({_describe(repo)})")
    with tempfile.TemporaryDirectory(prefix="memmagic-torchtitan-") as tmp:
        work = Path(tmp)
        env = _workdir(repo, work)
        for label, gpus, published in PUBLISHED:
            fig.rows.append(_row(label, gpus, published, repo, work, env))
    return fig


def _describe(repo: Path) -> str:
    """The checkout's version: ``git describe`` where it is a clone, else its version file."""
    try:
        done = subprocess.run(["git", "describe", "--tags", "--always"], cwd=repo,
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except OSError:
        pass
    version = repo / "assets" / "version.txt"
    return version.read_text(encoding="utf-8").strip() if version.is_file() else "version unknown"
