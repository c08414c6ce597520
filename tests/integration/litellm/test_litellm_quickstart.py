"""README.md's "LiteLLM in one command", run as written: a real ``litellm``
proxy started with exactly deploy/litellm/quickstart.yaml (no LiteLLM
database, no custom auth: the master key is the only key) and the README's
own command line, in front of the fake engine, with a control plane on
PostgreSQL that holds exactly the demo's configuration (controlplane/demo.yaml,
what ``burstgate demo`` loads). The README's curl is admitted (200); a free-tier
burst gets burstgate's refusal as LiteLLM's 429 with ``retry-after``."""

from __future__ import annotations

import json
import re
import shlex
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import openai
import pytest

from controlplane import configfile
from controlplane.domain.policy import Policy
from controlplane.store.config import ConfigRepository
from controlplane.store.db import make_engine, upgrade
from tests.conftest import fresh_pg_database
from tests.integration.litellm.conftest import EngineThread, LiteLLMProxy, Stack
from tests.integration.sdk.conftest import Plane

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
CONFIG = "deploy/litellm/quickstart.yaml"


@dataclass(frozen=True)
class Snippet:
    """The README section's shell lines, parsed as the shell would."""

    engine_port: int
    env: dict[str, str]  # the proxy line's VAR=value prefix
    proxy_args: list[str]  # after the program
    curl_headers: dict[str, str]
    curl_body: dict[str, object]


def readme_snippet() -> Snippet:
    text = (ROOT / "README.md").read_text()
    section = text.split("### LiteLLM in one command", 1)[1].split("\n#", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line) for line in block.splitlines() if line.strip()]
    engine = next(words for words in lines if words[1:2] == ["fake-engine"])
    proxy = next(words for words in lines if any(w.endswith("/litellm") for w in words))
    curl = next(words for words in lines if words[0] == "curl")
    cut = next(i for i, w in enumerate(proxy) if "=" not in w)
    headers = dict(
        (name.strip().lower(), value.strip())
        for flag, arg in pairwise(curl)
        if flag == "-H"
        for name, value in [arg.split(":", 1)]
    )
    return Snippet(
        engine_port=int(engine[engine.index("--port") + 1]),
        env=dict(w.split("=", 1) for w in proxy[:cut]),
        proxy_args=proxy[cut + 1 :],
        curl_headers=headers,
        curl_body=json.loads(curl[curl.index("-d") + 1]),
    )


def demo_plane(url: str, work: Path) -> Plane:
    """A served plane on ``url`` with the demo's lanes, tenants and policy."""
    upgrade(url)
    engine = make_engine(url)
    base = Policy(gate_fallback_inflight=100_000)  # Plane's own settings
    try:
        configfile.apply(ConfigRepository(engine), configfile.load(configfile.DEMO_CONFIG), None,
                         base)  # fmt: skip
    finally:
        engine.dispose()
    plane = Plane(url, {}, work / "ledger-spool")
    plane.start()
    return plane


