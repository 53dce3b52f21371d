"""What the processes of a job agree on, through jax.distributed's key-value store.

JAX offers no public API for its key-value store (``jax.distributed`` has
``initialize``, ``is_initialized`` and ``shutdown``), so this module is the one
place that reaches it, as ``jax._src.distributed.global_state.client`` (orbax
does the same). The trainer's side only: it imports JAX.

Each agreement takes a key no earlier one used. A process numbers its
agreements in the order it makes them, with a counter it keeps in the store
itself (``key_value_increment`` on a key of its own): the processes of a job
agree in the same order, so they meet on the same keys, and no module holds
state.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from typing import Callable

import jax
from jax._src import distributed as _distributed

from jaxckpt import errors


def _client():
  client = _distributed.global_state.client
  if client is None:
    raise errors.InvalidArgumentError(
        f"a job of {jax.process_count()} processes has no jax.distributed client; call "
        "jax.distributed.initialize() before creating the CheckpointManager")
  return client


def _key(client, name: str) -> str:
  n = client.key_value_increment(f"jaxckpt/agreements/{jax.process_index()}", 1)
  return f"jaxckpt/{name}/{n}"


def _get(client, key: str, timeout_secs: float) -> str | None:
  """The value under ``key`` once it is set; None if it was not within ``timeout_secs``."""
  try:
    return client.blocking_key_value_get(key, int(timeout_secs * 1000))
  except jax.errors.JaxRuntimeError:    # (how the client says it ran past its deadline)
    return None


def broadcast_from_0(name: str, make: Callable[[], str], *, timeout_secs: float) -> str:
  """``make()`` on process 0, handed to every process; a process that does not
  hear in time names process 0."""
  client = _client()
  key = _key(client, name)
  if jax.process_index() == 0:
    value = make()
    client.key_value_set(key, value)
    return value
  value = _get(client, key, timeout_secs)
  if value is None:
    raise errors.SnapshotTimeoutError(
        f"process {jax.process_index()}: process 0 did not publish the job's {name} within "
        f"{timeout_secs} s (is it running, with the same jaxckpt version?)")
  return value


class Channel:
  """Keys of one conversation the processes of a job hold over many steps (a
  manager's save schedule): ``set`` publishes under ``name/...``, ``get`` waits
  for a key, ``gather`` for one key from each process under a directory; old
  keys are deleted by whoever knows every process has read them."""

  def __init__(self, name: str, *, timeout_secs: float) -> None:
    self._client = _client()
    self.prefix = "jaxckpt/channel/" + broadcast_from_0(
        name, lambda: f"{name}-{uuid.uuid4().hex}", timeout_secs=timeout_secs)

  def set(self, key: str, value: str) -> None:
    self._client.key_value_set(f"{self.prefix}/{key}", value, allow_overwrite=True)

  def get(self, key: str, timeout_secs: float) -> str | None:
    """The value once it is set; None if it was not within ``timeout_secs``."""
    return _get(self._client, f"{self.prefix}/{key}", timeout_secs)

  def gather(self, directory: str, count: int, *, timeout_secs: float, poll_secs: float = 0.002
             ) -> dict[int, str] | list[int]:
    """``{process: value}`` of keys ``directory/<process>`` once all ``count`` are
    set (one request while they are); the processes still missing at the
    timeout, as a list, if not."""
    deadline = time.monotonic() + timeout_secs
    base = f"{self.prefix}/{directory}/"
    while True:
      got = {int(k[len(base):]): v for k, v in self._client.key_value_dir_get(base)
             if k[len(base):].isdigit()}
      if len(got) >= count:
        return got
      if time.monotonic() > deadline:
        return sorted(set(range(count)) - set(got))
      time.sleep(poll_secs)
      poll_secs = min(poll_secs * 2, 0.05)

  def delete(self, key: str) -> None:
    """Deletes ``key`` (a directory: every key under it)."""
    self._client.key_value_delete(f"{self.prefix}/{key}")


def allgather(name: str, value: str, *, timeout_secs: float, what: str) -> list[str]:
  """Every process's ``value``, in process order; SnapshotTimeoutError naming the
  processes that did not publish ``what`` in time."""
  client = _client()
  n, me = jax.process_count(), jax.process_index()
  key = _key(client, name)
  client.key_value_set(f"{key}/{me}", value)
  got = {p: _get(client, f"{key}/{p}", timeout_secs) for p in range(n)}
  late = [p for p, v in got.items() if v is None]
  if late:
    raise errors.SnapshotTimeoutError(
        f"processes {late} did not publish {what} within {timeout_secs} s (process {me} "
        f"heard from {sorted(p for p, v in got.items() if v is not None)})")
  return [got[p] for p in range(n)]


def agree_kept(name: str, held: str | None, make: Callable[[], str], *,
               timeout_secs: float) -> str:
  """The value the job keeps, agreed by every process: the one held by most of
  the processes that hold one (the lowest process's among equals), so that it
  survives the loss of any process, process 0's included; process 0's
  ``make()`` when none holds one. Every process says what it holds (the value
  travels as ``broadcast_from_0``'s would)."""
  me = jax.process_index()
  offer = held if held is not None else make() if me == 0 else ""
  said = [json.loads(v) for v in allgather(
      name, json.dumps([held is not None, offer]), timeout_secs=timeout_secs,
      what=f"the job's {name} they hold")]
  kept = [value for has, value in said if has]
  if not kept:
    return said[0][1]
  counts = collections.Counter(kept)
  return next(v for v in kept if counts[v] == max(counts.values()))
