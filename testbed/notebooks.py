"""Run the experiment notebooks headless: jupytext percent scripts executed by nbclient (`make experiments`).

    python -m testbed.notebooks experiments [NOTEBOOK.py ...] --output runs/experiments [-p full=True]

Each notebook NAME.py runs in a fresh kernel started in the repository root and writes everything into
OUTPUT/NAME/, the executed notebook NAME.ipynb (figures and tables rendered) included. Parameters follow
papermill: the cell tagged `parameters` holds the defaults, and the values given here go into a cell
tagged `injected-parameters` right after it (`output_dir` always), so the notebook reads as it ran.
Invariant: for the same notebook, parameters and seed, the executed notebook is byte for byte the same
(cell ids are numbered, no timing is recorded, and the notebooks print nothing that varies).
"""
from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from pathlib import Path
from typing import Any

PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"


class NotebookError(RuntimeError):
    """A notebook failed to run; the message names it, the failing cell and where its partial output went."""


def find_notebooks(paths: list[str | Path]) -> list[Path]:
    """Notebooks named by `paths`: files as given, folders as their `[0-9]*.py` files in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.glob("[0-9]*.py")))
        elif p.is_file() and p.suffix == ".py":
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: not a notebook (.py percent script) or a folder of them")
    if not out:
        raise FileNotFoundError(f"no notebooks ([0-9]*.py) in {', '.join(map(str, paths))}")
    return out


def read_notebook(path: str | Path):
    """The notebook of a jupytext percent script, with cell ids numbered (nbformat would draw random ones)."""
    import jupytext
    nb = jupytext.read(path, fmt="py:percent")
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    return nb


def parameter_names(nb) -> list[str]:
    """Names assigned in the notebook's `parameters` cell (there must be exactly one)."""
    cells = [c for c in nb.cells if PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"a notebook needs exactly one cell tagged {PARAMETERS_TAG!r} (found {len(cells)}); tag it "
                         "with `# %% tags=[\"parameters\"]`")
    names = []
    for node in ast.parse(cells[0].source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def inject_parameters(nb, parameters: dict[str, Any]) -> None:
    """Add the cell tagged `injected-parameters` after the `parameters` cell, as papermill does; every name must
    be a parameter of the notebook and every value a Python literal."""
    import nbformat
    known = parameter_names(nb)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; this notebook takes {', '.join(known)}")
    lines = ["# Parameters"]
    for name, value in parameters.items():
        text = repr(value)
        try:
            same = ast.literal_eval(text) == value
        except (ValueError, SyntaxError):
            same = False
        if not same:
            raise ValueError(f"parameter {name}={value!r} is not a Python literal")
        lines.append(f"{name} = {text}")
    cell = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": [INJECTED_TAG]})
    at = next(i for i, c in enumerate(nb.cells) if PARAMETERS_TAG in c.get("metadata", {}).get("tags", []))
    cell["id"] = "injected-parameters"
    nb.cells.insert(at + 1, cell)


TIMEOUT = "CellTimeoutError"  # the error a cell past the timeout ends with (nbclient's error_on_timeout)
# a kernel picks free TCP ports and binds them later, so one started beside another can lose them and die: nbclient
# then waits for it and raises RuntimeError before any cell ran; the notebook is started again in a fresh kernel
KERNEL_STARTS = 3


def execute_notebook(path: str | Path, output: str | Path, parameters: dict[str, Any] | None = None, *,
                     cwd: str | Path = ".", timeout: float = 900, progress: bool = False) -> Path:
    """Execute one notebook with `parameters` (plus `output_dir` = `output`) in a fresh kernel started in
    `cwd`; write the executed notebook to `output`/NAME.ipynb, also when a cell fails (NotebookError then)."""
    import nbformat
    from traitlets.config import Config
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    import matplotlib.pyplot  # noqa: F401  builds matplotlib's font cache here, so no kernel prints that notice

    src, out = Path(path), Path(output)
    nb = read_notebook(src)
    inject_parameters(nb, {"output_dir": str(out), **(parameters or {})})
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{src.stem}.ipynb"
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]

    def on_cell_executed(cell, cell_index: int, execute_reply=None, **_) -> None:  # a line per cell, to show progress
        ok = execute_reply is None or execute_reply.get("content", {}).get("status") == "ok"
        if progress and cell.cell_type == "code" and ok:
            print(f"  {src.stem}: cell {code.index(cell_index) + 1}/{len(code)} done", flush=True)

    # TCP with CurveZMQ keys the kernel manager makes: no "running over TCP without encryption" notice from the
    # kernel. (IPC sockets avoid it too, but through a KernelManager of our own, a blocking one, a cell past the
    # timeout was never stopped; nbclient's own AsyncKernelManager, configured here, stops it.)
    encrypted = Config({"KernelManager": {"transport_encryption": "required"}})
    # the kernel's own stderr (zmq's teardown noise when a cell past the timeout is stopped, say) goes to a file,
    # not the caller's stderr; it is shown only where the kernel stopped
    kernel_log = tempfile.TemporaryFile()

    # a cell past the timeout is interrupted first, so the kernel answers it before it is shut down (shut down
    # mid-cell, it logs a traceback of its reply to a closed socket)
    def run() -> None:
        kernel_log.seek(0)
        kernel_log.truncate()
        NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False, config=encrypted,
                       interrupt_on_timeout=True, error_on_timeout={"ename": TIMEOUT, "evalue": "", "traceback": []},
                       resources={"metadata": {"path": str(Path(cwd).resolve())}},
                       on_cell_executed=on_cell_executed).execute(stderr=kernel_log)

    try:
        for attempt in range(KERNEL_STARTS):
            try:
                run()
                break
            except RuntimeError:  # the kernel never answered (it lost a race for its ports to another process)
                if attempt + 1 == KERNEL_STARTS or any(nb.cells[i].get("outputs") or nb.cells[i].get("execution_count")
                                                       for i in code):
                    raise
                print(f"  {src.stem}: its kernel did not start; starting another", file=sys.stderr, flush=True)
    except CellExecutionError as e:
        if e.ename != TIMEOUT:
            raise NotebookError(f"{src}: a cell failed (the executed notebook up to it: {target}):\n{e}") from None
        raise NotebookError(f"{src}: a cell ran longer than --timeout {timeout:g} s (the executed notebook up to it: "
                            f"{target}); a full experiment on a small machine needs more, e.g. --timeout 14400, "
                            "or more --parameter jobs=N on more cores") from None
    except RuntimeError as e:  # the kernel died, or never answered: what it printed says why
        kernel_log.seek(0)
        said = kernel_log.read().decode(errors="replace").strip().splitlines()[-20:]
        raise NotebookError(f"{src}: its kernel stopped ({type(e).__name__}: {e}; the executed notebook up to it: "
                            f"{target}); the kernel's last words:\n" + "\n".join(said or ["(nothing)"])) from None
    finally:
        kernel_log.close()
        nbformat.write(nb, target)
    return target


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.notebooks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", help="notebook files (.py percent scripts) or folders of them")
    ap.add_argument("--output", "-o", default="runs/experiments", help="folder for every notebook's outputs (default: %(default)s)")
    ap.add_argument("-p", "--parameter", action="append", default=[], metavar="NAME=VALUE",
                    help="override a parameter (a Python literal: full=True, rates=[2,4]); repeatable")
    ap.add_argument("--timeout", type=float, default=900,
                    help="seconds one cell may run (default 900: plenty for the CI-sized defaults; raise it for full=True)")
    ap.add_argument("--parallel", type=int, default=1, metavar="N",
                    help="notebooks run at once, each in a process of its own (default 1; the notebooks' own "
                         "`jobs` parameter sizes their sweeps' process pools)")
    args = ap.parse_args(argv)
    try:
        params = {}
        for p in args.parameter:
            name, sep, value = p.partition("=")
            if not sep or not name.isidentifier():
                raise ValueError(f"-p {p!r}: expected NAME=VALUE")
            params[name] = _literal(value)
        if args.parallel < 1:
            raise ValueError(f"--parallel {args.parallel}: give at least 1")
        notebooks = find_notebooks(args.notebooks)
        # absolute: the kernel works from the repository root (experiment.start), so a relative folder would
        # put the notebooks' files there and the executed .ipynb here when run from elsewhere
        output = Path(args.output).resolve()
        args.output = str(output)
        if args.parallel > 1 and len(notebooks) > 1:
            return run_in_processes(notebooks, args)
        for nb in notebooks:
            print(f"running {nb} ...", flush=True)
            target = execute_notebook(nb, output / nb.stem, params, timeout=args.timeout, progress=True)
            print(f"wrote {target}", flush=True)
    except (ValueError, OSError, NotebookError) as e:
        print(f"testbed.notebooks: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_in_processes(notebooks: list[Path], args: argparse.Namespace) -> int:
    """Each notebook in a `python -m testbed.notebooks` process of its own, `args.parallel` at once; each one's
    output is printed whole when it ends (in the notebooks' order of ending). Exit 2 if any failed."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def run(nb: Path) -> tuple[Path, subprocess.CompletedProcess]:
        argv = [sys.executable, "-m", "testbed.notebooks", str(nb), "--output", args.output,
                "--timeout", str(args.timeout), *[a for p in args.parameter for a in ("-p", p)]]
        return nb, subprocess.run(argv, capture_output=True, text=True)

    failed = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        for nb, done in pool.map(run, notebooks):
            print(done.stdout, end="", flush=True)
            if done.returncode != 0:
                failed += 1
                print(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                      f"testbed.notebooks: error: {nb} exited {done.returncode}", file=sys.stderr)
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
