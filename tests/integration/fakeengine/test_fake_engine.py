"""The fake engine speaks the OpenAI API as the official client reads it
(streamed and not, usage included), its /metrics parse with the Prometheus
parser and agree with the answers, and it queues and aborts as the engine
model says."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import pytest

from controlplane.fakeengine.text import CHAT_HEADER, chat_prompt, estimate_tokens
from controlplane.sim.engine import EngineParams
from tests.integration.fakeengine.conftest import EngineThread
from tests.support import wait_until

MODEL = "fake-llama"
PROMPT = "Tell me about bursts of traffic. " * 20


def client(srv: EngineThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=30)


def body_of(err: openai.APIStatusError) -> dict[str, Any]:
    """The OpenAI error object the client read from the body."""
    assert isinstance(err.body, dict)
    return err.body


def chat(c: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
    return c.chat.completions.create(model=MODEL, **kw)


def test_different_short_chats_share_the_templates_header_blocks(
    make_engine: Callable[..., EngineThread],
) -> None:
    """As on vLLM, the chat template's header is part of every chat's prompt:
    short, different questions hit its whole blocks after the first, and the
    engine's miss rate stays that of a chat engine, not 100%."""
    srv = make_engine()
    c = client(srv)
    header_blocks = len(CHAT_HEADER.encode()) // (16 * 4) * 16  # whole 16-token blocks
    cached = []
    for i in range(12):
        r = chat(c, max_tokens=1, messages=[{"role": "user", "content": f"Question {i}?"}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert r.usage.prompt_tokens == estimate_tokens(chat_prompt([f"user: Question {i}?"]))
    assert cached[0] == 0 and cached[1:] == [header_blocks] * 11
    m = srv.metrics()
    miss = 1 - m["vllm:prefix_cache_hits_total"] / m["vllm:prefix_cache_queries_total"]
    assert miss < 0.30  # below the spec's default step: the price stays at the base


def test_chat_not_streamed(make_engine: Callable[..., EngineThread]) -> None:
    srv = make_engine()
    c = client(srv)
    r = chat(c, max_tokens=17)
    assert r.object == "chat.completion" and r.model == MODEL
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.message.content.split()) == 17
    assert r.usage.completion_tokens == 17
    assert r.usage.prompt_tokens == estimate_tokens(chat_prompt([f"user: {PROMPT}"]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 17
    # the same request, the same answer (seeded); the second finds its prefix cached
    again = chat(c, max_tokens=17)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # a request's own seed changes the words, not their count
    other = chat(c, max_tokens=17, seed=7)
    assert other.choices[0].message.content != choice.message.content
    assert len(other.choices[0].message.content.split()) == 17


def test_output_length_from_the_hint_header(make_engine: Callable[..., EngineThread]) -> None:
    c = client(make_engine())
    hint = {"x-burstgate-output-tokens": "9"}
    r = chat(c, max_tokens=50, extra_headers=hint)  # the trace's length, under the cap
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (9, "stop")
    r = chat(c, max_tokens=4, extra_headers=hint)  # the cap decides
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (4, "length")
    r = chat(c, extra_headers={**hint, "x-burstgate-prompt-tokens": "1234"})
    assert (r.usage.completion_tokens, r.usage.prompt_tokens) == (9, 1234)
    r = chat(c)  # no max_tokens, no hint: the server's default
    assert r.usage.completion_tokens == 256 and r.choices[0].finish_reason == "length"


def test_chat_streamed_with_and_without_usage(make_engine: Callable[..., EngineThread]) -> None:
    c = client(make_engine())
    whole = chat(c, max_tokens=12).choices[0].message.content
    chunks = list(chat(c, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole  # token by token, the same answer
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.completion_tokens, last.usage.prompt_tokens) == (
        12, estimate_tokens(chat_prompt([f"user: {PROMPT}"])),
    )  # fmt: skip
    assert all(ch.usage is None for ch in chunks[:-1])
    # one chunk per step: a token each (the role first, the finish last)
    assert len(chunks) == 1 + 12 + 1 + 1
    plain = list(chat(c, max_tokens=12, stream=True))
    assert all(ch.usage is None and ch.choices for ch in plain)
    assert "".join(ch.choices[0].delta.content or "" for ch in plain) == whole


def test_completions_streamed_and_not(make_engine: Callable[..., EngineThread]) -> None:
    c = client(make_engine())
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert r.object == "text_completion" and len(r.choices[0].text.split()) == 6
    assert r.usage is not None and r.usage.prompt_tokens == estimate_tokens("Once upon a time")
    parts = list(
        c.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text
    usage = parts[-1].usage
    assert usage is not None and usage.completion_tokens == 6


def test_models_and_errors(make_engine: Callable[..., EngineThread]) -> None:
    srv = make_engine(EngineParams(kv_capacity_tokens=4096, max_num_batched_tokens=2048))
    c = client(srv)
    [model] = c.models.list().data
    assert model.id == MODEL
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert body_of(nf.value) == {**body_of(nf.value), "code": "model_not_found", "param": "model"}
    with pytest.raises(openai.BadRequestError) as bad:
        chat(c, max_tokens=0)
    assert body_of(bad.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as long:
        chat(c, max_tokens=5000)  # more than the context
    assert "maximum context length is 4096" in body_of(long.value)["message"]
    with pytest.raises(openai.BadRequestError) as hint:
        chat(c, extra_headers={"x-burstgate-output-tokens": "many"})
    assert "x-burstgate-output-tokens" in body_of(hint.value)["message"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[])
    raw = urllib.request.Request(
        f"{srv.base_url}/chat/completions", data=b"{not json", method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(raw, timeout=10)
    assert http.value.code == 400
    body = json.loads(http.value.read())
    assert body["error"]["type"] == "invalid_request_error"
    # nothing of the refused requests reached the model
    m = srv.metrics()
    assert m["vllm:prompt_tokens_total"] == 0 and m["vllm:generation_tokens_total"] == 0


def test_metrics_agree_with_the_answers(make_engine: Callable[..., EngineThread]) -> None:
    srv = make_engine()
    c = client(srv)
    usages = [chat(c, max_tokens=n).usage for n in (3, 8, 21)]
    usages.append(chat(c, max_tokens=50, extra_headers={"x-burstgate-output-tokens": "5"}).usage)
    m = srv.metrics()
    assert m["vllm:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    # computed prompt tokens (the model has no prefix-cache speed-up: all of them)
    assert m["vllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert m["vllm:prefix_cache_queries_total"] == sum(u.prompt_tokens for u in usages)
    assert m["vllm:prefix_cache_hits_total"] == sum(
        u.prompt_tokens_details.cached_tokens for u in usages
    )
    assert m["vllm:request_success_total{finished_reason=length}"] == 3
    assert m["vllm:request_success_total{finished_reason=stop}"] == 1
    assert m["vllm:time_to_first_token_seconds_count"] == 4
    assert m["vllm:e2e_request_latency_seconds_count"] == 4
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:time_to_first_token_seconds_sum"] > 0


def test_a_full_engine_queues_the_rest(make_engine: Callable[..., EngineThread]) -> None:
    import concurrent.futures

    # two sequences at a time, and a slow clock (a step of ~6 model ms takes
    # ~12 ms of wall time): six requests of 100 tokens take three rounds
    srv = make_engine(EngineParams(max_num_seqs=2), speed=0.5)
    c = client(srv)
    samples: list[tuple[float, float]] = []
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, c, max_tokens=100, seed=i) for i in range(6)]
        while not all(f.done() for f in futures):
            m = srv.metrics()
            samples.append((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]))
            time.sleep(0.02)
        results = [f.result(timeout=60) for f in futures]
    assert all(r.usage.completion_tokens == 100 for r in results)
    assert max(running for running, _ in samples) == 2  # never more than max_num_seqs
    assert max(waiting for _, waiting in samples) >= 3  # the rest waited their turn
    m = srv.metrics()
    assert m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["vllm:request_queue_time_seconds_count"] == 6
    # a round is ~100 steps of ~6 model ms: the last two waited two rounds
    # (~1.2 model s), at least: over 0.5 s of queue time (model time)
    assert m["vllm:request_queue_time_seconds_bucket{le=0.5}"] <= 4


def test_a_client_that_goes_away_is_aborted(make_engine: Callable[..., EngineThread]) -> None:
    srv = make_engine(speed=1.0)
    c = client(srv)
    stream = chat(c, max_tokens=2000, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()  # the client disconnects mid-answer
    wait_until(lambda: srv.metrics().get("vllm:request_success_total{finished_reason=abort}") == 1,
               message="the request counted as aborted", timeout=20)  # fmt: skip
    wait_until(
        lambda: srv.metrics()["vllm:num_requests_running"] == 0,
        message="the request left the engine",
        timeout=20,
    )
    m = srv.metrics()
    assert m["vllm:generation_tokens_total"] < 2000  # it stopped generating
    assert m["vllm:kv_cache_usage_perc"] == 0  # its blocks were freed


def test_the_command(tmp_path: Any) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "controlplane", "fake-engine", "--port", "0", "--speed", "50",
         "--model", "m1"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:  # fmt: skip
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.startswith("fake engine listening on http://127.0.0.1:"), line
            base = line.split()[4]
            c = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30)
            assert [m.id for m in c.models.list().data] == ["m1"]
            r = c.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert r.usage is not None and r.usage.completion_tokens == 3
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=20)
    assert code == 0
    bad = subprocess.run(
        [sys.executable, "-m", "controlplane", "fake-engine", "--speed", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--speed" in bad.stderr
