"""The simulated GPU against a real one (issue 21): ``python -m benchmarks.gpu_check``.

Every check is one notebook cell, as source text: build a model (a zoo case, or a
transformers model from a config), AdamW, two training steps in fp32, fp16 (autocast and a
GradScaler) or bf16 (autocast), with activation checkpointing off or on. The cell ends with
an epilogue that reads ``torch.cuda``'s own counters (allocated and reserved, current and
peak, after the steps, then after ``empty_cache()``). The same text runs

* for real on a GPU (``--real``): each check from an empty allocator (``empty_cache``,
  the cuBLAS workspaces cleared, the peak counters reset), with the allocator's event
  history recorded (``--traces`` keeps it, compacted, for the cases where the two differ);
* on the simulated GPU told the same card (``--sim``), on whatever torch runs it: on the
  GPU machine's own torch in worker processes beside the real runs, and on this
  project's torch elsewhere (``--sim --merge FILE`` adds a column to a real run's file).

The CUDA context is read in fresh processes (``--context``): NVML's used memory before
torch starts, then ``mem_get_info`` after the first CUDA call, the first tensor, the first
cuBLAS / cuBLASLt / cuDNN / SDPA call, with lazy and with eager module loading.

``--probe`` adds what SDPA's kernels and cuDNN's RNNs allocate on a grid of shapes (the
figures the simulation's models of them are checked against). ``--diff CHECK`` shows the
blocks live at one cell's allocated peak, real (from the traces) against simulated;
``--docs`` writes the fidelity tables into docs/fidelity.md (``--readme`` is its old name).

Writes ``results/gpu-check-<device>.json``. Needs no IPython.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Check", "CHECKS", "cell_source", "main"]

ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ("fp32", "fp16", "bf16")
READOUT = ("step_alloc", "step_max_alloc", "step_reserved", "step_max_reserved",
           "empty_alloc", "empty_reserved")


@dataclass(frozen=True)
class Check:
    family: str      # "zoo" or "hf"
    model: str       # zoo case name, or gpt2 / bert / llama / vit / resnet
    precision: str   # fp32 / fp16 / bf16
    ckpt: bool

    @property
    def name(self) -> str:
        return f"{self.model} {self.precision}{' ckpt' if self.ckpt else ''}"


ZOO = ("mlp", "cnn", "transformer", "nanogpt", "lstm", "gpt2_small")
HF = ("gpt2", "bert", "llama", "vit", "resnet")

# transformers models built from configs (no download): (build lines, batch lines, loss)
_HF = {
    "gpt2": ("from transformers import GPT2Config, GPT2LMHeadModel\n"
             "model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=768, n_head=12)).cuda()\n",
             "batch = {'input_ids': torch.randint(0, 50257, (8, 512), device='cuda')}\n"
             "batch['labels'] = batch['input_ids']\n"),
    "bert": ("from transformers import BertConfig, BertForSequenceClassification\n"
             "model = BertForSequenceClassification(BertConfig(num_labels=2)).cuda()\n",
             "batch = {'input_ids': torch.randint(0, 30522, (16, 256), device='cuda'),\n"
             "         'labels': torch.randint(0, 2, (16,), device='cuda')}\n"),
    "llama": ("from transformers import LlamaConfig, LlamaForCausalLM\n"
              "model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, "
              "intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, "
              "num_key_value_heads=4, max_position_embeddings=2048)).cuda()\n",
              "batch = {'input_ids': torch.randint(0, 32000, (4, 1024), device='cuda')}\n"
              "batch['labels'] = batch['input_ids']\n"),
    "vit": ("from transformers import ViTConfig, ViTForImageClassification\n"
            "model = ViTForImageClassification(ViTConfig(num_labels=10)).cuda()\n",
            "batch = {'pixel_values': torch.randn(32, 3, 224, 224, device='cuda'),\n"
            "         'labels': torch.randint(0, 10, (32,), device='cuda')}\n"),
    # a ResNet-50 (bottleneck blocks, BatchNorm): where cuDNN picks convolution algorithms
    "resnet": ("from transformers import ResNetConfig, ResNetForImageClassification\n"
               "model = ResNetForImageClassification(ResNetConfig(num_labels=10)).cuda()\n",
               "batch = {'pixel_values': torch.randn(32, 3, 224, 224, device='cuda'),\n"
               "         'labels': torch.randint(0, 10, (32,), device='cuda')}\n"),
}
_NO_CKPT = {"resnet"}  # transformers' ResNet has no gradient checkpointing


def _checks() -> list[Check]:
    out = [Check("zoo", m, p, ck) for m in ZOO for p in PRECISIONS for ck in (False, True)]
    out += [Check("hf", m, p, ck) for m in HF for p in PRECISIONS for ck in (False, True)
            if not (ck and m in _NO_CKPT)]
    return out


CHECKS = _checks()


def selected(only: str | None) -> list[Check]:
    """The checks whose names contain one of the comma-separated ``only`` (all for None)."""
    return [c for c in CHECKS if not only or any(s in c.name for s in only.split(","))]


def cell_source(check: Check, steps: int = 2) -> str:
    """The cell: build, AdamW, ``steps`` training steps, then the readout epilogue."""
    lines = ["import torch"]
    if check.family == "zoo":
        lines += ["from memmagic import zoo",
                  f"model, (x, y) = zoo.build({check.model!r}, device='cuda', "
                  f"checkpointing={check.ckpt!r}, size='bench')",
                  "forward = lambda: model.loss(x, y)"]
    else:
        build, batch = _HF[check.model]
        lines += [build.rstrip("\n")]
        if check.ckpt:
            lines += ["model.gradient_checkpointing_enable()"]
        lines += ["model.train()", batch.rstrip("\n"),
                  "forward = lambda: model(**batch).loss"]
    amp = check.precision != "fp32"
    dtype = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}.get(check.precision, "None")
    lines += ["opt = torch.optim.AdamW(model.parameters())"]
    if check.precision == "fp16":
        lines += ["scaler = torch.amp.GradScaler('cuda')"]
    lines += [f"for _ in range({steps}):"]
    if amp:
        lines += [f"    with torch.autocast('cuda', dtype={dtype}):",
                  "        loss = forward()"]
    else:
        lines += ["    loss = forward()"]
    if check.precision == "fp16":
        lines += ["    scaler.scale(loss).backward()", "    scaler.step(opt)", "    scaler.update()"]
    else:
        lines += ["    loss.backward()", "    opt.step()"]
    lines += ["    opt.zero_grad(set_to_none=True)"]
    # the readout: torch.cuda's own counters, the same calls on the real and simulated GPU
    lines += [
        "torch.cuda.synchronize()",
        "_readout = [torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),",
        "            torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()]",
        "torch.cuda.empty_cache()",
        "_readout += [torch.cuda.memory_allocated(), torch.cuda.memory_reserved()]",
    ]
    return "\n".join(lines) + "\n"


# -- the CUDA context, in a fresh process ------------------------------------------------
_CONTEXT_PROBE = r"""
import json, sys
out = {"stages": []}
try:
    import pynvml
    pynvml.nvmlInit()
    _h = pynvml.nvmlDeviceGetHandleByIndex(0)
    nvml_used = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(_h).used)
