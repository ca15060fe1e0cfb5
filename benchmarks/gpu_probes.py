"""What issue 35 measures on a real GPU beside the checks of :mod:`benchmarks.gpu_check`.

* :func:`conv_probe`: what cuDNN allocates per convolution (forward, backward data,
  backward filter, the two together as autograd asks), for the convolutions of the
  course CNN, ResNet-18 / ResNet-50 and a ViT patch embedding, in fp32 / fp16 / bf16, with
  ``torch.backends.cudnn.benchmark`` off and on, read from the allocator's history.
* :func:`bench_cells`: the CNN and ResNet checks again with ``cudnn.benchmark`` on.
* :func:`whatif_probe`: cells of the paths added since the first GPU check (the what-if
  knobs, LoRA, 4-bit weights, ``generate()`` with the dynamic and static caches) run for
  real through :class:`memmagic.whatif.engine.Cell` on the CUDA backend; the same cells
  run simulated elsewhere (:func:`whatif_sim`).
* :func:`history_cost`: what the allocator's history costs a GPT-2-small training step with
  and without stacks, beside the CUDA backend with and without its breakdown.

Each returns plain data for the results file; none needs IPython.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["conv_shapes", "conv_probe", "bench_cells", "WhatIfCase", "WHATIF", "whatif_probe", "whatif_sim",
           "history_cost", "step_history", "events_of"]

DTYPES = ("fp32", "fp16", "bf16")


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def events_of(fn: Callable[[], Any]) -> list[list[Any]]:
    """The allocator's [action, size] events while ``fn`` runs: blocks (alloc,
    free_completed) and segments (segment_alloc, segment_free)."""
    import torch

    from memmagic.core import _torch_private as priv

    keep = ("alloc", "free_completed", "segment_alloc", "segment_free")
    torch.cuda.synchronize()
    priv.record_memory_history("all", device=0, max_entries=1 << 18, clear_history=True,
                               context=None)
    try:
        fn()
        torch.cuda.synchronize()
        events = priv.memory_snapshot(0)["device_traces"][0]
    finally:
        priv.record_memory_history(None, device=0)
    return [[e["action"], int(e["size"])] for e in events if e["action"] in keep]


# -- convolutions ---------------------------------------------------------------------------
def _models() -> list[tuple[str, Callable[[], Any], tuple[int, ...]]]:
    """(name, build, input shape) of the networks whose convolutions are probed."""
    from memmagic import zoo

    def cnn():
        return zoo.build("cnn", "meta", size="bench")[0]

    def resnet(layer_type: str, depths: list[int]):
        from transformers import ResNetConfig, ResNetForImageClassification

        cfg = ResNetConfig(num_labels=10, layer_type=layer_type, depths=depths,
                           hidden_sizes=[64, 128, 256, 512] if layer_type == "basic"
                           else [256, 512, 1024, 2048])
        return lambda: ResNetForImageClassification(cfg)

    def vit():
        import torch

        return torch.nn.Conv2d(3, 768, 16, 16)  # ViT-B/16's patch embedding

    return [("cnn", cnn, (256, 3, 32, 32)),
            ("resnet50", resnet("bottleneck", [3, 4, 6, 3]), (32, 3, 224, 224)),
            ("resnet18", resnet("basic", [2, 2, 2, 2]), (32, 3, 224, 224)),
            ("vit_patch", vit, (32, 3, 224, 224))]


def conv_shapes() -> list[dict[str, Any]]:
    """Every distinct convolution of the probed networks, read off a forward on the meta
    device: input shape, weight shape, stride, padding, dilation, groups, and the networks
    it occurs in."""
    import torch

    seen: dict[tuple, dict[str, Any]] = {}
    for name, build, shape in _models():
        with torch.device("meta"):
            model = build()
        model.train()

        def hook(mod, args, name=name):
            x = args[0]
            key = (tuple(x.shape), tuple(mod.weight.shape), tuple(mod.stride), tuple(mod.padding),
                   tuple(mod.dilation), mod.groups)
            row = seen.setdefault(key, {"input": list(key[0]), "weight": list(key[1]),
                                        "stride": list(key[2]), "padding": list(key[3]),
                                        "dilation": list(key[4]), "groups": key[5], "nets": []})
            if name not in row["nets"]:
                row["nets"].append(name)
        hooks = [m.register_forward_pre_hook(hook) for m in model.modules()
                 if isinstance(m, torch.nn.Conv2d)]
        try:
            with torch.no_grad():
                x = torch.empty(shape, device="meta")
                model(x) if name != "cnn" else model.loss(x, torch.zeros(shape[0], dtype=torch.long,
                                                                          device="meta"))
        finally:
            for h in hooks:
                h.remove()
    return list(seen.values())


def _conv_calls(row: dict[str, Any], dtype, batch: int):
    import torch

    aten = torch.ops.aten
    shape = [batch, *row["input"][1:]]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = torch.randn(row["weight"], device="cuda", dtype=dtype)
    geo = (row["stride"], row["padding"], row["dilation"], False, [0, 0], row["groups"])
    fwd = lambda: aten.convolution(x, w, None, *geo)  # noqa: E731
    out = fwd()
    go = torch.randn_like(out)

    def back(mask):
        return lambda: aten.convolution_backward(go, x, w, None, *geo, mask)
    return out, {"forward": fwd, "backward_data": back([True, False, False]),
                 "backward_filter": back([False, True, False]),
                 "backward": back([True, True, False])}


def conv_probe(deadline: float, modes: tuple[bool, ...] = (False, True)) -> dict[str, Any]:
    """The allocator's events of each pass of each convolution, twice (the first call of
    a shape is where ``cudnn.benchmark`` searches), at the network's batch and a quarter
    of it (benchmark on: the network's batch only), for each ``cudnn.benchmark`` of
    ``modes``. torch caches a shape's plan whichever mode made it, so a mode's figures are
    its own only where it runs first in the process. Stops at ``deadline``
    (``time.perf_counter()``), saying where."""
    import torch

    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"rows": rows, "cudnn": torch.backends.cudnn.version(),
                           "allow_tf32": torch.backends.cudnn.allow_tf32, "stopped": None,
                           "modes": list(modes)}
    before = torch.backends.cudnn.benchmark
    try:
        for bench in modes:
            torch.backends.cudnn.benchmark = bench
            for shape in conv_shapes():
                n = shape["input"][0]
                for batch in ((n,) if bench else (n, max(1, n // 4))):
                    for dname in DTYPES:
                        if time.perf_counter() > deadline:
                            out["stopped"] = f"deadline at benchmark={bench} {shape['weight']} {dname}"
                            return out
                        rows.append(_one_conv(shape, dname, batch, bench))
    finally:
        torch.backends.cudnn.benchmark = before
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _one_conv(shape: dict[str, Any], dname: str, batch: int, bench: bool) -> dict[str, Any]:
    import torch

    row = {**{k: shape[k] for k in ("weight", "stride", "padding", "dilation", "groups", "nets")},
           "input": [batch, *shape["input"][1:]], "dtype": dname, "benchmark": bench}
    t0 = time.perf_counter()
    try:
        out, calls = _conv_calls(shape, _dtype(dname), batch)
        row["output"] = list(out.shape)
        for name, fn in calls.items():
            row[name] = [events_of(fn), events_of(fn)]  # first call, then again
    except Exception as exc:  # recorded, never invented
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        out = calls = None
        torch.cuda.empty_cache()
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    return row


def bench_cells() -> dict[str, Any]:
    """The CNN and ResNet checks without checkpointing run for real with
    ``cudnn.benchmark`` on."""
    import torch

    from . import gpu_check

    rows: dict[str, Any] = {}
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        for c in gpu_check.CHECKS:
            if c.model in ("cnn", "resnet") and not c.ckpt:
                rows[c.name] = gpu_check.real_run(c, False, {})
    finally:
        torch.backends.cudnn.benchmark = before
    return rows


# -- the paths added since the first check ------------------------------------------------------
_GPT2 = """import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=768, n_head=12)).cuda()
model.train()
opt = torch.optim.AdamW(model.parameters())
"""
_TRAIN_STEP = """batch_size = {batch}
seq_len = {seq}
ids = torch.randint(0, {vocab}, (batch_size, seq_len), device='cuda')
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""
_GPT2_STEP = _TRAIN_STEP.format(batch=8, seq=512, vocab=50257)
_LLAMA = """import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    max_position_embeddings=4096)).cuda()
"""
_LORA = _LLAMA + """model = model.to(torch.bfloat16)
from peft import LoraConfig, get_peft_model
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
"""
_LORA_STEP = _TRAIN_STEP.format(batch=4, seq=1024, vocab=32000)
_GENERATE = _LLAMA + """model = model.to(torch.bfloat16).eval()
ids = torch.randint(0, 32000, (4, 256), device='cuda')
"""
_GEN_STEP = ("with torch.no_grad():\n"
             "    out = model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False, "
             "pad_token_id=0{extra})\n")
