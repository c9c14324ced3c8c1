"""Two prefill servers and one decoder behind vllm-router (KvprotoConnector).

Both prefill engines share the first core (OpenMP bound there), the decoder
has the last one; the router alternates prefill engines (round robin). Every
answer equals the plain engine's, both prefill engines granted leases, and
every lease on both ends DONE.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from examples.pd_cpu.client import complete, metrics
from examples.pd_cpu.cluster import Deployment, ModelSpec, default_layout, free_port
from examples.pd_cpu.tiny_model import make_prompt

from .baseline import Baseline
from .conftest import FIGURES, require_deployment, wait_for

require_deployment()

MAX_TOKENS = 8
REQUESTS = 8


@pytest.fixture(scope="module")
def pd2(
    deploy_model: ModelSpec, baseline: Baseline, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    prefills, decode = default_layout(2, base_port=None)
    with Deployment(
        deploy_model,
        tmp_path_factory.mktemp("pd-two-prefills"),
        prefills=prefills,
        decode=decode,
        router_port=free_port(),
        router_metrics_port=free_port(),
        lease_s=10,
        router_extra=["--prefill-policy", "round_robin"],
    ) as deployment:
        FIGURES.append(
            "two prefills + one decoder, startup: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in deployment.startup_s.items())
        )
        yield deployment


def test_two_prefill_engines_serve_through_one_router(pd2: Deployment, baseline: Baseline) -> None:
    model = str(pd2.model.path)
    prompts = [f"two-p {i}: " + make_prompt(3 + i % 3) for i in range(REQUESTS)]
    for prompt in prompts:
        baseline.answer("completion", prompt, MAX_TOKENS)
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        answers = list(
            pool.map(lambda p: complete(pd2.router_url, model, p, max_tokens=MAX_TOKENS), prompts)
        )
    for prompt, got in zip(prompts, answers, strict=True):
        baseline.check("completion", prompt, MAX_TOKENS, got)
    grants = []
    for spec in pd2.prefill_specs:
        # The last frees reach /metrics at the engine's next step after the answers.
        wait_for(partial(_settled, spec.url), 10.0)
        m = metrics(spec.url)
        grants.append(m.get("vllm:kvproto_holder_grants_total", 0.0))
        assert m.get("vllm:kvproto_holder_released_done_total") == grants[-1]
    assert sum(grants) == REQUESTS and min(grants) >= 1, grants
    d = metrics(pd2.decode_spec.url)
    assert d["vllm:external_prefix_cache_hits_total"] == d["vllm:prompt_tokens_total"]
    FIGURES.append(f"two prefills: grants per prefill engine {grants}, every lease DONE")


def _settled(url: str) -> bool:
    m = metrics(url)
    held = m.get("vllm:kvproto_holder_leases_held", 0.0)
    return held + m.get("vllm:kvproto_holder_leases_granted", 0.0) == 0