except Exception as exc:
    out["nvml"] = repr(exc)
    nvml_used = lambda: None
out["nvml_used_before_torch"] = nvml_used()
import torch
import torch.nn.functional as F

def stage(name):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out["stages"].append({"stage": name, "free": free, "total": total,
                          "allocated": torch.cuda.memory_allocated(),
                          "reserved": torch.cuda.memory_reserved(),
                          "context": total - free - torch.cuda.memory_reserved(),
                          "nvml_used": nvml_used()})

stage("first CUDA call (mem_get_info)")
x = torch.zeros(1, device="cuda"); stage("first tensor")
a = torch.randn(1024, 1024, device="cuda"); a @ a; stage("first matmul (cuBLAS)")
lin = torch.nn.Linear(1024, 1024).cuda(); lin(a); stage("first Linear (cuBLASLt addmm)")
conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
img = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
conv(img).sum().backward(); stage("first conv forward and backward (cuDNN)")
q = torch.randn(4, 8, 512, 64, device="cuda", dtype=torch.float16)
F.scaled_dot_product_attention(q, q, q, is_causal=True); stage("first SDPA (fp16)")
with torch.autocast("cuda", dtype=torch.float16):
    lin(a).sum()
stage("first autocast fp16 Linear")
out["device"] = torch.cuda.get_device_name(0)
out["module_loading"] = __import__("os").environ.get("CUDA_MODULE_LOADING", "(default)")
print(json.dumps(out))
"""


def context_probe(eager: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if eager:
        env["CUDA_MODULE_LOADING"] = "EAGER"
    try:
        proc = subprocess.run([sys.executable, "-c", _CONTEXT_PROBE], env=env, capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as exc:  # recorded, never invented
        return {"error": repr(exc)}


# -- real runs ---------------------------------------------------------------------------
def _compact_trace(snapshot: dict, strings: dict[str, int]) -> dict[str, Any]:
    """The allocator's events as rows [action, addr, size, stream, where] (where: an index
    into the strings table: the innermost Python frame outside torch, and the innermost
    frame), and the segments left at the end."""
    traces = snapshot.get("device_traces") or [[]]
    rows = []
    for e in traces[0]:
        if e.get("action") == "free_requested":  # one stream: free_completed follows it
            continue
        frames = e.get("frames") or []
        inner = next((f for f in frames if "/torch/" not in f.get("filename", "")), None)
        where = ""
        if frames:
            f0 = frames[0]
            where = f"{f0.get('name')}@{Path(f0.get('filename', '')).name}:{f0.get('line')}"
            if inner is not None and inner is not f0:
                where += (f" <- {inner.get('name')}@{Path(inner.get('filename', '')).name}:"
                          f"{inner.get('line')}")
        idx = strings.setdefault(where, len(strings))
        rows.append([e.get("action"), int(e.get("addr", 0)), int(e.get("size", 0)),
                     int(e.get("stream", 0)), idx])
    segments = [[int(s.get("total_size", 0)), int(s.get("allocated_size", 0)),
                 s.get("segment_type", "")] for s in snapshot.get("segments", [])]
    return {"events": rows, "segments": segments}


def _clear_workspaces() -> None:
    import torch

    clear = (getattr(torch.cuda, "_clear_cublas_workspaces", None)
             or getattr(torch._C, "_cuda_clearCublasWorkspaces", None))
    if clear is not None:
        clear()


def _fresh_allocator() -> None:
    """Nothing cached, no workspaces (each check allocates them anew, as on a fresh card),
    the peak counters reset."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _clear_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _let_go(ns: dict[str, Any]) -> None:
    """Drop what a check's cell left and give its cached blocks back."""
    import torch

    ns.clear()
    gc.collect()
    torch.cuda.empty_cache()