_QLORA_SAVE = """import tempfile
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
path = tempfile.mkdtemp()
LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
    tie_word_embeddings=False)).save_pretrained(path)
"""
_QLORA = """import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                         bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, device_map="cuda")
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
"""
_QLORA_STEP = """batch_size = 4
seq_len = 512
ids = torch.randint(0, 32000, (batch_size, seq_len), device='cuda')
with torch.autocast('cuda', dtype=torch.bfloat16):
    loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
"""



@dataclass(frozen=True)
class WhatIfCase:
    """A cell of the what-if probe: ``prepare`` runs plainly (files on the real disk),
    ``setup`` on the GPU (real or simulated), then ``step`` is measured at each setting,
    each from a fresh ``setup`` (a real step changes the model and the optimizer)."""
    setup: str
    step: str
    settings: tuple[dict[str, Any], ...]
    prepare: str = ""


WHATIF: dict[str, WhatIfCase] = {
    "gpt2": WhatIfCase(_GPT2, _GPT2_STEP, ({}, {"amp": "bf16"}, {"amp": "fp16"}, {"checkpointing": True},
                                           {"accum_steps": 4}, {"batch_size": 16}, {"seq_len": 1024},
                                           {"amp": "bf16", "checkpointing": True, "batch_size": 32})),
    "lora": WhatIfCase(_LORA, _LORA_STEP, ({}, {"checkpointing": True}, {"seq_len": 2048})),
    "generate dynamic": WhatIfCase(_GENERATE, _GEN_STEP.format(extra=""), ({}, {"new_tokens": 512})),
    "generate static": WhatIfCase(_GENERATE, _GEN_STEP.format(extra=", cache_implementation='static'"),
                                  ({}, {"new_tokens": 512})),
    "qlora 4-bit": WhatIfCase(_QLORA, _QLORA_STEP, ({}, {"batch_size": 8}), prepare=_QLORA_SAVE),
}


