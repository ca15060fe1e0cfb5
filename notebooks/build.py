"""Write the tutorial notebooks from the cell lists below, then execute them in place so
their stored outputs are real measurements (nbval checks them in CI).

    python notebooks/build.py            # all notebooks
    python notebooks/build.py 01         # the ones whose name contains 01
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent
M, C = new_markdown_cell, new_code_cell

NOTEBOOKS = {
    "01_first_steps.ipynb": [
        M("# First steps with memmagic\n\n"
          "`%%gpumem` runs a cell and shows what it did to memory: the **peak**, what the cell "
          "left allocated (**retained**), and a breakdown at the peak into parameters, buffers, "
          "gradients, optimizer state, activations (tensors autograd saved for backward) and "
          "other (inputs, outputs, temporaries).\n\n"
          "This notebook runs on any laptop: `--backend cpu` runs the cell for real on the CPU "
          "and tracks every tensor op by op. On a machine with a GPU, drop `--backend cpu` and "
          "the same magic reads the CUDA caching allocator instead."),
        C("%load_ext memmagic\nimport torch\ntorch.manual_seed(0)\n"
          "device = \"cuda\" if torch.cuda.is_available() else \"cpu\""),
        M("## One training step\n\nA 4096x4096 linear layer has 16.8 M parameters: 64 MiB in fp32. "
          "Adam keeps two more tensors of that size per parameter, and backward makes the gradients."),
        C("%%gpumem --backend cpu\n"
          "model = torch.nn.Linear(4096, 4096, device=device)\n"
          "opt = torch.optim.Adam(model.parameters())\n"
          "loss = model(torch.randn(64, 4096, device=device)).sum()\n"
          "loss.backward(); opt.step()"),
        M("The peak came inside `opt.step()`: parameters, gradients, the freshly made Adam state "
          "and the step's temporaries were live together. The report is an object: `-o` returns it, "
          "`-v NAME` stores it, `-q` prints nothing."),
        C("%%gpumem --backend cpu -q -v second_step\nloss = model(torch.randn(64, 4096, device=device)).sum()\n"
          "loss.backward(); opt.step(); opt.zero_grad()"),
        C("print(second_step.summary())"),
        C("{k: f\"{v / 2**20:.2f} MiB\" for k, v in second_step.breakdown.items()}"),
        M("## Evaluation without a graph\n\nUnder `torch.no_grad()` autograd saves nothing for "
          "backward, so activations do not pile up."),
        C("x = torch.randn(256, 4096, device=device)\n"
          "deep = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device=device) for _ in range(4)])"),
        C("%%gpumem --backend cpu -q -v without_grad\nwith torch.no_grad():\n    out = deep(x).relu()"),
        C("%%gpumem --backend cpu -q -v with_grad\ndel out\nout = deep(x).relu()"),
        C("from memmagic import format_bytes\n"
          "print('activations under no_grad:', format_bytes(without_grad.breakdown['activations']))\n"
          "print('activations with grad:   ', format_bytes(with_grad.breakdown['activations']))\n"
          "print('4 layers x 256 x 4096 fp32 inputs + the relu output:', format_bytes(5 * 256 * 4096 * 4))"),
        M("## No GPU? Simulate one\n\n`--backend sim` runs code written for a GPU (`device=\"cuda\"`, "
          "`.cuda()`, `torch.autocast(\"cuda\")`) on *fake* tensors: shapes and dtypes, no data, so it "
          "is fast and needs no memory. It predicts what the CUDA caching allocator would hold, "
          "including **reserved** memory (what `nvidia-smi` shows, minus the CUDA context). "
          "`--gpu NAME` checks the prediction against a card. Nothing real is touched: `model` and "
          "`opt` from the cells above are exactly as they were afterwards."),
        C("%%gpumem --backend sim --gpu T4 --no-chart\n"
          "gpu_model = torch.nn.Linear(4096, 4096, device=\"cuda\")\n"
          "gpu_opt = torch.optim.Adam(gpu_model.parameters())\n"
          "loss = gpu_model(torch.randn(64, 4096, device=\"cuda\")).sum()\n"
          "loss.backward(); gpu_opt.step()"),
        C("print(model.weight.device, model.weight.dtype)  # still the real CPU model from above"),
        M("The simulated GPU lasts the whole notebook, like a real one: what a simulated cell "
          "leaves referenced (`gpu_model`, its gradients, Adam's state, `loss`) stays on it, and the "
          "next simulated cell starts from there (`before`). A real cell cannot use those objects "
          "(they have no data): it gets a one-line message saying so. `%gpusim reset` empties the "
          "simulated GPU; `%gpusim on` would run every following cell on it."),
        C("%%gpumem --backend sim --gpu T4 -q -v t4_next\n"
          "print(format_bytes(torch.cuda.memory_allocated()), gpu_model.weight.device)"),
        C("print('before:', format_bytes(t4_next.before))\n%gpusim reset"),
        M("A GPT-2-small training step (124 M parameters, batch 8, 1024 tokens, mixed precision) "
          "simulates in about half a second (faster once the simulator has seen its ops). On a 6 GB laptop GPU it stops where a real run would, "
          "with the same kind of error, naming the op and the module:"),
        C("%%gpumem --backend sim --gpu laptop-6GB -v gpt2_laptop --no-chart\n"
          "from memmagic import zoo\n"
          "gpt, batch = zoo.build(\"gpt2_small\", device=\"cuda\")\n"
          "gpt_opt = torch.optim.AdamW(gpt.parameters())\n"
          "zoo.train_step(gpt, gpt_opt, batch, amp=True)",
          metadata={"tags": ["raises-exception"]}),
        M("On a T4 (16 GB) the same step fits. The laptop's failed cell left `gpt` on the "
          "simulated GPU (as a real failed cell would), so empty it first:"),
        C("%gpusim reset"),
        C("%%gpumem --backend sim --gpu T4 -q -v gpt2_t4\n"
          "gpt, batch = zoo.build(\"gpt2_small\", device=\"cuda\")\n"
          "gpt_opt = torch.optim.AdamW(gpt.parameters())\n"
          "zoo.train_step(gpt, gpt_opt, batch, amp=True)"),
        C("print(gpt2_t4.summary())"),
        M("## In a script\n\n`memmagic.measure(fn)` and `with memmagic.track():` return the same report."),
        C("import memmagic\nr = memmagic.measure(lambda: deep(x).sum().backward(), backend=\"cpu\")\nr"),
    ],
}


def build(name: str, cells) -> None:
    from run import execute  # noqa: E402  (same folder)

    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path = HERE / name
    nbformat.write(nb, path)
    execute(str(path), write=True)
    print(f"wrote and executed {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    wanted = sys.argv[1:]
    for name, cells in NOTEBOOKS.items():
        if not wanted or any(w in name for w in wanted):
            build(name, cells)
