"""Streamlit dashboard over run directories (testbed.rundir): run table, sim-vs-real comparison, plots, launcher.

`data` reads and downsamples run files (no Streamlit), `plots` draws matplotlib figures, `launch` starts
simulations and the Streamlit server, `app` is the Streamlit script that ties them together.
"""
