"""The experiment notebooks (experiments/): `make experiments` run headless to the end, each ending with a
figure and a table, and a rerun with the same parameters reproduces every file byte for byte; the
papermill-style parameters; figures whose bytes depend only on what they draw."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import nbformat
import pytest

from testbed.runs.plots import to_png
from testbed.notebooks import INJECTED_TAG, find_notebooks, inject_parameters, main, parameter_names, read_notebook

from conftest import REPO

NOTEBOOKS = REPO / "experiments"
# what a run directory's manifest says about the run itself rather than its results (testbed.runs.rundir)
VOLATILE = ("created", "wall_time_s", "speedup")


def snapshot(folder: Path, output: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative path, the run's output folder `output` written as <output>
    wherever a file names it; manifests without their wall-clock fields."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes().replace(str(output).encode(), b"<output>")
            if p.name == "manifest.json":
                m = json.loads(data)
                assert all(k in m for k in VOLATILE), p
                data = json.dumps({k: v for k, v in m.items() if k not in VOLATILE}, sort_keys=True).encode()
            out[str(p.relative_to(folder))] = data
    return out


def outputs(nb) -> list[list[str]]:
    """Per code cell: the kinds of output it left ('image/png', 'text/html', 'stream', 'error', ...)."""
    kinds = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            kinds.append([k for o in cell.outputs for k in (o.get("data", {}) or {o.output_type: 1})])
    return kinds


# The rerun check's parameters where a smaller run goes through the same cells for less than half of what one run
# with the defaults costs: the run it compares and the rerun both use them. jobs=1 runs each sweep in the kernel
# (sweep keeps the order either way), without starting worker processes for a few small simulations. Every other
# notebook is rerun with its defaults, against the run above: its sizes are fixed in its cells, or two smaller
# runs would cost more than that one.
RERUN_PARAMETERS = {
    "01_sim_vs_real": {"results": "benchmarks/results/fidelity/2026-11-24_643d33b_h200_llama-3.1-8b/azure-80",
                       "jobs": 1},
    "03_dp_routing": {"replicas": [4], "jobs": 1},
    "05_tensor_parallelism": {"gpus": ["H200"], "tp_sizes": [1, 2], "jobs": 1},
    "08_multi_lora": {"adapters": [1, 4], "max_loras": [1, 2], "limit": 100, "jobs": 1},
}


@pytest.fixture(scope="module")
def experiments_runs(tmp_path_factory) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """`make experiments` (every notebook with its defaults, two at a time) into an output folder of its own, and
    at once the rerun check's runs: each notebook twice with the same parameters (its defaults, or those of
    RERUN_PARAMETERS), a notebook with its defaults once more beside the run above. The run's folder, and per
    notebook the folders of the run and the rerun to compare."""
    base = tmp_path_factory.mktemp("experiments")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    notebooks = find_notebooks([NOTEBOOKS])
    rerun_defaults = [str(nb) for nb in notebooks if nb.stem not in RERUN_PARAMETERS]
    argvs = [[str(NOTEBOOKS), "--output", str(base / "run"), "--parallel", "2"],
             [*rerun_defaults, "--output", str(base / "rerun"), "--parallel", "2"]]
    pairs = {nb.stem: (base / "run" / nb.stem, base / "rerun" / nb.stem) for nb in notebooks}
    for name, params in RERUN_PARAMETERS.items():
        flags = [a for k, v in params.items() for a in ("-p", f"{k}={v!r}")]
        pairs[name] = (base / "small" / name, base / "small-rerun" / name)
        argvs += [[str(NOTEBOOKS / f"{name}.py"), "--output", str(folder.parent), *flags] for folder in pairs[name]]
    procs = [subprocess.Popen([sys.executable, "-m", "testbed.notebooks", *argv], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for argv in argvs]
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, out.decode(errors="replace")[-5000:]
    return base / "run", pairs


@pytest.fixture(scope="module")
def experiments_run(experiments_runs) -> Path:
    """`make experiments`: every notebook with its defaults, into one output folder."""
    return experiments_runs[0]


def test_every_notebook_runs_headless_and_ends_with_a_figure_and_a_table(experiments_run):
    names = [p.stem for p in find_notebooks([NOTEBOOKS])]
    assert names[:5] == ["01_sim_vs_real", "02_scheduler_knobs", "03_dp_routing", "04_prefix_cache_capacity",
                         "05_tensor_parallelism"]
    assert sorted(p.name for p in experiments_run.iterdir()) == sorted(names)
    for name in names:
        folder = experiments_run / name
        nb = nbformat.read(folder / f"{name}.ipynb", as_version=4)
        kinds = outputs(nb)
        assert not any("error" in k for k in kinds), name
        assert "image/png" in kinds[-2] and "text/html" in kinds[-1], f"{name} must end with a figure and a table"
        env = json.loads((folder / "environment.json").read_text())
        assert env["git_sha"] and env["versions"]["testbed"] and env["seeds"], name
        assert list(folder.glob("*.png")) and list(folder.glob("*.csv")), name
        injected = [c for c in nb.cells if INJECTED_TAG in c.metadata.get("tags", [])]
        assert len(injected) == 1 and f"output_dir = {str(folder)!r}" in injected[0].source


def test_a_rerun_reproduces_every_file_byte_for_byte(experiments_runs):
    """Same parameters (the output folder apart: each file that names it is compared with the name taken out):
    tables, figures, run directories and the executed notebooks are identical (run manifests apart from their
    wall-clock fields). Every notebook, with its defaults or with RERUN_PARAMETERS."""
    _, pairs = experiments_runs
    assert sorted(pairs) == [nb.stem for nb in find_notebooks([NOTEBOOKS])]
    for nb in find_notebooks([NOTEBOOKS]):
        run, rerun = pairs[nb.stem]
        before, after = snapshot(run, run.parent), snapshot(rerun, rerun.parent)
        for name, value in RERUN_PARAMETERS.get(nb.stem, {}).items():  # the rerun's own parameters, not the defaults
            assert f"{name} = {value!r}" in before[f"{nb.stem}.ipynb"].decode(), (nb.stem, name)
        assert any(k.endswith(".png") for k in before) and any(k.endswith("summary.json") for k in before)
        assert sorted(after) == sorted(before), nb.stem
        changed = [k for k in before if before[k] != after[k]]
        assert not changed, f"{nb.stem}: {changed[:5]}"


def test_parameters_are_injected_after_the_parameters_cell_as_papermill_does():
    nb = read_notebook(NOTEBOOKS / "02_scheduler_knobs.py")
    assert [c["id"] for c in nb.cells] == [f"cell-{i}" for i in range(len(nb.cells))]  # no random ids
    names = parameter_names(nb)
    assert {"full", "output_dir", "seed", "jobs"} <= set(names)
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    inject_parameters(nb, {"full": True, "output_dir": "x", "slo_ttft_s": 0.5})
    cell = nb.cells[at + 1]
    assert cell.metadata["tags"] == [INJECTED_TAG]
    assert cell.source == "# Parameters\nfull = True\noutput_dir = 'x'\nslo_ttft_s = 0.5"
    with pytest.raises(ValueError, match="unknown parameter.*fulll.*takes full"):
        inject_parameters(read_notebook(NOTEBOOKS / "02_scheduler_knobs.py"), {"fulll": True})
    with pytest.raises(ValueError, match="not a Python literal"):
        inject_parameters(read_notebook(NOTEBOOKS / "02_scheduler_knobs.py"), {"seed": object()})


def test_notebook_runner_errors_are_one_line(tmp_path, capfd):
    """Also what the kernel prints (capfd: its stderr is this process's): a cell past --timeout is stopped with
    one line and no kernel notice ("running over TCP without encryption") nor traceback."""
    capsys = capfd
    assert main([str(tmp_path / "nothing.py"), "-o", str(tmp_path)]) == 2
    assert "not a notebook" in capsys.readouterr().err
    assert main([str(NOTEBOOKS / "03_dp_routing.py"), "-o", str(tmp_path), "-p", "replica=[4]"]) == 2
    assert "unknown parameter(s) replica" in capsys.readouterr().err
    broken = tmp_path / "01_broken.py"
    broken.write_text('# %% tags=["parameters"]\noutput_dir = "x"\n\n# %%\nraise RuntimeError("boom")\n')
    assert main([str(broken), "-o", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert "01_broken.py: a cell failed" in err and "boom" in err
    # a line per executed cell (its parameters, the injected ones), none for the one that failed
    assert [x.strip() for x in out.splitlines() if "cell" in x] == ["01_broken: cell 1/3 done", "01_broken: cell 2/3 done"]
    nb = nbformat.read(tmp_path / "out" / "01_broken" / "01_broken.ipynb", as_version=4)  # kept for reading
    assert outputs(nb)[-1] == ["error"]
    slow = tmp_path / "02_slow.py"
    slow.write_text('# %% tags=["parameters"]\noutput_dir = "x"\n\n# %%\nimport time\ntime.sleep(60)\n')
    assert main([str(slow), "-o", str(tmp_path / "out"), "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert "02_slow.py: a cell ran longer than --timeout 2 s" in err and "02_slow.ipynb" in err
    assert len(err.strip().splitlines()) == 1 and "encryption" not in err, err


def test_the_kernels_own_stderr_stays_off_the_runners_unless_the_kernel_dies(tmp_path, capfd):
    """What the kernel process itself writes to stderr (not a cell's output, which the notebook keeps) is not
    the runner's to print; where the kernel dies, its last words are in the one error."""
    from testbed.notebooks import main
    noisy = tmp_path / "01_noisy.py"
    noisy.write_text('# %% tags=["parameters"]\noutput_dir = "x"\n\n# %%\nimport os\n'
                     'os.write(2, b"kernel noise\\n")\n')
    assert main([str(noisy), "-o", str(tmp_path / "out")]) == 0
    assert "kernel noise" not in capfd.readouterr().err
    dying = tmp_path / "02_dying.py"
    dying.write_text('# %% tags=["parameters"]\noutput_dir = "x"\n\n# %%\nimport os\n'
                     'os.write(2, b"dying words\\n")\nos._exit(3)\n')
    assert main([str(dying), "-o", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert "02_dying.py: its kernel stopped" in err and "dying words" in err, err


def test_a_relative_output_folder_is_read_from_where_the_command_runs(tmp_path, monkeypatch):
    """The kernel works from elsewhere (the notebooks chdir to the repository root), so a relative --output is
    made absolute first: the notebook's own files and the executed .ipynb land side by side under the caller's
    folder."""
    nb = tmp_path / "01_moves.py"
    nb.write_text('# %% tags=["parameters"]\noutput_dir = "x"\n\n# %%\nimport os\nos.chdir("/")\n'
                  'open(os.path.join(output_dir, "made.txt"), "w").write("1")\n')
    monkeypatch.chdir(tmp_path)
    assert main([str(nb), "-o", "rel"]) == 0
    assert sorted(p.name for p in (tmp_path / "rel" / "01_moves").iterdir()) == ["01_moves.ipynb", "made.txt"]


def test_png_bytes_depend_only_on_the_figure():
    code = ("import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt, sys\n"
            "from testbed.runs.plots import to_png\n"
            "fig, ax = plt.subplots(); ax.plot([0, 1, 4]); ax.set_title('t')\n"
            "sys.stdout.buffer.write(to_png(fig))")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, check=True, timeout=120).stdout
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].startswith(b"\x89PNG")
    assert b"Software" not in runs[0] and b"Creation" not in runs[0]
    fig, ax = plt.subplots()
    ax.plot([0, 1, 2])
    assert to_png(fig) != runs[0]


def test_full_experiments_name_the_traces_folder_they_need(monkeypatch, tmp_path):
    from testbed.experiment import TRACES_DIR_ENV, trace_path
    monkeypatch.delenv(TRACES_DIR_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=f"set {TRACES_DIR_ENV}"):
        trace_path(True, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv")
    (tmp_path / "azure_llm_2023_conv.csv").write_text("x")
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path))
    assert trace_path(True, "traces/azure_conv_10min.jsonl", "azure_llm_2023_conv.csv") == tmp_path / "azure_llm_2023_conv.csv"
