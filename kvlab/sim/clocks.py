"""Clocks and timers of measured runs (the real engine as executor, calibration): what a measured second is.

``timer`` names the time base of a measured run:

* ``"wall"`` (default): :class:`~kvlab.sim.scheduler.WallClock` / ``time.perf_counter``; idle gaps are slept
  through and a step lasts the wall seconds it took (device work synchronised). The measurement on a
  dedicated machine.
* ``"thread"``: :class:`ThreadClock` / ``time.thread_time``, the serving thread's CPU seconds, with idle
  gaps skipped instead of slept. On a shared CPU (other jobs competing for the cores) wall times stretch
  by whatever else runs; CPU time measures the engine's own work (with one torch thread all of it runs
  in the calling thread). CPU only: on an accelerator the thread time misses the device's work.

:func:`gc_paused` keeps the cyclic garbage collector's pauses out of measured steps. Torch-free: waiting
for queued device work is :func:`kvlab.engine.compute.sync_device`. Units: seconds.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator

from kvlab.errors import ConfigError
from kvlab.sim.scheduler import WallClock

TIMERS = ("wall", "thread")


class ThreadClock:
    """Engine time on a shared CPU: the calling thread's CPU seconds since construction, idle gaps skipped.

    ``wait_until(t)`` jumps to ``t`` instead of sleeping (nothing runs while idle). Not ``simulated``:
    the scheduler treats it like a wall clock (a step's time has passed when the executor returns).
    """

    simulated = False

    def __init__(self) -> None:
        self._t0 = time.thread_time()
        self._skipped = 0.0

    def now(self) -> float:
        return time.thread_time() - self._t0 + self._skipped

    def advance(self, seconds: float) -> None:
        """Nothing to do: the executor spent ``seconds`` of this thread's CPU time."""

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            self._skipped += delay


class StoppedClock:
    """A clock frozen at ``t`` seconds, the end of a run (the summary reads ``now()`` as the makespan's end)."""

    simulated = True

    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


def make_clock(timer: str) -> WallClock | ThreadClock:
    """The scheduler clock of a ``timer`` (``"wall"`` or ``"thread"``)."""
    if timer == "wall":
        return WallClock()
    if timer == "thread":
        return ThreadClock()
    raise ConfigError(f"timer must be one of {TIMERS}, got {timer!r}")


def timer_function(timer: str) -> Callable[[], float]:
    """``time.perf_counter`` (``"wall"``) or ``time.thread_time`` (``"thread"``): seconds."""
    if timer == "wall":
        return time.perf_counter
    if timer == "thread":
        return time.thread_time
    raise ConfigError(f"timer must be one of {TIMERS}, got {timer!r}")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect garbage, then keep the cyclic collector off (its pauses would land in measured steps)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
