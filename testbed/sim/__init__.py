"""Sim mode: trace loaders, cost models and the SimPy processes that drive the engine core."""
