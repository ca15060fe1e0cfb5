"""``python -m memmagic run train.py ...``: see :mod:`memmagic.cli`."""

from .cli import main

raise SystemExit(main())
