"""Sans-I/O engine core: plain, deterministic state machines.

Nothing in this package reads a clock, sleeps, opens a socket, spawns a process or imports
torch / simpy. Time comes in as `now`, work goes out as `SchedulerOutput`, results come back
as `ModelRunnerOutput`. The drivers (testbed.sim, testbed.worker, testbed.server) differ by mode.
"""
