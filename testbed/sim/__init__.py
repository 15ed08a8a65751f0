"""Sim mode: cost models, the sim executor, the emulator and the SimPy processes that drive the engine core
(the workloads they replay are in testbed/workload/, model and GPU specs in testbed/specs/)."""
