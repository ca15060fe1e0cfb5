"""The measurement core: what every backend and front end stands on, standing on nothing of
theirs.

- ``tracking``: who allocated what, by category and module, from torch's dispatch;
- ``objgraph``: the object-graph walk that finds what holds a tensor;
- ``failures``: what an error means (out of memory, unsupported op) and the frames it keeps;
- ``patching``: the undo log every temporary change to global state goes through;
- ``interrupts``: where a Ctrl-C may land;
- ``snapshot``: memory_viz snapshots;
- ``_torch_private``: the only door to torch's private APIs.
"""
