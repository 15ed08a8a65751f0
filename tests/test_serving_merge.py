"""GenerationRun.next merges every output already queued for a request into one delta per choice
(a stream that fell behind catches up with one SSE event), keeps every token exactly once, and still
finishes each choice once."""
import asyncio

from testbed.text.detokenizer import TokenTexts
from testbed.engine.params import SamplingParams
from testbed.server.metrics import ServerMetrics
from testbed.runtime.protocol import CoreOutput
from testbed.server.serving import GenerationRun
from testbed.server.state import ServerState


def _run(n: int) -> GenerationRun:
    state = ServerState(client=None, tokenizer=None, served_model_name="m", model_path="m",
                        metrics=ServerMetrics("m"), max_model_len=64, vocab_size=100, num_gpu_blocks=64,
                        block_size=16, token_texts=TokenTexts(None))
    run = GenerationRun(state, "cmpl-x", [[1, 2, 3]], SamplingParams(n=n, max_tokens=8, logprobs=1))
    run.stream.engines.update((c.request_id, 0) for c in run.choices)  # replica 0, as EngineClient.add records
    return run


def test_queued_outputs_merge_into_one_delta_per_choice():
    async def scenario() -> None:
        run = _run(n=2)
        a, b = (c.request_id for c in run.choices)
        q = run.stream
        for out in (CoreOutput(a, [5], new_logprobs=[(-0.1, 1, [(5, -0.1)])]),
                    CoreOutput(b, [7], new_logprobs=[(-0.2, 1, [(7, -0.2)])]),
                    CoreOutput(a, [6, 9], new_logprobs=[(-0.3, 2, []), (-0.4, 1, [])]),
                    CoreOutput(b, [8], True, "length", new_logprobs=[(-0.5, 3, [])])):
            q.put(out)
        changed = await run.next()
        assert [c.request_id for c in changed] == [a, b]  # one entry per choice, in order of first output
        ca, cb = changed
        assert ca.delta_ids == [5, 6, 9] and [lp for lp, _, _ in ca.delta_logprobs] == [-0.1, -0.3, -0.4]
        assert cb.delta_ids == [7, 8] and cb.finish_reason == "length" and not ca.finished
        assert run.state.metrics.engine(0).request_generation_tokens._sum.get() == 2  # b ended after 2 tokens

        q.put(CoreOutput(a, [4], True, "length"))
        q.put(CoreOutput(a, [3]))  # after the finish: ignored, never applied twice
        (ca,) = await run.next()
        assert ca.delta_ids == [4] and ca.token_ids == [5, 6, 9, 4] and ca.finish_reason == "length"
        assert run.done and run.usage()["completion_tokens"] == 6

    asyncio.run(scenario())


def test_one_output_at_a_time_gives_single_token_deltas():
    async def scenario() -> None:
        run = _run(n=1)
        (c,) = run.choices
        for tok in (11, 12):
            run.stream.put(CoreOutput(c.request_id, [tok]))
            (got,) = await run.next()
            assert got.delta_ids == [tok]
        assert c.token_ids == [11, 12]

    asyncio.run(scenario())
