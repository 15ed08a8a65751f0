"""GPU specs for the sim cost model: achievable (not peak) memory bandwidth and matmul rate.

The H200 row is measured on our device (device-to-device copy; bf16 dense matmul). The other
rows scale their datasheet peaks by the fractions the H200 achieves of its own datasheet peaks
(4.8 TB/s, 989 TFLOP/s), so every preset means the same thing: what a tuned kernel reaches.
Memory sizes are the datasheet's decimal gigabytes (slightly below what CUDA reports: a
conservative choice for KV sizing). Interconnect numbers and all-reduce latencies are estimates
until measured.

`host_bandwidth` is the host <-> device copy rate of pinned memory per direction (swap preemption's KV block
copies): PCIe 5.0 x16 (H100/H200 SXM: 64 GB/s per direction on the datasheet) or 4.0 x16 (A100, L4: 32 GB/s),
at PINNED_COPY_FRACTION of the link, the fraction pinned cudaMemcpy typically reaches on an x16 link
(NVIDIA's nvbandwidth and bandwidthTest report about 53-55 of 64 GB/s on PCIe 5.0 hosts): estimates until
`testbed profile` measures them on the machine (its profile's `host_device` section, which the profiled cost
model uses instead).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Achieved / datasheet on the H200 we measured; applied to the other GPUs' datasheet peaks.
BANDWIDTH_FRACTION = 4.28 / 4.8   # ~0.89
MATMUL_FRACTION = 789 / 989       # ~0.80
# The engine's tensor-parallel all-reduce between 2 H200s over NVLink 4, inside CUDA graphs (symmetric memory:
# one-shot up to 512 KiB, two-shot above; worker/tp_all_reduce.py), fitted over 1 to 8,192 tokens x 4,096 bf16
# values as time = latency + bytes / bandwidth (benchmarks/tp.py at 08cb01d, 2026-11-26,
# results/tp/2026-11-26_08cb01d_h200x2/allreduce.json). NCCL's, which the engine used before, was 17.9 us +
# bytes / 293.5 GB/s (2026-11-21).
MEASURED_ALLREDUCE_BW = 244.8e9
PINNED_COPY_FRACTION = 0.83
PCIE5_X16, PCIE4_X16 = 64e9, 32e9  # B/s per direction, datasheet
MEASURED_ALLREDUCE_LATENCY_S = 7.44e-6


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model. Rates are achievable per second, bandwidths in bytes/s per direction."""

    name: str
    memory_bytes: int
    mem_bandwidth: float           # B/s, measured device-to-device copy
    matmul_flops: float            # FLOP/s, bf16 dense, achievable
    interconnect_bandwidth: float  # B/s per direction between TP ranks (NVLink or PCIe)
    allreduce_latency_s: float     # fixed cost of one all-reduce
    source: str = ""
    host_bandwidth: float = PCIE5_X16 * PINNED_COPY_FRACTION  # B/s per direction, pinned host <-> device copies
    # one point-to-point send/recv between two GPUs of a host (pipeline stages' activations), where measured;
    # None: the all-reduce's link numbers stand in
    p2p_bandwidth: float | None = None
    p2p_latency_s: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("memory_bytes", "mem_bandwidth", "matmul_flops", "interconnect_bandwidth", "host_bandwidth"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"GPUSpec {self.name!r}: {field_name} must be > 0, got {getattr(self, field_name)!r}")
        if not self.allreduce_latency_s >= 0:
            raise ValueError(f"GPUSpec {self.name!r}: allreduce_latency_s must be >= 0, got {self.allreduce_latency_s!r}")


def _scaled(name: str, memory_gb: float, peak_tbps: float, peak_tflops: float, link_gbps: float,
            link_note: str, latency_s: float, pcie: float = PCIE5_X16) -> GPUSpec:
    return GPUSpec(
        name, int(memory_gb * 1e9), peak_tbps * 1e12 * BANDWIDTH_FRACTION, peak_tflops * 1e12 * MATMUL_FRACTION,
        link_gbps * 1e9, latency_s,
        source=(f"datasheet {peak_tbps} TB/s x {BANDWIDTH_FRACTION:.2f}, {peak_tflops} TFLOP/s bf16 dense x "
                f"{MATMUL_FRACTION:.2f} (H200 achieved fractions); {memory_gb:g} GB datasheet; "
                f"{link_note} {link_gbps:g} GB/s/direction and {latency_s * 1e6:g} us all-reduce latency: estimates; "
                f"host link {pcie / 1e9:g} GB/s x {PINNED_COPY_FRACTION} (pinned copies): estimate"),
        host_bandwidth=pcie * PINNED_COPY_FRACTION,
    )


GPU_PRESETS: dict[str, GPUSpec] = {g.name: g for g in [
    GPUSpec("H200", int(141e9), 4.28e12, 789e12, MEASURED_ALLREDUCE_BW, MEASURED_ALLREDUCE_LATENCY_S,
            source="measured on our H200s: 4.28e12 B/s device copy, 789e12 FLOP/s bf16 matmul, the engine's "
                   "symmetric-memory bf16 all-reduce inside CUDA graphs between 2 H200s over NVLink fitted as "
                   "7.44 us + bytes / 244.8 GB/s (benchmarks/tp.py, 2026-11-26); 141 GB datasheet (CUDA reports "
                   "~150.1e9 B); host link PCIe 5.0 x16 64 GB/s x 0.83 (pinned copies): estimate"),
    dataclasses.replace(
        _scaled("H100-SXM", 80, 3.35, 989, MEASURED_ALLREDUCE_BW / 1e9,
                "NVLink 4 all-reduce as measured between 2 H200s (same NVLink generation)", MEASURED_ALLREDUCE_LATENCY_S),
        p2p_bandwidth=380.5e9, p2p_latency_s=42.2e-6),  # NCCL send/recv between 2 H100s: benchmarks/pp.py, f4fe111
    _scaled("A100-80GB", 80, 2.039, 312, 300, "NVLink 3", 10e-6, PCIE4_X16),
    _scaled("L4", 24, 0.3, 121, 32, "PCIe 4 x16", 25e-6, PCIE4_X16),
]}

# Normalised spellings (also what torch.cuda.get_device_name() returns, minus "NVIDIA ").
_ALIASES = {
    "h100": "H100-SXM", "h100-80gb": "H100-SXM", "h100-sxm5": "H100-SXM", "h100-sxm5-80gb": "H100-SXM",
    "h100-80gb-hbm3": "H100-SXM", "h200-141gb": "H200", "h200-sxm": "H200", "h200-nvl": "H200",
    "a100": "A100-80GB", "a100-sxm4-80gb": "A100-80GB", "a100-sxm-80gb": "A100-80GB", "a100-80gb-sxm": "A100-80GB",
}


def _normalise(name: str) -> str:
    key = "-".join(name.strip().lower().replace("_", " ").replace("-", " ").split())
    return key.removeprefix("nvidia-")


def get_gpu_spec(name: str) -> GPUSpec:
    """Preset by name, case-insensitive, accepting aliases ("h100", "H100-80GB", "NVIDIA H100 80GB HBM3")."""
    key = _normalise(name)
    for spec in GPU_PRESETS.values():
        if _normalise(spec.name) == key:
            return spec
    if key in _ALIASES:
        return GPU_PRESETS[_ALIASES[key]]
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPU_PRESETS)} "
                     f"(aliases: {', '.join(sorted(_ALIASES))}); pick one with --gpu")