@pytest.fixture(scope="module")
def quick(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    snippet = readme_snippet()
    work = tmp_path_factory.mktemp("litellm-quickstart")
    for url in fresh_pg_database(pg_admin_dsn):
        plane = demo_plane(url, work)
        engine = EngineThread(speed=400.0)
        # The README's environment, with the engine where this test runs it;
        # the control plane's address is the one setting the README leaves to
        # its default (127.0.0.1:50051, `burstgate demo`'s).
        env = {**snippet.env, "ENGINE_API_BASE": f"http://127.0.0.1:{engine.port}/v1",
               "BURSTGATE_LITELLM_CONTROL_PLANE": plane.target}  # fmt: skip
        proxy = LiteLLMProxy(work, ROOT / CONFIG, env)
        try:
            yield Stack(plane, engine, proxy)
        finally:
            proxy.stop()
            engine.stop()
            plane.stop()
            assert plane.proxy is not None
            plane.proxy.close()


def test_the_readme_names_the_shipped_file_and_the_engine_it_starts() -> None:
    snippet = readme_snippet()
    assert snippet.proxy_args[:2] == ["--config", CONFIG] and (ROOT / CONFIG).is_file()
    assert snippet.env["ENGINE_API_BASE"] == f"http://127.0.0.1:{snippet.engine_port}/v1"
    port = snippet.proxy_args[snippet.proxy_args.index("--port") + 1]
    master = snippet.env["LITELLM_MASTER_KEY"]
    assert snippet.curl_headers["authorization"] == f"Bearer {master}"
    readme = (ROOT / "README.md").read_text()
    assert f"curl -si http://127.0.0.1:{port}/v1/chat/completions" in readme
    # the file itself: no database, the header rule, the demo's model
    config = (ROOT / CONFIG).read_text()
    assert "database_url" not in config and "custom_auth" not in config
    assert re.search(r"BURSTGATE_LITELLM_TENANT_FROM: header\.x-burstgate-tenant", config)


def test_the_readme_request_is_admitted(quick: Stack) -> None:
    snippet = readme_snippet()
    request = urllib.request.Request(
        f"{quick.proxy.url}/v1/chat/completions",
        data=json.dumps(snippet.curl_body).encode(),
        headers={**snippet.curl_headers, "x-litellm-call-id": "quick-readme"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.status == 200
        assert answer.headers["x-burstgate-pricing-multiplier"] == "1.000000"
        body = json.loads(answer.read())
    assert body["usage"]["completion_tokens"] == snippet.curl_body["max_tokens"]
    row = quick.rows("quick-readme")["quick-readme"]
    assert (row.tenant_id, row.pool, row.output_tokens) == ("acme", "fake-llama", 8)


def test_a_free_tier_burst_gets_burstgates_429(quick: Stack) -> None:
    """free-tier: a 4,000-token bucket refilling at 200 tokens/s; in the
    standard lane a request waits at most 2.25 s. Requests of ~2,000 tokens
    each (a long prompt and 100 output tokens: cheap to serve): the first is
    admitted, and by the third at the latest one would wait far longer than
    2.25 s for the bucket, so it is refused at once."""
    snippet = readme_snippet()
    client = openai.OpenAI(
        base_url=quick.proxy.url + "/v1", api_key=snippet.env["LITELLM_MASTER_KEY"],
        max_retries=0, timeout=60,
        default_headers={"x-burstgate-tenant": "free-tier", "x-burstgate-lane": "standard"},
    )  # fmt: skip
    messages = [{"role": "user", "content": "burst " * 1900}]

    def ask(call_id: str) -> object:
        return client.chat.completions.with_raw_response.create(
            model="fake-llama", messages=messages, max_tokens=100,  # type: ignore[arg-type]
            extra_headers={"x-litellm-call-id": call_id})  # fmt: skip

    ask("free-1")
    admitted = ["free-1"]
    with pytest.raises(openai.RateLimitError) as err:
        for n in (2, 3):
            ask(f"free-{n}")
            admitted.append(f"free-{n}")
    h = err.value.response.headers
    assert err.value.response.status_code == 429
    assert h["x-burstgate-reason"] == "token_rate" and int(h["retry-after"]) >= 3
    assert "free-tier" in err.value.response.json()["error"]["message"]
    assert set(quick.rows(*admitted)) == set(admitted)  # nothing booked for the refused one


def test_a_request_without_the_header_is_refused_with_the_rule_named(quick: Stack) -> None:
    client = openai.OpenAI(base_url=quick.proxy.url + "/v1", max_retries=0, timeout=60,
                           api_key=readme_snippet().env["LITELLM_MASTER_KEY"])  # fmt: skip
    with pytest.raises(openai.PermissionDeniedError) as err:
        client.chat.completions.create(model="fake-llama", max_tokens=3,
                                       messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert "header.x-burstgate-tenant" in err.value.response.json()["error"]["message"]
