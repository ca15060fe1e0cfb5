"""The simulated CUDA device (``--backend sim``): GPU memory numbers without a GPU.

A cell written for a GPU runs unchanged on fake tensors (metadata, no data). One module
per concern:

* :mod:`.state`: the simulated machine's devices (one GPU, ``cuda:0``) and what a run shares;
* :mod:`.rewrite`: the CUDA device rewritten onto fake CPU tensors for Python code;
* :mod:`.tracker`: the dispatch-level tracker: which storages are on the simulated GPU,
  fed to the allocator model, op by op; :mod:`.mismatch`: ops that mix devices;
* :mod:`.values` and :mod:`.constants`: placeholders for values a simulation does not
  have, and the small real values it carries;
* :mod:`.allocator` and :mod:`.workspaces`: the model of the caching allocator, and the
  cuBLAS workspaces it holds;
* :mod:`.kernels`, :mod:`.autocast` and :mod:`.op_cache`: CUDA's kernels and autocast
  policy where the CPU's use memory differently, and ops answered from metadata;
* :mod:`.cuda_api`: the ``torch.cuda`` a simulated cell sees; :mod:`.compat`: third-party
  libraries and files; :mod:`.decode`: transformers' ``generate()`` decode steps read off
  a line through three that ran;
* :mod:`.sandbox` and :mod:`.session`: the notebook's objects swapped for fake copies
  during a run, and the simulated GPU that lasts the whole notebook;
* :mod:`.backend`: the run itself.
"""

from __future__ import annotations

from .backend import KERNELS, OP_CACHES, SIM_NOTES, SimBackend, clear_op_cache
from .errors import (
    SimulatedDeviceMismatchError,
    SimulatedOutOfMemoryError,
    SimulatedSizeError,
    SimulatedValueError,
    SimulationBudgetExceeded,
    SimulationError,
    SimulationUnsupported,
    StageWaits,
    waits_for_a_stage,
)
from .allocator import round_request
from .gpus import GPUS, CardSpec, cuda_context, option_spelling, resolve_target
from .ranks import check_gpus_per_node, rank_of
from .session import SimSession, session_of, shell_session
from .values import SimulatedValue
from .workspaces import reduction_scratch

# the one door: code outside this package imports these names from here, never its modules
# (tests/test_architecture.py checks it)
__all__ = [
    "SimBackend", "KERNELS", "OP_CACHES", "SIM_NOTES", "clear_op_cache", "GPUS", "CardSpec", "resolve_target",
    "option_spelling", "round_request", "rank_of", "check_gpus_per_node", "SimSession",
    "session_of",
    "shell_session", "cuda_context", "reduction_scratch",
    "SimulationError", "SimulationUnsupported", "SimulationBudgetExceeded",
    "SimulatedOutOfMemoryError", "SimulatedValueError", "SimulatedDeviceMismatchError",
    "SimulatedSizeError", "SimulatedValue", "StageWaits", "waits_for_a_stage",
]
