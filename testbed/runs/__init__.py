"""Run records, whichever mode made them: the run directory schema (rundir.py, with arrow_columns.py building its
columns), the envelope every run shares (finish.py: checks before, summary and manifest after), the comparison
of runs (compare.py: `testbed compare` and the dashboard's table), the summary block (report.py), and the run
figures (series.py reads and downsamples run files, plots.py draws them) for `compare --png`, the dashboard and
the notebooks. It imports only the engine's records and metrics: both modes, the dashboard and the CLI build
on it."""
