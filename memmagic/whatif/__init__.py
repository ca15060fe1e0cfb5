"""What-if: a cell re-run under other settings.

- ``engine``: the cell held as an object that re-runs under a backend with a setting;
- ``knobs``: the knob table (each knob one entry) and :class:`Setting`;
- ``apply``: how memmagic applies a knob to a cell that does not read its variable;
- ``sweeps``: a knob across values, and the largest batch or context that fits;
- ``fitmap``: the (batch, context) pairs that fit a card, read off four or six runs;
- ``sharding``: FSDP2 and tensor parallelism on a fake process group.
"""

from .engine import Cell
from .knobs import KNOBS, Setting
from .fitmap import fit_map
from .sweeps import find_batch_size, find_seq_len, sweep

__all__ = ["Cell", "Setting", "KNOBS", "sweep", "find_batch_size", "find_seq_len", "fit_map"]
