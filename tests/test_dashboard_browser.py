"""The dashboard served by Streamlit on 127.0.0.1 and opened in headless Chromium: title and charts, no error box.

Chromium's --dump-dom / --screenshot run on virtual time, each with a budget of 15 s (the page must render
within it: title, tables, charts). Virtual time does not wait for Streamlit's websocket, so while the
first script run is cold a page may come out before its charts: the DOM is fetched again until they are
drawn, then the screenshot is taken from the warm server, its charts in `testbed compare --png`'s
colours. The screenshot is kept at
test-artifacts/dashboard.png (and the DOM at test-artifacts/dashboard.html).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from test_dashboard import make_runs  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)

from testbed.dashboard.app import TITLE  # noqa: E402
from testbed.dashboard.launch import _env, dashboard_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium(url: str, profile: Path, *args: str, budget_ms: int = 15_000) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-quic", "--no-first-run", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--window-size=1400,3000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


@pytest.fixture()
def server(tmp_path):
    root = make_runs(tmp_path / "runs")
    port = free_port()
    log = (tmp_path / "streamlit.log").open("w")
    proc = subprocess.Popen(dashboard_command([str(root)], port), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                            start_new_session=True)
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
            assert time.monotonic() < deadline, "streamlit did not answer /_stcore/health within 60 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
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
