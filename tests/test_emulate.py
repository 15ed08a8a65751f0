"""`testbed serve --emulate`: the real API server and engine core on an executor that runs no model, each step
taking the shipped profile's predicted time; requests echo their prompt (official openai client, 127.0.0.1)."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import REPO, running_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    with running_server("--emulate", "--model", "Llama-3.2-1B", "--load-format", "dummy", "--gpu", "H200",
                        log_dir=tmp_path_factory.mktemp("emulate")) as srv:
        yield srv


def test_emulated_server_answers_with_the_profiles_timing_and_echoed_tokens(emulated):
    client = openai.OpenAI(base_url=f"{emulated.url}/v1", api_key="none")
    out = client.completions.create(model="Llama-3.2-1B", prompt=[1000, 1001, 1002, 1003], max_tokens=6,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    assert choice.model_extra["token_ids"] == [1000, 1001, 1002, 1003, 1000, 1001]
    stream = client.completions.create(model="Llama-3.2-1B", prompt=[7, 8], max_tokens=3, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    chunks = list(stream)  # a client that reads late gets several tokens in one chunk, as from vLLM
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert streamed == [7, 8, 7] and chunks[-1].usage.completion_tokens == 3
    assert httpx.get(f"{emulated.url}/health", timeout=10).status_code == 200
    log = emulated.log_text()
    assert "no profile ships" not in log  # the H200 profile of Llama-3.2-1B was found


def test_without_a_tokenizer_a_stream_carries_one_event_per_token(tmp_path):
    """A server without a tokenizer (--skip-tokenizer-init, as vLLM's) streams token-id prompts with empty text:
    every token gets an event of its own (with its id under return_token_ids), never several in one, so a client
    can count the tokens and time them; a text prompt is refused."""
    with running_server("--emulate", "--model", "Llama-3.2-1B", "--load-format", "dummy", "--gpu", "H200",
                        "--skip-tokenizer-init", log_dir=tmp_path) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.completions.create(model="Llama-3.2-1B", prompt="Hello", max_tokens=2)
        for extra in ({}, {"return_token_ids": True}):
            chunks = [c for c in client.completions.create(model="Llama-3.2-1B", prompt=[7, 8, 9], max_tokens=8,
                                                           stream=True, extra_body=extra) if c.choices]
            assert len(chunks) == 8 and all(c.choices[0].text == "" for c in chunks)
            assert [c.choices[0].finish_reason for c in chunks] == [None] * 7 + ["length"]
            if extra:
                assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == [7, 8, 9, 7, 8, 9, 7, 8]
        assert "tokenizer" not in srv.log_text()  # none was looked for, nothing to warn about


def test_emulated_chat_works_with_the_bundled_tokenizer(emulated):
    """A preset has no tokenizer files: emulation takes the bundled SmolLM2 tokenizer, so chat and text prompts
    work with the official client (the reply echoes the prompt's tokens, as text)."""
    client = openai.OpenAI(base_url=f"{emulated.url}/v1", api_key="none")
    chat = client.chat.completions.create(model="Llama-3.2-1B", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hello there"}])
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].message.content
    text = client.completions.create(model="Llama-3.2-1B", prompt="The capital of France is", max_tokens=5)
    assert text.choices[0].text.startswith("The capital")
    assert "emulating Llama-3.2-1B with the bundled SmolLM2 tokenizer" in emulated.log_text()


@pytest.mark.parametrize("flags, error", [
    (["--cost-model", "recorded:/nowhere"], "--cost-model recorded:/nowhere: emulation predicts each step"),
    (["--gpu", "B200"], "unknown GPU 'B200'"),
    (["--model", "none"], "unknown model 'none'"),
    (["--tokenizer", "x", "--skip-tokenizer-init"], "--tokenizer: give either --tokenizer or --skip-tokenizer-init"),
])
@pytest.mark.timeout(120)
def test_what_cannot_be_emulated_is_one_line_before_the_engine_starts(flags, error, capfd):
    """A recorded timeline, an unknown GPU or model: `testbed serve: error: ...` and exit 2, checked before the
    engine process starts (whose traceback it printed before; capfd holds what processes started here print).
    The CLI runs in this process: a separate one spent seconds on its imports alone."""
    from testbed.cli import main
    capfd.readouterr()
    code = main(["serve", "--emulate", "--model", "Llama-3.2-1B", "--load-format", "dummy", "--port", "1", *flags])
    out, err = capfd.readouterr()
    assert code == 2 and out == "", out
    assert err.startswith(f"testbed serve: error: {error}") and len(err.splitlines()) == 1, err


def test_warnings_carry_the_running_commands_name(monkeypatch, capsys):
    """An emulated server's engine process warns as `testbed serve`, the command that started it (the CLI
    names itself in TESTBED_COMMAND, which the processes it starts inherit), not as `testbed simulate`."""
    from testbed import COMMAND_ENV
    from testbed.engine.config import EngineConfig
    from testbed.sim.emulator import EmulatedExecutor
    monkeypatch.setenv(COMMAND_ENV, "testbed serve")
    EmulatedExecutor("Llama-3.2-1B", EngineConfig(), gpu="A100-80GB")
    err = capsys.readouterr().err
    assert err.startswith("testbed serve: warning: no profile ships for Llama-3.2-1B on A100-80GB"), err


def test_an_emulated_server_says_so_and_runs_against_it_are_labelled(emulated, tmp_path, capsys):
    """/v1/models names what a server emulates; `bench serve` records it in its run, and compare labels the run
    `emulated`, never as a real one to measure the simulator against."""
    from testbed.cli import main
    card = httpx.get(f"{emulated.url}/v1/models", timeout=10).json()["data"][0]
    assert card["emulated"] == "H200, cost model auto"
    out = tmp_path / "bench"
    assert main(["bench", "serve", "--url", emulated.url, "--dataset", "random", "--num-prompts", "4",
                 "--random-input-len", "16", "--random-output-len", "4", "-o", str(out), "--disable-tqdm"]) == 0
    from testbed.runs.rundir import read_run
    assert read_run(out).manifest["emulated"] == "H200, cost model auto"
    capsys.readouterr()
    real = REPO / "benchmarks" / "results" / "fidelity" / "2026-11-24_795c0af_h200_llama-3.2-1b" / "azure-80"
    assert main(["compare", str(out), str(real)]) == 0
    text = capsys.readouterr().out
    assert "[emulated]" in text and "[real]" in text and "sim-vs-real" not in text


def test_an_emulator_that_falls_behind_its_cost_model_warns_once(capsys):
    """Steps that end later than predicted (a busy host) make the emulator say, once, that its latencies are
    the host's; steps on time say nothing."""
    from testbed.engine.config import EngineConfig
    from testbed.sim.emulator import LATE_WINDOW, EmulatedExecutor
    on_time = EmulatedExecutor("Llama-3.2-1B", EngineConfig(), gpu="H200", cost_model="zero")
    for _ in range(2 * LATE_WINDOW):
        on_time._account(0.001, 0.002)  # 1 ms to spare
    assert "falls behind" not in capsys.readouterr().err
    late = EmulatedExecutor("Llama-3.2-1B", EngineConfig(), gpu="H200", cost_model="zero")
    for _ in range(3 * LATE_WINDOW):
        late._account(-0.002, 0.0023)  # 2 ms late on a 2.3 ms step, as on a loaded laptop
    err = capsys.readouterr().err
    assert err.count("emulation falls behind its cost model") == 1, err


def test_the_offline_engine_runs_on_an_emulated_executor():
    """LLM takes an EmulatedExecutor built for its engine arguments (benchmarks/serve/offline.py --emulate: the
    served/offline ratio's CPU proxy): the offline engine then echoes prompts at the emulated pace, as the server."""
    from testbed.engine.params import SamplingParams
    from testbed.entrypoints.llm import LLM
    from testbed.entrypoints.llm_args import engine_config
    from testbed.sim.emulator import EmulatedExecutor
    args = dict(max_model_len=256)
    llm = LLM("Llama-3.2-1B", load_format="dummy", executor=EmulatedExecutor(
        "Llama-3.2-1B", engine_config(dict(args)), cost_model="zero"), **args)
    outs = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[5, 6, 7, 5], [9, 10, 9, 10]]
