"""A P/D proxy that sends each request to the prefill and the decode engine at once.

vllm-router 0.1.17 drives P first: D hears of a request only with P's finished
parameters. In push mode D can register its blocks earlier, while P still prefills
(stock push's flow): the decode engine allocates, grants the prefill engine a lease
on those blocks and registers them; the prefill engine heartbeats that lease from
then on and writes once its prefill is done (spec/push-mode.md §7). This proxy
makes that flow. Per request it picks one ``X-Request-Id`` for both engines (each
engine appends its own random suffix; the registration names the request without
it) and sends at once:

* to P the request as a one-token prefill for a remote decoder
  (``kv_transfer_params: {"do_remote_decode": true}``, not streamed);
* to D the request as the client sent it, with where P is instead of P's finished
  parameters (``do_remote_prefill``, ``remote_engine_id``, ``remote_host``,
  ``remote_port``, ``tp_size``, ``kvproto_transfer_mode``): D's answer, streamed or
  not, goes back to the client.

P's engine id must be fixed (``engine_id`` in P's ``--kv-transfer-config``): the
proxy names it to D. Run::

    python -m examples.pd_cpu.push_proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --prefill-engine-id prefill-0 \\
        --prefill-side-channel 127.0.0.1:5600 --decode http://127.0.0.1:8200

A prefill that fails leaves D's registration unclaimed or unwritten: P gives it up
after one lease duration, or D's lease lapses, and D prefills locally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

ROUTES = ("/v1/completions", "/v1/chat/completions")
"""The OpenAI endpoints the proxy splits; everything else is answered 404."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Prefill:
    """The prefill engine, as the decode engine must name it before it has run."""

    url: str
    """Base URL of its HTTP server."""
    engine_id: str
    """Its ``kv_transfer_config.engine_id``."""
    host: str
    """Its side channel's host (``VLLM_NIXL_SIDE_CHANNEL_HOST``)."""
    port: int
    """Its rank 0's side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``)."""
    tp_size: int = 1
    """Its tensor-parallel size."""

    def decode_params(self) -> dict[str, Any]:
        """What the decode engine gets instead of the prefill's finished parameters."""
        return {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "kvproto_transfer_mode": ["pull", "push"],
        }


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for P: a one-token prefill whose blocks a decoder is to get."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    out.pop("max_completion_tokens", None)
    out["n"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], prefill: Prefill) -> dict[str, Any]:
    """The request for D: the client's, with where its KV will come from."""
    return {**body, "kv_transfer_params": prefill.decode_params()}


def make_app(prefill: Prefill, decode_url: str) -> web.Application:
    """The proxy's aiohttp application."""
    app = web.Application()
    session: dict[str, ClientSession] = {}

    async def start(_: web.Application) -> None:
        session["s"] = ClientSession(timeout=ClientTimeout(total=None))

    async def stop(_: web.Application) -> None:
        await session["s"].close()

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def split(request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body is not a JSON object"}, status=400)
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        http = session["s"]
        path = request.path
        prefilled = asyncio.create_task(
            _discard(http.post(prefill.url + path, json=prefill_body(body), headers=headers))
        )
        try:
            async with http.post(
                decode_url + path, json=decode_body(body, prefill), headers=headers
            ) as answer:
                reply = web.StreamResponse(status=answer.status)
                reply.content_type = answer.content_type
                await reply.prepare(request)
                async for chunk in answer.content.iter_any():
                    await reply.write(chunk)
                await reply.write_eof()
                return reply
        finally:
            await prefilled

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    for route in ROUTES:
        app.router.add_post(route, split)
    return app


async def _discard(call: Any) -> None:
    """Await P's answer (its one token is not the client's) and drop it; a failed
    prefill is D's to survive (it recomputes), not the client's error."""
    try:
        async with call as response:
            await response.read()
    except (OSError, asyncio.TimeoutError):
        pass


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    parser.add_argument("--prefill-engine-id", required=True)
    parser.add_argument(
        "--prefill-side-channel", required=True, help="HOST:PORT of its rank 0's side channel"
    )
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode", required=True, help="the decode engine's base URL")
    args = parser.parse_args(argv)
    host, _, port = args.prefill_side_channel.rpartition(":")
    if not host or not port.isdigit():
        parser.error("--prefill-side-channel takes HOST:PORT")
    prefill = Prefill(
        url=args.prefill.rstrip("/"),
        engine_id=args.prefill_engine_id,
        host=host,
        port=int(port),
        tp_size=args.prefill_tp,
    )
    web.run_app(
        make_app(prefill, args.decode.rstrip("/")), host=args.host, port=args.port, print=None
    )


if __name__ == "__main__":
    main()
