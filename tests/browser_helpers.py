"""Headless Chromium for the browser tests (Debian's `chromium`, which `make test` installs): a page's DOM or a
screenshot after a budget of virtual time, with no network beyond the page's own host."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, profile: Path, *args: str, budget_ms: int = 15_000) -> str:
    """Run Chromium headless on `url` with `args` (--dump-dom, --screenshot=FILE) within `budget_ms` of virtual
    time; its stdout (the DOM with --dump-dom)."""
    assert CHROMIUM is not None, "chromium is not installed (make test installs it: apt-get install -y chromium)"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-quic", "--no-first-run", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", "--window-size=1400,3000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
