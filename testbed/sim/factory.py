"""The cost-model factory: what `--cost-model` names ('auto', 'roofline', 'recorded:RUN_DIR' or a profile file),
built for a model, GPU and engine. The simulator's drivers (sim/run.py, the emulator, calibrate, error bands)
take their cost model from here."""
from __future__ import annotations

from pathlib import Path

from testbed import warn
from testbed.engine.capture_sizes import split_sizes
from testbed.engine.config import EngineConfig
from testbed.profiling.profile_file import shipped_profile, shipped_profiles
from testbed.runs.rundir import RunDirError, read_run
from testbed.sim.cost_model import CostModel, RecordedCostModel, RooflineCostModel
from testbed.sim.lora_cost import LoRACost, MeasuredLoRACost, WithLoRA
from testbed.sim.pipeline import PipelineCostModel, RecordedPipeline
from testbed.sim.profiled import ProfiledCostModel
from testbed.sim.recorded_dp import RecordedDPRun
from testbed.specs.hardware import GPUSpec
from testbed.specs.presets import ModelSpec, get_model_spec


def _preset_name(name: str) -> str:
    try:
        return get_model_spec(name).name
    except ValueError:
        return name


def check_cost_model_name(spec: str) -> None:
    """ValueError unless `spec` can name a cost model: 'auto', 'roofline', 'recorded:RUN_DIR' or a file (a profile)."""
    if spec not in ("auto", "roofline") and not spec.startswith("recorded:") and not Path(spec).is_file():
        raise ValueError(f"--cost-model {spec!r}: not 'auto', 'roofline', 'recorded:RUN_DIR' or an existing profile "
                         "file (testbed profile -o FILE writes one)")


def load_cost_model(spec: str, model: ModelSpec, gpu: GPUSpec, config: EngineConfig) -> tuple[CostModel, str]:
    """The cost model `--cost-model` names, and a one-line description of it for the manifest and summary.

    'auto' (default): the profile shipped for (model, GPU, TP), else the roofline with a warning on stderr;
    'roofline'; 'recorded:RUN_DIR' (replay a real run's step timeline: decision parity); or the path of a
    profile written by `testbed profile`. With --pipeline-parallel-size N > 1 the profile or roofline (of one
    stage's TP) is cut into N stages plus their activation transfers (sim/pipeline.py), and a recorded run must
    be a pipeline-parallel run of the same N."""
    pp = config.pipeline_parallel_size
    cm, desc = _load_stage_cost_model(spec, model, gpu, config)
    if pp == 1 or isinstance(cm, RecordedPipeline):
        return cm, desc
    if not isinstance(cm, (RooflineCostModel, ProfiledCostModel)):
        raise ValueError(f"--cost-model {spec}: a recorded run without pipeline parallelism cannot time a "
                         f"--pipeline-parallel-size {pp} simulation; replay a run made with it, or use a profile or "
                         "the roofline")
    pipe = PipelineCostModel(cm, model, gpu, pp)
    return pipe, (f"{desc}, {pp} pipeline stages ({'/'.join(map(str, pipe.parts))} layers), activations at "
                  f"{pipe.p2p_latency_s * 1e6:.2f} us + bytes / {pipe.p2p_bandwidth / 1e9:.1f} GB/s")


def _load_stage_cost_model(spec: str, model: ModelSpec, gpu: GPUSpec, config: EngineConfig) -> tuple[CostModel, str]:
    """load_cost_model's model of one pipeline stage's TP group running every layer (or a recorded timeline)."""
    tp = config.tensor_parallel_size
    if spec == "auto":
        path = shipped_profile(model.name, gpu.name, tp)
        if path is None:
            warn(f"no profile ships for {model.name} on {gpu.name} at TP={tp} (shipped: "
                 f"{', '.join(shipped_profiles()) or 'none'}); using the roofline model, whose errors are much larger "
                 "(docs/cost-models.md); measure one with `testbed profile`")
            spec = "roofline"
        else:
            spec = str(path)
    if spec == "roofline":
        return _with_lora(RooflineCostModel(model, gpu, tensor_parallel_size=tp, block_size=config.block_size),
                          "roofline", model, gpu, config)
    if spec.startswith("recorded:"):
        run_dir = spec.removeprefix("recorded:")
        try:
            run = read_run(run_dir)
        except RunDirError as e:
            raise ValueError(f"--cost-model {spec}: not a readable run directory: {e}") from None
        recorded_async = bool(run.manifest.get("config", {}).get("async_scheduling"))
        if recorded_async != config.async_scheduling:  # the replay makes the calls of the loop the run had
            raise ValueError(f"--cost-model {spec}: that run was made {'with' if recorded_async else 'without'} "
                             f"--async-scheduling, this simulation {'with' if config.async_scheduling else 'without'} "
                             f"it; replay it as it ran ({'add' if recorded_async else 'drop'} the flag, or take the "
                             f"run's flags with --like {run_dir})")
        if RecordedDPRun.is_dp_run(run_dir):  # per-replica timelines and the coordinator's record
            return RecordedDPRun.from_run_dir(run_dir), spec
        recorded_pp = int(run.manifest.get("config", {}).get("pipeline_parallel_size", 1))
        if recorded_pp != config.pipeline_parallel_size:
            raise ValueError(f"--cost-model {spec}: that run used --pipeline-parallel-size {recorded_pp}, this "
                             f"simulation {config.pipeline_parallel_size}; replay it with the same")
        if recorded_pp > 1:
            return RecordedPipeline.from_run_dir(run_dir, recorded_pp), spec
        return RecordedCostModel.from_run_dir(run_dir), spec
    check_cost_model_name(spec)
    path = Path(spec)
    # a data-parallel replica pays the profile's dp_replica_host term per step (profiled.py); a single engine does not
    cm = ProfiledCostModel.from_file(path, config.async_scheduling, config.enable_prefix_caching,
                                     config.data_parallel_size, split_sizes(config)[1])
    if _preset_name(cm.model_name) != model.name or cm.tensor_parallel_size != tp:
        raise ValueError(f"--cost-model {spec}: profile is for {cm.model_name} TP={cm.tensor_parallel_size}, "
                         f"but the run uses {model.name} TP={tp}; use a matching profile")
    if cm.block_size != config.block_size:
        raise ValueError(f"--cost-model {spec}: profile was measured with --block-size {cm.block_size}, the run "
                         f"uses {config.block_size}; profile that block size")
    attention = "" if cm.attention_source == "module timings" else f"; eager attention from {cm.attention_source}"
    return _with_lora(cm, f"profile {path.name} ({cm.gpu_name}, {cm.profile.get('created', '?')}, "
                          f"{cm.profile.get('git_sha') or '?'}{attention})", model, gpu, config)


def _with_lora(cm: CostModel, desc: str, model: ModelSpec, gpu: GPUSpec, config: EngineConfig) -> tuple[CostModel, str]:
    """With --enable-lora, the cost model plus multi-LoRA's roofline terms (sim/lora_cost.py); a recorded timeline
    needs none (its steps were timed with their adapters)."""
    if not config.enable_lora:
        return cm, desc
    measured = cm.profile.get("lora") if isinstance(cm, ProfiledCostModel) else None
    if measured:
        return (WithLoRA(cm, MeasuredLoRACost(measured, config.max_lora_rank)),
                f"{desc} + LoRA as the profile measured it (rank {measured['max_lora_rank']})")
    lora = LoRACost(model, gpu, config.max_lora_rank, config.tensor_parallel_size)
    return WithLoRA(cm, lora), f"{desc} + LoRA roofline terms (rank {config.max_lora_rank})"
