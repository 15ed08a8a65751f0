"""Tensor parallelism with real worker processes over gloo (CPU): token parity with TP=1 under
continuous batching and chunked prefill, a clear refusal of sizes the heads cannot be split by,
the memory-profiling forward on every rank, and bounded failure with cleanup when a worker dies,
hangs or raises (its traceback reaches rank 0's error).

Only one TP engine can live in a process (one torch.distributed group), so every test shuts its
engines down in teardown, and checks that the group is gone and no worker process is left.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from llm_helpers import hf_greedy, random_prompts, run_staggered, save_tiny_llama
from testbed import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=8, enable_prefix_caching=True)


pytestmark = pytest.mark.timeout(240)  # worker processes: never let a hang stall the suite


def _assert_cleaned_up(procs) -> None:
    assert not dist.is_initialized(), "the process group outlived shutdown()"
    assert all(not p.is_alive() for p in procs), [p for p in procs if p.is_alive()]
    assert not [c for c in mp.active_children() if c.name.startswith("testbed-tp-rank")]


@pytest.fixture
def engines():
    """Build LLMs through `make(...)`; all are shut down afterwards, and cleanup is checked."""
    made: list[LLM] = []

    def make(*args, **kwargs) -> LLM:
        llm = LLM(*args, **kwargs)
        made.append(llm)
        return llm

    yield make
    procs = []
    for llm in made:
        llm.executor.shutdown()
        procs += getattr(llm.executor, "procs", [])
    _assert_cleaned_up(procs)


def _run(llm: LLM, prompts, arrivals, prefix: str) -> dict[str, list[int]]:
    tokens, _, _ = run_staggered(llm, prompts, arrivals, GREEDY, prefix=prefix)
    steps = llm.engine.records.steps
    assert max(s[3] for s in steps) >= 3 and any(s[4] > 0 and s[5] > 0 for s in steps), "no continuous batching"
    return tokens


@pytest.mark.smollm2
def test_smollm2_tp3_matches_tp1(engines):
    from testbed.worker.smollm2 import default_model_dir
    folder = str(default_model_dir())
    tp1 = engines(folder, max_model_len=256, **ENGINE)
    tok = tp1.get_tokenizer()
    texts = ["The capital of France is", "def add(a, b):\n", "Hello, my name is",
             "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
             "and his three children. One day, the eldest son went into the woods to",
             "Q: How many legs does a spider have?\nA:"]
    prompts = [tok.encode(t) for t in texts]
    assert max(len(p) for p in prompts) > 2 * ENGINE["max_num_batched_tokens"]
    arrivals = [0, 0, 1, 2, 6]
    ref = _run(tp1, prompts, arrivals, "a")
    tp1.executor.shutdown()
    tp3 = engines(folder, max_model_len=256, tensor_parallel_size=3, **ENGINE)
    assert len(tp3.executor.procs) == 2 and all(p.is_alive() for p in tp3.executor.procs)
    runner = tp3.executor.runner
    assert (runner.num_kv_heads, runner.model.attention_layers()[0].num_heads) == (1, 3)  # 9 q / 3 KV heads over 3
    assert _run(tp3, prompts, arrivals, "a") == ref
    # the offline API on TP: repeats hit the prefix cache, logprobs come from the gathered logits
    outs = tp3.generate([prompts[3], texts[0]], SamplingParams(temperature=0.0, max_tokens=16, logprobs=1))
    assert outs[0].num_cached_tokens > 0 and outs[0].outputs[0].token_ids == ref["a3"]
    assert outs[1].outputs[0].token_ids == ref["a0"]
    greedy = outs[1].outputs[0]
    assert all(d[t].rank == 1 for t, d in zip(greedy.token_ids, greedy.logprobs))


@pytest.mark.smollm2
def test_smollm2_tp2_is_refused_naming_the_head_count():
    """SmolLM2 has 9 query heads and 3 KV heads: TP=2 cannot split them (TP=3 is the size that works)."""
    from testbed.worker.smollm2 import default_model_dir
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 must divide the number of attention heads \(9\)"):
        LLM(str(default_model_dir()), tensor_parallel_size=2, max_model_len=128, **ENGINE)
    assert time.monotonic() - start < 60
    _assert_cleaned_up([])


# 4 query / 2 KV heads split 2 ways; 4 query / 1 KV head: the KV head is replicated on both ranks.
# A vocabulary of 321 does not divide by 2: the vocab-parallel embedding and LM head pad the last shard.
TINY = {"split-kv": dict(heads=4, kv_heads=2), "replicated-kv": dict(heads=4, kv_heads=1, vocab_size=321)}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_llama_tp2_matches_tp1_and_hf(name, tmp_path, engines):
    cfg = dict(TINY[name])
    hf = save_tiny_llama(tmp_path, cfg.pop("heads"), cfg.pop("kv_heads"), seed=5, **cfg)
    prompts = random_prompts([5, 40, 17, 2, 26, 33], hf.config.vocab_size, seed=7)
    arrivals = [0, 0, 1, 1, 4, 9]
    tp1 = engines(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    ref = _run(tp1, prompts, arrivals, "t")
    assert [ref[f"t{i}"] for i in range(len(prompts))] == [hf_greedy(hf, p, 16) for p in prompts]
    tp1.executor.shutdown()
    tp2 = engines(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    attn = tp2.executor.runner.model.attention_layers()[0]
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert _run(tp2, prompts, arrivals, "t") == ref
    again, cached, _ = run_staggered(tp2, prompts[1:3], [0, 0], GREEDY, prefix="p")
    assert cached["p0"] > 0 and again == {"p0": ref["t1"], "p1": ref["t2"]}


def test_tiny_llama_tp2_swap_preemption_matches_tp1(tmp_path, engines):
    """Swap preemption on TP: every rank copies its shard of the swapped blocks to its own CPU pool and back,
    on rank 0's command, before the step that needs them."""
    hf = save_tiny_llama(tmp_path, 4, 2, seed=4)
    prompts = random_prompts([30, 26, 21, 33], hf.config.vocab_size, seed=3)
    engine = {**ENGINE, "num_gpu_blocks": 13, "preemption_mode": "swap", "num_cpu_blocks": 16}  # 4 x 6 blocks
    tp1 = engines(str(tmp_path), skip_tokenizer_init=True, **engine)
    ref, _, _ = run_staggered(tp1, prompts, [0, 0, 0, 0], GREEDY, prefix="t")
    assert [ref[f"t{i}"] for i in range(len(prompts))] == [hf_greedy(hf, p, 16) for p in prompts]
    assert tp1.engine.scheduler.num_swap_preemptions > 0
    tp1.executor.shutdown()
    tp2 = engines(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, **engine)
    assert run_staggered(tp2, prompts, [0, 0, 0, 0], GREEDY, prefix="t")[0] == ref
    assert tp2.engine.scheduler.num_swapped_in_blocks == tp1.engine.scheduler.num_swapped_in_blocks > 0


