"""Run cases against a factory and judge them (PASS / NON-STRICT / FAIL / INFO / UNSUPPORTED)."""

from __future__ import annotations

import functools
import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor

from kvproto_transports.conformance.discovery import as_factory, load_factory
from kvproto_transports.conformance.factory import TransportFactory
from kvproto_transports.conformance.harness import Ctx
from kvproto_transports.conformance.model import CaseResult, Level, Report, Verdict
from kvproto_transports.conformance.registry import Case, Outcome, Unsupported, all_cases

FactoryLike = str | TransportFactory | Callable[[], TransportFactory]
"""An entry-point name, a factory, or a zero-argument callable returning one."""


def resolve(factory: FactoryLike) -> TransportFactory:
    """Turn a :data:`FactoryLike` into a factory."""
    if isinstance(factory, str):
        return load_factory(factory)
    return as_factory(factory)


def judge(case: Case, outcome: Outcome, strict: bool) -> Verdict:
    """The verdict for ``outcome`` of ``case``."""
    if case.level is Level.INFO or outcome.informational:
        return Verdict.INFO
    if outcome.ok:
        return Verdict.PASS
    if case.level is Level.SHOULD and not strict:
        return Verdict.NON_STRICT
    return Verdict.FAIL


def run_case(case: Case, factory: TransportFactory, *, strict: bool = False) -> CaseResult:
    """Run one case on fresh endpoints; a crash in the case is a FAIL with the traceback tail."""
    t0 = time.perf_counter()
    measured: float | None = None
    if case.id in factory.unsupported:
        verdict, detail = Verdict.UNSUPPORTED, f"declared: {factory.unsupported[case.id]}"
    else:
        ctx = Ctx(factory)
        try:
            outcome = case.run(ctx)
            verdict = judge(case, outcome, strict)
            detail, measured = outcome.detail, outcome.measured
        except Unsupported as exc:
            verdict, detail = Verdict.UNSUPPORTED, str(exc)
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            verdict = Verdict.FAIL
            detail = (
                f"raised {type(exc).__name__}: {exc} "
                f"(at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
            )
        finally:
            ctx.close()
    return CaseResult(
        id=case.id,
        title=case.title,
        group=case.group,
        level=case.level,
        verdict=verdict,
        detail=detail,
        measured=measured,
        duration_s=time.perf_counter() - t0,
    )


def select(cases: Iterable[Case], only: Iterable[str] | None) -> list[Case]:
    """Cases whose id equals, or starts with ``<prefix>.``, one of ``only`` (all if None).

    Ids are matched without regard to case: ``t3.2`` is T3.2, as a user types it.
    """
    wanted = [w.strip().upper() for w in only] if only is not None else None
    if not wanted:
        return list(cases)
    return [
        c
        for c in cases
        if any(c.id.upper() == w or c.id.upper().startswith(w + ".") for w in wanted)
    ]


def run_conformance(
    name_or_factory: FactoryLike,
    strict: bool = False,
    *,
    only: Iterable[str] | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
    jobs: int = 1,
) -> Report:
    """Run the suite (or the cases in ``only``, e.g. ``["T2", "T3.2"]``) against a transport.

    ``jobs`` > 1 runs the cases in that many fresh processes (each loads the transport by its
    entry-point name, so ``name_or_factory`` must be one). It pays where a transport's
    endpoints are slow to start or stop rather than busy (Mooncake's engine waits out a 1 s
    accept timeout when destroyed); timing cases then measure under the other processes' load.
    The report is the same: results in case order, ``on_result`` called in that order.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    cases = select(all_cases(), only)
    if jobs == 1:
        factory = resolve(name_or_factory)
        results = []
        for case in cases:
            result = run_case(case, factory, strict=strict)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return Report(transport=factory.name, strict=strict, cases=tuple(results))
    if not isinstance(name_or_factory, str):
        raise ValueError(
            "jobs > 1 needs the transport's entry-point name: every worker process loads it"
        )
    name = name_or_factory
    # spawn, not fork: a transport's library threads (UCX progress, engines) do not survive a fork.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_run_by_id, name, case.id, strict) for case in cases]
        results = []
        for future in futures:
            result = future.result()
            results.append(result)
            if on_result is not None:
                on_result(result)
    return Report(transport=_factory(name).name, strict=strict, cases=tuple(results))


@functools.cache
def _factory(name: str) -> TransportFactory:
    """The transport ``name``, loaded once per process."""
    return load_factory(name)


def _run_by_id(name: str, case_id: str, strict: bool) -> CaseResult:
    """One case in a worker process of :func:`run_conformance`."""
    (case,) = (c for c in all_cases() if c.id == case_id)
    return run_case(case, _factory(name), strict=strict)