def _prepared(name: str, case: WhatIfCase) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    if case.prepare:
        exec(compile(case.prepare, f"<{name} prepare>", "exec"), ns)
    return ns


def _report_row(report) -> dict[str, Any]:
    return {"peak": report.peak, "before": report.before, "after": report.after,
            "reserved_peak": report.reserved_peak, "reserved_after": report.reserved_after,
            "breakdown": dict(report.breakdown), "error": report.error,
            "notes": [str(n) for n in report.notes][:12]}


def whatif_probe(deadline: float) -> dict[str, Any]:
    """Each :data:`WHATIF` cell for real: its setup run plainly on the GPU, then the
    measured cell at a setting through ``Cell(..., backend="cuda")`` (no breakdown: the
    allocator's own figures) from a fresh allocator; the setup again for each setting."""
    import torch

    from memmagic.whatif.engine import Cell

    from .gpu_check import _fresh_allocator, _let_go

    out: dict[str, Any] = {}
    for name, case in WHATIF.items():
        rows = out[name] = {"settings": list(case.settings), "real": []}
        try:
            prepared = _prepared(name, case)
            for setting in case.settings:
                if time.perf_counter() > deadline:
                    rows["stopped"] = "deadline"
                    break
                ns = dict(prepared)
                try:
                    exec(compile(case.setup, f"<{name} setup>", "exec"), ns)
                    _fresh_allocator()
                    t0 = time.perf_counter()
                    cell = Cell(case.step, ns, backend="cuda", backend_options={"breakdown": False})
                    r = _report_row(cell.run(**setting))
                    r.update(max_allocated=torch.cuda.max_memory_allocated(),
                             max_reserved=torch.cuda.max_memory_reserved(),
                             wall_s=round(time.perf_counter() - t0, 3))
                except Exception as exc:  # recorded, never invented
                    r = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                finally:
                    _let_go(ns)
                rows["real"].append(r)
        except Exception as exc:
            rows["error"] = f"{type(exc).__name__}: {exc}"[:400]
    return out


