"""Streamlit dashboard over run directories (testbed.rundir): run table, sim-vs-real comparison, plots, launcher.

`data` finds runs and builds the runs table, `series` reads and downsamples run files (no Streamlit), `plots`
draws matplotlib figures, `launch` starts simulations and the Streamlit server, `app` is the Streamlit script
that ties them together. The comparison table is testbed.compare's, which `testbed compare` prints.
"""
