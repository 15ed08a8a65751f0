"""Streamlit dashboard over run directories (testbed.runs.rundir): run table, sim-vs-real comparison, plots, launcher.

`data` finds runs and builds the runs table, `launch` starts simulations and the Streamlit server, `app` is the
Streamlit script that ties them together. The figures are testbed.runs' (series and plots: run series and matplotlib plots) and
the comparison table is testbed.runs.compare's, which `testbed compare` prints.
"""
