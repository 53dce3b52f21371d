"""Inside one replica group: only process 0 talks to other groups.

Design: process 0 of a group gathers the group's gradients to its host
(``process_allgather``), does all lighthouse and peer traffic, and broadcasts
every decision (quorum, outcome, averaged gradient, catch-up data) to the
group's other processes with ``broadcast_one_to_all``. So every process of a
group takes the same decision at the same point, and the group's processes run
the same collectives in the same order. With one process per group (the common
case on a single host) all of this is the identity; multiprocess_group_test.py
runs a group of two processes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import msgspec
import numpy as np
from jax.experimental import multihost_utils


class GroupComm:
  """Gathers to and broadcasts from process 0 of this JAX program."""

  def __init__(self):
    self.size = jax.process_count()
    self.is_talker = jax.process_index() == 0

  def to_host(self, leaves: Sequence[Any]) -> list[np.ndarray]:
    """Whole values of ``leaves`` on the host (of process 0; others get them too)."""
    if self.size == 1:
      return [np.asarray(x) for x in jax.device_get(list(leaves))]
    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in leaves]

  def share(self, obj: Any) -> Any:
    """Process 0's ``obj`` (msgpack-able) on every process."""
    if self.size == 1:
      return obj
    data = msgspec.msgpack.encode(obj) if self.is_talker else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(_padded(n), np.uint8)  # few distinct lengths: few compilations of the broadcast
    if self.is_talker:
      buf[:n] = np.frombuffer(data, np.uint8)
    return msgspec.msgpack.decode(np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes())

  def share_arrays(self, arrays: Sequence[np.ndarray] | None,
                   like: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Process 0's ``arrays`` on every process (others pass None and the shapes in ``like``).

    Bit-exact: the broadcast sums zeros into the source's values, so it moves raw
    bytes (``-0.0 + 0.0`` would turn into ``0.0``, NaN payloads could change).
    """
    if self.size == 1:
      return list(arrays or ())
    if self.is_talker:
      source = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    else:
      source = [np.zeros(int(np.prod(s)) * np.dtype(d).itemsize, np.uint8) for s, d in like]
    out = multihost_utils.broadcast_one_to_all(source)
    return [np.asarray(x).view(np.dtype(d)).reshape(s) for x, (s, d) in zip(out, like)]


def _padded(n: int) -> int:
  """The next power of two >= ``n`` (at least 256)."""
  return max(256, 1 << (n - 1).bit_length())
