"""How pipeline parallelism splits a model's decoder layers into stages: vLLM's partition rule, for both modes.

Every stage holds `L // P` contiguous layers; the `L % P` left over go one each to the stages before the last,
starting from the second-to-last and moving towards the first (the last stage also runs the final norm, the LM
head and sampling, the first the embedding). 30 layers over 4 stages: 7, 8, 8, 7. Real mode builds each stage's
layers from it (worker/model.py) and the simulator splits a step's layer time by it (sim/pipeline.py).
"""
from __future__ import annotations


def pp_partition(num_layers: int, pipeline_parallel_size: int) -> list[int]:
    """The number of layers of each stage, first to last; ValueError when some stage would get none."""
    pp = pipeline_parallel_size
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
    if pp > num_layers:
        raise ValueError(f"--pipeline-parallel-size {pp} exceeds the model's {num_layers} decoder layers: every "
                         f"stage needs at least one; use at most {num_layers} stages")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def get_pp_indices(num_layers: int, pp_rank: int, pipeline_parallel_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` holds (vLLM's name)."""
    if not 0 <= pp_rank < pipeline_parallel_size:
        raise ValueError(f"pipeline stage {pp_rank} is not in [0, {pipeline_parallel_size})")
    parts = pp_partition(num_layers, pipeline_parallel_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def pipeline_manifest(num_layers: int, pipeline_parallel_size: int) -> dict:
    """What a run's manifest says of its pipeline: each stage's layers [start, end) (both modes); {} without one."""
    if pipeline_parallel_size == 1:
        return {}
    parts = pp_partition(num_layers, pipeline_parallel_size)
    return {"pipeline": {"stages": [[sum(parts[:s]), sum(parts[:s + 1])] for s in range(len(parts))],
                         "max_in_flight": pipeline_parallel_size}}
