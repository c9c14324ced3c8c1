"""The reader's kept ``get_timer`` answer is always the one it would find afresh.

``Reader.get_timer`` keeps its answer until an input comes (so that an idle
step is two comparisons): every input method must forget it. The lease
machine of :mod:`.test_stateful` drives every input in random order; after
each step the kept answer must equal a fresh search of the sessions' timers,
the awaited dones and the read deferrals.
"""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis.stateful import invariant

from .test_stateful import EXAMPLES, SETTINGS, LeaseMachine


class TimerAnswerMachine(LeaseMachine):
    """The lease machine, checking each reader's timer answer after every step."""

    @invariant()
    def timer_answer_is_fresh(self) -> None:
        for peer, reader in self.readers.items():
            fresh = reader._next_due()
            assert reader.get_timer() == (None if fresh == math.inf else fresh), peer


TimerAnswerMachine.TestCase.settings = settings(max_examples=max(1, EXAMPLES // 4), **SETTINGS)
TestTimerAnswerMachine = TimerAnswerMachine.TestCase
