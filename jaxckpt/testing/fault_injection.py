"""Fault injection for replica groups, in the spirit of torchft's EventInjector.

>>> injector = EventInjector().fail_at("g1", step=3).drop_messages("g2", range(5, 8))
>>> injector.drops("g2", attempt=6), injector.drops("g2", attempt=8)
(True, False)

Hook it into a group with ``ReplicaGroup(..., injector=injector)``. The group
calls :meth:`EventInjector.on_attempt` at the start of every step attempt and
:meth:`EventInjector.drops` before sending (and after receiving) any message.
An injector round-trips through :meth:`to_json` / :meth:`from_json`, so a test
can hand it to a child process on its command line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from typing import Iterable, Literal

logger = logging.getLogger(__name__)

FailMode = Literal["raise", "kill"]


class InjectedFailure(RuntimeError):
  """Raised by a ``fail_at(..., mode="raise")`` event."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Event:
  kind: Literal["fail", "delay", "drop"]
  group: str
  steps: tuple[int, ...]
  mode: FailMode = "raise"
  seconds: float = 0.0


class EventInjector:
  """Failures, delays and network partitions keyed by group and step.

  Steps of ``fail_at`` and ``delay_at`` are committed steps (the group's
  ``step`` when the attempt starts). A partitioned group commits nothing, so
  ``drop_messages`` counts *attempts* instead: the attempt index of a group
  counts every step attempt from 0 and equals the step until the first retry.
  """

  def __init__(self):
    self._events: list[_Event] = []
    self._fired: list[tuple[str, str, int]] = []
    self._lock = threading.Lock()

  def fail_at(self, group: str, step: int, *, mode: FailMode = "raise") -> EventInjector:
    """``group`` fails once when it starts ``step``: raises InjectedFailure or SIGKILLs itself."""
    if mode not in ("raise", "kill"):
      raise ValueError(f"fail_at mode must be 'raise' or 'kill', got {mode=}")
    self._events.append(_Event(kind="fail", group=group, steps=(step,), mode=mode))
    return self

  def delay_at(self, group: str, step: int, seconds: float) -> EventInjector:
    """``group`` sleeps ``seconds`` when it starts ``step`` (a straggler)."""
    if seconds < 0:
      raise ValueError(f"delay_at seconds must be >= 0, got {seconds=}")
    self._events.append(_Event(kind="delay", group=group, steps=(step,), seconds=seconds))
    return self

  def drop_messages(self, group: str, steps: Iterable[int]) -> EventInjector:
    """Every message ``group`` sends or receives is lost during the attempts ``steps``."""
    self._events.append(_Event(kind="drop", group=group, steps=tuple(sorted(set(steps)))))
    return self

  @property
  def fired(self) -> list[tuple[str, str, int]]:
    """(kind, group, step) of every fail/delay event that fired, in order."""
    with self._lock:
      return list(self._fired)

  def on_attempt(self, group: str, step: int) -> None:
    """Called by the group at the start of each attempt; fires due fail/delay events once."""
    for event in self._events:
      if event.group != group or event.kind == "drop" or step not in event.steps:
        continue
      with self._lock:
        if (event.kind, group, step) in self._fired:
          continue
        self._fired.append((event.kind, group, step))
      logger.warning("injecting %s into group %s at step %d", event.kind, group, step,
                     extra={"group_id": group, "step": step, "fault": event.kind})
      if event.kind == "delay":
        time.sleep(event.seconds)
      elif event.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      else:
        raise InjectedFailure(f"injected failure of group {group!r} at step {step}")

  def drops(self, group: str, attempt: int) -> bool:
    """Whether messages of ``group`` are lost during ``attempt``."""
    return any(e.kind == "drop" and e.group == group and attempt in e.steps for e in self._events)

  def to_json(self) -> str:
    return json.dumps([dataclasses.asdict(e) for e in self._events])

  @classmethod
  def from_json(cls, text: str) -> EventInjector:
    injector = cls()
    for obj in json.loads(text):
      injector._events.append(_Event(**dict(obj, steps=tuple(obj["steps"]))))  # pylint: disable=protected-access
    return injector
