"""SIGTERM as a request to stop at the next safe point, not an exception at any point.

An exception raised from a signal handler can land inside a library's own clean-up (Optuna's
journal lock, a half-done atomic write) and break it. The first SIGTERM only sets a flag; the
sweep loops call :func:`check` between trials, so the trial in flight is finished and
recorded, and then the sweep stops as after Ctrl-C. A second SIGTERM stops it at once.
"""
from __future__ import annotations

import signal
import threading


class Terminated(Exception):
    """SIGTERM arrived: the sweep stops, recording that it was terminated."""


_requested = threading.Event()


def install():
    """Handle SIGTERM as above (main thread only); return the previous handler, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    _requested.clear()

    def handler(signum, frame):
        if _requested.is_set():
            raise Terminated()
        _requested.set()
    return signal.signal(signal.SIGTERM, handler)


def restore(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def check() -> None:
    """Raise Terminated if SIGTERM was received."""
    if _requested.is_set():
        raise Terminated()
