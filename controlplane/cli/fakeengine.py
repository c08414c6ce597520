"""``burstgate fake-engine``: an OpenAI-compatible engine on the simulate
engine model, in scaled real time (controlplane/fakeengine)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli.common import fail


def fake_engine(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0 = any free port).")] = 8000,
    model: Annotated[str, typer.Option(help="The model name it serves.")] = "fake-llama",
    speed: Annotated[
        float, typer.Option(min=0.001, help="Model time per wall time: 10 = ten times faster.")
    ] = 1.0,
    engine_config: Annotated[
        Path | None, typer.Option(help="YAML with an 'engine:' section (default: the 8B/H100 one).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated words.")] = 0,
    default_max_tokens: Annotated[
        int, typer.Option(min=1, help="Output tokens of a request that gives no max_tokens.")
    ] = 256,
) -> None:
    """Serve /v1/chat/completions, /v1/completions (streamed or not), /v1/models
    and vLLM-named /metrics from the modelled engine, until Ctrl-C.

    A request gets the x-burstgate-output-tokens header's count of tokens
    (capped by max_tokens), else max_tokens; x-burstgate-prompt-tokens sets the
    prompt's count. docs/loadtest.md."""
    import asyncio

    from controlplane.fakeengine import FakeEngine
    from controlplane.fakeengine.app import EngineConfig
    from controlplane.sim.engine import EngineParams

    try:
        params = EngineParams.load(engine_config) if engine_config else EngineParams()
    except (OSError, ValueError) as exc:
        fail(f"--engine-config: {exc}")
    engine = FakeEngine(
        params, EngineConfig(model, seed, default_max_tokens), speed=speed, host=host, port=port
    )

    async def main() -> None:
        try:
            bound = await engine.start()
        except OSError as exc:
            fail(f"--port: cannot listen on {host}:{port}: {exc.strerror or exc}", 7)
        typer.echo(
            f"fake engine listening on http://{host}:{bound}/v1 (model {model}, "
            f"speed {speed:g}x, metrics http://{host}:{bound}/metrics)",
            err=True,
        )
        try:
            await asyncio.Event().wait()
        finally:
            await engine.stop()

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop quietly
        asyncio.run(main())
