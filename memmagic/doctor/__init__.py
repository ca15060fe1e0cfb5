"""The memory doctor: who holds memory after a cell, what a failed cell keeps, what an
out of memory was made of, and which fix saves how much. One room a job:

* ``holders``: :func:`snapshot` / :func:`retained`, the tensors a cell left alive, largest
  first, with the names that hold them in the namespace (``history[3]``, ``model.cache``,
  ``stats['loss']``, a closure's variable, IPython's ``Out[12]`` and ``_``), the bytes of
  autograd graphs they pin, and the classic leaks named with their fix;
* ``tracebacks``: :func:`traceback_holdings` / :func:`free_traceback`, what a failed cell's
  traceback keeps alive (IPython keeps it for ``%debug``) and the one call that frees it;
  :func:`release_failed_cell` frees it after an out of memory and says how much;
* ``oom``: :func:`describe_oom`, what was requested, what was live by category, by holder
  and by module, and which op, phase and line asked;
* ``ranking``: :func:`rank`, the fixes ranked by the peak a re-run with each knob gives,
  and FSDP2 / tensor-parallel rows; the re-runs go through the what-if engine the caller
  hands in (the pipeline's, :func:`memmagic.pipeline.ranking_engine`): the doctor builds
  no run of its own;
* ``advice``: :func:`advise`, all of it as one :class:`Advice`, and how it reads.

Sizes are ``int`` bytes of tensor storage (the simulation's 512-byte rounding is not
applied here: a fake tensor counts its storage's bytes). Knows nothing of IPython: the
notebook's names (``Out``, ``_``) are read from the namespace handed in.
"""

from .advice import Advice, advise, after_cell, before_cell, on_card
from .holders import Holder, NamespaceSnapshot, Retained, freed_by_del, namespace_view, retained, snapshot
from .oom import OOMDescription, describe_oom
from .ranking import BATCH_HINT, Strategy, rank
from .tracebacks import FREE_CALL, TracebackHold, free_traceback, release_failed_cell, traceback_holdings

__all__ = ["Holder", "Retained", "NamespaceSnapshot", "TracebackHold", "OOMDescription",
           "Strategy", "Advice", "snapshot", "retained", "freed_by_del", "traceback_holdings",
           "free_traceback", "release_failed_cell", "describe_oom", "rank", "advise",
           "namespace_view", "FREE_CALL", "BATCH_HINT", "after_cell", "before_cell", "on_card"]
