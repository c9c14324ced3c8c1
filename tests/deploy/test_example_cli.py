"""The example as a user runs it: ``python -m examples.pd_cpu --serve``, then Ctrl-C.

It must come up (engines and router healthy), answer through the router,
and on SIGINT stop every process it started and free every port, exit 0.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from examples.pd_cpu.client import complete
from examples.pd_cpu.cluster import free_port, port_is_free
from examples.pd_cpu.tiny_model import make_prompt

from .conftest import FIGURES, require_deployment

require_deployment()

REPO = Path(__file__).resolve().parents[2]


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session id) of every running (non-zombie) process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[1]), int(fields[3]))
    return out


def _started_by(cli: int) -> set[int]:
    """Every process the CLI started: its children lead sessions of their own (so a
    kill reaches a server's whole tree); their sessions' members."""
    procs = _processes()
    leaders = {pid for pid, (ppid, _) in procs.items() if ppid == cli}
    return {pid for pid, (_, sid) in procs.items() if sid in leaders}


def test_example_serves_until_ctrl_c_then_leaves_nothing_behind(tmp_path: Path) -> None:
    base, side, router, metrics_port = free_port(), free_port(), free_port(), free_port()
    while not (port_is_free(base + 100) and port_is_free(side + 100)):
        base, side = free_port(), free_port()
    started: set[int] = set()
    argv = [
        sys.executable,
        "-m",
        "examples.pd_cpu",
        "--serve",
        "--prompts",
        "2",
        "--workdir",
        str(tmp_path),
        "--base-port",
        str(base),
        "--side-base",
        str(side),
        "--router-port",
        str(router),
        "--router-metrics-port",
        str(metrics_port),
    ]
    log = tmp_path / "example.out"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        t0 = time.monotonic()
        while "serving at" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() - t0 < 300, "example not serving after 300 s"
            time.sleep(0.5)
        up_s = time.monotonic() - t0
        text = log.read_text(errors="replace")
        assert "request 0:" in text and "request 1:" in text and "FAILED" not in text
        model = re.search(r"vllm serve (\S+) ", text)
        assert model is not None
        answer = complete(f"http://127.0.0.1:{router}", model.group(1), make_prompt(3))
        assert answer.finish_reason == "length" and answer.token_ids
        started = _started_by(proc.pid)
        assert len(started) >= 5  # 2 servers with their engine cores and workers, the router
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        # A failed assertion above must not leak the servers (each leads a session of its
        # own, so killing the CLI's group would not reach them): let the CLI stop them,
        # then kill whatever is left.
        if proc.poll() is None:
            left = _started_by(proc.pid)
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            for pid in left & set(_processes()):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert "stopped: every process exited" in text and "ports still bound" not in text
    assert not started & set(_processes())
    assert all(port_is_free(p) for p in (base, base + 100, router, metrics_port))
    FIGURES.append(f"example CLI: serving {up_s:.0f} s after start; Ctrl-C left no process")
