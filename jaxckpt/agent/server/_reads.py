"""The agent's requests that read a committed step (``Agent.reads``): a reader's pin
(``open``/``close``: a local trainer's by its pid, a remote reader's leased), and the
bulk path's byte ranges of a snapshot or of a parity block."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING, Annotated, Any, Iterator, Literal

import numpy as np
from msgspec import Meta

from jaxckpt import errors
from jaxckpt.agent import _requests
from jaxckpt.host import _slots
from jaxckpt.net import _schema
from jaxckpt.net._schema import Bytes, Index, Step


class BulkRead(_schema.Message, tag="bulk", frozen=True, kw_only=True,
               forbid_unknown_fields=True):
  """A bulk request (:mod:`jaxckpt.net._bulk`, its framing checked by ``_wire.open_``):
  byte ``ranges`` [[offset, nbytes], ...] of ``step``'s snapshot, or of its parity block
  ``stripe``; checked by its schema before anything reads by it, as every request is."""
  what: Literal["snapshot", "parity"]
  step: Step
  ranges: Annotated[list[tuple[Bytes, Bytes]], Meta(max_length=1 << 20)]
  stripe: Index | None = None

if TYPE_CHECKING:
  from jaxckpt.agent.server._server import Agent

logger = logging.getLogger("jaxckpt.agent")


class Reads:
  """The readers of ``agent``'s steps: their pins, leases and the bytes sent them."""

  def __init__(self, agent: Agent) -> None:
    self.agent = agent
    self._readers = itertools.count(1)
    self.leases: dict[int, tuple[float, float]] = {}   # remote reader -> (expiry, lease secs)
    self.served = 0                    # bytes bulk reads sent (others' restores, parity)

  def expired(self) -> set[int]:
    """Forgets the remote readers whose lease ran out (they died or hung): the pin
    owners to unpin (``Agent.reap``)."""
    now = time.monotonic()
    expired = {r for r, (until, _) in self.leases.items() if until < now}
    for r in expired:
      logger.warning("remote reader %d: its lease on a step ran out (it died or hung); "
                     "unpinning", -r)
      del self.leases[r]
    return expired

  def op_open(self, pid: int, step: int,
              lease_secs: float | None = None) -> _requests.Open.Reply:
    """Pins ``step`` for local reader ``pid``, or with ``lease_secs`` (a remote
    reader: ``handle`` gives one to every open over tcp, and none to an open over
    the local socket) for a reader id of its own whose pin ends with its lease,
    renewed by each bulk read of the step."""
    reader = pid if lease_secs is None else -next(self._readers)
    s = self.agent.table.pin(step, reader) or self.agent.slot_of(step)
    if lease_secs is not None:
      self.leases[reader] = (time.monotonic() + lease_secs, lease_secs)
    return _requests.Open.Reply(path=self.agent.files.of(s.index).path,
                                manifest=s.manifest,
                                index=s.index, size=s.size,
                                reader=None if lease_secs is None else reader)

  def op_close(self, pid: int, step: int, index: int | None = None,
               lend: bool = False, reader: int | None = None) -> _requests.Done:
    """Unpins what ``op_open`` pinned: slot ``index`` (the step may have been
    dropped meanwhile), or the slot still holding ``step``; a leased pin by its
    ``reader``. With ``lend`` the (local) reader keeps views of the slot's memory
    (restored arrays): it is never written again, and its next reservation gets
    a new file."""
    s = self.agent.table.committed(step) if index is None else self.agent.table.slots[index]
    if reader is not None:
      self.leases.pop(reader, None)
    if s is not None:
      owner = pid if reader is None else reader
      if lend and reader is None and pid in s.pins:
        self.agent.table.lend(s.index)
      self.agent.table.unpin(s.index, owner)
    return _requests.Done()

  def renew(self, s: _slots.SlotState) -> None:
    """A read of ``s``'s step: the leases of the remote readers pinning it go on."""
    now = time.monotonic()
    for r in s.pins:
      if r in self.leases:
        self.leases[r] = (now + self.leases[r][1], self.leases[r][1])

  @contextlib.contextmanager
  def bulk(self, header: dict[str, Any]) -> Iterator[list[Any]]:
    """What a bulk request (:mod:`jaxckpt.net._bulk`) reads: byte ``ranges`` of
    ``step``'s snapshot (``what="snapshot"``), as views of the slot's memory
    sent without a copy, the step pinned until they are sent; or of the parity
    block of ``stripe`` (``what="parity"``)."""
    req = _schema.decode(header, {"bulk": BulkRead}, "bulk request")
    what, step, ranges = req.what, req.step, req.ranges
    if what == "parity":
      if req.stripe is None:
        raise errors.InvalidArgumentError(f"bulk request for the parity of step {step} names "
                                          "no stripe; nothing was read")
      with self.agent.lock:
        worker = self.agent.durable.worker()
        path, size, start, nbytes = worker.block_at(step, req.stripe)
        wanted = _checked(ranges, nbytes, f"parity of step {step}")
        self.served += sum(n for _, n in wanted)
      yield read_parity(path, size, start, wanted, f"parity of stripe {req.stripe} of step {step}")
      return                                                      # (copies, taken unlocked)
    reader = -next(self._readers)          # a pin owner no trainer pid can be
    with self.agent.lock:
      s = self.agent.table.pin(step, reader) or self.agent.slot_of(step)
      self.renew(s)
      view = memoryview(self.agent.files.of(s.index).read_map(s.size))
    try:
      wanted = _checked(ranges, s.size, f"step {step}")
      with self.agent.lock:
        self.served += sum(n for _, n in wanted)
      yield [view[o:o + n] for o, n in wanted]
    finally:
      with self.agent.lock:
        self.agent.table.unpin(s.index, reader)


def _checked(ranges: list[list[int]], size: int, what: str) -> list[tuple[int, int]]:
  out = [(int(o), int(n)) for o, n in ranges]
  bad = [r for r in out if r[0] < 0 or r[1] < 0 or r[0] + r[1] > size]
  if bad:
    raise errors.InvalidArgumentError(f"byte ranges {bad} lie outside {what} ({size} bytes)")
  return out


def read_parity(path: str, size: int, start: int, wanted: list[tuple[int, int]],
                what: str) -> list[np.ndarray]:
  """Byte ranges ``wanted`` of the block at ``start`` of parity file ``path`` (``size``
  bytes), read through its descriptor (``pread``), never through a map: a file truncated
  under the agent (a /dev/shm cleaner, a hostile process) is a short read, a
  CorruptSnapshotError the reader takes for a missing piece, where a map is SIGBUS at
  the first touch past the file's new end, the agent and every step it holds lost."""
  fd = os.open(path, os.O_RDONLY)
  try:
    have = os.fstat(fd).st_size
    out = []
    for o, n in wanted:
      buf = np.empty(n, np.uint8)
      got = 0
      while got < n:
        k = os.preadv(fd, [memoryview(buf)[got:]], start + o + got) if have >= size else 0
        if k <= 0:
          raise errors.CorruptSnapshotError(
              f"{what}: parity file {path} is {os.fstat(fd).st_size} bytes, shorter than "
              f"the {size} it holds: it was truncated (a /dev/shm cleaner, a full tmpfs); "
              "this parity is lost on this host")
        got += k
      out.append(buf)
    return out
  finally:
    os.close(fd)
