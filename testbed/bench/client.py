"""The HTTP side of `testbed bench serve`: stream each request and time it as vLLM's benchmark does.

Per request (perf_counter, client side): st = just before sending; every SSE chunk that carries a
choice is one token arrival: the first gives TTFT = t - st, later ones ITL gaps; latency (E2E) =
last such chunk - st; output tokens from the usage chunk (else the number of such chunks).
TPOT = (latency - TTFT) / (output tokens - 1) is derived from these in the summary.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from testbed.bench.datasets import BenchRequest

JSON = {"Content-Type": "application/json"}


@dataclass
class RequestResult:
    bench_id: str
    send_s: float  # seconds after the benchmark start
    server_id: str | None = None
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


async def send_request(http: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, t0: float,
                       ignore_eos: bool, headers: dict[str, str]) -> RequestResult:
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
               "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    body = msgspec.json.encode(payload)
    st = time.perf_counter()
    res = RequestResult(req.id, st - t0)
    last, chunks, usage = st, 0, None
    try:
        async with http.post(url, data=body, headers=headers) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {text[:300]}"
                res.finish_reason = "rejected" if r.status == 503 and "waiting" in text else "error"
                res.latency = time.perf_counter() - st
                return res
            buf, done = b"", False
            async for piece in r.content.iter_any():  # whatever arrived; events end with a blank line
                if done:
                    break
                now = time.perf_counter()  # events that came in one piece arrived together
                buf += piece
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                        break
                    obj = msgspec.json.decode(data)
                    if "error" in obj:
                        res.error = obj["error"].get("message", "error event")
                        res.finish_reason = "error"
                        done = True
                        break
                    res.server_id = obj.get("id", res.server_id)
                    if obj.get("choices"):
                        if res.ttft is None:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        res.finish_reason = obj["choices"][0].get("finish_reason") or res.finish_reason
                    elif obj.get("usage"):
                        usage = obj["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as e:
        res.error, res.finish_reason = f"{type(e).__name__}: {e}", "error"
    res.latency = last - st if res.ttft is not None else time.perf_counter() - st
    if usage is not None:
        res.output_tokens = usage.get("completion_tokens", chunks)
        res.prompt_tokens = usage.get("prompt_tokens")
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:
        res.output_tokens = chunks
    if res.error is None and res.finish_reason is None:
        res.finish_reason, res.error = "error", "the stream ended without a finish_reason"
    return res


async def replay(url: str, model: str, requests: list[BenchRequest], *, max_concurrency: int | None,
                 ignore_eos: bool, api_key: str | None, timeout: float, on_done=None
                 ) -> tuple[list[RequestResult], float, float]:
    """Send each request at its arrival time (at most `max_concurrency` in flight; a late slot
    delays the send, as in vLLM); returns (results in request order, duration, start as time.time())."""
    headers = {**JSON, "Authorization": f"Bearer {api_key}"} if api_key else JSON
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, ttl_dns_cache=300)
    timeouts = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts, read_bufsize=1 << 20) as http:
        t0_wall, t0 = time.time(), time.perf_counter()

        async def one(req: BenchRequest) -> RequestResult:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await send_request(http, url, model, req, t0, ignore_eos, headers)
            else:
                async with sem:
                    res = await send_request(http, url, model, req, t0, ignore_eos, headers)
            if on_done is not None:
                on_done(res)
            return res

        results = await asyncio.gather(*(one(r) for r in requests))
        return list(results), time.perf_counter() - t0, t0_wall
