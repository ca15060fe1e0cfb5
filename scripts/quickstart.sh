#!/usr/bin/env bash
# Install memmagic into ./.venv (torch==2.13.0 first) and run the first tutorial notebook
# headlessly, printing what each cell shows. No GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c .ci/constraints.txt -e ".[test]"
.venv/bin/python notebooks/run.py notebooks/01_first_steps.ipynb
