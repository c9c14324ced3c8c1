"""Loaded by every Python process the deployment tests start (``PYTHONPATH``, see conftest).

SIGUSR1 prints every thread's Python stack to the process's stderr, which the engines' logs
capture: a failed test signals the engine processes before it reads their logs, so an engine
that hangs (rather than crashing) shows where each of its threads waits.
"""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
