"""The core is sans-I/O: no module of kvproto/ imports anything that does I/O, threads,
reads a clock or pulls a transport in (checked statically and in a fresh interpreter)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import kvproto

CORE = Path(kvproto.__file__).parent
BANNED = {
    "socket",
    "threading",
    "_thread",
    "asyncio",
    "time",
    "zmq",
    "nixl",
    "nixl_cu12",
    "ucxx",
    "ucp",
    "torch",
    "select",
    "selectors",
    "subprocess",
    "multiprocessing",
    "concurrent",
    "signal",
    "datetime",
    "kvproto_transports",
    "kvproto_vllm",
    "kvproto_tools",
}


def core_modules() -> list[Path]:
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 14, files  # every module, not an empty glob
    return files


def imported_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            in {
                "__import__",
                "import_module",
            }
        ):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.add(arg.value)
                else:
                    names.add("<dynamic import>")
    return names


def test_no_core_module_imports_io_threads_clocks_or_transports() -> None:
    offenders = {}
    for path in core_modules():
        names = imported_names(ast.parse(path.read_text(), str(path)))
        bad = sorted(n for n in names if n.split(".")[0] in BANNED or n == "<dynamic import>")
        if bad:
            offenders[path.name] = bad
    assert offenders == {}


def test_the_static_check_would_catch_an_offender() -> None:
    tree = ast.parse(
        "import time\nfrom threading import Lock\nimport importlib\nimportlib.import_module(x)"
    )
    names = imported_names(tree)
    assert {"time", "threading", "<dynamic import>"} <= names


PROBE = r"""
import importlib, json, os, sys
BANNED = set(json.loads(sys.argv[1]))
core = sys.argv[2]
hits = []

class Tripwire:
    # Record who imports a banned module: the importer's file must not be in the core.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BANNED:
            frame = sys._getframe(1)
            while frame and frame.f_code.co_filename.startswith("<frozen"):
                frame = frame.f_back
            if frame and frame.f_code.co_filename.startswith(core):
                hits.append([name, frame.f_code.co_filename])
        return None

for name in list(sys.modules):  # the interpreter's start-up imports 'time' itself
    if name.split(".")[0] in BANNED:
        del sys.modules[name]
sys.meta_path.insert(0, Tripwire())
before = set(sys.modules)
for f in sorted(os.listdir(core)):
    if f.endswith(".py") and f != "__init__.py":
        importlib.import_module("kvproto." + f[:-3])
importlib.import_module("kvproto")
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in BANNED)
loaded = sorted(m for m in sys.modules if m.startswith("kvproto"))
print(json.dumps({"hits": hits, "new": new, "loaded": loaded}))
"""


def test_importing_the_core_in_a_fresh_interpreter_loads_none_of_them() -> None:
    out = subprocess.run(
        [sys.executable, "-I", "-c", PROBE, json.dumps(sorted(BANNED)), str(CORE)],
        capture_output=True,
        text=True,
        check=True,
        cwd=CORE.parent,
    )
    result = json.loads(out.stdout)
    assert result["hits"] == []  # no core file imported any of them, directly or lazily
    # Dependencies may load harmless stdlib pieces: dataclasses and functools import
    # _thread for their locks, msgspec imports datetime, which imports time. None of the
    # modules that do I/O, start threads or talk to a transport may appear.
    harmless = {"_thread", "datetime", "time"}
    assert [m for m in result["new"] if m.split(".")[0] not in harmless] == []
    assert {f"kvproto.{p.stem}" for p in core_modules() if p.stem != "__init__"} <= set(
        result["loaded"]
    )
