"""The sidecar in front of a real fake engine, over real HTTP, with a
plain stand-in for the admission SDK (tests/sidecar_support.py): what is
admitted, forwarded, rewritten, relayed and settled. The end-to-end tests
with the control plane are in test_end_to_end.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from burstgate_client.sidecar import Sidecar, load
from prometheus_client.parser import text_string_to_metric_families

from controlplane.fakeengine import FakeEngine
from tests.sidecar_support import Call, FakeAdmission, FakeAdmitter, refused

MODEL = "fake-llama"


@dataclass
class Rig:
    engine: FakeEngine
    sidecar: Sidecar
    admitter: FakeAdmitter
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar.port}"

    async def post(self, path: str, body: dict[str, Any], **headers: str) -> aiohttp.ClientResponse:
        h = {"authorization": "Bearer sk-acme", **headers}
        return await self.http.post(self.url + path, json=body, headers=h)

    async def engine_metrics(self) -> dict[str, float]:
        async with self.http.get(f"http://127.0.0.1:{self.engine.port}/metrics") as r:
            text = await r.text()
        return {s.name + (f"{{{s.labels.get('finished_reason')}}}"
                          if "finished_reason" in s.labels else ""): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip

    async def settled(self, n: int = 1) -> list[Call]:
        deadline = time.monotonic() + 10
        while len(self.admitter.completes) < n:
            assert time.monotonic() < deadline, f"{len(self.admitter.completes)} of {n} settled"
            await asyncio.sleep(0.01)
        return self.admitter.completes


@asynccontextmanager
async def rig(admitter: FakeAdmitter | None = None, *, speed: float = 50.0,
              **cfg: Any) -> AsyncIterator[Rig]:  # fmt: skip
    engine = FakeEngine(speed=speed, port=0)
    await engine.start()
    admitter = admitter or FakeAdmitter()
    settings = load(**{
        "upstream": f"http://127.0.0.1:{engine.port}", "control_plane": "127.0.0.1:1",
        "port": 0, "api_keys": {"sk-acme": "acme"}, "tenant_lanes": {"acme": "standard"},
        "metrics": {"interval_s": 0.05, "max_num_seqs": 256}, **cfg,
    })  # fmt: skip
    sidecar = Sidecar(settings, admitter)
    await sidecar.start()
    http = aiohttp.ClientSession()
    try:
        yield Rig(engine, sidecar, admitter, http)
    finally:
        await http.close()
        await sidecar.stop()
        await engine.stop()


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 60))


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there, engine"}]}


def test_an_admitted_request_is_forwarded_and_settled_with_the_engines_usage() -> None:
    async def main() -> None:
        async with rig() as r:
            before = time.time_ns()
            resp = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 7},
                                **{"x-request-id": "req-1", "x-burstgate-prompt-tokens": "40"})
            body = await resp.json()
            assert resp.status == 200 and body["usage"]["completion_tokens"] == 7
            assert resp.headers["x-request-id"] == "req-1"
            assert resp.headers["x-burstgate-pricing-multiplier"] == "1.000000"
            # the tenant's first answer waits (briefly) for the GetLimits started
            # beside its Admit: the full set, remaining-tokens the admission's own
            assert {k: v for k, v in resp.headers.items() if k.startswith("x-ratelimit-")} == {
                "x-ratelimit-limit-requests": "8", "x-ratelimit-remaining-requests": "5",
                "x-ratelimit-reset-requests": "0ms", "x-ratelimit-limit-tokens": "1000",
                "x-ratelimit-remaining-tokens": "1000", "x-ratelimit-reset-tokens": "0ms",
            }  # fmt: skip
            assert "x-burstgate-granted-max-tokens" not in resp.headers  # granted what it asked
            (admit,) = r.admitter.admits
            # burstgate's request id is minted per request, never the client's
            # (issue 30 item 3); the client's is its correlation id
            minted = resp.headers["x-burstgate-request-id"]
            assert (admit.tenant_id, admit.request_id) == ("acme", minted)
            assert len(minted) == 32 and minted != "req-1"
            assert admit.kw["lane"] == "standard" and admit.kw["pool"] == "default"
            assert admit.kw["model"] == MODEL and admit.kw["max_tokens"] == 7
            assert admit.kw["prompt_tokens"] == 3 + 4 + 5  # priming, message, 19 bytes
            assert admit.kw["deadline_s"] == 2.25 + 0.25  # the lane's max wait + the call
            (done,) = await r.settled()
            assert (done.request_id, done.kw["correlation_id"]) == (minted, "req-1")
            assert done.kw["prompt_tokens"] == 40 and done.kw["generated_tokens"] == 7
            assert done.kw["cached_prompt_tokens"] == 0
            start, end = done.kw["exec_start_unix_ns"], done.kw["exec_end_unix_ns"]
            assert before <= start <= end <= time.time_ns()
            later = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 1})
            assert later.headers["x-ratelimit-limit-tokens"] == "1000"  # known by now
            assert later.headers["x-ratelimit-limit-requests"] == "8"

    run(main)


def test_a_stream_gets_usage_forced_and_stripped_again() -> None:
    async def main() -> None:
        async with rig() as r:
            resp = await r.post("/v1/chat/completions",
                                {**CHAT, "max_tokens": 5, "stream": True})  # fmt: skip
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [e for e in (await resp.read()).split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert all("usage" not in c and c["choices"] for c in chunks)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
            assert len(text.split()) == 5
            (done,) = await r.settled()
            assert done.kw["generated_tokens"] == 5 and done.kw["prompt_tokens"] > 0
            asked = await r.post("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True,
                                 "max_tokens": 3, "stream_options": {"include_usage": True}})
            tail = [e for e in (await asked.read()).split(b"\n\n") if e][-2]
            assert json.loads(tail[6:])["usage"]["completion_tokens"] == 3  # the client's own
            await r.settled(2)

    run(main)


def test_a_refusal_never_reaches_the_engine() -> None:
    async def main() -> None:
        admitter = FakeAdmitter(decide=lambda c: refused("token_rate", 1500, bucket_remaining=12))
        async with rig(admitter) as r:
            resp = await r.post("/v1/chat/completions", CHAT, **{"x-request-id": "r-9"})
            assert resp.status == 429
            err = (await resp.json())["error"]
            assert err["code"] == "rate_limit_exceeded" and "r-9" in err["message"]
            h = resp.headers
            assert h["retry-after"] == "2" and h["retry-after-ms"] == "1500"
            assert h["x-ratelimit-remaining-tokens"] == "12" and h["x-request-id"] == "r-9"
            assert h["x-burstgate-pricing-multiplier"] == "1.000000"
            assert (await r.engine_metrics())["vllm:prompt_tokens_total"] == 0
            assert r.admitter.completes == []

    run(main)


def test_degradation_caps_max_tokens_and_a_fallback_the_engine_lacks_passes_its_404() -> None:
    async def main() -> None:
        capped = FakeAdmission(degraded=True, max_tokens_cap=4, granted_max_tokens=4)
        async with rig(FakeAdmitter(decide=lambda c: capped)) as r:
            resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "p",
                                                    "max_tokens": 50})  # fmt: skip
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 4
            assert resp.headers["x-burstgate-degraded"] == "max_tokens=4"
            assert resp.headers["x-burstgate-granted-max-tokens"] == "4"
            # two choices share the grant: each is sent (and told) half of it (the
            # fake engine serves n=1 only: its 400 comes back, with the header)
            two = await r.post("/v1/completions", {"model": MODEL, "prompt": "p", "n": 2,
                                                   "max_tokens": 50})  # fmt: skip
            assert two.status == 400 and two.headers["x-burstgate-granted-max-tokens"] == "2"
        fallback = FakeAdmission(degraded=True, fallback_model="tiny", granted_max_tokens=9)
        async with rig(FakeAdmitter(decide=lambda c: fallback)) as r:
            direct = await r.http.post(f"http://127.0.0.1:{r.engine.port}/v1/completions",
                                       json={"model": "tiny", "prompt": "p", "max_tokens": 9})
            resp = await r.post("/v1/completions", {"model": MODEL, "prompt": "p",
                                                    "max_tokens": 9})  # fmt: skip
            assert resp.status == direct.status == 404
            assert await resp.json() == await direct.json()  # the engine's error, unchanged
            assert resp.headers["x-burstgate-degraded"] == "model=tiny"
            (done,) = await r.settled()
            assert done.kw["generated_tokens"] == 0 and done.kw["prompt_tokens"] == 1  # estimate

    run(main)


class SlowLimits(FakeAdmitter):
    """GetLimits that never answers in time."""

    async def limits(self, tenant_id: str) -> Any:
        await asyncio.sleep(30)


def test_a_first_answer_waits_for_getlimits_at_most_limits_timeout_s() -> None:
    async def main() -> None:
        async with rig(SlowLimits(), limits_timeout_s=0.2) as r:
            began = time.monotonic()
            resp = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 3})
            took = time.monotonic() - began
            assert resp.status == 200 and 0.2 <= took < 5
            # what is known without GetLimits: the admission's bucket level only
            assert [k for k in resp.headers if k.startswith("x-ratelimit-")] == [
                "x-ratelimit-remaining-tokens"
            ]

    run(main)


def test_a_client_that_goes_away_mid_stream_is_settled_and_the_engine_request_aborted() -> None:
    async def main() -> None:
        async with rig(speed=1.0) as r:  # real time: ~20 ms a token
            resp = await r.post("/v1/chat/completions",
                                {**CHAT, "max_tokens": 2000, "stream": True})  # fmt: skip
            seen = 0
            async for _ in resp.content.iter_any():
                seen += 1
                if seen >= 5:
                    break
            resp.close()  # the client goes away
            (done,) = await r.settled()
            assert 1 <= done.kw["generated_tokens"] < 2000
            deadline = time.monotonic() + 10
            while (await r.engine_metrics()).get("vllm:request_success_total{abort}") != 1:
                assert time.monotonic() < deadline, "the engine did not abort the request"
                await asyncio.sleep(0.05)
            m = await r.engine_metrics()
            assert m["vllm:num_requests_running"] == 0
            assert m["vllm:generation_tokens_total"] < 2000

    run(main)


def test_an_engine_that_is_down_gives_502_and_a_settlement_of_nothing_generated() -> None:
    async def main() -> None:
        async with rig() as r:
            await r.engine.stop()
            resp = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 5})
            assert resp.status == 502 and (await resp.json())["error"]["code"] == (
                "upstream_unavailable")
            (done,) = await r.settled()
            assert done.kw["generated_tokens"] == 0 and done.kw["prompt_tokens"] == 12
            health = await r.http.get(r.url + "/health")
            assert health.status == 503 and (await health.json())["status"] == "engine_unavailable"

    run(main)


def test_who_the_request_is_for_and_bad_requests() -> None:
    async def main() -> None:
        async with rig(default_tenant=None, tenant_header="x-burstgate-tenant") as r:
            nobody = await r.http.post(r.url + "/v1/chat/completions", json=CHAT)
            assert nobody.status == 401
            assert (await nobody.json())["error"]["code"] == "invalid_api_key"
            by_header = await r.http.post(
                r.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                headers={"x-burstgate-tenant": "agentco", "x-burstgate-lane": "batch"})
            assert by_header.status == 200
            assert r.admitter.admits[-1].tenant_id == "agentco"
            assert r.admitter.admits[-1].kw["lane"] == "batch"
            assert r.admitter.admits[-1].kw["deadline_s"] == 11.25 + 0.25
            # the key wins over the header; a header picks the lane
            keyed = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 1},
                                 **{"x-burstgate-tenant": "agentco", "x-burstgate-lane": "premium"})
            assert keyed.status == 200 and r.admitter.admits[-1].tenant_id == "acme"
            assert r.admitter.admits[-1].kw["lane"] == "premium"
            n = len(r.admitter.admits)
            bad = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": "ten"})
            assert bad.status == 400 and (await bad.json())["error"]["param"] == "max_tokens"
            not_json = await r.http.post(r.url + "/v1/completions", data=b"{",
                                         headers={"authorization": "Bearer sk-acme"})
            assert not_json.status == 400
            long_id = await r.post("/v1/chat/completions", CHAT, **{"x-request-id": "x" * 129})
            assert long_id.status == 400 and "x-request-id" in (await long_id.json())["error"][
                "message"]
            # every malformed body is a 400 that says why (never a 500)
            for raw, says in (
                (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper"),
                (b'{"model": "m", "messages": ' + b"[" * 70 + b"]" * 70 + b"}", "nests deeper"),
                (b'{"model": "a", "model": "b", "messages": []}', "repeats the key 'model'"),
                (b'{"model": "\xff"}', "not valid JSON"),  # not UTF-8
                ('{"model": "\u00e9"}'.encode("latin-1"), "not valid JSON"),
            ):
                bad_body = await r.http.post(r.url + "/v1/chat/completions", data=raw,
                                             headers={"authorization": "Bearer sk-acme"})
                assert bad_body.status == 400, raw[:40]
                assert says in (await bad_body.json())["error"]["message"]
            assert len(r.admitter.admits) == n  # none of these was admitted
            generated = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 1})
            assert len(generated.headers["x-request-id"]) == 32  # none given: the minted one
            assert generated.headers["x-request-id"] == generated.headers["x-burstgate-request-id"]
            assert (await r.settled(2))[-1].kw["correlation_id"] == ""

    run(main)


def test_other_paths_pass_through_and_its_own_endpoints() -> None:
    async def main() -> None:
        async with rig() as r:
            models = await r.http.get(r.url + "/v1/models?x=1")
            assert models.status == 200 and (await models.json())["data"][0]["id"] == MODEL
            missing = await r.http.get(r.url + "/v1/nothing")
            assert missing.status == 404  # the engine's answer
            health = await r.http.get(r.url + "/health")
            assert health.status == 200 and (await health.json())["status"] == "ok"
            await (await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 2})).read()
            await r.settled()
            text = await (await r.http.get(r.url + "/metrics")).text()
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for f in text_string_to_metric_families(text) for s in f.samples}
            prefix = "burstgate_sidecar_"
            assert samples[(prefix + "requests_total", (("outcome", "admitted"),))] == 1
            assert samples[(prefix + "passthrough_requests_total", ())] == 2
            assert samples[(prefix + "settlements_total", (("result", "delivered"),))] == 1
            assert samples[(prefix + "upstream_responses_total", (("status", "2xx"),))] == 1

    run(main)


def test_the_engines_metrics_become_load_reports() -> None:
    async def main() -> None:
        async with rig(speed=1.0) as r:
            stream = await r.post("/v1/chat/completions",
                                  {**CHAT, "max_tokens": 60, "stream": True})  # fmt: skip
            deadline = time.monotonic() + 10
            while not any(p.requests_running == 1 and p.batch_tokens > 0
                          for p in r.admitter.reports):  # fmt: skip
                assert time.monotonic() < deadline, r.admitter.reports[-3:]
                await asyncio.sleep(0.02)
            await stream.read()
            report = r.admitter.reports[-1]
            assert report.pool == "default" and report.engine_id == f"127.0.0.1:{r.engine.port}"
            assert report.max_num_seqs == 256 and report.max_batch_tokens == 8192
            assert report.queue_depth == 0 and report.HasField("kv_cache_usage")

    run(main)


def test_shutdown_drains_a_stream_in_flight() -> None:
    async def main() -> None:
        async with rig(speed=1.0) as r:
            resp = await r.post("/v1/chat/completions",
                                {**CHAT, "max_tokens": 30, "stream": True})  # fmt: skip
            await resp.content.readline()  # it has started
            stopping = asyncio.create_task(r.sidecar.stop())
            body = await resp.read()
            assert body.endswith(b"data: [DONE]\n\n")
            await stopping
            (done,) = r.admitter.completes
            assert done.kw["generated_tokens"] == 30
            try:
                await r.http.get(r.url + "/health")
                raise AssertionError("a stopped sidecar answered")
            except aiohttp.ClientConnectionError:
                pass

    run(main)


def test_the_tenant_header_is_ignored_unless_configured() -> None:
    async def main() -> None:
        async with rig(default_tenant=None) as r:
            claimed = await r.http.post(r.url + "/v1/chat/completions", json=CHAT,
                                        headers={"x-burstgate-tenant": "acme"})  # fmt: skip
            assert claimed.status == 401 and r.admitter.admits == []

    run(main)


def test_an_engine_stream_that_breaks_is_settled_with_what_it_carried() -> None:
    """An engine that dies mid-stream: the client's stream breaks too (it
    must not look complete), and the request is settled with the chunks
    that came."""

    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for word in (" the", " gate", " holds"):
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()  # no terminating chunk, no [DONE]
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", broken)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        admitter = FakeAdmitter()
        sidecar = Sidecar(load(upstream=f"http://127.0.0.1:{port}", control_plane="x:1", port=0,
                               default_tenant="acme", metrics={"enabled": False}), admitter)
        await sidecar.start()
        try:
            async with aiohttp.ClientSession() as http:
                resp = await http.post(f"http://127.0.0.1:{sidecar.port}/v1/chat/completions",
                                       json={**CHAT, "stream": True, "max_tokens": 50})
                assert resp.status == 200
                try:
                    body = await resp.read()
                    raise AssertionError(f"the broken stream looked complete: {body!r}")
                except aiohttp.ClientPayloadError:
                    pass
            deadline = time.monotonic() + 10
            while not admitter.completes:
                assert time.monotonic() < deadline, "not settled"
                await asyncio.sleep(0.01)
            (done,) = admitter.completes
            assert done.kw["generated_tokens"] == 3 and done.kw["prompt_tokens"] == 12
        finally:
            await sidecar.stop()
            await runner.cleanup()

    run(main)


def test_retries_carry_the_clients_key_or_a_digest_and_their_attempt() -> None:
    # docs/gate.md, "Retries": the plane judges a retry (x-stainless-retry-count
    # > 0, as the openai client counts them) against its first attempt's
    # deadline, under a key that is the same on every attempt
    async def main() -> None:
        async with rig() as r:
            body = {**CHAT, "max_tokens": 2}
            await r.post("/v1/chat/completions", body, **{"x-stainless-retry-count": "0"})
            await r.post("/v1/chat/completions", body, **{"x-stainless-retry-count": "2"})
            await r.post("/v1/chat/completions", {**body, "max_tokens": 3})
            await r.post("/v1/chat/completions", body, **{"idempotency-key": "mine-1",
                                                          "x-stainless-retry-count": "x"})
            first, retry, other, keyed = r.admitter.admits
            assert first.request_id != retry.request_id  # a new ledger id per HTTP request
            assert first.kw["retry_key"] == retry.kw["retry_key"] != other.kw["retry_key"]
            assert first.kw["retry_key"].startswith("b:")  # the digest of tenant and body
            assert (first.kw["attempt"], retry.kw["attempt"], other.kw["attempt"]) == (0, 2, 0)
            assert (keyed.kw["retry_key"], keyed.kw["attempt"]) == ("mine-1", 0)  # not a count

    run(main)


def test_a_stream_reports_when_its_first_token_came() -> None:
    async def main() -> None:
        async with rig(speed=1.0) as r:  # the modelled engine in real time (~6 ms a token)
            resp = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 40, "stream": True})
            await resp.read()
            plain = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 5})
            await plain.read()
            streamed, whole = await r.settled(2)
            start, first, end = (streamed.kw[k] for k in (
                "exec_start_unix_ns", "first_token_unix_ns", "exec_end_unix_ns"))  # fmt: skip
            # the first of 40 tokens comes well before the last
            assert start < first < end and first - start < (end - start) / 4
            # a whole answer arrives at once: its first token's time is not known
            assert whole.kw["first_token_unix_ns"] == 0

    run(main)


async def _raw(port: int, head: bytes, body: bytes, path: bytes = b"/v1/chat/completions",
               close: bool = True) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One request written byte for byte (headers no client library would
    send), and the answer: status, headers (lower-case names), body. Read
    until the connection closes (``close``: the request asks for it)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST " + path + b" HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n" % len(body) + (b"Connection: close\r\n" if close else b"")
            + head + b"\r\n" + body)  # fmt: skip
    await w.drain()
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def test_a_body_over_max_body_bytes_is_413_in_openai_form() -> None:
    # Issue 30 item 11: aiohttp answered its own text/plain 413 (or a
    # passthrough path's); now every one is OpenAI's JSON error, and a
    # declared Content-Length over the limit is refused before any read.
    async def main() -> None:
        async with rig(max_body_bytes=4096) as r:
            big = {**CHAT, "max_tokens": 1, "pad": "x" * 5000}
            for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
                resp = await r.post(path, big)
                assert resp.status == 413, path
                assert resp.headers["content-type"].startswith("application/json"), path
                err = (await resp.json())["error"]
                assert err["code"] == "request_too_large" and "4,096 bytes" in err["message"]
                assert err["type"] == "invalid_request_error"

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
                yield b'{"model": "m", "messages": [], "pad": "'
                for _ in range(10):
                    yield b"x" * 1000
                yield b'"}'

            chunked = await r.http.post(r.url + "/v1/chat/completions", data=chunks(),
                                        headers={"authorization": "Bearer sk-acme"})  # fmt: skip
            assert chunked.status == 413
            assert (await chunked.json())["error"]["code"] == "request_too_large"
            # declared larger than it is: answered from the header alone
            # (a keep-alive request: the sidecar closes the connection itself)
            status, headers, body = await _raw(
                r.sidecar.port, b"authorization: Bearer sk-acme\r\n", b"{}" * 2049, close=False)
            assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
            assert headers["connection"] == "close" and headers["x-burstgate-request-id"]
            assert r.admitter.admits == []  # none of them reached the admission
            fits = await r.post("/v1/chat/completions", {**CHAT, "max_tokens": 1,
                                                         "pad": "x" * 3000})  # fmt: skip
            assert fits.status == 200

    run(main)


def test_header_values_the_sidecar_uses_must_be_text_else_400_naming_the_header() -> None:
    # Issue 30 item 11: a tenant header with a byte that is not UTF-8 was a
    # 500 (the retry key's digest could not encode it); a TAB or such in the
    # tenant, lane or idempotency key went on to the plane as a name or key.
    async def main() -> None:
        async with rig(default_tenant=None, tenant_header="x-burstgate-tenant") as r:
            port, keyed = r.sidecar.port, b"authorization: Bearer sk-acme\r\n"
            body = json.dumps({**CHAT, "max_tokens": 1}).encode()
            for head, header in (
                (b"x-burstgate-tenant: acme\xe9\r\n", "x-burstgate-tenant"),
                (b"x-burstgate-tenant: ac\tme\r\n", "x-burstgate-tenant"),
                (b"x-burstgate-tenant: " + b"t" * 129 + b"\r\n", "x-burstgate-tenant"),
                (keyed + b"x-burstgate-lane: batch\xff\r\n", "x-burstgate-lane"),
                (keyed + b"x-request-id: id\t1\r\n", "x-request-id"),
                (keyed + b"x-request-id: \xc3(\r\n", "x-request-id"),
                (keyed + b"idempotency-key: k\t1\r\n", "idempotency-key"),
            ):
                status, headers, answer = await _raw(port, head, body)
                assert status == 400, head
                err = json.loads(answer)["error"]
                assert err["message"].startswith(f"header {header}: "), (head, err)
                assert err["type"] == "invalid_request_error"
                assert headers["x-burstgate-request-id"]
            # CR, LF (bare or folding), NUL and other control characters never
            # reach the sidecar's code: aiohttp's parser answers 400 itself, in
            # plain text saying what it found (its C parser quotes the line)
            for head, says in (
                (keyed + b"x-request-id: a\x00b\r\n", b"Invalid header value char"),
                (keyed + b"x-burstgate-tenant: a\x1bb\r\n", b"Invalid header value char"),
                (keyed + b"x-burstgate-tenant: a\rb\r\n", b"Missing expected LF"),
                (keyed + b"x-request-id: a\nx-burstgate-tenant: evil\r\n", b"Missing expected CR"),
                (keyed + b"idempotency-key: a\r\n b\r\n", b"Unexpected whitespace"),
            ):
                status, _, answer = await _raw(port, head, body)
                # (the pure-Python parser, AIOHTTP_NO_EXTENSIONS=1, says "Invalid HTTP header")
                assert status == 400, (head, answer)
                assert says in answer or b"Invalid HTTP header" in answer, (head, answer)
            assert r.admitter.admits == []
            # UTF-8 text is text: a tenant named in it is admitted as it is
            status, _, _ = await _raw(port, "x-burstgate-tenant: café\r\n".encode(), body)
            assert status == 200 and r.admitter.admits[-1].tenant_id == "café"

    run(main)
