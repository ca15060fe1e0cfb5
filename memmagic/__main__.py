"""``python -m memmagic run train.py ...``: see :mod:`memmagic.frontends.cli`."""

from .frontends.cli import main

raise SystemExit(main())
