"""Front ends: each parses what the user typed, builds a request, calls the pipeline and
shows the answer.

- ``magics``: ``%%gpumem`` / ``%gpumem``; ``options``: their option parser;
- ``simmode``: ``%gpusim``, the notebook's simulated GPU;
- ``widgets``: the what-if panel;
- ``cli``: ``python -m memmagic run``, with ``scriptrun`` (running a script as Python would)
  and ``scratchdisk`` (the copy-on-write disk a script writes to);
- ``budget`` and ``pytest_plugin``: memory budgets as tests.
"""
