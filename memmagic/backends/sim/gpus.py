"""Target GPUs for the simulated device: a table of common cards, or a bare size."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Callable, Mapping

from ...report import format_bytes, parse_bytes

__all__ = ["CardSpec", "GPUS", "resolve_target", "DEFAULT_CAPABILITY", "MIN_GPU_MEMORY",
           "MAX_GPU_MEMORY", "api_spelling", "option_spelling", "CudaContext", "cuda_context"]

_GiB = 1 << 30
_MiB = 1 << 20

# The smallest card size accepted: a bare number below it is almost always a size
# without its unit (``--gpu-memory 6`` meant 6 GiB, not 6 bytes).
MIN_GPU_MEMORY = 64 * _MiB
# The largest card size accepted: 4 TiB, well above any GPU sold or announced (under
# 300 GB today): a size above it is a slip (16TB for 16GB). No size at all is no target
# card, on which nothing runs out.
MAX_GPU_MEMORY = 4 << 40

# When no card is named, kernels are chosen as on an Ampere-class card (sm_80).
DEFAULT_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class CardSpec:
    """A card: ``total_memory`` in bytes is what ``torch.cuda.get_device_properties``
    reports (a little below the nominal size: the driver keeps some); ``capability`` is
    the compute capability, which decides e.g. whether flash attention can run."""

    name: str
    total_memory: int
    capability: tuple[int, int] = DEFAULT_CAPABILITY
    multi_processor_count: int = 0
    # the card of the table whose size ``gpu_memory`` replaced (``name`` then says both)
    resized_from: "CardSpec | None" = None

    @property
    def major(self) -> int:
        return self.capability[0]

    @property
    def minor(self) -> int:
        return self.capability[1]


# Sizes are the usual torch-reported totals (MiB); laptop parts vary by vendor, so those
# are the nominal size less the ~5% the driver typically keeps.
GPUS: dict[str, CardSpec] = {g.name.lower(): g for g in [
    CardSpec("laptop-4GB", 3_910 * _MiB, (8, 6), 16),
    CardSpec("laptop-6GB", 5_930 * _MiB, (8, 6), 30),
    CardSpec("laptop-8GB", 7_940 * _MiB, (8, 9), 24),
    CardSpec("GTX1080Ti", 11_172 * _MiB, (6, 1), 28),
    CardSpec("RTX2080Ti", 10_997 * _MiB, (7, 5), 68),
    CardSpec("RTX3060", 12_044 * _MiB, (8, 6), 28),
    CardSpec("RTX3090", 24_260 * _MiB, (8, 6), 82),
    CardSpec("RTX4060", 7_940 * _MiB, (8, 9), 24),
    CardSpec("RTX4090", 24_564 * _MiB, (8, 9), 128),
    CardSpec("T4", 15_095 * _MiB, (7, 5), 40),
    CardSpec("V100-16GB", 16_160 * _MiB, (7, 0), 80),
    CardSpec("V100-32GB", 32_501 * _MiB, (7, 0), 80),
    CardSpec("P100", 16_280 * _MiB, (6, 0), 56),
    CardSpec("L4", 22_478 * _MiB, (8, 9), 58),
    CardSpec("A10G", 22_516 * _MiB, (8, 6), 80),
    CardSpec("A100-40GB", 40_536 * _MiB, (8, 0), 108),
    CardSpec("A100-80GB", 81_051 * _MiB, (8, 0), 108),
    # torch reports 81,079 MiB (measured, H100 80GB HBM3, driver 580): nvidia-smi shows
    # 81,559, of which the driver keeps 480
    CardSpec("H100-80GB", 81_079 * _MiB, (9, 0), 132),
    # measured: torch reports 150,109,880,320 B on an H200 (driver 580; nvidia-smi: 143,771 MiB)
    CardSpec("H200", 150_109_880_320, (9, 0), 132),
]}
_ALIASES = {
    "a100": "a100-40gb", "h100": "h100-80gb", "h200-141gb": "h200", "v100": "v100-16gb", "tesla-t4": "t4",
    "rtx-3060": "rtx3060", "rtx-4090": "rtx4090", "3060": "rtx3060", "4090": "rtx4090",
    "laptop": "laptop-8gb", "laptop-4gb": "laptop-4gb", "laptop-6gb": "laptop-6gb",
}


def _key(name: str) -> str:
    return str(name).strip().lower().replace(" ", "-").replace("_", "-")


def api_spelling(name: str, value: object) -> str:
    """How an error names an argument of :func:`resolve_target`: ``gpu_memory='6GiB'``."""
    return f"{name}={value!r}"


def option_spelling(name: str, value: object) -> str:
    """The same argument as a magic's option: ``--gpu-memory 6GiB``."""
    return f"--{name.replace('_', '-')} {value}"


