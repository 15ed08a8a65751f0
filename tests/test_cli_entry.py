"""`testbed` as a process's entry (cli.main, argv None, main thread): the cyclic collector is off while the parser
is built and on again while the command runs, with what building the parser left alive frozen out of its passes;
called with arguments (a test, a notebook) the caller's collector is left as it is."""
from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, sys
from testbed import cli
seen = {}
def probe(args):
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
    return 0
cli.cmd_simulate = probe
if sys.argv[1] == "off":
    gc.disable()
how = sys.argv[2]
sys.argv = ["testbed", "simulate", "trace.jsonl"]
rc = cli.main(None if how == "entry" else sys.argv[1:])
print(json.dumps({**seen, "rc": rc, "after": gc.isenabled()}))
"""


def _probe(how: str, collector: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, collector, how], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_entry_runs_its_command_with_the_parsers_objects_frozen():
    seen = _probe("entry", "on")
    assert seen["rc"] == 0 and seen["enabled"] and seen["after"]
    assert seen["frozen"] > 10_000  # the commands' modules, numpy and pyarrow among them


def test_a_collector_turned_off_stays_off_and_a_call_with_arguments_freezes_nothing():
    assert _probe("entry", "off") == {"enabled": False, "frozen": 0, "rc": 0, "after": False}
    assert _probe("args", "on") == {"enabled": True, "frozen": 0, "rc": 0, "after": True}
