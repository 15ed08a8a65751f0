"""The profile file: the one module that names, finds, reads and writes profiles.

A profile is one JSON object (format "testbed-profile", version 1): the measured grid of `testbed profile`
(sweep.py) plus the model, GPU, TP, engine flags, versions and git sha it was measured with, and, once
rescaled (`testbed profile --quick`, `testbed calibrate`), per-component `scales` and the `calibration` record.
Profiles for common (model preset, GPU preset, TP) ship in PROFILES_DIR as `{model}_{gpu}_tp{N}.json`.
ProfiledCostModel (sim/profiled.py) interprets the grid; this module only moves files. Invariants: a profile
is written whole or not at all (a temporary file renamed over the target), and every read failure is a
ProfileError naming the file and how to make a good one.
"""
from __future__ import annotations

import json
from pathlib import Path

FORMAT = "testbed-profile"
VERSION = 1
PROFILES_DIR = Path(__file__).parent / "profiles"


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and what is wrong."""


def profile_file_name(model: str, gpu: str, tensor_parallel_size: int) -> str:
    """Where a profile of (model preset, GPU preset, TP) ships: `{model}_{gpu}_tp{N}.json`."""
    return f"{model}_{gpu}_tp{tensor_parallel_size}.json"


def shipped_profile(model: str, gpu: str, tensor_parallel_size: int) -> Path | None:
    """The shipped profile for these preset names, or None."""
    path = PROFILES_DIR / profile_file_name(model, gpu, tensor_parallel_size)
    return path if path.is_file() else None


def shipped_profiles() -> list[str]:
    """The names (file stems) of every shipped profile."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def read_profile(path: str | Path) -> dict:
    """The profile stored at `path` (its format is checked by ProfiledCostModel); ProfileError when the file is
    missing or not JSON."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{p}: no such profile file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{p}: not a JSON profile ({e}); make one with `testbed profile`") from None


def write_profile(path: str | Path, profile: dict) -> Path:
    """Write `profile` to `path` atomically (a reader never sees half a file); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(out)
    return out


def output_target(output: str | Path, num_models: int) -> tuple[Path, bool]:
    """(--output as a path, whether it is a folder of one profile per model): several models, or an existing
    folder, write `{model}_{gpu}_tp{N}.json` files into it. The folder is created."""
    out = Path(output)
    many = num_models > 1 or out.is_dir()
    if many and out.exists() and not out.is_dir():
        raise ValueError(f"--output {out}: several models write one profile each; give a folder")
    (out if many else out.parent).mkdir(parents=True, exist_ok=True)
    return out, many


def output_path(out: Path, many: bool, model: str, gpu: str, tensor_parallel_size: int) -> Path:
    """The file a profile of (model, gpu, TP) is written to under output_target's (out, many)."""
    return out / profile_file_name(model, gpu, tensor_parallel_size) if many else out


def base_profile(cost_model: str, model: str, gpu: str, tensor_parallel_size: int) -> tuple[dict, str]:
    """(profile, its path) that `profile --quick --cost-model` names: 'auto' is the one shipped for (model, gpu,
    TP), else a file. ValueError saying what to give instead."""
    path = cost_model
    if path == "auto":
        found = shipped_profile(model, gpu, tensor_parallel_size)
        if found is None:
            raise ValueError(f"no profile ships for {model} on {gpu} at TP={tensor_parallel_size} to rescale; "
                             "give one with --cost-model FILE, or run `testbed profile` without --quick (a full sweep)")
        path = str(found)
    try:
        return read_profile(path), path
    except ProfileError as e:
        raise ValueError(f"--cost-model {path}: not a readable profile ({e})") from None
