"""The search's listeners: what a person sees while the walk runs (`progress=True`, the CLI's table).

`make_progress` turns `autofit.autofit`'s `progress` argument into a listener: silent, `PrintedProgress`
(a line on stderr per probe), or the caller's object. Skips decided dozens at a time are counted, not
listed (`SkipTally`); predicting between probes is said to go on (`Heartbeat`).
"""

from __future__ import annotations

import collections
import sys
from typing import Protocol, TextIO

from autofit.config import Config
from autofit.errors import UsageError
from autofit.probe.outcome import ProbeResult, Skip
from autofit.units import format_size


class Progress(Protocol):
    """Receives the search's events (the CLI shows them). A listener may also have `flush()`, called once
    the search has decided everything (what it held back, it says then), and `learned(text)`, told once per
    error the walk lays to a knob value (`Lesson`)."""

    def starting(self, config: Config, why: str) -> None: ...

    def finished(self, result: ProbeResult) -> None: ...


# Why a candidate was not run, as progress counts them; each skip is in plan.probes with its reason.
SKIP_WORDS = {Skip.PREDICTED: "predicted not to fit", Skip.IMPLIED: "implied by a measured result",
              Skip.EXCLUDED: "excluded", Skip.BUDGET: "past the probe budget"}
# Skips progress counts instead of listing: decided by a measured result, the rules or the spent probe
# budget, dozens at a time (a predicted one is shown as it is decided, with the need it was predicted).
QUIET_SKIPS = (Skip.IMPLIED, Skip.EXCLUDED, Skip.BUDGET)


def skip_counts(counts: "collections.Counter[Skip]") -> str:
    """'32 implied by a measured result, 24 excluded'."""
    return ", ".join(f"{counts[skip]} {words}" for skip, words in SKIP_WORDS.items() if counts[skip])


class SkipTally:
    """The quiet skips (`QUIET_SKIPS`) decided since progress last printed a line."""

    def __init__(self) -> None:
        self.counts: collections.Counter[Skip] = collections.Counter()

    def held(self, result: ProbeResult) -> bool:
        """Count `result` when it is a quiet skip (and say so)."""
        if result.skip in QUIET_SKIPS:
            self.counts[result.skip] += 1
            return True
        return False

    def take(self) -> str:
        """The counts held ('' when none), emptied."""
        text = skip_counts(self.counts)
        self.counts.clear()
        return text


class _Silent:
    def starting(self, config: Config, why: str) -> None:
        pass

    def finished(self, result: ProbeResult) -> None:
        pass


class Heartbeat:
    """Predictions between probes, timed: simulating a step takes seconds to minutes (a recurrent model's
    scan, token by token), so where predicting has gone on `EVERY_S` since the last line, `heard` returns
    one saying so (the search is simulating, not stuck); else None. A probe's line is one too (`probed`)."""

    EVERY_S = 10.0

    def __init__(self) -> None:
        self.count, self.seconds, self.quiet = 0, 0.0, 0.0

    def heard(self, seconds: float) -> str | None:
        self.count, self.seconds, self.quiet = self.count + 1, self.seconds + seconds, self.quiet + seconds
        if self.quiet < self.EVERY_S:
            return None
        self.quiet = 0.0
        return (f"predicting peaks ({self.count} predicted in {self.seconds:.0f} s: training steps simulated under "
                "fake tensors, nothing trained)")

    def probed(self) -> None:
        """A probe's line was printed: the quiet time starts again."""
        self.quiet = 0.0


class PrintedProgress:
    """`progress=True`: a line on stderr as each probe starts (the candidate and why) and one as it lands
    (its status, peak and speed, and the reason), for a script or a notebook cell. The skips a measured
    result implies, the rules exclude or the spent probe budget leaves are counted in one line (`SkipTally`;
    `plan.probes` lists them all)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.count = 0
        self.tally = SkipTally()
        self.heartbeat = Heartbeat()

    def predicted(self, seconds: float) -> None:
        """A peak was predicted in `seconds` (`Heartbeat`)."""
        line = self.heartbeat.heard(seconds)
        if line:
            self._print(f"autofit: {line}")

    def learned(self, lesson: str) -> None:
        """The walk learnt an error's cause (`Lesson.announcement`): said once, its skips counted."""
        self.flush()
        self._print(f"autofit: learned: {lesson}")

    def starting(self, config: Config, why: str) -> None:
        self.flush()
        self.heartbeat.probed()
        self.count += 1
        self._print(f"autofit probe {self.count}: {config.describe()} ({why})")

    def finished(self, result: ProbeResult) -> None:
        if self.tally.held(result):
            return
        self.flush()
        peak = f", peak {format_size(result.peak_bytes)}" if result.peak_bytes else ""
        speed = f", {result.samples_per_s:,.2f} samples/s" if result.samples_per_s else ""
        self._print(f"  {result.status.value} {result.config.describe()}{peak}{speed} - {result.reason}")

    def flush(self) -> None:
        """Print the skips counted since the last line, if any."""
        held = self.tally.take()
        if held:
            self._print(f"  skipped {held} (plan.probes has each with its reason)")

    def _print(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)


def make_progress(progress: "Progress | bool | None") -> "Progress":
    """The search's listener for `progress`: None or False (silent), True (`PrintedProgress`), or an
    object with `starting(config, why)` and `finished(result)`."""
    if progress is None or progress is False:
        return _Silent()
    if progress is True:
        return PrintedProgress()
    if not (callable(getattr(progress, "starting", None)) and callable(getattr(progress, "finished", None))):
        raise UsageError(f"progress={progress!r}: pass True (a line per probe on stderr), False, or an object "
                         "with starting(config, why) and finished(result) methods.")
    return progress
