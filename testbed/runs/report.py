"""The summary table printed by `testbed simulate`, `replay` and `bench serve` (vLLM's result-block style)."""
from __future__ import annotations


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.2f}"


def format_summary(s: dict, title: str = "Result", setup: str | None = None) -> str:
    """The result block; `setup` (format_setup's lines) after it, in place of the bare cost-model line."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value) -> None:
        lines.append(f"{label:<36}{value:>14}")

    row("Requests finished:", s["num_finished"])
    row("Requests rejected / aborted:", f"{s['num_rejected']} / {s['num_aborted']}")
    row("Makespan (s):", f"{s['makespan_s']:.2f}")
    row("Request throughput (req/s):", f"{s['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}")
    row("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")
    slo = s.get("slo") or {}
    slo_txt = ", ".join(f"{k[:-2].upper()}<={v * 1000:g}ms" for k, v in slo.items() if v is not None) or "no SLO"
    row(f"Goodput (req/s, {slo_txt}):" if len(slo_txt) < 20 else "Goodput (req/s):", f"{s['goodput']:.2f}")
    lines.append(f"{' Latency (ms) ':-^{w}}")
    lines.append(f"{'':<6}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        st = s[key]
        lines.append(f"{label:<6}" + "".join(f"{_ms(st[q]):>11}" for q in ("mean", "p50", "p90", "p99")))
    lines.append(f"{' Engine ':-^{w}}")
    row("KV-cache utilisation mean / max:", f"{s['kv_util_mean']:.1%} / {s['kv_util_max']:.1%}")
    row("Preemptions:", s["num_preemptions"])
    row("Prefix-cache hit rate:", f"{s['prefix_cache_hit_rate']:.1%}")
    row("Mean batch size (requests/step):", f"{s['mean_batch_size']:.2f}")
    row("Engine steps:", s["num_steps"])
    if s.get("cost_model") and not setup:
        lines.append(f"Cost model: {s['cost_model']}")
    if s.get("expected_error") and not setup:
        lines.append(format_expected(s["expected_error"]))
    lines.append("=" * w)
    if setup:
        lines.append(setup)
    return "\n".join(lines)


def format_setup(manifest: dict, replicas: list[int] | None = None) -> str:
    """What a simulation ran (model, GPU, TP, DP and its policy, prefix caching, cost model) and how fast
    (simulated seconds per wall second); with DP, each replica's share of the requests and the imbalance
    (the busiest replica's share over the mean)."""
    from testbed.runs.rundir import entry_name
    cfg = manifest.get("config") or {}
    dp = cfg.get("data_parallel_size", 1)
    lines = [f"Setup: {entry_name(manifest.get('model'))} on {entry_name(manifest.get('hardware'))}, TP {cfg.get('tensor_parallel_size', 1)}, "
             + (f"DP {dp} ({cfg.get('dp_policy')})" if dp > 1 else "one replica")
             + f", prefix caching {'on' if cfg.get('enable_prefix_caching') else 'off'}, "
             f"max-num-seqs {cfg.get('max_num_seqs')}, max-num-batched-tokens {cfg.get('max_num_batched_tokens')}"]
    if manifest.get("cost_model"):
        lines.append(f"Cost model: {manifest['cost_model']}")
    if manifest.get("expected_error"):
        lines.append(format_expected(manifest["expected_error"]))
    sim_s, wall = manifest.get("simulated_time_s"), manifest.get("wall_time_s")
    if sim_s is not None and wall:
        lines.append(f"Speed: {sim_s:,.1f} simulated s in {wall:.2f} wall s ({sim_s / wall:,.0f}x real time)")
    if replicas and len(replicas) > 1:
        mean = sum(replicas) / len(replicas)
        lines.append("Replica load (requests): " + ", ".join(f"{i}: {n}" for i, n in enumerate(replicas))
                     + (f"; imbalance (max / mean) {max(replicas) / mean:.2f}" if mean else ""))
    return "\n".join(lines)


# the metrics of a band the summary names, with their short names
SHORT = {"output_throughput": "throughput", "ttft_s.p50": "TTFT p50", "tpot_s.p50": "TPOT p50", "e2e_s.p50": "E2E p50"}


def format_expected(expected: dict) -> str:
    """One line for the summary table."""
    bounds = expected.get("bounds")
    if not bounds:
        return f"Expected error: {expected['basis']}"
    parts = [f"{SHORT[k]} ±{bounds[k]:.0%}" if bounds[k] >= 0.01 else f"{SHORT[k]} ±{bounds[k]:.1%}"
             for k in SHORT if k in bounds]
    return f"Expected error: {', '.join(parts)}; {expected['basis']}"
