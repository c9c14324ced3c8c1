"""Push mode over HTTP: ``vllm serve`` P + D with ``"transfer_mode": "push"`` behind vllm-router.

vllm-router drives push as it drives pull (``--kv-connector nixl``: P first, then D with
P's ``kv_transfer_params``); D then grants P a writable lease on the blocks it allocated,
registers them with P, and P writes its KV into them (spec/push-mode.md §7).

1. completions and chat completions, streamed and not, equal the baseline; every prompt
   token on D came from P (external prefix hits) and every writable lease on D ended DONE;
2. the same push P serves a pull decoder started beside the push one (a push engine runs
   the holder a pull reader needs): its answer equals the baseline, its KV read from P; a
   push decoder handed a pull-only holder's parameters prefills locally with a WARNING that
   names both modes;
3. behind the deployment's own proxy instead (examples/pd_cpu/push_proxy.py), which sends
   each request to P and D at once: D registers its blocks before P has prefilled, P pairs
   them with its own when it has them and writes; the answers equal the baseline, every
   prompt token on D came from P, each registration was written once, and P ends its own
   lease with the write (nobody reads it);
4. P stopped (SIGSTOP) after its prefill answer and killed (``kill -9``) once D has granted
   and registered the blocks P was to write (the stopped P's kernel takes the registration,
   P never claims it): D's leases on them are freed within the transport's loss bound
   (counted from the killed tree's exit), and the request is answered by local prefill,
   equal to the baseline. Stock push's figure for the same fault (its blocks still held a
   minute later) comes from tests/deploy/test_stock_push.py (opt-in).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

from examples.pd_cpu.client import Answer, RequestFailed, chat, complete, metrics, prefill
from examples.pd_cpu.cluster import Deployment, ModelSpec, Proc, free_port, wait_healthy
from examples.pd_cpu.tiny_model import make_prompt

from .baseline import Baseline
from .conftest import FIGURES, one_prefill_deployment, require_deployment, wait_for, wait_lost_freed

require_deployment()

LEASE_S = 12
MAX_TOKENS = 8
HOLDER = "vllm:kvproto_holder_"
MODE_KEY = "kvproto_transfer_mode"
"""kv_transfer_params key: the modes the holder serves (kvproto_vllm.holder_scheduler)."""


@pytest.fixture(scope="module")
def push_up(
    deploy_model: ModelSpec, baseline: Baseline, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    deployment = one_prefill_deployment(
        deploy_model,
        tmp_path_factory.mktemp("pd-push"),
        "kvproto",
        lease_s=LEASE_S,
        connector_extra={"transfer_mode": "push"},
    )
    with deployment:
        FIGURES.append(
            "push startup: " + ", ".join(f"{k} {v:.1f} s" for k, v in deployment.startup_s.items())
        )
        yield deployment


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _settled(url: str) -> bool:
    m = metrics(url)
    return all(m.get(f"{HOLDER}{g}", 0.0) == 0 for g in ("leases_granted", "leases_held"))


def test_push_answers_equal_baseline_streamed_or_not_with_kv_written_by_p(
    push_up: Deployment, baseline: Baseline
) -> None:
    model = str(push_up.model.path)
    d_url, p_url = push_up.decode_spec.url, push_up.prefill_specs[0].url
    d_before, p_before = metrics(d_url), metrics(p_url)
    cases = [(kind, stream) for kind in ("completion", "chat") for stream in (False, True)]
    for i, (kind, stream) in enumerate(cases):
        prompt = f"push {i}: " + make_prompt(3 + i)
        ask = complete if kind == "completion" else chat
        got = ask(push_up.router_url, model, prompt, max_tokens=MAX_TOKENS, stream=stream)
        baseline.check(kind, prompt, MAX_TOKENS, got)
    wait_for(lambda: _settled(d_url) and _settled(p_url), 10.0)
    d_after, p_after = metrics(d_url), metrics(p_url)
    prompt_tokens = _delta(d_after, d_before, "vllm:prompt_tokens_total")
    external = _delta(d_after, d_before, "vllm:external_prefix_cache_hits_total")
    # Every prompt token on D was written by P (none recomputed, none a local hit) ...
    assert prompt_tokens > 0 and external == prompt_tokens
    # ... into blocks D granted and registered: each writable lease ended DONE.
    assert _delta(d_after, d_before, f"{HOLDER}grants_total") == len(cases)
    assert _delta(d_after, d_before, f"{HOLDER}released_done_total") == len(cases)
    # P granted its finished blocks, and its writes were confirmed (D held the lease when
    # each done arrived); D read nothing.
    confirmed = "vllm:kvproto_reader_reads_confirmed_total"
    assert _delta(p_after, p_before, f"{HOLDER}grants_total") == len(cases)
    assert _delta(p_after, p_before, confirmed) == len(cases)
    assert _delta(d_after, d_before, confirmed) == 0
    # The push counters on /metrics say the same: one registration and one confirmed write
    # per request (one rank each), nothing fenced, failed or malformed.
    push = "vllm:kvproto_push_"
    assert _delta(d_after, d_before, push + "registrations_total") == len(cases)
    assert _delta(p_after, p_before, push + "written_total") == len(cases)
    for side, after, before, name in [
        ("D", d_after, d_before, "fenced_total"),
        ("P", p_after, p_before, "write_failures_total"),
        ("P", p_after, p_before, "bad_registrations_total"),
    ]:
        assert _delta(after, before, push + name) == 0, (side, name)


def test_one_push_prefill_serves_a_pull_decoder_too_and_a_mode_it_lacks_is_refused(
    push_up: Deployment, baseline: Baseline
) -> None:
    model = str(push_up.model.path)
    p_url = push_up.prefill_specs[0].url
    pull_d = dataclasses.replace(
        push_up.decode_spec,
        name="decode-pull",
        port=free_port(),
        side_channel_port=free_port(),
        connector_extra=(("transfer_mode", "pull"),),
    )
    push_up.start_engine(pull_d)
    try:
        prompt = "push and pull: " + make_prompt(5)
        p_before, d_before = metrics(p_url), metrics(pull_d.url)
        params = prefill(p_url, model, prompt)
        assert params[MODE_KEY] == ["pull", "push"]
        got = complete(pull_d.url, model, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        baseline.check("completion", prompt, MAX_TOKENS, got)
        wait_for(lambda: _settled(p_url), 10.0)
        p_after, d_after = metrics(p_url), metrics(pull_d.url)
        # The pull decoder read P's blocks (every prompt token an external hit, the read
        # confirmed), and P's lease ended DONE with nothing written.
        prompt_tokens = _delta(d_after, d_before, "vllm:prompt_tokens_total")
        external = _delta(d_after, d_before, "vllm:external_prefix_cache_hits_total")
        assert prompt_tokens > 0 and external == prompt_tokens
        assert _delta(d_after, d_before, "vllm:kvproto_reader_reads_confirmed_total") == 1
        assert _delta(p_after, p_before, f"{HOLDER}released_done_total") == 1
        assert _delta(p_after, p_before, "vllm:kvproto_push_written_total") == 0
    finally:
        push_up.procs.pop(pull_d.name).stop()
    # A push decoder given a holder that serves pull only: prefilled locally, one WARNING.
    prompt = "pull only: " + make_prompt(4)
    params = prefill(p_url, model, prompt)
    params[MODE_KEY] = ["pull"]
    d_proc = push_up.procs[push_up.decode_spec.name]
    offset = d_proc.log_size()
    got = complete(
        push_up.decode_spec.url, model, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params
    )
    baseline.check("completion", prompt, MAX_TOKENS, got)
    warned = [
        line for line in d_proc.log_since(offset).splitlines() if "is prefilled locally" in line
    ]
    assert len(warned) == 1 and "WARNING" in warned[0], warned
    assert "serves transfer_mode pull, this engine runs 'push'" in warned[0], warned


def test_a_proxy_sending_to_both_engines_at_once_gets_the_kv_written_early(
    push_up: Deployment, baseline: Baseline
) -> None:
    model = str(push_up.model.path)
    d_url, p_url = push_up.decode_spec.url, push_up.prefill_specs[0].url
    # What the proxy must name to D: P's engine id and side channel (an operator pins the
    # engine id in P's --kv-transfer-config; here one prefill's parameters say it).
    known = prefill(p_url, model, "proxy: " + make_prompt(2))
    port = free_port()
    argv = [sys.executable, "-m", "examples.pd_cpu.push_proxy", "--port", str(port)]
    argv += ["--prefill", p_url, "--prefill-engine-id", known["remote_engine_id"]]
    argv += [
        "--prefill-side-channel",
        f"{known['remote_host']}:{known['kvproto_side_channel_port']}",
    ]
    argv += ["--decode", d_url]
    proxy = Proc.start("push-proxy", argv, dict(os.environ), push_up.workdir / "push-proxy.log")
    push_up.procs[proxy.name] = proxy
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proxy, url, 30.0)
        wait_for(lambda: _settled(d_url) and _settled(p_url), LEASE_S + 5.0)
        d_before, p_before = metrics(d_url), metrics(p_url)
        cases = [(kind, stream) for kind in ("completion", "chat") for stream in (False, True)]
        for i, (kind, stream) in enumerate(cases):
            prompt = f"early {i}: " + make_prompt(4 + i)
            ask = complete if kind == "completion" else chat
            got = ask(url, model, prompt, max_tokens=MAX_TOKENS, stream=stream)
            baseline.check(kind, prompt, MAX_TOKENS, got)
        wait_for(lambda: _settled(d_url) and _settled(p_url), 10.0)
        d_after, p_after = metrics(d_url), metrics(p_url)
    finally:
        push_up.procs.pop(proxy.name).stop()
    prompt_tokens = _delta(d_after, d_before, "vllm:prompt_tokens_total")
    external = _delta(d_after, d_before, "vllm:external_prefix_cache_hits_total")
    assert prompt_tokens > 0 and external == prompt_tokens
    push = "vllm:kvproto_push_"
    assert _delta(d_after, d_before, push + "registrations_total") == len(cases)
    assert _delta(p_after, p_before, push + "written_total") == len(cases)
    assert _delta(d_after, d_before, f"{HOLDER}released_done_total") == len(cases)
    assert _delta(p_after, p_before, f"{HOLDER}grants_total") == len(cases)
    # Nobody reads P's own leases: P ended each with its write.
    assert _delta(p_after, p_before, f"{HOLDER}revoked_total") == len(cases)
    for side, after, before, name in [
        ("D", d_after, d_before, "fenced_total"),
        ("P", p_after, p_before, "write_failures_total"),
        ("P", p_after, p_before, "bad_registrations_total"),
    ]:
        assert _delta(after, before, push + name) == 0, (side, name)


def test_p_killed_after_d_registered_frees_ds_blocks_and_d_recomputes(
    push_up: Deployment, baseline: Baseline
) -> None:
    model = str(push_up.model.path)
    d_url = push_up.decode_spec.url
    prompt = "push kill: " + make_prompt(6)
    want = baseline.answer("completion", prompt, MAX_TOKENS)
    params = prefill(push_up.prefill_specs[0].url, model, prompt)
    assert params.get(MODE_KEY) == ["pull", "push"] and "transfer_mode" not in params
    d_before = metrics(d_url)
    p = push_up.procs[push_up.prefill_specs[0].name]
    # Stopped, P takes no registration and writes nothing; D's sessions with it are open
    # (the previous test), so its loss is reported once the kill closes its sockets.
    p._signal_tree(signal.SIGSTOP)
    out: dict[str, Answer | str] = {}

    def decode() -> None:
        try:
            out["answer"] = complete(
                d_url, model, prompt, max_tokens=MAX_TOKENS, kv_transfer_params=params
            )
        except RequestFailed as exc:
            out["error"] = str(exc)

    client = threading.Thread(target=decode, name="push-kill-client", daemon=True)
    client.start()
    try:
        wait_for(lambda: metrics(d_url).get(f"{HOLDER}leases_granted", 0.0) >= 1, 30.0)
        granted_at_kill = metrics(d_url).get(f"{HOLDER}leases_granted", 0.0)
    finally:
        p.kill(wait=False)  # the module's last test: P is not restarted
    lost = wait_lost_freed(d_url, p, gauges=("leases_granted", "leases_held"))
    client.join(60.0)
    d_after = metrics(d_url)
    FIGURES.append(
        f"push: P kill -9 after D registered {granted_at_kill:.0f} writable lease(s): D's "
        f"gauges 0 in {lost.freed_s:.2f} s after the kill (bound {lost.bound_s:.2f} s: tree "
        f"exit {lost.exit_s:.2f} s + detection); answer by local prefill: {out}"
    )
    assert granted_at_kill >= 1
    assert lost.freed_s <= lost.bound_s, lost
    answer = out.get("answer")
    assert isinstance(answer, Answer), out
    assert answer.text == want.text and answer.token_ids == want.token_ids
    # (vLLM counts the request's external prefix hit when it schedules the load, failed or
    # not: the lease's end says it was never written.)
    ended = sum(
        _delta(d_after, d_before, f"{HOLDER}{reason}_total") for reason in ("peer_lost", "revoked")
    )
    assert ended >= 1
