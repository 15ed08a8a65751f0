"""Figures of run directories, for every reader of runs: `series` reads and downsamples run files, `plots` draws
matplotlib figures from them. `testbed compare --png`, the dashboard and the notebooks use them; this package
imports none of those, so their imports point one way."""
