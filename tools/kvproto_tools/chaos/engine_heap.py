"""A plain vLLM CPU engine's malloc heap as prefills of new batch shapes arrive (no kvproto).

``python -m kvproto_tools.chaos.engine_heap [--requests N] [--out FILE]``

Why it exists: the chaos run's memory judge once found its prefill workers' main
malloc arena growing for the whole run while the decoder's stayed flat. This
measures the same engine (the tiny Llama and the flags of examples/pd_cpu, no KV
connector) with its model on the main thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so the figures are glibc's main arena, the one that grew), sending greedy one-token
requests in batches of 1-6, and reads ``mallinfo2()`` as it goes: bytes in use and
bytes free inside the heap (both resident once touched).

Four configurations, each in a process of its own (oneDNN reads its settings once):
prompts of random length (almost every step a batch shape the engine has not seen)
or of one length, each with oneDNN's primitive cache at its default and switched
off (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``). vLLM's oneDNN linear layers keep the
last 32 batch shapes' primitives per layer whatever that setting is.

Needs vLLM and a checkout (examples/pd_cpu builds the model); glibc for mallinfo2.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproto_tools.bench.engine_suites import SuiteUnavailable, pd_cpu
from kvproto_tools.chaos.driver import MAX_MODEL_LEN

CHECKPOINTS = (60, 120, 250, 500, 1000, 1500, 2000, 3000, 4000)
"""Requests after which each configuration's heap is reported."""
FIXED_LENGTH = 300
"""Prompt tokens of every request in the fixed-length configurations."""
LENGTHS = (16, 900)
"""Smallest and largest prompt, in tokens, of the random-length configurations."""
CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
MODULE = "kvproto_tools.chaos.engine_heap"
"""This file as a module (the child processes run it; ``__name__`` is ``__main__`` here)."""


class EngineFailed(RuntimeError):
    """A configuration's engine process failed; the message ends with its stderr."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """One measured configuration."""

    lengths: str
    """``random`` or ``fixed``."""
    cache: str | None
    """``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, or None for oneDNN's default."""

    @property
    def label(self) -> str:
        cache = "default cache" if self.cache is None else f"cache {self.cache}"
        return f"{self.lengths} lengths, {cache}"


CONFIGS = (
    Config(lengths="fixed", cache=None),
    Config(lengths="random", cache=None),
    Config(lengths="fixed", cache="0"),
    Config(lengths="random", cache="0"),
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_mib() -> tuple[float, float]:
    """(in use, free) MiB of this process's malloc arenas (glibc's ``mallinfo2``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks / 2**20, info.fordblks / 2**20


def _model_spec(model: Path) -> Any:
    """The chaos run's engine settings for ``model`` (examples/pd_cpu's ``ModelSpec``)."""
    return pd_cpu("cluster").ModelSpec(path=model, max_model_len=MAX_MODEL_LEN)


def _child(model: str, lengths: str, requests: int) -> None:
    """Run the engine in this process; print one JSON line per checkpoint."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    # The chaos run's engine (examples/pd_cpu's flags), but for the prefix cache: a prefix
    # hit would skip the very computation whose batch sizes this is about.
    spec = _model_spec(Path(model))
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        seed=0,
        enable_prefix_caching=False,
    )
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(1)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    done, started = 0, time.monotonic()
    marks = [c for c in CHECKPOINTS if c <= requests]
    while marks:
        batch: list[list[int]] = []
        for _ in range(rng.randint(1, 6)):
            n = FIXED_LENGTH if lengths == "fixed" else rng.randint(*LENGTHS)
            ids = [rng.randrange(5, vocab) for _ in range(n)]
            batch.append(ids)  # a list of token ids is a prompt
        llm.generate(batch, greedy, use_tqdm=False)
        done += len(batch)
        while marks and done >= marks[0]:
            in_use, free = heap_mib()
            seconds = time.monotonic() - started
            line = {"at": marks.pop(0), "in_use": in_use, "free": free, "seconds": seconds}
            print(json.dumps(line), flush=True)


def measure(config: Config, model: Path, requests: int) -> list[dict[str, float]]:
    """The checkpoints of ``config``, measured in a new process."""
    # The KV cache of examples/pd_cpu's engines: vLLM's CPU default takes most of the
    # machine's memory.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(_model_spec(model).kv_cache_gib)
    env.pop(CACHE_ENV, None)
    if config.cache is not None:
        env[CACHE_ENV] = config.cache
    argv = [sys.executable, "-m", MODULE, "--child", str(model), config.lengths]
    proc = subprocess.run(
        [*argv, str(requests)], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        tail = proc.stderr[-3000:]
        raise EngineFailed(f"{config.label}: the engine exited {proc.returncode}:\n{tail}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def table(results: dict[Config, list[dict[str, float]]]) -> str:
    """One row per checkpoint, in use / free MiB per configuration."""
    head = ["requests", *(c.label for c in results)]
    rows = [head]
    for i, at in enumerate(p["at"] for p in next(iter(results.values()))):
        cells = [f"{at:.0f}"]
        for points in results.values():
            cells.append(f"{points[i]['in_use']:.0f} / {points[i]['free']:.0f}")
        rows.append(cells)
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(["heap MiB, in use / free (mallinfo2), after N requests:", *lines])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvproto_tools.chaos.engine_heap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requests", type=int, default=3000, help="per configuration")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model, lengths, requests = args.child
        _child(model, lengths, int(requests))
        return 0
    if not CHECKPOINTS[0] <= args.requests <= CHECKPOINTS[-1]:
        parser.error(f"--requests: {CHECKPOINTS[0]} to {CHECKPOINTS[-1]}")
    try:
        heap_mib()
        tiny = pd_cpu("tiny_model")
    except (OSError, AttributeError) as exc:
        parser.exit(2, f"engine_heap: needs glibc's mallinfo2 ({exc})\n")
    except SuiteUnavailable as exc:
        parser.exit(2, f"engine_heap: {exc}\n")
    with tempfile.TemporaryDirectory(prefix="engine-heap-") as tmp:
        model = tiny.build_tiny_llama(Path(tmp) / "tiny-llama")
        results = {}
        for config in CONFIGS:
            print(f"measuring: {config.label} ...", file=sys.stderr, flush=True)
            try:
                results[config] = measure(config, model, args.requests)
            except EngineFailed as exc:
                parser.exit(1, f"engine_heap: {exc}\n")
    print(table(results))
    if args.out is not None:
        figures = {c.label: points for c, points in results.items()}
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
