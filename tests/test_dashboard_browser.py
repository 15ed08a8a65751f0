"""The dashboard as `make dashboard PORT=...` serves it (Streamlit on 127.0.0.1), opened in headless Chromium:
title, the comparison table's columns, charts, no error box.

Chromium's --dump-dom / --screenshot run on virtual time, each with a budget of 15 s (the page must render
within it: title, tables, charts). Virtual time does not wait for Streamlit's websocket, so while the
first script run is cold a page may come out before its charts: the DOM is fetched again until they are
drawn, then the screenshot is taken from the warm server, its charts in `testbed compare --png`'s
colours. The screenshot is kept at
test-artifacts/dashboard.png (and the DOM at test-artifacts/dashboard.html).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from test_dashboard import make_runs  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)

from testbed.dashboard.app import TITLE  # noqa: E402
from testbed.dashboard.launch import _env  # noqa: E402

from browser_helpers import CHROMIUM, chromium  # noqa: E402
from server_helpers import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"


@pytest.fixture()
def server(tmp_path):
    """The dashboard as `make dashboard RUNS=... PORT=...` starts it (the Makefile's recipe with this interpreter's
    venv; its install step is skipped), on a free port."""
    root = make_runs(tmp_path / "runs")
    port = free_port()
    stamp = tmp_path / "dashboard-installed"
    stamp.touch()
    log = (tmp_path / "streamlit.log").open("w")
    proc = subprocess.Popen([shutil.which("make"), "-s", "dashboard", f"BIN={Path(sys.executable).parent}",
                             f"DASH={stamp}", f"RUNS={root}", f"PORT={port}"], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "streamlit.log").read_text()
            assert time.monotonic() < deadline, f"`make dashboard PORT={port}` did not answer on it within 60 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # make, testbed dashboard and Streamlit: the group make leads
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_dashboard_renders_in_chromium(server, tmp_path):
    dom, attempts = "", 0
    deadline = time.monotonic() + 90
    while 'data-testid="stImage"' not in dom and time.monotonic() < deadline:  # the first script run is cold
        attempts += 1
        dom = chromium(server, tmp_path / f"profile-dom{attempts}", "--dump-dom")
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "dashboard.html").write_text(dom)
    assert f">{TITLE}<" in dom or TITLE in dom, "title missing from the rendered page"
    assert 'data-testid="stImage"' in dom, f"no chart in the page after {attempts} tries (test-artifacts/dashboard.html)"
    assert 'data-testid="stDataFrame"' in dom or "stDataFrame" in dom
    assert "stException" not in dom and "stAlertContentError" not in dom, "the page shows an error box"
    # the comparison table (the second grid; its accessible header cells carry the column names): the metric
    # labels, the runs and the error column, and not the summary's internal JSON path
    headers = [re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r'role="columnheader"[^>]*>(.*?)</th>', dom, re.S)]
    comparison = headers[headers.index("metric"):]
    assert comparison == ["metric", "real_base [real]", "sim_base [sim]", "sim_base: sim-vs-real error vs real_base (%)",
                          "sim_base: within expected error"], headers
    assert "summary key" not in headers and "summary key" not in dom

    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    attempts, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:  # the server is warm now, so the page usually renders at the first try
        attempts += 1
        chromium(server, tmp_path / f"profile-shot{attempts}", f"--screenshot={shot}")
        if shot.is_file() and _ink(shot) > 0.01 and _sim_colour(shot) > 50:
            break
    assert shot.is_file(), f"chromium wrote no screenshot in {attempts} attempts"
    assert _ink(shot) > 0.01, f"the screenshot is (nearly) blank after {attempts} attempts"
    # its default selection (a real run and a simulation) in compare --png's colours (runs.plots.series_of: the
    # real run C0, the simulation C1): the simulation's solid lines show C1's exact colour
    assert _sim_colour(shot) > 50, f"no chart with a simulation line in compare's C1 after {attempts} attempts"


def _sim_colour(png: Path) -> int:
    """Pixels of matplotlib's C1 (#ff7f0e), the colour of a simulation drawn beside one real run."""
    from matplotlib.image import imread
    img = (imread(png)[..., :3] * 255).round().astype(int)
    return int((abs(img - (255, 127, 14)).max(axis=2) <= 2).sum())


def _ink(png: Path) -> float:
    """Fraction of pixels that are not near-white: a blank or skeleton page scores close to 0."""
    from matplotlib.image import imread
    img = imread(png)[..., :3]
    return float((img.mean(axis=2) < 0.9).mean())
