"""Print a compact summary of a probe dump (see probe.py).

python -m tests.vllm.shapes.summarize FILE
"""

from __future__ import annotations

import json
import sys

SPEC_KEYS = (
    "block_size",
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "sliding_window",
    "shapes",
    "dtypes",
    "mamba_type",
    "page_size_bytes",
    "real_page_size_bytes",
    "page_size_padded",
    "cache_dtype_str",
)


def _spec(spec: dict) -> str:
    return (
        spec["class"]
        + "("
        + ", ".join(f"{k}={spec[k]}" for k in SPEC_KEYS if k in spec and spec[k] is not None)
        + ")"
    )


def main(path: str) -> None:
    seen_cfg = False
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        d = json.loads(line)
        kind = d["kind"]
        if kind == "kv_cache_config":
            if seen_cfg:
                continue
            seen_cfg = True
            c = d["kv_cache_config"]
            print(
                f"[{d['role']}] block_size={d['block_size']} "
                f"hma_disabled={d['disable_hybrid_kv_cache_manager']} "
                f"num_blocks={c['num_blocks']} layout={c.get('kv_cache_layout')}"
            )
            for i, g in enumerate(c["kv_cache_groups"]):
                print(f"  group {i}: {_spec(g['kv_cache_spec'])}")
                print(f"           layers={g['layer_names']}")
            for t in c["kv_cache_tensors"]:
                rest = {k: v for k, v in t.items() if k not in ("class", "layers", "shared_by")}
                print(f"  tensor shared_by={t.get('shared_by', t.get('layers'))} {rest}")
        elif kind == "register_kv_caches":
            base = {}
            for name, f in d["layers"].items():
                for i, p in enumerate(f.get("parts", [f])):
                    tag = name if "parts" not in f else f"{name}[{i}]"
                    base.setdefault(p["storage_ptr"], p["storage_ptr"])
                    print(
                        f"  kv_caches[{tag}] shape={p['shape']} {p['dtype']} stride={p['stride']} "
                        f"contig={p['is_contiguous']} storage=+{p['data_ptr'] - p['storage_ptr']}B "
                        f"of {p['storage_nbytes']}B (storage {hex(p['storage_ptr'])}) "
                        f"view={p['nbytes_view']}B"
                    )
            for ptr, names in d["storages"].items():
                print(f"  storage {hex(int(ptr))}: {names}")
        elif kind in (
            "update_state_after_alloc",
            "request_finished_all_groups",
            "request_finished",
        ):
            rest = {k: v for k, v in d.items() if k not in ("kind", "pid", "request_id")}
            print(f"  {kind} {d['request_id']}: {rest}")
        else:
            print(f"  {kind}: { {k: v for k, v in d.items() if k not in ('kind', 'pid')} }")


if __name__ == "__main__":
    main(sys.argv[1])