def whatif_sim(name: str, setting: dict[str, Any], gpu: str) -> dict[str, Any]:
    """The same cell simulated: the setup on a simulated GPU session, then the measured
    cell at ``setting`` from a copy of it (``start_from``), as the notebook's panel runs."""
    from memmagic.backends import get_backend
    from memmagic.backends.sim.session import SimSession
    from memmagic.whatif.engine import Cell

    case = WHATIF[name]
    session, ns = SimSession(), _prepared(name, case)
    got = get_backend("sim", gpu=gpu, session=session).execute(
        lambda n: exec(compile(case.setup, f"<{name} setup>", "exec"), n), ns)
    if got.error is not None:
        return {"error": f"setup: {type(got.error).__name__}: {got.error}"[:400]}
    cell = Cell(case.step, ns, backend="sim", backend_options={"gpu": gpu, "start_from": session})
    return _report_row(cell.run(**setting))


# -- what the allocator's history costs -----------------------------------------------------------
def history_cost(reps: int = 3) -> dict[str, Any]:
    """A warm GPT-2-small training step (the zoo's, fp32 and bf16 autocast) timed plainly
    and under: the allocator's history with no stacks, with Python stacks at allocations,
    the CUDA backend without and with its breakdown. ABBA pairs, median of B/A."""
    import torch

    from memmagic import zoo
    from memmagic.backends import get_backend
    from memmagic.core import _torch_private as priv

    from .common import paired

    rows = []
    model, batch = zoo.build("gpt2_small", "cuda")
    opt = torch.optim.AdamW(model.parameters())
    try:
        for amp in (False, True):
            def step(amp=amp) -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                    loss = model.loss(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()

            def recorded(context, stacks, step=step):
                def run() -> None:
                    priv.record_memory_history("all", device=0, max_entries=1 << 20,
                                               context=context, stacks=stacks, clear_history=True)
                    try:
                        step()
                        priv.memory_snapshot(0)
                    finally:
                        priv.record_memory_history(None, device=0)
                return run

            def backend(bd, step=step):
                be = get_backend("cuda", breakdown=bd)
                return lambda: be.measure(step)
            step()
            row: dict[str, Any] = {"precision": "bf16 autocast" if amp else "fp32"}
            variants = [("history, no stacks", recorded(None, "python"), reps),
                        ("history, python stacks at alloc", recorded("alloc", "python"), reps),
                        ("history, python stacks at alloc and free", recorded("all", "python"), reps),
                        ("cuda backend, no breakdown", backend(False), reps)]
            if not amp:  # a dispatch per op: seconds a step, one pair is enough to size it
                variants.append(("cuda backend, breakdown", backend(True), 1))
            for label, fn, n in variants:
                p = paired(step, fn, n)
                row[label] = {"ratio": p.ratio, **p.to_dict()}
            rows.append(row)
    finally:
        model = opt = batch = None
        gc.collect()
        torch.cuda.empty_cache()
    return {"case": "zoo gpt2_small (124M, batch 8 x 1024), AdamW", "reps": reps, "rows": rows}


def step_history(path) -> dict[str, Any]:
    """One warm GPT-2-small fp32 step recorded with Python stacks at each allocation,
    the storages of the parameters, gradients and optimizer state after its backward and
    after its step, and the CUDA backend's breakdown (a dispatch per op) of the same step:
    the data a breakdown read off the allocator's history is built and checked against.
    Written gzipped to ``path``; returns a summary."""
    import gzip
    import json

    import torch

    from memmagic import zoo
    from memmagic.backends import get_backend
    from memmagic.core import _torch_private as priv

    model, batch = zoo.build("gpt2_small", "cuda")
    opt = torch.optim.AdamW(model.parameters())
    ptrs: dict[str, list[list[int]]] = {}

    def ids(tensors) -> list[list[int]]:
        return [[t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()] for t in tensors]

    def step() -> None:
        loss = model.loss(*batch)
        loss.backward()
        ptrs["grads"] = ids(p.grad for p in model.parameters() if p.grad is not None)
        opt.step()
        ptrs["params"] = ids(model.parameters())
        ptrs["optimizer"] = ids(v for s in opt.state.values() for v in s.values()
                                if isinstance(v, torch.Tensor) and v.is_cuda)
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    try:
        step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        priv.record_memory_history("all", device=0, max_entries=1 << 20, context="alloc",
                                   stacks="python", clear_history=True)
        try:
            step()
            snap = priv.memory_snapshot(0)
        finally:
            priv.record_memory_history(None, device=0)
        stacks: dict[str, int] = {}
        events = []
        for e in snap["device_traces"][0]:
            where = " | ".join(f"{f.get('name')}@{f.get('filename', '').rsplit('/', 1)[-1]}:{f.get('line')}"
                               for f in (e.get("frames") or []))
            events.append([e["action"], int(e["addr"]), int(e["size"]), stacks.setdefault(where, len(stacks))])
        report = get_backend("cuda", breakdown=True).measure(step).report
        data = {"before": before, "events": events, "stacks": list(stacks), "storages": ptrs,
                "breakdown": dict(report.breakdown), "peak": report.peak,
                "peak_op": report.peak_op, "before_report": report.before}
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(data, f)
        return {"events": len(events), "stacks": len(stacks), "breakdown": data["breakdown"],
                "peak": report.peak, "file": str(path)}
    finally:
        model = opt = batch = None
        gc.collect()
        torch.cuda.empty_cache()


_EAGER_STATIC = _GEN_STEP.format(extra=", cache_implementation='static', disable_compile=True")


def main(argv: list[str] | None = None) -> int:
    """The probes that need a fresh process each (``cudnn.benchmark``'s plans are cached
    per process), writing one JSON file each: ``--conv-bench``, ``--bench-cells``,
    ``--step-history``, ``--whatif NAME,...``."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_probes")
    p.add_argument("what", choices=("conv-bench", "bench-cells", "step-history", "whatif"))
    p.add_argument("out")
    p.add_argument("--only", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.what == "conv-bench":
        got = conv_probe(t0 + 150, modes=(True,))
    elif args.what == "bench-cells":
        got = bench_cells()
    elif args.what == "step-history":
        got = step_history(Path(args.out).with_suffix(".json.gz"))
    else:
        if args.only:
            for name in list(WHATIF):
                if name not in args.only.split(","):
                    del WHATIF[name]
        WHATIF["generate static eager"] = WhatIfCase(_GENERATE, _EAGER_STATIC, ({}, {"new_tokens": 512}))
        got = whatif_probe(t0 + 200)
    Path(args.out).write_text(json.dumps({"probe": args.what, "wall_s": round(time.perf_counter() - t0, 1),
                                          "result": got}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
