"""`testbed profile`: the sweep of synthetic steps through the real executor (sweep.py), step measurement
(step_measure.py), the engine's host costs (host_costs.py), synthetic steps (synthetic_steps.py) and the profile
file (profile_file.py: the one module that names, finds, reads and writes profiles; shipped ones in profiles/).
The simulator reads profiles through profile_file (ProfiledCostModel, sim/profiled.py) and rescales them
(sim/rescale.py: `testbed calibrate`; sim/quick_rescale.py: `testbed profile --quick`); nothing here imports
the simulator."""
