"""Inside one replica group: only process 0 talks to other groups.

Design: process 0 of a group gathers the group's gradients to its host
(``process_allgather``), does all lighthouse and peer traffic, and broadcasts
every decision (quorum, outcome, averaged gradient, catch-up data) to the
group's other processes with ``broadcast_one_to_all``. So every process of a
group takes the same decision at the same point, and the group's processes run
the same collectives in the same order. With one process per group (the common
case on a single host, and in the tests) all of this is the identity.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import msgpack
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
    data = msgpack.packb(obj) if self.is_talker else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buf = np.frombuffer(data, np.uint8) if self.is_talker else np.zeros(n, np.uint8)
    return msgpack.unpackb(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes())

  def share_arrays(self, arrays: Sequence[np.ndarray] | None,
                   like: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Process 0's ``arrays`` on every process (others pass None and the shapes in ``like``)."""
    if self.size == 1:
      return list(arrays or ())
    source = list(arrays) if self.is_talker else [np.zeros(s, d) for s, d in like]
    return [np.asarray(x) for x in multihost_utils.broadcast_one_to_all(source)]
