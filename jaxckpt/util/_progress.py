"""Progress of the CLI's long commands (``convert``, ``import-orbax``, ``export-orbax``,
``verify``): a bar on a terminal (tqdm), plain lines otherwise, and the duration and
rate at the end.

>>> import io
>>> out = io.StringIO()
>>> with Progress(2000, "demo", stream=out) as p:
...   p.update(1000); p.update(1000)
>>> out.getvalue().splitlines()[0]
'demo: 1000 B of 2.0 KiB (50%)'
>>> p.nbytes, p.summary().startswith("2.0 KiB in ")
(2000, True)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

import tqdm

#: Without a terminal, a line each time another tenth is done, or after this long.
LINE_EVERY_SECS = 30.0


def human_bytes(n: float) -> str:
  """``1536`` -> ``'1.5 KiB'``."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  raise AssertionError("unreachable")


def rate(nbytes: float, secs: float) -> str:
  """``'1.25 GB/s'`` (GB = 1e9 bytes; three significant figures)."""
  return f"{nbytes / max(secs, 1e-9) / 1e9:.3g} GB/s"


class Progress:
  """Counts bytes done of ``total``; shows them on ``stream`` (stderr) unless ``enabled`` is
  False: a tqdm bar when it is a terminal, plain lines otherwise. ``update`` is thread-safe
  (a conversion writes chunks on several threads)."""

  def __init__(self, total: int, desc: str, *, enabled: bool = True,
               stream: TextIO | None = None) -> None:
    self.total, self.desc = total, desc
    self.stream = sys.stderr if stream is None else stream
    self.nbytes = 0
    self._start = time.monotonic()
    self._end: float | None = None
    self._lock = threading.Lock()
    self._bar: Any = None
    self._plain = enabled and not _is_terminal(self.stream)
    self._next_tenth, self._last_line = 1, self._start
    if enabled and not self._plain:
      sized = _columns(self.stream) > 0       # one that reports no size (0 x 0): 80 x 24
      self._bar = tqdm.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                            file=self.stream, dynamic_ncols=sized,
                            ncols=None if sized else 80, nrows=None if sized else 24)

  def update(self, n: int) -> None:
    with self._lock:
      self.nbytes += n
      if self._bar is not None:
        self._bar.update(n)
      elif self._plain:
        self._maybe_line()

  def _maybe_line(self) -> None:
    now = time.monotonic()
    tenth = self.nbytes * 10 // self.total if self.total else 10
    if tenth < self._next_tenth and now - self._last_line < LINE_EVERY_SECS:
      return
    self._next_tenth, self._last_line = tenth + 1, now
    pct = f" ({100 * self.nbytes / self.total:.0f}%)" if self.total else ""
    print(f"{self.desc}: {human_bytes(self.nbytes)} of {human_bytes(self.total)}{pct}",
          file=self.stream, flush=True)

  @property
  def secs(self) -> float:
    return (self._end or time.monotonic()) - self._start

  def summary(self, verb: str = "") -> str:
    """``'1.0 GiB in 2.10 s, 0.511 GB/s'`` (``verb`` after the bytes): the bytes done, the
    time and the rate."""
    what = f"{human_bytes(self.nbytes)} {verb}".rstrip()
    return f"{what} in {self.secs:.2f} s, {rate(self.nbytes, self.secs)}"

  def close(self) -> None:
    if self._end is None:
      self._end = time.monotonic()
      if self._bar is not None:
        self._bar.close()

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def _columns(stream: TextIO) -> int:
  try:
    return os.get_terminal_size(stream.fileno()).columns
  except (AttributeError, ValueError, OSError):
    return 0


def _is_terminal(stream: TextIO) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


class LogProgress:
  """Progress of the library's own long work (a persist, a restore) as INFO lines of
  ``logger``: none for work that ends within ``every_secs``, then one each
  ``every_secs`` with bytes done, of how many, and the rate so far. Thread-safe."""

  def __init__(self, logger: Any, what: str, total: int, *, every_secs: float = 5.0) -> None:
    self.logger, self.what, self.total, self.every = logger, what, total, every_secs
    self.nbytes = 0
    self._start = self._last = time.monotonic()
    self._lock = threading.Lock()

  def update(self, n: int) -> None:
    with self._lock:
      self.nbytes += n
      now = time.monotonic()
      if now - self._last < self.every:
        return
      self._last = now
      done, secs = self.nbytes, now - self._start
    self.logger.info("%s: %s of %s (%.0f%%) in %.1f s, %s", self.what, human_bytes(done),
                     human_bytes(self.total), 100 * done / max(self.total, 1), secs,
                     rate(done, secs))