def resolve_target(gpu: str | CardSpec | None = None,
                   gpu_memory: int | str | None = None, *,
                   spell: Callable[[str, object], str] = api_spelling) -> CardSpec | None:
    """The card to simulate: ``gpu`` names one of :data:`GPUS` (case-insensitive),
    ``gpu_memory`` is its size (``int`` bytes or ``'10GiB'``, from :data:`MIN_GPU_MEMORY`
    to :data:`MAX_GPU_MEMORY`); both None means no target (nothing can run out).

    Both given: the named card (its kernels, e.g. flash attention or not) with that much
    memory, named so (``'T4 with 6.00 GiB'``, ``resized_from`` the T4). ``spell(name,
    value)`` writes an argument as the user typed it in error messages."""
    spec: CardSpec | None = None
    if isinstance(gpu, CardSpec):
        spec = gpu
    elif gpu is not None:
        k = _key(gpu)
        k = _ALIASES.get(k, k)
        spec = GPUS.get(k) or GPUS.get(k.replace("-", ""))
        if spec is None:
            raise ValueError(
                f"unknown GPU {gpu!r}; choose one of {', '.join(g.name for g in GPUS.values())}, "
                f"or give the card's size with {spell('gpu_memory', '<size>')} instead")
    if gpu_memory is not None:
        size = _size(gpu_memory, spell)
        if spec is None:
            return CardSpec(f"GPU with {format_bytes(size)}", size)
        card = spec.resized_from or spec
        if size == card.total_memory:
            return card
        return CardSpec(f"{card.name} with {format_bytes(size)}", size, card.capability,
                       card.multi_processor_count, resized_from=card)
    return spec


def _size(gpu_memory: int | str, spell: Callable[[str, object], str]) -> int:
    example = spell("gpu_memory", "6GiB")
    try:
        size = operator.index(gpu_memory)  # int bytes (numpy ints too)
    except TypeError:
        try:
            size = parse_bytes(gpu_memory)
        except ValueError:
            size = None
        if size is None:
            raise ValueError(f"cannot read {spell('gpu_memory', gpu_memory)} as a card's size: "
                             f"write a positive size with a unit, like {example}")
    if size < MIN_GPU_MEMORY:
        raise ValueError(f"{spell('gpu_memory', gpu_memory)} is {format_bytes(size)}, below the "
                         f"smallest card simulated ({format_bytes(MIN_GPU_MEMORY)}): give the "
                         f"size with a unit, like {example}")
    if size > MAX_GPU_MEMORY:
        raise ValueError(f"{spell('gpu_memory', gpu_memory)} is {format_bytes(size)}, above the "
                         f"largest card simulated ({format_bytes(MAX_GPU_MEMORY)}): give the "
                         f"card's size, like {example}")
    return int(size)


@dataclass(frozen=True)
class CudaContext:
    """What the CUDA context takes on a card, outside PyTorch's caching allocator (the
    driver's structures and the kernels loaded): ``nvidia-smi`` shows it, ``memory_reserved``
    never does, and the allocator can only reserve what it leaves. ``basis`` says where the
    figure comes from."""

    nbytes: int
    basis: str


# Published figures, for the cards the GPU check has not measured (below).
_LAZY = CudaContext(400_000_000, (
    "about 400 MB after the first CUDA op with CUDA's lazy module loading (CUDA 11.7 and "
    "later, PyTorch's default): pytorch/pytorch#109888; 256 MiB was measured on an RTX 3090 "
    "with torch 2.7.1+cu128 (invoke-ai/InvokeAI#9413); kernels libraries load later "
    "(cuBLAS, cuDNN) add to it"))
_EAGER = CudaContext(1_000_000_000, (
    "over 1000 MB with every kernel loaded when CUDA starts (CUDA_MODULE_LOADING=EAGER, as "
    "before CUDA 11.7): pytorch/pytorch#107667"))
# Measured by the GPU check (python -m benchmarks.gpu_check --real, results/gpu-check-*.json):
# total - free - reserved from torch.cuda.mem_get_info in a fresh process after its first
# cuBLAS, cuBLASLt, cuDNN convolution and SDPA calls (552 MB right after the first CUDA call)
_MEASURED = {
    "h100-80gb": (
        CudaContext(736_952_320, (
            "measured on an H100 80GB HBM3 (torch 2.11+cu130, driver 580, lazy module loading): "
            "737 MB after the first matmul, convolution and attention, 552 MB at the first CUDA "
            "call; 787-829 MB after training transformers models, as more kernels load")),
        CudaContext(2_100_101_120, (
            "measured on an H100 80GB HBM3 (torch 2.11+cu130, driver 580) with "
            "CUDA_MODULE_LOADING=EAGER: 2100 MB after the first matmul, convolution and "
            "attention"))),
    "h200": (
        CudaContext(736_952_320, (
            "measured on an H200 (torch 2.11+cu130, driver 580, lazy module loading): 737 MB "
            "after the first matmul, convolution and attention, 552 MB at the first CUDA call")),
        CudaContext(2_098_003_968, (
            "measured on an H200 (torch 2.11+cu130, driver 580) with CUDA_MODULE_LOADING=EAGER: "
            "2098 MB after the first matmul, convolution and attention"))),
}


def cuda_context(target: CardSpec | None, env: Mapping[str, str] | None = None) -> CudaContext | None:
    """The CUDA context on ``target``, read from the environment as CUDA does when it starts
    (``CUDA_MODULE_LOADING``). None for no target and for a bare size (``gpu_memory``): that
    is the memory PyTorch may reserve, a budget the context is not taken from."""
    if target is None or target.resized_from is not None or target.name.lower() not in GPUS:
        return None
    env = os.environ if env is None else env
    lazy, eager = _MEASURED.get(target.name.lower(), (_LAZY, _EAGER))
    return eager if env.get("CUDA_MODULE_LOADING", "").strip().upper() == "EAGER" else lazy