def test_tiny_llama_tp2_async_scheduling_matches_tp1(tmp_path, engines):
    """Async scheduling on TP: rank 0 launches step k+1 before it reads step k, so the tokens sampled at step k
    reach the other rank's inputs by broadcast, on the device."""
    hf = save_tiny_llama(tmp_path, 4, 2, seed=3)
    prompts = random_prompts([5, 40, 17, 2, 26, 33], hf.config.vocab_size, seed=2)
    arrivals = [0, 0, 1, 1, 4, 9]
    tp1 = engines(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    ref = _run(tp1, prompts, arrivals, "t")
    tp1.executor.shutdown()
    tp2 = engines(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    assert tp2.stepper.async_scheduling
    assert _run(tp2, prompts, arrivals, "t") == ref


@pytest.fixture
def tiny_folder(tmp_path):
    save_tiny_llama(tmp_path, 4, 2, seed=1)
    return str(tmp_path)


def test_killed_worker_fails_within_bound_naming_rank(tiny_folder, engines, monkeypatch):
    monkeypatch.setenv("TESTBED_TP_TIMEOUT_S", "20")
    llm = engines(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    prompts = random_prompts([12, 30], 320, seed=2)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    victim = llm.executor.procs[0]
    os.kill(victim.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {victim.pid}"):
        llm.generate(prompts, GREEDY)
    assert time.monotonic() - start < 30
    assert not llm.engine.has_unfinished_requests()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1.*unusable"):  # stays failed, fast
        llm.generate(prompts[:1], GREEDY)
    assert time.monotonic() - start < 2
    llm.executor.shutdown()
    _assert_cleaned_up(llm.executor.procs)
    # the process group is gone: a fresh TP engine can start in this process and computes the same tokens
    fresh = engines(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY)] == before


def test_hung_worker_times_out_naming_the_ranks(tiny_folder, engines, monkeypatch):
    monkeypatch.setenv("TESTBED_TP_TIMEOUT_S", "4")
    llm = engines(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    prompts = random_prompts([12, 30], 320, seed=3)
    llm.generate(prompts, GREEDY)
    victim = llm.executor.procs[0]
    os.kill(victim.pid, signal.SIGSTOP)  # alive but silent
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"ranks 1\.\.1\) did not answer within 4 s") as failed:
            llm.generate(prompts, GREEDY)
        assert time.monotonic() - start < 20
        assert str(failed.value).count("did not answer") == 1, "the error is wrapped twice"
        assert not llm.engine.has_unfinished_requests()
        start = time.monotonic()  # the ranks may be out of step now: later calls fail at once
        with pytest.raises(RuntimeError, match="did not answer.*unusable, create a new engine"):
            llm.generate(prompts, GREEDY)
        assert time.monotonic() - start < 2
        start = time.monotonic()
        llm.executor.shutdown()
        assert time.monotonic() - start < 8, "shutdown waited on a worker known to be hung"
        _assert_cleaned_up(llm.executor.procs)
    finally:
        if victim.is_alive():
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(5)


def test_clean_shutdown_ends_every_worker(tiny_folder, engines):
    llm = engines(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    procs = list(llm.executor.procs)
    llm.generate(random_prompts([4], 320), GREEDY)
    llm.executor.shutdown()
    assert [p.exitcode for p in procs] == [0]
    _assert_cleaned_up(procs)
    llm.executor.shutdown()  # idempotent


def _worker_start_hook(tmp_path_factory, monkeypatch, env: str, code: str) -> None:
    """Every Python process started from now on runs `code` at start-up (a sitecustomize on PYTHONPATH) while
    `env` is set (the test unsets it to stop); the resource tracker is started first, so it escapes the hook."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    hook = tmp_path_factory.mktemp("hook")
    (hook / "sitecustomize.py").write_text(f"import os\nif os.environ.get({env!r}):\n    {code}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(env, "1")


def test_worker_dying_at_startup_is_named(tiny_folder, tmp_path_factory, monkeypatch, engines):
    """A rank that exits before joining the group: the engine fails after the bound, naming it, and
    the next engine in this process starts normally (a failed init must not leave torch state behind)."""
    monkeypatch.setenv("TESTBED_TP_TIMEOUT_S", "5")
    _worker_start_hook(tmp_path_factory, monkeypatch, "TESTBED_TEST_WORKER_EXIT", "os._exit(3)")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker died during startup: rank 1 \(pid \d+, exit code 3\)"):
        LLM(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 30
    _assert_cleaned_up([])
    monkeypatch.delenv("TESTBED_TEST_WORKER_EXIT")
    start = time.monotonic()
    llm = engines(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 30
    assert len(llm.generate(random_prompts([6], 320), GREEDY)[0].outputs[0].token_ids) == 16


def test_a_worker_slow_to_start_is_waited_for_past_the_step_timeout(tiny_folder, tmp_path_factory, monkeypatch,
                                                                   engines):
    """TESTBED_TP_TIMEOUT_S bounds a step (and the collectives), not a live worker's spawn and imports: a worker
    that takes longer than it to get ready (a loaded host) still joins, and the engine works."""
    monkeypatch.setenv("TESTBED_TP_TIMEOUT_S", "3")
    _worker_start_hook(tmp_path_factory, monkeypatch, "TESTBED_TEST_WORKER_SLOW", "__import__('time').sleep(6)")
    start = time.monotonic()
    llm = engines(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start >= 6
    assert len(llm.generate(random_prompts([6], 320), GREEDY)[0].outputs[0].token_ids) == 16


def test_profiling_forward_runs_on_every_rank_at_tp3(tmp_path, engines, monkeypatch):
    """The worst-case forward a GPU sizes its KV cache after (TESTBED_PROFILE_ON_CPU runs it on CPU too) on 3
    gloo ranks: compute_logits gives ranks 1 and 2 no logits, and they still run the forward's collectives,
    so the engine starts and then computes TP=1's tokens (once rank 1 died on `None.float()`)."""
    # 6 query / 3 KV heads: 2 / 1 per rank; a vocabulary of 320 pads to 3 x 107
    save_tiny_llama(tmp_path, 6, 3, seed=4, hidden_size=96)
    monkeypatch.setenv("TESTBED_PROFILE_ON_CPU", "1")
    monkeypatch.setenv("TESTBED_TP_TIMEOUT_S", "10")
    prompts = random_prompts([9, 21], 320, seed=4)
    tp1 = engines(str(tmp_path), skip_tokenizer_init=True, **ENGINE)
    ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, GREEDY)]
    tp1.executor.shutdown()
    start = time.monotonic()
    tp3 = engines(str(tmp_path), skip_tokenizer_init=True, tensor_parallel_size=3, **ENGINE)
    assert time.monotonic() - start < 30
    attn = tp3.executor.runner.model.attention_layers()[0]
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert [o.outputs[0].token_ids for o in tp3.generate(prompts, GREEDY)] == ref


# Imported by every spawned process while TESTBED_TEST_FAIL_RANK is set: torch's attention raises on that rank.
# Only the profiling forward (no KV cache yet) calls it, so that rank fails in memory profiling.
FAIL_IN_PROFILING = """
import os
if os.environ.get("TESTBED_TEST_FAIL_RANK"):
    import torch.distributed as dist
    import torch.nn.functional as F
    sdpa = F.scaled_dot_product_attention

    def failing_sdpa(*args, **kwargs):
        if dist.is_initialized() and dist.get_rank() == int(os.environ["TESTBED_TEST_FAIL_RANK"]):
            raise RuntimeError("injected failure in the profiling forward")
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = failing_sdpa
"""


def test_worker_failing_in_profiling_ends_the_engine_with_its_traceback(tiny_folder, tmp_path_factory, monkeypatch):
    """A non-zero rank that raises in memory profiling sends its traceback to rank 0 and exits: LLM(...) fails
    within seconds (not at the 60 s collective timeout) naming the rank, with that traceback, and no worker
    process is left."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()  # started now, so it does not import the hook below
    hook = tmp_path_factory.mktemp("fail")
    (hook / "sitecustomize.py").write_text(FAIL_IN_PROFILING)
    monkeypatch.delenv("TESTBED_TP_TIMEOUT_S", raising=False)  # the default 60 s
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TESTBED_PROFILE_ON_CPU", "1")
    monkeypatch.setenv("TESTBED_TEST_FAIL_RANK", "1")  # only processes started from now on read it
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+, exit code 1\) raised RuntimeError in memory "
                                           r"profiling") as failed:
        LLM(tiny_folder, skip_tokenizer_init=True, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 20
    message = str(failed.value)
    assert "Traceback (most recent call last)" in message and "in profile_run" in message
    assert "RuntimeError: injected failure in the profiling forward" in message
    _assert_cleaned_up([])


SCRIPT = """
import sys
from testbed import LLM

def main():
    llm = LLM({folder!r}, skip_tokenizer_init=True, tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4)
    print("tokens", len(llm.generate([[1, 2, 3]])[0].outputs[0].token_ids))
    llm.executor.shutdown()

if sys.argv[1] == "guarded":
    if __name__ == "__main__":
        main()
else:
    main()  # at import time: every spawned worker runs this again
"""


def test_a_script_without_a_main_guard_fails_at_once_with_an_explanation(tiny_folder, tmp_path):
    """A TP script that builds its LLM at import time once waited for the whole rendezvous timeout, then
    failed with `DistStoreError: ... clients joined`; now the worker explains and the script fails at once."""
    import subprocess
    import sys
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT.format(folder=tiny_folder))
    repo = str(Path(__file__).resolve().parents[1])  # this checkout's testbed, whatever is installed
    env = {**os.environ, "TESTBED_TP_TIMEOUT_S": "600",  # the old behaviour: a 600 s wait, past the bound below
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    bad = subprocess.run([sys.executable, str(script), "unguarded"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert bad.returncode != 0 and "tokens" not in bad.stdout
    assert "a tensor-parallel worker was asked to build an engine while starting up" in bad.stderr  # the worker
    assert "worker died during startup: rank 1" in bad.stderr and 'if __name__ == \"__main__\":' in bad.stderr
    assert "DistStoreError" not in bad.stderr
    good = subprocess.run([sys.executable, str(script), "guarded"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert good.returncode == 0 and "tokens 16" in good.stdout, good.stderr


@pytest.mark.smollm2
def test_serve_with_tensor_parallel_size_3_matches_tp1_text(tmp_path):
    """`testbed serve --tensor-parallel-size 3` (engine core driving 2 spawned gloo ranks) answers a
    greedy completion with the same text as the TP=1 offline engine, then stops cleanly on SIGTERM."""
    import openai
    from server_helpers import ServerProcess
    from testbed.worker.smollm2 import default_model_dir
    prompt = "The capital of France is"
    server = ServerProcess("--tensor-parallel-size", "3", log_dir=tmp_path)  # the reference is computed meanwhile
    try:
        ref = LLM(str(default_model_dir()), max_model_len=256).generate([prompt], SamplingParams(temperature=0, max_tokens=12))
        server.wait_ready()
    except BaseException:
        server.kill()
        raise
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref[0].outputs[0].text
        assert out.usage.completion_tokens == len(ref[0].outputs[0].token_ids)
    finally:
        assert server.terminate() == 0, server.log_text()
