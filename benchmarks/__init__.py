"""Benchmarks of memmagic against its peers (issue 4): overhead, simulation speed,
accuracy, peer estimates and what-if latency on the shared model zoo.

    python -m benchmarks            # full CPU run, a few minutes; writes results/cpu-*.json
    python -m benchmarks --quick    # two small cases, few repetitions (CI)
    python -m benchmarks --gpu      # on a CUDA machine: results/gpu-<device>.json
    python -m benchmarks.readme     # the tables of docs/benchmarks.md from the latest results/*.json
"""
