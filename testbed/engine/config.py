"""Engine configuration with vLLM's names, validated on construction so bad flags fail early."""
from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
DP_POLICIES = ("round_robin", "least_loaded", "kv_aware", "prefix_affinity", "lora_affinity")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values
DEFAULT_DP_ROUTING_DELAY = 7e-4  # s, arrival -> admission at a replica, measured (docs/data-parallel.md)


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the flag and how to fix it."""


@dataclass
class EngineConfig:
    """Scheduler, cache and parallelism settings of one engine (one DP replica).

    `async_scheduling` keeps one step in flight in real mode (the next step is scheduled before the
    previous one's tokens are applied); the simulator steps the same way, so batches stay identical.

    `num_gpu_blocks` None means "size from memory": the executor decides it (profiling on a GPU,
    the cost model's capacity in simulation) before the BlockManager is built.

    Data parallelism (`data_parallel_size` > 1): `dp_stats_interval` is the least time between two
    stats publications of a replica to the DP coordinator (0 = after every step that changed its
    queues; real and sim). `dp_routing_delay` is the simulator's time from a request's arrival to its
    admission by the replica (API server -> coordinator -> replica; the default was measured, see
    docs/data-parallel.md); half of it passes before the coordinator decides, and a stats publication takes
    the other half (one hop) to reach the coordinator.

    Preemption (vLLM V0's flags): `preemption_mode` "recompute" frees a preempted request's blocks and recomputes
    its tokens later; "swap" copies them to a CPU block pool of `swap_space` GiB per GPU (per rank) and back before
    the request runs again, recomputing only when that pool is full. `num_cpu_blocks` None sizes the pool from
    `swap_space` and the model's block bytes (the executor in real mode, the model spec in simulation).

    Pipeline parallelism (`pipeline_parallel_size` > 1, vLLM's name): the model's layers are split into that
    many contiguous stages (worker/pipeline.py), each on its own workers, and the engine keeps up to that many
    batches in flight (vLLM V1's batch queue, engine/stepper.py): a batch is scheduled while earlier ones are
    still in the pipeline, and no request is in two in-flight batches. It replaces `async_scheduling`, which
    it excludes. The simulator models the same schedule (sim/pipeline.py).

    `cuda_graph_sizes` (vLLM's name): the token counts of the steps real mode captures as CUDA graphs on a
    GPU (decode batches up to max_num_seqs, mixed and prefill steps up to max_num_batched_tokens; None:
    the defaults of engine/capture_sizes.py). The simulator prices a step with a prefill chunk at the mixed size
    it is padded to (a profiled cost model's linear layers).

    LoRA (vLLM's flags): with `enable_lora`, requests may name an adapter; a step runs at most `max_loras`
    distinct adapters (each in a device slot sized for `max_lora_rank`), and the host keeps up to
    `max_cpu_loras` adapters (None: max_loras) in an LRU cache (engine/lora.py).

    `structured_outputs_timeout`: a request's grammar (structured outputs) must compile within this many
    seconds, or the request is rejected (a 400 from the server); grammars compile off the step loop, so
    other requests step meanwhile (real: a thread pool; simulation: a modelled or recorded compile time).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    dp_policy: str = "least_loaded"
    dp_stats_interval: float = 0.0
    dp_routing_delay: float = DEFAULT_DP_ROUTING_DELAY
    max_num_waiting: int | None = None
    async_scheduling: bool = False
    seed: int = 0
    cuda_graph_sizes: list[int] | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    num_cpu_blocks: int | None = None
    structured_outputs_timeout: float = 5.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, flag: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag.replace('_', '-')}: {msg}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                     "pipeline_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 1, name, f"must be a positive integer, got {v!r}")
        need(self.block_size & (self.block_size - 1) == 0 and self.block_size <= 256, "block_size",
             f"must be a power of two up to 256 (e.g. 16), got {self.block_size}")
        need(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
             "max_model_len", f"must be a positive integer, got {self.max_model_len!r}")
        need(self.num_gpu_blocks is None or (isinstance(self.num_gpu_blocks, int) and self.num_gpu_blocks >= 1),
             "num_gpu_blocks", f"must be a positive integer, got {self.num_gpu_blocks!r}")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
             f"must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
             f"({self.max_num_batched_tokens}) must be >= --max-num-seqs ({self.max_num_seqs}) so every running "
             "sequence can decode in one step; raise it or lower --max-num-seqs")
        need(not (self.enable_lora and self.pipeline_parallel_size > 1), "enable_lora",
             f"LoRA adapters are not split across pipeline stages yet; drop --enable-lora or use "
             f"--pipeline-parallel-size 1 (--tensor-parallel-size splits adapters)")
        need(not (self.async_scheduling and self.pipeline_parallel_size > 1), "async_scheduling",
             f"cannot be combined with --pipeline-parallel-size {self.pipeline_parallel_size}: pipeline parallelism "
             "already keeps several batches in flight (its batch queue); drop --async-scheduling")
        need(self.policy in SCHEDULING_POLICIES, "policy", f"must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        need(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
             f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        need(isinstance(self.swap_space, (int, float)) and not isinstance(self.swap_space, bool)
             and 0 <= self.swap_space < float("inf"), "swap_space",
             f"must be a number of GiB >= 0, got {self.swap_space!r}")
        need(self.num_cpu_blocks is None or (isinstance(self.num_cpu_blocks, int) and self.num_cpu_blocks >= 0),
             "num_cpu_blocks", f"must be an integer >= 0, got {self.num_cpu_blocks!r}")
        need(self.dp_policy in DP_POLICIES, "dp_policy", f"must be one of {DP_POLICIES}, got {self.dp_policy!r}")
        for name in ("dp_stats_interval", "dp_routing_delay"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and 0 <= v < float("inf"), name,
                 f"must be a number of seconds >= 0, got {v!r}")
        t = self.structured_outputs_timeout
        need(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < float("inf"),
             "structured_outputs_timeout", f"must be a finite number of seconds > 0, got {t!r}")
        sizes = self.cuda_graph_sizes
        need(sizes is None or (isinstance(sizes, (list, tuple)) and len(sizes) > 0
                               and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)),
             "cuda_graph_sizes", f"must be a non-empty list of positive token counts (e.g. 1 2 4 8 16 256 512), "
             f"got {sizes!r}")
        if sizes is not None:
            self.cuda_graph_sizes = sorted(set(sizes))
        need(isinstance(self.max_loras, int) and self.max_loras >= 1, "max_loras",
             f"must be a positive integer, got {self.max_loras!r}")
        need(self.max_lora_rank in LORA_RANKS, "max_lora_rank",
             f"must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        need(isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             f"({self.max_cpu_loras!r}) must be an integer >= --max-loras ({self.max_loras})")
        need(self.max_num_waiting is None or self.max_num_waiting >= 1, "max_num_waiting",
             f"must be a positive integer, got {self.max_num_waiting!r}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            need(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                 f"({self.max_num_batched_tokens}) must be >= --max-model-len ({self.max_model_len}) when chunked "
                 "prefill is off, or a long prompt could never be scheduled")

    def to_dict(self) -> dict:
        return asdict(self)

    def cpu_blocks(self, block_bytes: int) -> int:
        """Blocks of the CPU swap pool: `num_cpu_blocks` if given, else `swap_space` GiB of blocks of
        `block_bytes` (one rank's K and V of a block over all layers) in swap mode, 0 otherwise."""
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        if self.preemption_mode != "swap":
            return 0
        return int(self.swap_space * (1 << 30) // block_bytes)


@dataclass
class PoolerConfig:
    """How pooling (embedding) requests are pooled unless a request says otherwise, with vLLM's names:
    `pooling_type` LAST (the last prompt token's final hidden state) or MEAN (their average over the
    prompt), `normalize` (L2). `LLM(pooler_config=...)` and `testbed serve --pooler-config JSON` take one."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        from testbed.engine.params import InvalidParam, PoolingParams
        try:
            self.pooling_type = PoolingParams(self.pooling_type, self.normalize).pooling_type
        except InvalidParam as e:
            raise ConfigError(f"--pooler-config: {e}") from None

    @classmethod
    def of(cls, value) -> "PoolerConfig":
        """A PoolerConfig from one, a dict of its fields, or None (the defaults)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not isinstance(value, dict) or set(value) - {"pooling_type", "normalize"}:
            raise ConfigError(f"--pooler-config: give an object with pooling_type (LAST or MEAN) and normalize, "
                              f"got {value!r}")
        return cls(**value)
