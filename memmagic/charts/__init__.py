"""Charts of a report: ``plots`` draws with matplotlib (the report's breakdown, per-module
rows, the timeline, sweeps); ``svg`` draws the what-if panel's small charts as SVG, with no
matplotlib in the loop."""
