"""The 'Launch simulation' form: pick a trace and settings, run `testbed simulate` with a progress bar."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

from testbed.dashboard.launch import (REPO_TRACES, SimSettings, bundled_traces, inside, new_run_dir, save_upload,
                                      simulate_run)
from testbed.engine.config import DP_POLICIES, SCHEDULING_POLICIES, ConfigError
from testbed.specs.presets import MODEL_PRESETS
from testbed.specs.hardware import GPU_PRESETS

SOURCES = ("bundled trace", "path", "upload")


def _trace(source: str, bundled: str | None, path: str, upload, folder: str, roots: list[str]) -> str:
    """The trace file the form points at; ValueError says what is missing. A path must lie under the run
    folders or traces/: the form never reads another file of the host (its errors would show what it holds)."""
    if source == "bundled trace":
        if not bundled:
            raise ValueError("no bundled trace found under traces/; choose 'path' or 'upload'")
        return bundled
    if source == "path":
        if not path.strip():
            raise ValueError("enter the path of a trace file (JSONL, Azure CSV, Mooncake JSONL or lengths CSV)")
        p = Path(path.strip()).expanduser()
        if not inside(p, [*roots, REPO_TRACES]):
            raise ValueError(f"trace path {p} is outside the run folders ({', '.join(roots)}) and traces/; "
                             "upload the file instead")
        if not p.is_file():
            raise ValueError(f"trace path {p} is not a file")
        return str(p.resolve())
    if upload is None:
        raise ValueError("upload a .jsonl or .csv trace file first")
    return str(save_upload(upload.name, upload.getvalue(), folder).resolve())


def launch_form(roots: list[str]) -> None:
    """Render the form; on submit, simulate into the output folder and remember the new run's path. `roots`:
    the run folders the dashboard was started with, the only places (with traces/) it reads traces from and
    writes runs to."""
    default_folder = roots[0] if roots else "runs"
    traces = {p.name: str(p) for p in bundled_traces()}
    models, gpus = list(MODEL_PRESETS), list(GPU_PRESETS)
    with st.form("launch"):
        source = st.radio("Trace source", SOURCES, horizontal=True, key="launch_source")
        c1, c2, c3 = st.columns(3)
        bundled = c1.selectbox("Bundled trace", list(traces), key="launch_bundled")
        path = c2.text_input("Trace path", placeholder="/path/to/trace.jsonl", key="launch_path")
        upload = c3.file_uploader("Upload a trace", type=["jsonl", "csv"], key="launch_upload")
        c1, c2, c3, c4 = st.columns(4)
        model = c1.selectbox("Model", models, index=models.index("Llama-3.1-8B") if "Llama-3.1-8B" in models else 0,
                             key="launch_model")
        gpu = c2.selectbox("GPU", gpus, index=gpus.index("H100-SXM") if "H100-SXM" in gpus else 0, key="launch_gpu")
        policy = c3.selectbox("Scheduling policy", SCHEDULING_POLICIES, key="launch_policy")
        enable_prefix = c4.checkbox("Enable prefix caching", key="launch_prefix")
        max_seqs = c1.number_input("max-num-seqs", 1, 65536, 256, key="launch_max_num_seqs")
        max_tokens = c2.number_input("max-num-batched-tokens", 1, 1 << 20, 8192,
                                     key="launch_max_num_batched_tokens")
        dp = c3.number_input("data-parallel-size", 1, 1024, 1, key="launch_dp")
        dp_policy = c4.selectbox("DP policy", DP_POLICIES, index=DP_POLICIES.index("least_loaded"),
                                 key="launch_dp_policy")
        rate = c1.number_input("Request rate (req/s, 0 = trace timing)", 0.0, 1e6, 0.0, key="launch_rate")
        limit = c2.number_input("Limit (first N requests, 0 = all)", 0, 10**9, 0, key="launch_limit")
        folder = c3.text_input("Output folder", default_folder, key="launch_folder")
        tp = c4.number_input("tensor-parallel-size", 1, 64, 1, key="launch_tp")
        cost_model = c1.text_input("Cost model (auto, roofline, a profile JSON)", "auto", key="launch_cost_model")
        burstiness = c2.number_input("Burstiness (gamma shape, 1 = Poisson)", 0.01, 100.0, 1.0, key="launch_burstiness")
        slo_ttft = c3.number_input("TTFT SLO (ms, 0 = none)", 0.0, 1e7, 0.0, key="launch_slo_ttft")
        slo_tpot = c4.number_input("TPOT SLO (ms, 0 = none)", 0.0, 1e7, 0.0, key="launch_slo_tpot")
        blocks = c1.number_input("num-gpu-blocks (0 = from the GPU's memory)", 0, 1 << 30, 0, key="launch_blocks")
        async_sched = c2.checkbox("Async scheduling", key="launch_async")
        submitted = st.form_submit_button("Run simulation", type="primary", key="launch_submit")
    if not submitted:
        return
    bar = st.progress(0.0, text="starting simulation...")
    try:
        if not inside(Path(folder), roots):
            raise ValueError(f"output folder {folder} is not one of the run folders ({', '.join(roots)}) or inside "
                             "one; the dashboard writes runs only there")
        trace = _trace(source, traces.get(bundled), path, upload, folder, roots)
        settings = SimSettings(trace, model, gpu, int(max_seqs), int(max_tokens), int(dp), dp_policy, policy,
                               enable_prefix, float(rate) or None, int(limit) or None, int(tp), cost_model.strip() or "auto",
                               float(burstiness), float(slo_ttft) / 1e3 or None, float(slo_tpot) / 1e3 or None,
                               int(blocks) or None, bool(async_sched))
        out = new_run_dir(folder, settings)

        def on_progress(now: float, horizon: float) -> None:
            bar.progress(min(now / horizon, 1.0) if horizon > 0 else 0.0,
                         text=f"simulated {now:,.0f} of {horizon:,.0f} s of trace time")

        run_dir = simulate_run(settings, out, on_progress)
    except (ValueError, ConfigError, FileNotFoundError, OSError) as e:
        bar.empty()
        st.error(f"Simulation not started or failed: {e}")
        return
    bar.progress(1.0, text="done")
    st.session_state["launched_path"] = str(Path(run_dir).resolve())
    st.success(f"New run written to {run_dir}; it is in the runs table and selected in the sidebar.")
