"""The contract every :class:`jaxckpt.host.store.HostStore` keeps, as shipped tests.

A store implementation (jaxckpt's in-process store, the snapshot agent, or
yours) subclasses :class:`HostStoreContract` in a ``*_test.py`` and provides
the ``make_store`` fixture; pytest then runs every contract test on it::

    class TestMyStore(HostStoreContract):
      @pytest.fixture
      def make_store(self):
        stores = []
        def make(max_snapshots, limit_bytes):
          stores.append(MyStore(max_snapshots=max_snapshots, limit_bytes=limit_bytes))
          return stores[-1]
        yield make
        for s in stores:
          s.close()

The tests use only the public ``HostStore`` methods, with real bytes and
checksums (a store that verifies shards at commit, as the agent does, must
accept them).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxckpt import errors
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum

MiB = 2**20


def write_step(store, step: int, nbytes: int = 4096, *, seed: int | None = None,
               timeout_secs: float = 0.0) -> np.ndarray:
  """Reserves a slot, writes ``nbytes`` of data for ``step`` and commits it; the data."""
  data = np.random.default_rng(step if seed is None else seed).integers(
      0, 256, nbytes, dtype=np.uint8)
  slot = store.reserve(step, nbytes, timeout_secs=timeout_secs)
  assert slot is not None, f"no free slot for step {step}"
  np.asarray(slot.buffer)[:nbytes] = data
  store.commit(slot, manifest_of(step, data))
  return data


def manifest_of(step: int, data: np.ndarray) -> SnapshotManifest:
  """A one-leaf manifest of ``data`` (uint8, one shard at offset 0)."""
  shard = ShardRecord(((0, data.size),), 0, data.size, checksum(data))
  leaf = LeafRecord("['x']", "numpy", (data.size,), "uint8", (shard,))
  return SnapshotManifest(step=step, leaves=(leaf,), nbytes=data.size)


def read_bytes(store, step: int) -> bytes:
  with store.read(step) as (manifest, buf):
    assert manifest.step == step
    return bytes(np.asarray(buf)[:manifest.nbytes])


class HostStoreContract:
  """Subclass and provide a ``make_store(max_snapshots, limit_bytes)`` fixture."""

  @pytest.fixture
  def make_store(self):
    raise NotImplementedError("a HostStoreContract subclass provides make_store")

  def test_a_committed_step_reads_back_its_bytes(self, make_store):
    store = make_store(2, 64 * MiB)
    data = write_step(store, 3)
    assert store.steps() == [3]
    assert read_bytes(store, 3) == data.tobytes()

  def test_a_step_is_invisible_until_committed_and_gone_when_aborted(self, make_store):
    store = make_store(1, 64 * MiB)
    slot = store.reserve(5, 4096, timeout_secs=0)
    assert store.steps() == []
    with pytest.raises(errors.StepNotFoundError, match="5"):
      with store.read(5):
        pass
    store.abort(slot)
    assert store.steps() == []
    write_step(store, 6)                     # the aborted slot is free again
    write_step(store, 7)
    assert store.steps() == [7]

  def test_keeps_the_newest_max_snapshots_steps(self, make_store):
    store = make_store(2, 64 * MiB)
    data = {s: write_step(store, s) for s in (1, 2, 3, 4)}
    assert store.steps() == [3, 4]
    assert read_bytes(store, 3) == data[3].tobytes()
    assert read_bytes(store, 4) == data[4].tobytes()

  def test_committing_an_older_step_drops_the_newer_ones(self, make_store):
    store = make_store(3, 64 * MiB)
    for s in (1, 2, 3):
      write_step(store, s)
    again = write_step(store, 2, seed=99)    # a rolled-back timeline
    assert store.steps() == [1, 2]
    assert read_bytes(store, 2) == again.tobytes()

  def test_a_slot_being_read_is_never_handed_out_for_writing(self, make_store):
    store = make_store(1, 64 * MiB)
    first = write_step(store, 1)
    with store.read(1) as (_, buf):
      write_step(store, 2)                   # drops step 1, whose slot is still read
      assert store.steps() == [2]
      assert store.reserve(3, 4096, timeout_secs=0) is None, "a pinned slot was reused"
      assert bytes(np.asarray(buf)[:first.size]) == first.tobytes()
    write_step(store, 3)                     # free again once the reader is done
    assert store.steps() == [3]

  def test_an_unknown_step_is_step_not_found(self, make_store):
    store = make_store(1, 64 * MiB)
    write_step(store, 1)
    with pytest.raises(errors.StepNotFoundError, match=r"\b9\b"):
      with store.read(9):
        pass

  def test_more_than_the_budget_is_refused_with_the_sizes(self, make_store):
    store = make_store(1, 1 * MiB)
    with pytest.raises(errors.HostMemoryBudgetError, match=r"MiB exceed host_memory_limit_bytes"):
      store.reserve(1, 1 * MiB, timeout_secs=0)
    write_step(store, 2, nbytes=4096)        # and the store still works
    assert store.steps() == [2]

  def test_a_discarded_step_is_gone_and_its_slot_reused(self, make_store):
    store = make_store(1, 64 * MiB)
    write_step(store, 1)
    assert store.discard(1) and store.steps() == []
    assert not store.discard(1)
    with pytest.raises(errors.StepNotFoundError):
      with store.read(1):
        pass
    write_step(store, 2)
    write_step(store, 3)                     # both slots free again
    assert store.steps() == [3]

  def test_an_empty_snapshot_commits(self, make_store):
    store = make_store(1, 64 * MiB)
    slot = store.reserve(4, 0, timeout_secs=0)
    store.commit(slot, SnapshotManifest(step=4, leaves=(), nbytes=0))
    assert store.steps() == [4]
    assert read_bytes(store, 4) == b""
