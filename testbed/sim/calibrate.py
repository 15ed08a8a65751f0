"""The roofline's constants recalibrated from measured profiles, so the fallback for unprofiled models and
GPUs carries what the measurements taught (CALIBRATED in cost_model.py holds the result over the shipped
profiles; a test keeps the two in step).

From each profile, on its own GPU preset:
- step overhead: the decode step at batch 1 and the shortest context, minus its roofline time;
- eager overhead per layer: the mean host time to issue an eager step (ProfiledCostModel.eager_launch) / layers;
- bandwidth efficiency: the decode step's growth with context at the largest batch measured at two
  contexts (KV bytes read per second), over the preset's bandwidth;
- matmul efficiency: the linear layers' rate (forward minus attention) on the largest chunk, over the
  preset's matmul rate.
The constants are the medians over the profiles.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Iterable

from testbed.specs.presets import get_model_spec
from testbed.sim.cost_model import PHYSICAL, RooflineConstants, RooflineCostModel, rank_shape
from testbed.specs.hardware import get_gpu_spec
from testbed.profiling.profile_file import PROFILES_DIR
from testbed.sim.profiled import ProfiledCostModel
from testbed.profiling.synthetic_steps import StepFactory, decode_rows


def _constants(cm: ProfiledCostModel) -> RooflineConstants:
    p = cm.profile
    model, gpu = get_model_spec(cm.model_name), get_gpu_spec(cm.gpu_name)
    r = rank_shape(model, cm.tensor_parallel_size)
    d = p["decode"]
    c0 = d["context"][0]
    physics = RooflineCostModel(model, gpu, cm.tensor_parallel_size, constants=PHYSICAL)
    f = StepFactory(1 << 30, cm.block_size, 1000 + 1)
    overhead = max(0.0, d["wall_s"][0][0] - physics.step_time(f.step(decode_rows(d["batch"][0], c0))))
    # KV bandwidth: the largest batch with at least two measured contexts from 1024 up
    kv_token_bytes = model.num_hidden_layers * 2 * r.num_kv_heads * model.head_dim * 2
    for i in range(len(d["batch"]) - 1, -1, -1):
        pts = [(c, w) for c, w in zip(d["context"], d["wall_s"][i]) if w is not None and c >= 1024]
        if len(pts) >= 2:
            (c_lo, w_lo), (c_hi, w_hi) = pts[0], pts[-1]
            bandwidth = d["batch"][i] * kv_token_bytes * (c_hi - c_lo) / (w_hi - w_lo)
            break
    else:
        raise ValueError(f"{cm.name}: no decode batch measured at two contexts >= 1024")
    ch = p["chunk"]
    n = max(t for t, row in zip(ch["tokens"], ch["forward_s"]) if row[0] is not None)
    i = ch["tokens"].index(n)
    linear_s = ch["forward_s"][i][0] - ch["attention_s"][i][0]
    rate = 2 * r.layer_linear_params * n / linear_s
    return RooflineConstants(overhead, cm.eager_launch / model.num_hidden_layers,
                             min(1.0, bandwidth / gpu.mem_bandwidth), min(1.0, rate / gpu.matmul_flops))


def roofline_constants(profiles: Iterable[str | Path] | None = None) -> RooflineConstants:
    """Medians of each constant over the profiles (default: every shipped one of one GPU, `*_tp1.json`: the
    constants describe one GPU's work; the roofline adds TP's all-reduces from their own measured fit)."""
    paths = list(profiles) if profiles is not None else sorted(PROFILES_DIR.glob("*_tp1.json"))
    if not paths:
        raise ValueError("no profile to calibrate the roofline from")
    each = [_constants(ProfiledCostModel.from_file(p)) for p in paths]
    med = lambda attr: statistics.median(getattr(c, attr) for c in each)  # noqa: E731
    return RooflineConstants(med("step_overhead_s"), med("eager_overhead_per_layer_s"), med("bandwidth_efficiency"),
                             med("matmul_efficiency"))


def per_profile(profiles: Iterable[str | Path] | None = None) -> dict[str, RooflineConstants]:
    paths = list(profiles) if profiles is not None else sorted(PROFILES_DIR.glob("*_tp1.json"))
    return {Path(p).stem: _constants(ProfiledCostModel.from_file(p)) for p in paths}


if __name__ == "__main__":
    for name, c in per_profile().items():
        print(f"{name}: {c}")
    print(f"median: {roofline_constants()}")
