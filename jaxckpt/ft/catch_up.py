"""Non-blocking catch-up: the snapshot seam, the gradient-fetch protocol, replay.

A recovering group asks one healthy peer (served on the peer's serving thread,
never its training thread):

1. ``ring_get(step)`` for each step it missed, when the peer's ring still holds
   them chained on from the recovering group's own digest; otherwise
2. ``snap_latest`` (the newest snapshot step ``S`` the peer can serve),
   ``digest(S)`` (the digest the peer recorded for ``S``), ``snap_fetch(S)`` (the state's leaves by tree path) and then the
   ring entries ``S ..`` the quorum's step.

It then replays the averaged gradients with the user's ``apply_fn`` and joins
the quorum with bit-identical state. Snapshots go through the
:class:`SnapshotSource` protocol: in tests an :class:`InMemorySnapshotSource`
held by the healthy peer backs it; in production an
:class:`~jaxckpt.ft.agent_source.AgentSnapshotSource` does: the healthy peer
answers ``snap_where`` with its agents' locator (run_root, job name) and the
recovering group reads the snapshot from those agent processes, not from the
peer's trainer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import jax
import numpy as np

from jaxckpt import errors
from jaxckpt.arrays import _assemble
from jaxckpt.ft import _peer
from jaxckpt.ft.ring import DigestLog, GradientRing, RingEntry
from jaxckpt.host.snapshot import relative_slices
from jaxckpt.net import _wire

HostLeaves = Mapping[str, np.ndarray]
"""A state's leaves on the host, keyed by ``jax.tree_util.keystr`` of their tree path."""


@runtime_checkable
class SnapshotSource(Protocol):
  """Where a recovering group gets a healthy group's whole state."""

  def latest_step(self) -> int | None:
    """The newest step whose snapshot can be served, or None."""

  def fetch(self, step: int) -> HostLeaves:
    """Every leaf of the state at ``step``, on the host, by tree path."""


class InMemorySnapshotSource:
  """Keeps references to the last ``keep`` states put into it (no copy on ``put``).

  jax.Arrays are immutable, so holding a reference is a free snapshot; the copy
  to the host happens in :meth:`fetch`, on the serving thread. Do not donate
  the buffers of a state that was put here. Single-process groups only.
  """

  def __init__(self, keep: int = 2):
    if keep < 1:
      raise errors.InvalidArgumentError(f"InMemorySnapshotSource keep must be >= 1, got {keep=}")
    self._keep = keep
    self._states: dict[int, Any] = {}
    self._lock = threading.Lock()

  def put(self, step: int, state: Any) -> None:
    with self._lock:
      self._states[step] = state
      for old in sorted(self._states)[:-self._keep]:
        del self._states[old]

  def latest_step(self) -> int | None:
    with self._lock:
      return max(self._states, default=None)

  def fetch(self, step: int) -> HostLeaves:
    with self._lock:
      state = self._states.get(step)
      held = sorted(self._states)
    if state is None:
      raise KeyError(f"no in-memory snapshot of {step=}; held steps: {held}")
    return host_leaves(state)


def host_leaves(state: Any) -> dict[str, np.ndarray]:
  """Every leaf of ``state`` as a host array, keyed by tree path."""
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  values = jax.device_get([leaf for _, leaf in flat])
  return {jax.tree_util.keystr(p): np.asarray(v) for (p, _), v in zip(flat, values)}


