"""What multi-LoRA adds to a step's time in simulation (roofline terms, on top of any base cost model).

Per step, on one tensor-parallel rank (ranks run in parallel on equal shares):
- compute: every token that runs an adapter pays its shrink and expand in every layer, 2 * R * (a + b) FLOPs per
  projection, where a is the input width of its A shard and b the output width of its B shard and R is
  --max-lora-rank (the slots are padded to it and the kernels compute the padding, as Punica's and vLLM's do);
  all seven projections (q, k, v, o, gate, up, down) are assumed targeted, an upper bound;
- weights: each distinct adapter of the step reads its slots once, R * (a + b) * dtype bytes per projection and
  layer, at the GPU's memory bandwidth; the two are combined as max(bytes / bandwidth, FLOPs / matmul rate);
- loads: each adapter the engine puts into a slot this step (SchedulerOutput.lora_loads) copies its weights from
  host memory at the GPU's host link rate (GPUSpec.host_bandwidth, pinned copies, as swap preemption's), after
  reading its folder first when the host cache lacks it (DISK_BYTES_PER_S plus DISK_OPEN_S for opening and
  parsing the files).
Base rows pay nothing, and a step without adapters costs exactly what the base model says. A profile made with
`testbed profile --enable-lora` carries LoRA's measured costs, which MeasuredLoRACost charges instead. The load constants
of the disk are assumptions (one NVMe drive), not measurements.
"""
from __future__ import annotations

import numpy as np

from testbed.engine.outputs import SchedulerOutput
from testbed.sim.cost_model import CALIBRATED, CostModel, RooflineConstants
from testbed.specs.hardware import GPUSpec
from testbed.specs.presets import ModelSpec

DISK_BYTES_PER_S = 2e9
DISK_OPEN_S = 2e-3


def lora_widths(model: ModelSpec, tensor_parallel_size: int = 1) -> int:
    """Sum over the seven projections of one layer of (A's input width + B's output width) on one rank:
    column-parallel layers (q, k, v, gate, up) keep all of A and their share of B's rows, row-parallel ones
    (o, down) their share of A's columns and all of B."""
    tp, h, hd = tensor_parallel_size, model.hidden_size, model.head_dim
    q, kv = model.num_attention_heads * hd, max(1, model.num_key_value_heads // tp) * hd
    inter = model.intermediate_size
    column = (h + q / tp) + 2 * (h + kv) + 2 * (h + inter / tp)
    row = (q / tp + h) + (inter / tp + h)
    return int(column + row)


class LoRACost:
    """The LoRA terms of the module docstring for one (model, GPU, TP, max_lora_rank)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, max_lora_rank: int, tensor_parallel_size: int = 1,
                 dtype_bytes: int = 2, constants: RooflineConstants = CALIBRATED) -> None:
        per_layer = max_lora_rank * lora_widths(model, tensor_parallel_size)  # slot elements per layer
        L = model.num_hidden_layers
        mm = gpu.matmul_flops * constants.matmul_efficiency
        bw = gpu.mem_bandwidth * constants.bandwidth_efficiency
        self.adapter_bytes = L * per_layer * dtype_bytes  # one adapter's slot on one rank
        self._flop_per_token = 2 * L * per_layer / mm
        self._mem_per_adapter = self.adapter_bytes / bw
        self._copy = self.adapter_bytes / gpu.host_bandwidth
        self._disk = DISK_OPEN_S + self.adapter_bytes * tensor_parallel_size / DISK_BYTES_PER_S  # the whole adapter

    def step_time(self, so: SchedulerOutput) -> float:
        if not so.num_lora_tokens and not so.lora_loads:
            return 0.0
        t = max(self._mem_per_adapter * so.num_loras, self._flop_per_token * so.num_lora_tokens)
        for ld in so.lora_loads:
            t += self._copy + (self._disk if ld.from_disk else 0.0)
        return t


class MeasuredLoRACost:
    """LoRA's terms as `testbed profile --enable-lora` measured them (profiling/lora_measure.py): the extra device
    time of a step's LoRA tokens, interpolated in their count (decode-only steps and steps with a prefill chunk
    each from their own table; linear beyond the largest point), and each load from the host cache or the disk.
    A run at another --max-lora-rank than the profile's scales them by the ratio of the ranks (the kernels'
    work and the slots' bytes grow with it)."""

    def __init__(self, table: dict, max_lora_rank: int) -> None:
        scale = max_lora_rank / table["max_lora_rank"]
        self._tables = {}
        for kind in ("decode", "chunk"):
            pts = [(t, max(0.0, e) * scale) for t, e in zip(table[kind]["tokens"], table[kind]["extra_s"])
                   if e is not None]
            if not pts:
                raise ValueError(f"the profile's LoRA {kind} table has no measured point; profile again with "
                                 "--enable-lora")
            self._tables[kind] = ([float(t) for t, _ in pts], [e for _, e in pts])
        self._host, self._disk = table["load_host_s"] * scale, table["load_disk_s"] * scale

    def _extra(self, kind: str, tokens: int) -> float:
        xs, ys = self._tables[kind]
        if tokens >= xs[-1]:
            return ys[-1] * tokens / xs[-1]
        if tokens <= xs[0]:
            return ys[0]
        return float(np.interp(tokens, xs, ys))

    def step_time(self, so: SchedulerOutput) -> float:
        if not so.num_lora_tokens and not so.lora_loads:
            return 0.0
        t = self._extra("chunk" if so.num_prefill_tokens else "decode", so.num_lora_tokens) if so.num_lora_tokens else 0.0
        for ld in so.lora_loads:
            t += self._disk if ld.from_disk else self._host
        return t


class WithLoRA:
    """A base cost model plus the LoRA terms (the simulator's cost model when --enable-lora is on); every other
    attribute is the base model's."""

    def __init__(self, base: CostModel, lora: LoRACost) -> None:
        self.base, self.lora = base, lora

    def step_time(self, so: SchedulerOutput) -> float:
        return self.base.step_time(so) + self.lora.step_time(so)

    def __getattr__(self, name: str):
        return getattr(self.base, name)