def real_run(check: Check, trace: bool, strings: dict[str, int]) -> dict[str, Any]:
    import torch

    from memmagic.core import _torch_private as priv

    row: dict[str, Any] = {}
    ns: dict[str, Any] = {}
    code = compile(cell_source(check), f"<{check.name}>", "exec")
    _fresh_allocator()
    row["start_alloc"], row["start_reserved"] = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    if trace:
        # context "all" (stacks of frees too) made torch 2.11 raise SystemError in
        # non-reentrant checkpointing with dropout; "alloc" does not
        priv.record_memory_history("all", device=0, max_entries=1 << 20, stacks="python",
                                   context="alloc", clear_history=True)
    t0 = time.perf_counter()
    try:
        exec(code, ns)
        row.update(zip(READOUT, ns["_readout"]))
        free, total = torch.cuda.mem_get_info()
        row["context_after"] = total - free - torch.cuda.memory_reserved()
        if trace:
            row["trace"] = _compact_trace(priv.memory_snapshot(0), strings)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row["traceback"] = traceback.format_exc()[-2000:]
    finally:
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        if trace:
            priv.record_memory_history(None, device=0)
        _let_go(ns)
    return row


def cuda_backend_run(check: Check) -> dict[str, Any]:
    """The same cell through memmagic's CUDA backend (with the breakdown): its report's
    peak against the raw counters of the same run."""
    from memmagic.backends import get_backend

    code = compile(cell_source(check), f"<{check.name}>", "exec")
    _fresh_allocator()
    ns: dict[str, Any] = {}
    try:
        out = get_backend("cuda").execute(lambda n: exec(code, n), ns)
        r = out.report
        return {"error": None if out.error is None else repr(out.error)[:400],
                "report_peak": r.peak, "report_before": r.before, "report_after": r.after,
                "report_reserved_peak": r.reserved_peak, "breakdown": dict(r.breakdown),
                "readout": dict(zip(READOUT, ns.get("_readout", []))), "wall_s": r.wall_s}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        _let_go(ns)


# -- kernels' own allocations, for modelling them ---------------------------------------------
def _allocs(fn) -> list[list[Any]]:
    """The allocator's (action, size) events while ``fn`` runs (alloc and free only)."""
    from .gpu_probes import events_of

    return [e for e in events_of(fn) if e[0] in ("alloc", "free_completed")]


def kernel_probe() -> dict[str, Any]:
    """What SDPA's kernels and cuDNN's RNNs allocate, forward and backward, on a grid of
    shapes: the figures a model of their workspaces and reserves is fitted to."""
    import torch
    import torch.nn.functional as F

    out: dict[str, Any] = {"sdpa": [], "rnn": []}
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for dname, dtype in dtypes.items():
        for B, H, L, D in [(16, 12, 256, 64), (32, 12, 197, 64), (8, 12, 1024, 64), (4, 16, 1024, 64),
                           (2, 8, 512, 128), (1, 4, 100, 32), (64, 4, 256, 64)]:
            for dropout in (0.0, 0.1):
                for masked in (False, True):
                    row = {"dtype": dname, "B": B, "H": H, "L": L, "D": D, "dropout": dropout,
                           "mask": masked}
                    try:
                        q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype).transpose(1, 2)
                                   .requires_grad_() for _ in range(3))
                        mask = (torch.ones(L, L, device="cuda", dtype=torch.bool).tril() if masked else None)
                        row["choice"] = int(torch._fused_sdp_choice(q, k, v, mask, dropout, not masked))
                        box: dict[str, Any] = {}
                        row["forward"] = _allocs(lambda: box.setdefault(
                            "o", F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                                is_causal=not masked)))
                        o = box["o"]
                        row["out_stride"] = list(o.stride())
                        g = torch.randn_like(o)
                        row["backward"] = _allocs(lambda: o.backward(g))
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    out["sdpa"].append(row)
                    q = k = v = o = g = box = None
    for mode in ("LSTM", "GRU", "RNN"):
        for dname in ("fp32", "fp16"):
            for layers in (1, 2):
                for bidir in (False, True):
                    for B, T, I, Hs in [(128, 64, 512, 512), (32, 100, 256, 128), (16, 50, 300, 1024)]:
                        row = {"mode": mode, "dtype": dname, "layers": layers, "bidirectional": bidir,
                               "B": B, "T": T, "I": I, "H": Hs}
                        try:
                            m = getattr(torch.nn, mode)(I, Hs, num_layers=layers, bidirectional=bidir,
                                                        batch_first=True).cuda().to(dtypes[dname])
                            x = torch.randn(B, T, I, device="cuda", dtype=dtypes[dname], requires_grad=True)
                            box = {}
                            row["forward"] = _allocs(lambda: box.setdefault("y", m(x)[0]))
                            y = box["y"]
                            row["backward"] = _allocs(lambda: y.sum().backward())
                        except Exception as exc:
                            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                        out["rnn"].append(row)
                        m = x = y = box = None
    return out


# -- simulated runs ----------------------------------------------------------------------
def card_for(capability: tuple[int, int], total: int) -> dict[str, Any]:
    """The simulated card that stands for a real one: the table's card of the same compute
    capability and size (within 1%), else the first of that capability resized to it."""
    from memmagic.backends.sim.gpus import GPUS

    same = [g for g in GPUS.values() if tuple(g.capability) == tuple(capability)]
    for g in same:
        if abs(g.total_memory - total) <= 0.01 * total:
            return {"gpu": g.name}
    return {"gpu": same[0].name, "gpu_memory": int(total)} if same else {"gpu_memory": int(total)}


