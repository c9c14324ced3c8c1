"""The client side of a chaos run: each planned request sent through the router, as users do.

Requests are sent open-loop at their planned times from a thread pool (a
request that cannot get a thread waits for one; its ``sent`` time says when it
really left). Every one ends as an answer, an error or a hang-up, recorded
with the answer's text and token ids for the checker.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

import msgspec

from kvproto_tools.chaos.answers import LOGPROBS
from kvproto_tools.chaos.baseline import choice_of
from kvproto_tools.chaos.history import Sent
from kvproto_tools.chaos.schedule import Request

ERROR_CHARS = 200
"""How much of an error message a history keeps."""


class Load:
    """Sends the plan's requests at their times; :meth:`wait` for the last to end."""

    def __init__(
        self,
        client: ModuleType,
        url: str,
        model: str,
        clock: Callable[[], float],
        record: Callable[[Sent], None],
        *,
        threads: int = 64,
    ) -> None:
        self._client = client
        self._url = url
        self._model = model
        self._clock = clock
        self._record = record
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="chaos-client")
        self._futures: list[Future[None]] = []
        self.stopped = threading.Event()
        """Set to stop sending (requests already sent still end)."""

    def run(self, requests: tuple[Request, ...]) -> float:
        """Send every request at its time (blocks until the last is sent or :attr:`stopped`);
        returns when the last was handed to a thread."""
        for req in requests:
            delay = req.at - self._clock()
            if delay > 0 and self.stopped.wait(delay):
                break
            if self.stopped.is_set():
                break
            self._futures.append(self._pool.submit(self._one, req))
        return self._clock()

    def wait(self, timeout_s: float) -> int:
        """Wait (bounded) for every sent request to end; how many had not."""
        deadline = time.monotonic() + timeout_s
        for future in self._futures:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(Exception):  # a timeout: the count below says
                future.result(timeout=left)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return sum(not f.done() for f in self._futures)

    def _one(self, req: Request) -> None:
        sent = self._clock()
        try:
            got = self._ask(req)
        except (self._client.RequestFailed, OSError, ValueError) as exc:
            got = Sent(
                index=req.index,
                sent=sent,
                ended=self._clock(),
                outcome="error",
                error=f"{type(exc).__name__}: {exc}"[:ERROR_CHARS],
            )
        else:
            got = msgspec.structs.replace(got, sent=sent, ended=self._clock())
        self._record(got)

    def _ask(self, req: Request) -> Sent:
        """Send ``req``; what came back (times filled in by the caller)."""
        c, url, model = self._client, self._url, self._model
        if req.kind in ("complete", "stream", "repeat"):
            got = c.complete(
                url,
                model,
                req.prompt,
                max_tokens=req.max_tokens,
                stream=req.kind == "stream",
                logprobs=LOGPROBS,
            )
            answers = [got]
        elif req.kind in ("sample", "sample-stream"):
            answers = c.sample(
                url,
                model,
                req.prompt,
                n=req.n,
                seed=req.sample_seed,
                max_tokens=req.max_tokens,
                stream=req.kind == "sample-stream",
                logprobs=LOGPROBS,
            )
        else:
            hang_up = threading.Event()
            timer = threading.Timer(req.hang_up_s, hang_up.set)
            timer.start()
            try:
                c.cancel_stream(
                    url,
                    model,
                    req.prompt,
                    after_chunks=req.hang_up_chunks,
                    hang_up=hang_up if req.kind == "cancel-queued" else None,
                    max_tokens=req.max_tokens,
                )
            finally:
                timer.cancel()
            return Sent(index=req.index, sent=0.0, ended=0.0, outcome="cancelled")
        return Sent(
            index=req.index,
            sent=0.0,
            ended=0.0,
            outcome="ok",
            choices=tuple(choice_of(a) for a in answers),
        )
