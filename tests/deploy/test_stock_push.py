"""Stock vLLM 0.32.0 push mode (NixlPushConnector) through vllm-router: what kvproto's push
mode is compared with (spec/push-mode.md §1).

Opt-in (``KVPROTO_STOCK_BESIDE=1``): it measures stock, not kvproto, and its kill case
watches D for a minute. Through ``--kv-connector nixl`` the router drives push as it drives
pull (P first, P's ``kv_transfer_params`` to D unchanged): the answers equal the
baseline and every prompt token reaches D from P. Then P is stopped between its prefill
answer and D's registration (the handshakes are cached by then, so the registration is a
NIXL notification the stopped P's kernel accepts) and killed: D keeps the request
waiting and its blocks allocated, however long (the watchdog only drops registrations).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from examples.pd_cpu.client import Answer, RequestFailed, complete, metrics, prefill
from examples.pd_cpu.cluster import Deployment, ModelSpec, default_layout, free_port
from examples.pd_cpu.tiny_model import make_prompt

from .baseline import Baseline
from .conftest import FIGURES, wait_for

pytestmark = pytest.mark.skipif(
    os.environ.get("KVPROTO_STOCK_BESIDE") != "1",
    reason="measures stock vLLM's push mode: set KVPROTO_STOCK_BESIDE=1",
)

WATCH_S = 60.0
"""How long D is watched after P's kill -9."""


@pytest.fixture(scope="module")
def stock_push(
    deploy_model: ModelSpec, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    prefills, decode = default_layout(1, base_port=None)
    deployment = Deployment(
        deploy_model,
        tmp_path_factory.mktemp("pd-stock-push"),
        connector="stock-push",
        prefills=prefills,
        decode=decode,
        router_port=free_port(),
        router_metrics_port=free_port(),
    )
    with deployment:
        yield deployment


def _d(dep: Deployment) -> dict[str, float]:
    m = metrics(dep.decode_spec.url)
    return {
        "waiting": m.get("vllm:num_requests_waiting", 0.0),
        "kv_usage": m.get("vllm:kv_cache_usage_perc", 0.0),
        "hits": m.get("vllm:external_prefix_cache_hits_total", 0.0),
        "prompt": m.get("vllm:prompt_tokens_total", 0.0),
    }


def test_the_router_drives_stock_push_and_the_kv_comes_from_p(
    stock_push: Deployment, baseline: Baseline
) -> None:
    before = _d(stock_push)
    model = str(stock_push.model.path)
    for i in range(4):
        prompt = f"stock push {i}: " + make_prompt(3 + i)
        got = complete(stock_push.router_url, model, prompt, max_tokens=8)
        baseline.check("completion", prompt, 8, got)
    after = _d(stock_push)
    assert after["prompt"] > before["prompt"]
    assert after["hits"] - before["hits"] == after["prompt"] - before["prompt"]


def test_stock_push_keeps_ds_blocks_when_p_dies_after_the_registration(
    stock_push: Deployment,
) -> None:
    model = str(stock_push.model.path)
    prompt = "stock push kill: " + make_prompt(6)
    params = prefill(stock_push.prefill_specs[0].url, model, prompt)
    assert params.get("transfer_mode") == "push"
    p = stock_push.procs[stock_push.prefill_specs[0].name]
    p._signal_tree(signal.SIGSTOP)
    out: dict[str, Answer | str] = {}

    def decode() -> None:
        try:
            out["answer"] = complete(
                stock_push.decode_spec.url, model, prompt, max_tokens=4, kv_transfer_params=params
            )
        except RequestFailed as exc:
            out["error"] = str(exc)

    threading.Thread(target=decode, daemon=True).start()
    wait_for(lambda: _d(stock_push)["waiting"] == 1.0, 30.0)
    time.sleep(2.0)  # the registration leaves at D's next steps
    p.kill(wait=False)
    killed = time.monotonic()
    time.sleep(WATCH_S)
    held = _d(stock_push)
    FIGURES.append(
        f"stock push: {time.monotonic() - killed:.0f} s after P's kill -9, D still has "
        f"{held['waiting']:.0f} request waiting and KV usage {held['kv_usage']:.2e} "
        f"(client: {out or 'waiting'})"
    )
    assert held["waiting"] == 1.0 and held["kv_usage"] > 0
    assert not out  # the client still waits too
