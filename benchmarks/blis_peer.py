"""BLIS (inference-sim, a Go discrete-event vLLM simulator) as a peer for benchmarks/sim_speed.py.

Never a dependency: given the path of its `blis` binary (run from the binary's folder, where its
defaults.yaml, hardware_config.json and model_configs/ live), `write_trace` writes a trace in its
replay format (the columns and header of peers/jsonl2tracev2.py, arrivals in whole microseconds) and
`replay_command` is its replay of that trace with the engine settings testbed simulates by default:
Llama-3.1-8B on one H100, max_num_seqs 256, max_num_batched_tokens 8192, at its fastest setting
(`--cache-signal-delay 0`, which gives it byte-identical per-request results).
"""
from __future__ import annotations

from pathlib import Path

from testbed.workload.trace import TraceRequest

COLUMNS = ("request_id,client_id,tenant_id,slo_class,session_id,round_index,prefix_group,prefix_length,streaming,"
           "input_tokens,output_tokens,text_tokens,image_tokens,audio_tokens,video_tokens,reason_ratio,model,"
           "deadline_us,server_input_tokens,arrival_time_us,send_time_us,first_chunk_time_us,last_chunk_time_us,"
           "num_chunks,status,error_message,finish_reason")
HEADER = "trace_version: 3\ntime_unit: microseconds\nmode: real\nwarm_up_requests: 0\n"


def write_trace(trace: list[TraceRequest], prefix: Path) -> tuple[Path, Path]:
    """BLIS's (header.yaml, data.csv) for `trace` (ordered by arrival, as testbed's loaders give it)."""
    header, data = prefix.with_suffix(".yaml"), prefix.with_suffix(".csv")
    header.write_text(HEADER)
    with data.open("w") as f:
        f.write(COLUMNS + "\n")
        for k, r in enumerate(trace):
            us = int(round(r.arrival_s * 1e6))
            f.write(f"{k},trace,,,,0,,0,false,{r.input_tokens},{r.output_tokens},0,0,0,0,0,,0,0,{us},{us},0,0,0,ok,,\n")
    return header, data


def replay_command(blis: Path, header: Path, data: Path, out_dir: Path) -> list[str]:
    """The BLIS replay of a written trace (run it with cwd = the binary's folder)."""
    return [str(blis.resolve()), "replay", "--trace-header", str(header.resolve()), "--trace-data",
            str(data.resolve()), "--model", "meta-llama/llama-3.1-8b-instruct", "--hardware", "H100", "--tp", "1",
            "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--cache-signal-delay", "0",
            "--metrics-path", str((out_dir / "blis_metrics.json").resolve()),
            "--results-path", str((out_dir / "blis_results.json").resolve())]