def sim_run(check: Check, options: dict[str, Any]) -> dict[str, Any]:
    from memmagic.backends import get_backend

    code = compile(cell_source(check), f"<{check.name}>", "exec")

    def run(ns: dict) -> list[int]:
        exec(code, ns)
        return list(ns["_readout"])

    t0 = time.perf_counter()
    try:
        out = get_backend("sim", **options).execute(run, {})
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:400], "wall_s": round(time.perf_counter() - t0, 2)}
    r = out.report
    row = {"error": None if out.error is None else f"{type(out.error).__name__}: {out.error}"[:400],
           "wall_s": round(time.perf_counter() - t0, 2),
           "report_peak": r.peak, "report_before": r.before, "report_after": r.after,
           "report_reserved_peak": r.reserved_peak, "report_reserved_after": r.reserved_after,
           "context": r.context, "breakdown": dict(r.breakdown), "notes": list(r.notes)}
    if out.error is None and out.value is not None:
        row.update(zip(READOUT, out.value))
    return row


# -- the run -----------------------------------------------------------------------------
def _versions() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                            "python": platform.python_version()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:
        info["transformers"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip()
    except Exception as exc:
        info["nvidia_smi"] = repr(exc)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, total_memory=p.total_memory, capability=[p.major, p.minor],
                    multiprocessors=p.multi_processor_count)
    return info


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _sim_worker_cmd(out: Path, part: int, parts: int, options: dict[str, Any],
                    only: str | None) -> list[str]:
    return [sys.executable, "-m", "benchmarks.gpu_check", "--sim", "--part", f"{part}/{parts}",
            "--sim-options", json.dumps(options), "--sim-out", str(out),
            *(["--only", only] if only else [])]


