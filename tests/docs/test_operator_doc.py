"""spec/operator.md stays true to the code, without vLLM installed.

The page is what an operator reads when a metric moves or a log line appears, so
a metric, a warning or error line or an engine-start refusal added to the code
without a line on the page fails here. Everything is read with ``ast`` (stats.py
imports vLLM at its top), so the test runs in any environment.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "spec" / "operator.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
STATS = ROOT / "adapters" / "kvproto_vllm" / "stats.py"
LOGGING_PACKAGES = ("kvproto_vllm", "kvproto_binding", "kvproto_transports")
REFUSING_PACKAGE = "kvproto_vllm"
REFUSALS = frozenset({"UnsupportedShape", "ConfigError"})
"""Exceptions whose message is the operator's only hint at engine start."""
LEVELS = frozenset({"warning", "warn", "error", "exception", "critical"})
"""Logger methods whose lines an operator must be able to look up."""
PLACEHOLDER = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")
"""A printf conversion as ``logging`` applies it."""
SHAPE_HEADER = "| model shape (tiny model) |"


def _section(text: str, heading: str) -> str:
    """The text under a ``## `` heading that starts with ``heading``, up to the next one."""
    found = re.search(rf"^## {re.escape(heading)}.*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert found is not None, f"spec/operator.md has no '## {heading}' section"
    return found.group(0)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _module_constant(path: Path, name: str) -> object:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = (
            [node.target]
            if isinstance(node, ast.AnnAssign)
            else node.targets
            if isinstance(node, ast.Assign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            assert node.value is not None
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} defines no {name}")


def _sources(package: str) -> Iterator[tuple[str, ast.Module]]:
    spec = importlib.util.find_spec(package)  # where it is, without importing it
    assert spec is not None and spec.origin is not None, package
    for path in sorted(Path(spec.origin).parent.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(encoding="utf-8"))


def _loggers(tree: ast.Module) -> set[str]:
    """Names bound to ``logging.getLogger(...)`` at module level, and ``logging`` itself."""
    names = {"logging"}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Attribute) and func.attr == "getLogger":
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _log_calls() -> Iterator[tuple[str, ast.Call]]:
    for package in LOGGING_PACKAGES:
        for where, tree in _sources(package):
            loggers = _loggers(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in LEVELS
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in loggers
                ):
                    yield f"{where}:{node.lineno}", node


def _fixed_parts(fmt: str) -> list[str]:
    """The literal runs of a %-format string worth finding on the page (3+ letters or digits)."""
    parts = (" ".join(p.split()) for p in PLACEHOLDER.split(fmt))
    return [p for p in parts if sum(c.isalnum() for c in p) >= 3]


def _string_parts(node: ast.AST) -> list[str]:
    """Every literal piece of a message expression (f-string parts, concatenations)."""
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def test_every_exported_metric_is_on_the_page() -> None:
    assert _module_constant(STATS, "PROM_PREFIX") == "vllm:kvproto_"
    counters = _module_constant(STATS, "PROM_COUNTERS")
    gauges = _module_constant(STATS, "PROM_GAUGES")
    assert isinstance(counters, dict) and isinstance(gauges, dict) and counters and gauges
    metrics = _section(PAGE, "3. Metrics")
    # Prometheus exports a counter as <name>_total: the page shows what a query names.
    missing = [
        f"vllm:kvproto_{k}_total" for k in counters if f"`vllm:kvproto_{k}_total`" not in metrics
    ] + [f"vllm:kvproto_{k}" for k in gauges if f"`vllm:kvproto_{k}`" not in metrics]
    assert not missing, f"spec/operator.md section 3 does not document {missing}"


def test_the_page_names_no_metric_that_does_not_exist() -> None:
    counters = _module_constant(STATS, "PROM_COUNTERS")
    gauges = _module_constant(STATS, "PROM_GAUGES")
    assert isinstance(counters, dict) and isinstance(gauges, dict)
    exported = {f"vllm:kvproto_{k}_total" for k in counters} | {f"vllm:kvproto_{k}" for k in gauges}
    named = set(re.findall(r"vllm:kvproto_[a-z][a-z_]*[a-z]", PAGE))
    assert named <= exported, f"spec/operator.md names metrics nobody exports: {named - exported}"


def test_every_warning_and_error_line_is_in_troubleshooting() -> None:
    section = _flat(_section(PAGE, "4. Troubleshooting"))
    calls = list(_log_calls())
    assert len(calls) >= 20, "the log-call scan found too few calls: is it still looking?"
    undocumented = []
    for where, call in calls:
        first = call.args[0] if call.args else None
        assert isinstance(first, ast.Constant) and isinstance(first.value, str), (
            f"{where}: a log line must be a %-format string constant so it can be documented"
        )
        fmt = first.value
        prefix = " ".join(fmt.split("%", 1)[0].split())
        wanted = ([prefix] if prefix else []) + _fixed_parts(fmt)
        absent = [part for part in wanted if part not in section]
        if absent:
            undocumented.append(f"{where}: {fmt!r} (missing {absent})")
    assert not undocumented, "spec/operator.md section 4 lacks:\n" + "\n".join(undocumented)


def test_every_engine_start_refusal_is_in_troubleshooting() -> None:
    section = _flat(_section(PAGE, "4. Troubleshooting"))
    undocumented = []
    for where, tree in _sources(REFUSING_PACKAGE):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            if not (isinstance(func, ast.Name) and func.id in REFUSALS):
                continue
            for text in _string_parts(node.exc):
                part = " ".join(text.split())
                if sum(c.isalnum() for c in part) >= 3 and part not in section:
                    undocumented.append(f"{where}:{node.lineno}: {part!r}")
    assert not undocumented, "spec/operator.md section 4.3 lacks:\n" + "\n".join(undocumented)


def _shape_rows(text: str, columns: int) -> list[tuple[str, ...]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(SHAPE_HEADER))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append(tuple(cells[:columns]))
    return rows


def test_the_shape_table_equals_the_readmes() -> None:
    readme = _shape_rows(README, 3)
    page = _shape_rows(PAGE, 3)
    assert readme, "README.md lost its model-shape table"
    assert page == readme, "spec/operator.md section 1 and README.md 'Model shapes' differ"


def test_every_test_the_page_names_exists() -> None:
    named = set(re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", PAGE))
    assert named, "spec/operator.md names no test"
    for path, function in sorted(named):
        source = ROOT / path
        assert source.is_file(), f"spec/operator.md names {path}, which does not exist"
        if function:
            assert re.search(rf"^def {function}\(", source.read_text(encoding="utf-8"), re.M), (
                f"spec/operator.md names {path}::{function}, which does not exist"
            )


def test_the_readme_points_operators_to_the_page() -> None:
    vllm = README[README.index("## Using kvproto with vLLM") :]
    limits = vllm[vllm.index("**Limits.**") :].split("\n\n", 1)[0]
    assert "spec/operator.md" in limits
    for limit in ("GPU", "DP > 1", "push mode", "block sizes", "kv_buffer_device"):
        assert limit in limits, f"the README's vLLM limits no longer mention {limit!r}"