def rebuild_state(template: Any, leaves: HostLeaves) -> Any:
  """``template``'s tree with values from ``leaves`` on ``template``'s shardings."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(template)
  missing = [jax.tree_util.keystr(p) for p, _ in flat if jax.tree_util.keystr(p) not in leaves]
  if missing:
    raise KeyError(f"snapshot lacks leaves {missing[:5]} of the state (of {len(flat)} leaves)")
  out = [rebuild_leaf(leaf, leaves[jax.tree_util.keystr(p)]) for p, leaf in flat]
  return jax.tree_util.tree_unflatten(treedef, out)


def rebuild_leaf(like: Any, host: np.ndarray) -> Any:
  """``host`` placed like ``like`` (a jax.Array or ShapeDtypeStruct keeps its
  sharding; a numpy leaf comes back as ``host`` itself when that is read-only)."""
  if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)) and getattr(like, "sharding", None):
    if tuple(host.shape) != tuple(like.shape) or host.dtype != like.dtype:
      raise errors.InvalidArgumentError(f"cannot place a {host.dtype}{list(host.shape)} value on a leaf of "
                       f"{like.dtype}{list(like.shape)}")
    return _assemble.make_array(tuple(like.shape), like.dtype, like.sharding,
                                lambda box: np.array(host[relative_slices(box, _full(host))]))
  if isinstance(like, np.ndarray):
    # Read-only as it is (the ring entry peers catch up from): a view keeps its
    # buffer out of the all-reduce's pool for as long as the caller holds it.
    return host if not host.flags.writeable else np.array(host)
  return type(like)(host.item()) if np.ndim(host) == 0 else np.array(host)


def _full(host: np.ndarray) -> tuple[tuple[int, int], ...]:
  return tuple((0, n) for n in host.shape)


def replay(state: Any, grads: Sequence[Any], apply_fn: Callable[[Any, Any], Any]) -> Any:
  """Applies each averaged gradient in order: ``state = apply_fn(state, g)``."""
  for g in grads:
    state = apply_fn(state, g)
  return state


@dataclasses.dataclass(frozen=True)
class CatchUpServer:
  """The serving-thread handler of a healthy group's catch-up requests."""
  ring: GradientRing
  digests: DigestLog
  snapshots: Callable[[], SnapshotSource | None]

  def __call__(self, header: _wire.Header) -> tuple[_wire.Header, Sequence[np.ndarray]] | None:
    op = header.get("op")
    if op == "ring_get":
      entry = self.ring.get(int(header["step"]))
      if entry is None:
        if header.get("wait"):             # (committed soon: answered then, see ft/_peer.py)
          return _peer.LATER
        return {"op": "missing", "held": list(self.ring.steps())}, ()
      return {"op": "ring_entry", "step": entry.step, "digest_before": entry.digest_before,
              "digest_after": entry.digest_after, "batches_after": entry.batches_after}, entry.leaves
    if op == "digest":
      return {"op": "digest", "digest": self.digests.get(int(header["step"]))}, ()
    source = self.snapshots()
    if op == "snap_where":
      locator = getattr(source, "locator", None)
      return {"op": "snap_where", "agent": locator() if locator is not None else None}, ()
    if op == "snap_latest":
      step = source.latest_step() if source is not None else None
      digest = self.digests.get(step) if step is not None else None
      return {"op": "snap_latest", "step": step if digest is not None else None, "digest": digest}, ()
    if op == "snap_fetch":
      if source is None:
        return {"op": "missing", "held": []}, ()
      leaves = source.fetch(int(header["step"]))
      return {"op": "snapshot", "paths": list(leaves)}, list(leaves.values())
    raise errors.InvalidArgumentError(f"unknown catch-up request op={op!r}")


class RemoteSnapshotSource:
  """A :class:`SnapshotSource` that asks a healthy peer's serving thread."""

  def __init__(self, sender: _peer.PeerSender, address: str, timeout_secs: float):
    self._sender, self._address, self._timeout = sender, address, timeout_secs
    self.digest: int | None = None

  def latest_step(self) -> int | None:
    reply = self._ask({"op": "snap_latest"})
    self.digest = reply[0].get("digest")
    return reply[0].get("step")

  def fetch(self, step: int) -> HostLeaves:
    header, arrays = self._ask({"op": "snap_fetch", "step": step})
    if header.get("op") != "snapshot":
      raise KeyError(f"peer {self._address} holds no snapshot of {step=}: {header}")
    return dict(zip(header["paths"], arrays))

  def _ask(self, header: _wire.Header) -> _peer.Message:
    reply = self._sender.request(self._address, header, self._timeout)
    if reply is None:
      raise TimeoutError(f"peer {self._address} did not answer {header['op']!r} within "
                         f"{self._timeout:.1f}s")
    return reply


def fetch_ring(sender: _peer.PeerSender, address: str, start: int, digest: int, stop: int,
               timeout_secs: float, *, wait_secs: float = 0.0) -> list[RingEntry] | None:
  """Ring entries ``start .. stop - 1`` from ``address`` chained on from ``digest``, or None.
  With ``wait_secs``, the peer holds each request until it has committed the step (up to then)."""
  entries = []
  for step in range(start, stop):
    request = {"op": "ring_get", "step": step, **({"wait": wait_secs} if wait_secs > 0 else {})}
    reply = sender.request(address, request, timeout_secs + wait_secs)
    if reply is None or reply[0].get("op") != "ring_entry" or reply[0]["digest_before"] != digest:
      return None
    header, arrays = reply
    entries.append(RingEntry(step=step, digest_before=digest, digest_after=header["digest_after"],
                             leaves=tuple(arrays), batches_after=int(header.get("batches_after", 0))))
    digest = header["digest_after"]
  return entries
