"""The burst through the sidecar of docs/sidecar.md, "A first run":
three requests of 2,048 tokens at once from the demo's free tier (a
4,000-token bucket refilling at 200 tokens/s) in the standard lane, where a
request may be held up to 2.25 s. Needs the demo, the fake engine and the
sidecar of that section running; the `openai` package (the test extra)."""

from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI, RateLimitError

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="sk-free-456", max_retries=0)


def ask(i: int) -> str:
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="fake-llama", messages=[{"role": "user", "content": f"Question {i}"}],
            max_tokens=2048, extra_headers={"x-burstgate-lane": "standard"})
        return (f"{i}: {raw.parse().usage.completion_tokens} tokens, held "
                f"{raw.headers.get('x-burstgate-queue-wait-ms', '0')} ms")
    except RateLimitError as exc:
        h = exc.response.headers
        return (f"{i}: 429 {exc.response.json()['error']}\n   retry-after {h['retry-after']}, "
                + ", ".join(f"{k} {v}" for k, v in h.items() if k.startswith("x-ratelimit")))


with ThreadPoolExecutor(3) as pool:
    for line in pool.map(ask, range(3)):
        print(line)
