"""Model shapes (presets.py) and GPU specs (hardware.py): pure data, no torch, shared by the cost models,
`--load-format dummy`, the profiler and the dashboard."""
