"""The example's process handling, with real processes (no vLLM needed)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from examples.pd_cpu.cluster import (
    CONNECTORS,
    Deployment,
    EngineSpec,
    ModelSpec,
    Proc,
    free_port,
    kv_transfer_config,
    port_is_free,
    vllm_cpu_shim,
)

#: A leader that starts one child in the same group and one that moves to a group of its own.
TREE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                           preexec_fn=lambda: os.setpgid(0, 0))
    print(same.pid, own.pid, flush=True)
    time.sleep(300)
    """
)


def _start_tree(tmp_path: Path) -> tuple[Proc, list[int]]:
    log = tmp_path / "tree.log"
    proc = Proc.start("tree", [sys.executable, "-c", TREE], dict(os.environ), log)
    for _ in range(200):
        if log.read_text().strip():
            break
        os.sched_yield()
        time.sleep(0.02)
    children = [int(p) for p in log.read_text().split()]
    return proc, children


def _state(pid: int) -> str:
    """The state letter of ``pid`` in /proc ("" when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z")


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_stop_and_kill_reach_every_process_of_the_tree(tmp_path: Path, how: str) -> None:
    proc, children = _start_tree(tmp_path)
    assert len(children) == 2 and all(_alive(p) for p in children)
    assert set(children) <= set(proc.tree())
    getattr(proc, how)()
    assert not proc.alive()
    assert not any(_alive(p) for p in [proc.pid, *children])
    assert proc.tree() == []


#: A leader whose main thread exits while another thread still runs: the leader reads
#: ``Z`` in /proc, as every killed process's leader does while its threads tear it down.
LEADER_GONE_FIRST = textwrap.dedent(
    """
    import ctypes, sys, threading, time
    threading.Thread(target=time.sleep, args=(300,)).start()
    print("up", flush=True)
    ctypes.CDLL(None).pthread_exit(None)
    """
)


def test_a_zombie_leader_with_a_running_thread_is_still_in_the_tree(tmp_path: Path) -> None:
    log = tmp_path / "leader.log"
    proc = Proc.start("leader", [sys.executable, "-c", LEADER_GONE_FIRST], dict(os.environ), log)
    try:
        deadline = time.monotonic() + 30.0
        while _state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(proc.pid) == "Z" and log.read_text().strip() == "up"
        assert proc.tree() == [proc.pid]
    finally:
        proc.kill()
    assert proc.tree() == []


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    # Linux's default ephemeral range starts at 32768 (where bind(0) and the engines' own
    # sockets draw from); the example hands out ports below it.
    assert all(port_is_free(p) and 20000 <= p < 32000 for p in ports)


def test_unknown_connector_is_refused_before_anything_starts(tmp_path: Path) -> None:
    assert CONNECTORS == ("kvproto", "stock", "stock-push")
    assert kv_transfer_config("stock-push", "kv_consumer")["kv_connector"] == "NixlPushConnector"
    with pytest.raises(ValueError, match="unknown connector 'nixl'"):
        kv_transfer_config("nixl", "kv_producer")
    spec = EngineSpec(name="p", role="kv_producer", port=1, side_channel_port=2)
    with pytest.raises(ValueError, match="unknown connector"):
        Deployment(ModelSpec(path=tmp_path), tmp_path, connector="x", prefills=[spec], decode=spec)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing started


def test_commands_are_what_the_readme_shows(tmp_path: Path) -> None:
    spec_p = EngineSpec(
        name="prefill-0", role="kv_producer", port=8100, side_channel_port=5600, cpus="0"
    )
    spec_d = EngineSpec(
        name="decode-0", role="kv_consumer", port=8200, side_channel_port=5700, cpus="1"
    )
    dep = Deployment(ModelSpec(path=Path("/m")), tmp_path, prefills=[spec_p], decode=spec_d)
    if dep.shim is None:
        pytest.skip("the README shows the vllm-cpu commands (with the dist-info shim)")
    lines = dep.commands()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    flat = " ".join(readme.replace("\\\n", " ").split())
    for line in lines:
        shown = line.replace(str(tmp_path), "<workdir>").replace(" /m ", " <model> ")
        assert " ".join(shown.split()) in flat, shown


def test_shim_declares_vllm_only_when_missing(tmp_path: Path) -> None:
    import importlib.metadata

    shim = vllm_cpu_shim(tmp_path)
    try:
        importlib.metadata.version("vllm")
        has_vllm = True
    except importlib.metadata.PackageNotFoundError:
        has_vllm = False
    if has_vllm:
        assert shim is None
    else:
        assert shim is not None
        (info,) = shim.iterdir()
        assert info.name.endswith("+cpu.dist-info")
        assert "Name: vllm\n" in (info / "METADATA").read_text()
