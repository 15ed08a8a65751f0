"""The OpenAPI document of `testbed serve` is served and truthful: a bounded schemathesis run against the real
API server finds no 5xx and no response that breaks the document (status, content type, headers, body), and
every request the document calls invalid is refused.

The server runs with `--emulate --cost-model zero` (the real API server and engine core, the bundled model's
tokenizer, no model forward), so each of the few thousand generated requests is answered in milliseconds.
"""
from __future__ import annotations

import re

import subprocess
import sys

import httpx
import pytest

from browser_helpers import chromium
from server_helpers import running_server

KEY = "openapi-key"
pytestmark = pytest.mark.timeout(300)

# Every check that applies to a stateless API. Left out: positive_data_acceptance (ranges such as n >= 1 or a
# prompt that fits max_model_len depend on the served model and are answered with a documented 400, not
# written into the schema) and the checks of resources created and deleted through the API (none here).
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,missing_required_header,unsupported_method,"
          "allow_header_conformance,ignored_auth")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("--emulate", "--cost-model", "zero", "--max-model-len", "64", api_key=KEY,
                        log_dir=tmp_path_factory.mktemp("openapi")) as srv:
        yield srv


def test_document_is_served_and_states_errors(server):
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)  # open, like /health and /metrics
    assert r.status_code == 200
    doc = r.json()
    ops = {(path, method): op for path, item in doc["paths"].items() for method, op in item.items()}
    assert {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
            ("/health", "get"), ("/metrics", "get"), ("/tokenize", "post"), ("/detokenize", "post")} <= set(ops)
    for (path, method), op in ops.items():
        assert "422" not in op["responses"], f"{method} {path}: a body that does not validate is a 400 here"
        if method == "post":
            err = op["responses"]["400"]["content"]["application/json"]["schema"]
            assert err == {"$ref": "#/components/schemas/ErrorResponse"}
            assert op["security"] == [{"bearer": []}] and "401" in op["responses"]
    assert set(ops["/v1/completions", "post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                   "text/event-stream"}
    assert "ErrorResponse" in doc["components"]["schemas"]
    docs = httpx.get(f"{server.url}/docs", timeout=30)
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"] and "/openapi.json" in docs.text
    # offline: every asset the page loads is served here, none from another host
    assert "http://" not in docs.text and "https://" not in docs.text, docs.text
    for asset in re.findall(r'(?:src|href)="(/docs-assets/[^"]+)"', docs.text):
        r = httpx.get(f"{server.url}{asset}", timeout=30)
        assert r.status_code == 200 and len(r.content) > 500, asset
    assert len(re.findall(r'(?:src|href)="/docs-assets/', docs.text)) == 3  # script, style, icon


def test_docs_render_the_document_in_chromium_offline(server, tmp_path):
    """/docs in headless Chromium (nothing but 127.0.0.1 reachable): Swagger UI lists the operations of the
    OpenAPI 3.1 document, rather than a blank page or "Unable to render this definition"."""
    dom = chromium(f"{server.url}/docs", tmp_path / "profile", "--dump-dom", budget_ms=10_000)
    assert "Unable to render" not in dom, dom[-2000:]
    shown = set(re.findall(r'data-path="([^"]+)"', dom))
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= shown, sorted(shown)


def test_health_json_and_405_allow(server):
    r = httpx.get(f"{server.url}/health", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}
    r = httpx.delete(f"{server.url}/health", timeout=30)
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{server.url}/v1/completions", headers=server.headers, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"


def test_strict_json_types(server):
    """The document's types are the accepted ones: no boolean or float for an integer, no number for a boolean."""
    for body in ({"prompt": [[False]], "max_tokens": 1}, {"prompt": [1.0], "max_tokens": 1},
                 {"prompt": "Hi", "max_tokens": 1, "echo": 1}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=30)
        assert r.status_code == 400, (body, r.text)


def test_schemathesis_finds_nothing(server, tmp_path):
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", "-H",
           f"Authorization: Bearer {KEY}", "--checks", CHECKS, "--max-examples", "40", "--seed", "7", "--workers",
           "1", "--request-timeout", "30", "--report-dir", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-12000:]
    assert " passed" in out, out[-4000:]