def run_real(args: argparse.Namespace) -> int:
    import torch

    from .common import code_version, slug

    if not torch.cuda.is_available():
        print("gpu_check --real: no usable CUDA GPU here; nothing written")
        return 0
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = _versions()
    path = out_dir / f"gpu-check-{slug(info['device'])}.json"
    data: dict[str, Any] = {"kind": "gpu-check", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "command": " ".join(sys.argv), "code": code_version(), "versions": info,
                            "checks": {c.name: asdict(c) | {"source": cell_source(c)} for c in CHECKS},
                            "context": {}, "real": {}, "cuda_backend": {}, "sim": {}}
    print(f"gpu_check on {info.get('nvidia_smi')}, torch {info['torch']}", flush=True)
    data["context"]["lazy"] = context_probe(eager=False)
    data["context"]["eager"] = context_probe(eager=True)
    _write(path, data)
    _issue35(args, data, path, started, "first")
    print("context:", json.dumps({k: [s.get("context") for s in v.get("stages", [])]
                                  for k, v in data["context"].items()}), flush=True)
    # the simulation on this machine's torch, in worker processes beside the real runs
    options = card_for(tuple(info["capability"]), info["total_memory"])
    workers = []
    if args.sim_workers:
        env = dict(os.environ, OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")
        for k in range(args.sim_workers):
            part = Path(tempfile.gettempdir()) / f"gpu-check-sim-part{k}.json"  # not among the results
            log = open(out_dir / "sim.log", "a")  # the workers' lines, interleaved
            workers.append((part, subprocess.Popen(_sim_worker_cmd(part, k, args.sim_workers, options, args.only),
                                                   cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
    strings: dict[str, int] = {}
    traces: dict[str, Any] = {}
    checks = selected(args.only)
    for c in checks:
        row = real_run(c, args.traces, strings)
        if "trace" in row:
            traces[c.name] = row.pop("trace")
        data["real"][c.name] = row
        print(f"real {c.name:28s} " + (row.get("error") or
              f"peak {row['step_max_alloc']:>13,} reserved {row['step_max_reserved']:>13,} "
              f"({row['wall_s']} s)"), flush=True)
        _write(path, data)
    for family in ("zoo", "hf"):  # two files: each comes back under the device tool's 16 MiB
        mine = {k: v for k, v in traces.items() if data["checks"][k]["family"] == family}
        if mine:
            with gzip.open(out_dir / f"gpu-check-traces-{family}.json.gz", "wt", encoding="utf-8") as f:
                json.dump({"strings": list(strings), "traces": mine}, f)
    for c in checks if args.backend_cells else ():
        if c.ckpt or c.precision == "bf16":
            continue
        data["cuda_backend"][c.name] = cuda_backend_run(c)
    _write(path, data)
    if args.probe:
        _phase(data, path, "kernels", kernel_probe)
    _issue35(args, data, path, started, "last")
    for part, proc in workers:
        try:
            proc.wait(timeout=max(10.0, args.sim_wait - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
        if part.exists():
            got = json.loads(part.read_text())
            data["sim"].setdefault(got["torch"], {"options": got["options"], "rows": {}})
            data["sim"][got["torch"]]["rows"].update(got["rows"])
            part.unlink()
    data["elapsed_s"] = round(time.perf_counter() - started, 1)
    _write(path, data)
    print(f"wrote {path} in {data['elapsed_s']} s", flush=True)
    return 0


def _phase(data: dict[str, Any], path: Path, key: str, fn) -> None:
    """One probe of issue 35 into ``data[key]``, its failure recorded, the file rewritten."""
    t0 = time.perf_counter()
    try:
        data[key] = fn()
    except Exception as exc:  # recorded, never invented
        data[key] = {"error": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc()[-2000:]}
    if isinstance(data[key], dict):
        data[key]["probe_s"] = round(time.perf_counter() - t0, 1)
    print(f"{key}: {time.perf_counter() - t0:.1f} s", flush=True)
    _write(path, data)


def _issue35(args: argparse.Namespace, data: dict[str, Any], path: Path, started: float,
             when: str) -> None:
    """Issue 35's probes (benchmarks.gpu_probes): the convolutions before the checks, the
    rest after them; each stops at its share of ``--budget`` seconds from the start."""
    from . import gpu_probes as gp

    until = lambda share: started + share * args.budget  # noqa: E731
    if when == "first" and args.conv:
        _phase(data, path, "conv", lambda: gp.conv_probe(until(0.30)))
        return
    if when == "first":
        return
    if args.conv:
        _phase(data, path, "bench_cells", gp.bench_cells)
    if args.whatif:
        _phase(data, path, "whatif", lambda: gp.whatif_probe(until(0.80)))
    if args.history:
        _phase(data, path, "step_history", lambda: gp.step_history(path.parent / "gpu-step-history.json.gz"))
        _phase(data, path, "history_cost", gp.history_cost)


def run_sim(args: argparse.Namespace) -> int:
    """The simulated column: the checks (``--part k/n`` of them) on the simulated GPU, to
    ``--sim-out``, or merged into the real run's file with ``--merge``."""
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    merged = json.loads(Path(args.merge).read_text()) if args.merge else None
    if args.sim_options:
        options = json.loads(args.sim_options)
    elif merged is not None:  # the card the real run was taken on
        v = merged["versions"]
        options = card_for(tuple(v["capability"]), v["total_memory"])
    else:
        options = {"gpu": "H100-80GB"}
    checks = selected(args.only)
    if args.part:
        k, n = (int(v) for v in args.part.split("/"))
        checks = checks[k::n]
    from .common import code_version

    res = {"torch": torch.__version__, "options": options, "code": code_version(), "rows": {}}
    for c in checks:
        res["rows"][c.name] = row = sim_run(c, options)
        print(f"sim {c.name:28s} " + (row.get("error") or f"peak {row.get('step_max_alloc', 0):>13,} "
              f"reserved {row.get('step_max_reserved', 0):>13,} ({row['wall_s']} s)"), flush=True)
        if args.sim_out:
            _write(Path(args.sim_out), res)
    if merged is not None:
        merged["sim"][res["torch"]] = res
        if args.whatif:
            whatif_sim_column(merged)
        _write(Path(args.merge), merged)
    return 0


def whatif_sim_column(data: dict[str, Any]) -> None:
    """The what-if probe's cells simulated here on the card the real run was taken on
    (``data["whatif"][name]["sim"]``, one row per setting), for ``--sim --merge``."""
    import torch

    from . import gpu_probes

    v = data["versions"]
    gpu = card_for(tuple(v["capability"]), v["total_memory"]).get("gpu", "H100-80GB")
    for name, rows in data.get("whatif", {}).items():
        if not isinstance(rows, dict) or name not in gpu_probes.WHATIF:
            continue
        sim = []
        for setting in rows["settings"]:
            t0 = time.perf_counter()
            try:
                row = gpu_probes.whatif_sim(name, setting, gpu)
            except Exception as exc:  # recorded, never invented
                row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            sim.append(row)
            print(f"sim {name} {setting}: " + (row.get("error") or f"peak {row['peak']:,} reserved "
                                               f"{row['reserved_peak']:,}"), flush=True)
        rows["sim"] = {"torch": torch.__version__, "gpu": gpu, "rows": sim}


# -- where the two differ ------------------------------------------------------------------
def live_at_peak(events: list[tuple[str, int, int, str]]) -> tuple[int, list[tuple[int, str]]]:
    """The allocated peak of (action, addr, size, where) events, and the blocks live then."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    at_peak: list[tuple[int, str]] = []
    for action, addr, size, where in events:
        if action == "alloc":
            live[addr] = (size, where)
            cur += size
            if cur > peak:
                peak, at_peak = cur, list(live.values())
        elif action == "free_completed" and addr in live:
            cur -= live.pop(addr)[0]
    return peak, at_peak


def real_events(traces_dir: Path, name: str) -> list[tuple[str, int, int, str]]:
    for path in sorted(traces_dir.glob("gpu-check-traces-*.json.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            got = json.load(f)
        if name in got["traces"]:
            strings = got["strings"]
            return [(a, addr, size, strings[w]) for a, addr, size, _s, w in got["traces"][name]["events"]]
    raise SystemExit(f"no trace of {name!r} under {traces_dir}")


def sim_events(check: Check, options: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    from memmagic.backends import get_backend
    from memmagic.core.snapshot import snapshot_dict

    code = compile(cell_source(check), f"<{check.name}>", "exec")
    out = get_backend("sim", **options).execute(lambda ns: exec(code, ns), {})
    history = snapshot_dict(out.report)["device_traces"][0]
    return [(e["action"], e["addr"], e["size"],
             " <- ".join(f["name"] for f in e.get("frames", [])[:2])) for e in history]


def diff(name: str, traces_dir: Path, options: dict[str, Any]) -> str:
    """What was live at the allocated peak of the real run and of the simulated one, by
    block size: the sizes one side held and the other did not, with where each was made."""
    from collections import defaultdict

    check = next((c for c in CHECKS if c.name == name), None)
    if check is None:
        raise SystemExit(f"no check named {name!r}")
    rp, rlive = live_at_peak(real_events(traces_dir, name))
    sp, slive = live_at_peak(sim_events(check, options))
    by: dict[int, list[list[str]]] = defaultdict(lambda: [[], []])
    for side, live in ((0, rlive), (1, slive)):
        for size, where in live:
            by[size][side].append(where)
    lines = [f"{name}: allocated peak real {rp:,} sim {sp:,} ({sp / rp - 1:+.2%})",
             f"{'size':>14} {'real':>5} {'sim':>5}  {'bytes sim - real':>16}  where (real | sim)"]
    rows = sorted(by.items(), key=lambda kv: -abs(kv[0] * (len(kv[1][1]) - len(kv[1][0]))))
    for size, (r, s_) in rows:
        if len(r) != len(s_):
            lines.append(f"{size:>14,} {len(r):>5} {len(s_):>5}  {size * (len(s_) - len(r)):>+16,}  "
                         f"{(r or [''])[0][:70]} | {(s_ or [''])[0][:70]}")
    return "\n".join(lines)


# -- the fidelity page's tables (docs/fidelity.md) --------------------------------------------
ALLOCATED_TARGET, RESERVED_TARGET = 0.02, 0.05
FIDELITY_PAGE = ROOT / "docs" / "fidelity.md"
FIDELITY_START, FIDELITY_END = "<!-- fidelity:start -->", "<!-- fidelity:end -->"


def _err(sim: Any, real: Any) -> float | None:
    return sim / real - 1 if isinstance(sim, int) and isinstance(real, int) and real else None


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def fidelity_markdown(data: dict[str, Any], sim_key: str | None = None,
                      before_key: str | None = None) -> str:
    """The fidelity tables of a ``gpu-check`` results file: per check, the real peaks and
    the simulation's error (``sim_key``: the torch whose simulation to show, by default
    the newest entry without "before"; ``before_key``: an earlier simulation to show
    beside it), the CUDA context, and the CUDA backend against the raw counters."""
    from memmagic.report import format_bytes

    sims = data.get("sim", {})
    if sim_key is None:
        sim_key = next((k for k in reversed(list(sims)) if "before" not in k), None)
    if before_key is None:
        before_key = next((k for k in sims if "before" in k), None)
    v = data["versions"]
    out = [f"Measured on {v.get('nvidia_smi')} with torch {v['torch']} (CUDA {v['cuda']}, cuDNN "
           f"{v['cudnn']}), {data['date'][:10]}; simulated on torch "
           f"{sims[sim_key]['torch'] if sim_key else 'n/a'} told the same card "
           f"({(sims[sim_key]['options'] if sim_key else {}).get('gpu', 'n/a')}). Each check is one cell: "
           "build, AdamW, two training steps; peaks are `max_memory_allocated` / "
           "`max_memory_reserved` read at the end of the cell on a fresh allocator; \"after the step\" "
           "is `memory_allocated()` then, and the last column `memory_reserved()` after "
           "`torch.cuda.empty_cache()`. "
           f"Targets: allocated within {ALLOCATED_TARGET:.0%}, reserved within {RESERVED_TARGET:.0%}. "
           f"`{data['command']}` writes it (`results/gpu-check-*.json`).", ""]
    head = "| check | real allocated | sim err"
    if before_key:
        head += " | before"
    head += " | real reserved | sim err"
    if before_key:
        head += " | before"
    head += " | after the step | reserved after empty_cache | within |"
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    n_ok = n = 0
    for name, real in data["real"].items():
        if "step_max_alloc" not in real:
            out.append(f"| {name} | {real.get('error', 'n/a')} |")
            continue
        row = sims[sim_key]["rows"].get(name, {}) if sim_key else {}
        old = sims[before_key]["rows"].get(name, {}) if before_key else {}
        ea, er = _err(row.get("step_max_alloc"), real["step_max_alloc"]), _err(
            row.get("step_max_reserved"), real["step_max_reserved"])
        ok = ea is not None and er is not None and abs(ea) <= ALLOCATED_TARGET and abs(er) <= RESERVED_TARGET
        n += 1
        n_ok += ok
        cells = [name, format_bytes(real["step_max_alloc"]), _pct(ea)]
        if before_key:
            cells.append(_pct(_err(old.get("step_max_alloc"), real["step_max_alloc"])))
        cells += [format_bytes(real["step_max_reserved"]), _pct(er)]
        if before_key:
            cells.append(_pct(_err(old.get("step_max_reserved"), real["step_max_reserved"])))
        cells += [_pct(_err(row.get("step_alloc"), real.get("step_alloc"))),
                  _pct(_err(row.get("empty_reserved"), real.get("empty_reserved")))]
        cells.append("yes" if ok else "**no**")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"{n_ok} of {n} checks within both targets."]
    same = [k for k in sims if k != sim_key]
    for k in same:
        rows = sims[k]["rows"]
        ref = sims[before_key]["rows"] if before_key and k != before_key else None
        if ref is not None:
            eq = sum(1 for c, r in rows.items() if ref.get(c, {}).get("step_max_alloc") == r.get("step_max_alloc")
                     and ref.get(c, {}).get("step_max_reserved") == r.get("step_max_reserved"))
            out.append(f"The simulation on torch {sims[k]['torch']} (the GPU machine's, the code "
                       f"before) gave the same bytes as on {sims[before_key]['torch']} for {eq} of "
                       f"{len(rows)} checks.")
    ctx = data.get("context", {})
    if ctx:
        out += ["", "The CUDA context (`mem_get_info`'s total - free - reserved, a fresh process each):", "",
                "| after | " + " | ".join(f"{k} loading" for k in ctx) + " |",
                "|---|" + "---|" * len(ctx)]
        stages = [s["stage"] for s in next(iter(ctx.values())).get("stages", [])]
        for i, stage in enumerate(stages):
            out.append(f"| {stage} | " + " | ".join(
                format_bytes(c["stages"][i]["context"]) if i < len(c.get("stages", [])) else "n/a"
                for c in ctx.values()) + " |")
    cb = data.get("cuda_backend", {})
    if cb:
        exact = sum(1 for c, r in cb.items() if r.get("report_peak") == r.get("readout", {}).get("step_max_alloc")
                    and r.get("report_reserved_peak") == r.get("readout", {}).get("step_max_reserved"))
        out += ["", f"`--backend cuda` on the same cells: its peak and reserved peak equal the "
                f"allocator's own counters in {exact} of {len(cb)} cells."]
    out += _whatif_markdown(data) + _history_markdown(data)
    ov = data.get("overhead")
    if ov:
        out += ["", f"Overhead of `--backend cuda` on a warm training step ({ov['method']}):", "",
                "| case | plain step | no breakdown | breakdown |", "|---|---|---|---|"]
        for r in ov["rows"]:
            out.append(f"| {r['case']} {r['precision']} | {r['plain_s'] * 1000:.1f} ms | "
                       f"{r['ratio_nobd']:.2f}x | {r['ratio_bd']:.1f}x |")
    return "\n".join(out) + "\n"


# -- cuDNN's workspaces: the simulation's table (memmagic/backends/sim/cudnn_tables.py) ------------
TABLES = ROOT / "memmagic" / "backends" / "sim" / "cudnn_tables.py"


def _conv_workspace(events: list[list[Any]]) -> int:
    """A pass's workspace: what it allocated after its output (the first allocation)."""
    return sum(size for action, size in events if action == "alloc") - next(
        (size for action, size in events if action == "alloc"), 0)


def _row_geometry(r: dict[str, Any]) -> tuple[int, ...]:
    """A probed convolution's key in the tables: (C_in, H, W, C_out, kh, kw, sh, sw, ph, pw,
    dh, dw), as memmagic.backends.sim.cudnn reads a convolution's arguments."""
    _n, c, h, w = r["input"]
    k, _c, kh, kw = r["weight"]
    return (c, h, w, k, kh, kw, *r["stride"], *r["padding"], *r["dilation"])


def conv_table(data: dict[str, Any]) -> dict[tuple, tuple[tuple[int, int], ...]]:
    """(pass, dtype, C_in, H, W, C_out, kh, kw, sh, sw, ph, pw, dh, dw) -> ((batch, bytes), ...)
    from a results file's convolution probe (``cudnn.benchmark`` off; the second call of
    each pass, when the plan is cached)."""
    table: dict[tuple, dict[int, int]] = {}
    for r in data.get("conv", {}).get("rows", []):
        if r.get("error") or r["benchmark"] or r["groups"] != 1:
            continue
        n, geo = r["input"][0], _row_geometry(r)
        for p in ("forward", "backward_data", "backward_filter"):
            table.setdefault((p, r["dtype"], *geo), {})[n] = _conv_workspace(r[p][1])
    return {key: tuple(sorted(v.items())) for key, v in sorted(table.items())}


def bench_table(data: dict[str, Any]) -> dict[tuple, tuple[int, tuple[int, ...], int]]:
    """(pass, dtype, C_in, ..., dw) -> (batch, what its first call allocated beside the
    output, the workspace of the calls after it) with ``cudnn.benchmark`` on, from the probe
    run first in a fresh process (``conv_bench``): the first call of a shape times cuDNN's
    engines, each with its own workspace; the later ones run the fastest engine."""
    table = {}
    for r in data.get("conv_bench", {}).get("rows", []):
        if r.get("error") or not r["benchmark"] or r["groups"] != 1:
            continue
        n, geo = r["input"][0], _row_geometry(r)
        for p in ("forward", "backward_data", "backward_filter"):
            first = [size for action, size in r[p][0] if action == "alloc"][1:]
            table[(p, r["dtype"], *geo)] = (n, tuple(first), _conv_workspace(r[p][1]))
    return dict(sorted(table.items()))


def rnn_table(data: dict[str, Any]) -> dict[tuple, int]:
    """(mode, dtype, layers, bidirectional, T, B, I, H) -> bytes of cuDNN's workspace: the
    first buffer the forward frees (it takes the same again for backward data and weights)."""
    out = {}
    for r in data.get("kernels", {}).get("rnn", []):
        if r.get("error"):
            continue
        ws = next(size for action, size in r["forward"] if action == "free_completed")
        back = [size for action, size in r["backward"] if action == "alloc"]
        if back.count(ws) != 2:
            raise ValueError(f"{r['mode']} {r['dtype']}: the backward does not take the forward's workspace twice")
        out[(r["mode"], r["dtype"], r["layers"], r["bidirectional"], r["T"], r["B"], r["I"], r["H"])] = ws
    return dict(sorted(out.items()))


def tables_source(data: dict[str, Any], name: str) -> str:
    v = data["versions"]
    cudnn = v["cudnn"]
    source = (f"{v['device']}, cuDNN {cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}, torch {v['torch']}, "
              f"cudnn.benchmark off, {data['date'][:10]}")
    lines = [f'"""cuDNN\'s workspaces as a real GPU\'s allocator recorded them: made by `python -m '
             f'benchmarks.gpu_check --tables` from {name}; do not edit (see .cudnn)."""', "",
             f"SOURCE = {source!r}", "",
             "# (pass, dtype, C_in, H, W, C_out, kh, kw, sh, sw, ph, pw, dh, dw) -> ((batch, bytes), ...)",
             "CONV = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in conv_table(data).items()]
    lines += ["}", "", "# cudnn.benchmark on: the same key -> (batch, the first call's buffers, the workspace after)",
              f"BENCHMARK_SOURCE = {source.replace('cudnn.benchmark off', 'cudnn.benchmark on, a fresh process')!r}",
              "BENCHMARK = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in bench_table(data).items()]
    lines += ["}", "", "# (mode, dtype, layers, bidirectional, T, B, I, H) -> bytes", "RNN = {"]
    lines += [f"    {k!r}: {v!r}," for k, v in rnn_table(data).items()]
    return "\n".join(lines + ["}"]) + "\n"


def _setting_label(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in setting.items()) or "as written"


def _whatif_markdown(data: dict[str, Any]) -> list[str]:
    """The what-if probe's cells, real (the CUDA backend's figures) against simulated."""
    from memmagic.report import format_bytes

    rows = {k: v for k, v in data.get("whatif", {}).items() if isinstance(v, dict) and "sim" in v}
    if not rows:
        return []
    out = ["", "What-if settings, LoRA, 4-bit weights and `generate()` (`--whatif`): each cell's setup "
           "run, then the cell measured at a setting through `Cell(..., backend=\"cuda\")` on the GPU "
           "and through the what-if panel's path on the simulated card (a copy of the setup's "
           "simulated GPU):", "",
           "| cell | setting | real allocated | sim err | real reserved | sim err | within |",
           "|---|---|---|---|---|---|---|"]
    n = n_ok = 0
    for name, r in rows.items():
        for setting, real, sim in zip(r["settings"], r["real"], r["sim"]["rows"]):
            if real.get("error") or sim.get("error"):
                out.append(f"| {name} | {_setting_label(setting)} | {real.get('error') or sim.get('error')} |")
                continue
            ea, er = _err(sim["peak"], real["peak"]), _err(sim["reserved_peak"], real["reserved_peak"])
            ok = abs(ea) <= ALLOCATED_TARGET and abs(er) <= RESERVED_TARGET
            n, n_ok = n + 1, n_ok + ok
            out.append(f"| {name} | {_setting_label(setting)} | {format_bytes(real['peak'])} | {_pct(ea)} | "
                       f"{format_bytes(real['reserved_peak'])} | {_pct(er)} | {'yes' if ok else '**no**'} |")
    return out + ["", f"{n_ok} of {n} within both targets."]


def _history_markdown(data: dict[str, Any]) -> list[str]:
    h = data.get("history_cost")
    if not isinstance(h, dict) or "rows" not in h:
        return []
    labels = [k for k in h["rows"][0] if isinstance(h["rows"][0][k], dict)]
    out = ["", f"What the allocator's history and the CUDA backend cost a warm training step "
           f"({h['case']}; median of per-pair ratios, {h['reps']} ABBA pairs):", "",
           "| step | plain | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for r in h["rows"]:
        plain = r[labels[0]]["median_a_s"]
        out.append(f"| {r['precision']} | {plain * 1000:.1f} ms | " + " | ".join(
            f"{r[k]['ratio']:.3f}x" if k in r else "n/a" for k in labels) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", action="store_true", help="the real runs (needs a GPU)")
    p.add_argument("--sim", action="store_true", help="the simulated runs")
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--only", default=None, help="comma-separated substrings of check names")
    p.add_argument("--traces", action="store_true", help="keep the allocator's events of each real run")
    p.add_argument("--probe", action="store_true",
                   help="--real: also what SDPA's kernels and cuDNN's RNNs allocate on a grid of shapes")
    p.add_argument("--conv", action="store_true",
                   help="--real: what cuDNN allocates per convolution, and the CNN / ResNet checks "
                        "with cudnn.benchmark on (issue 35)")
    p.add_argument("--whatif", action="store_true",
                   help="--real: the what-if, LoRA, 4-bit and generate() cells for real (issue 35); "
                        "--sim --merge: the same cells simulated into the real run's file")
    p.add_argument("--history", action="store_true",
                   help="--real: what the allocator's history and the CUDA backend cost a step")
    p.add_argument("--no-backend-cells", dest="backend_cells", action="store_false",
                   help="--real: leave out the checks through memmagic's CUDA backend")
    p.add_argument("--budget", type=float, default=400.0,
                   help="--real: seconds the probes' deadlines are shares of")
    p.add_argument("--sim-workers", type=int, default=0, help="--real: simulate beside it in N processes")
    p.add_argument("--sim-wait", type=float, default=400.0, help="--real: seconds the workers may take in all")
    p.add_argument("--sim-options", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sim-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--merge", default=None, help="--sim: add the simulated column to this real run's file")
    p.add_argument("--diff", default=None, metavar="CHECK",
                   help="blocks live at the allocated peak, real (from --traces-dir) against simulated")
    p.add_argument("--traces-dir", default=str(ROOT / "results"))
    p.add_argument("--docs", "--readme", dest="docs", nargs="?", const=str(FIDELITY_PAGE), default=None,
                   metavar="FILE",
                   help="write the fidelity tables of --merge's file (default: the newest "
                        "results/gpu-check-*.json) into FILE (default: docs/fidelity.md) between its "
                        "fidelity markers; --readme is the old name")
    p.add_argument("--tables", nargs="?", const=str(TABLES), default=None, metavar="FILE",
                   help="write the simulation's cuDNN workspace table from --merge's file "
                        "(default: the newest results/gpu-check-*.json with a convolution probe)")
    args = p.parse_args(argv)
    if args.tables:
        src = Path(args.merge) if args.merge else max(
            p for p in (ROOT / "results").glob("gpu-check-*.json") if '"conv"' in p.read_text())
        Path(args.tables).write_text(tables_source(json.loads(src.read_text()), f"results/{src.name}"))
        return 0
    if args.docs:
        from .readme import update_readme

        src = Path(args.merge) if args.merge else max((ROOT / "results").glob("gpu-check-*.json"))
        tables = fidelity_markdown(json.loads(src.read_text(encoding="utf-8")))
        page = Path(args.docs)
        text = update_readme(page.read_text(encoding="utf-8"), tables, FIDELITY_START, FIDELITY_END)
        if text is None:
            print(tables)
            return 0
        page.write_text(text, encoding="utf-8")
        return 0
    if args.diff:
        print(diff(args.diff, Path(args.traces_dir), json.loads(args.sim_options or '{"gpu": "H100-80GB"}')))
        return 0
    if args.real:
        return run_real(args)
    if args.sim:
        return run_sim(args)
    p.error("say --real (on a GPU) or --sim")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
