"""The slot table against a model of its rules (hypothesis state machine)."""

from __future__ import annotations

import collections

import hypothesis
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant,
                                 precondition, rule)

from jaxckpt import errors
from jaxckpt.host import _slots

OWNERS = st.integers(1, 3)
STEPS = st.integers(0, 12)


class SlotTableMachine(RuleBasedStateMachine):
  """Every operation of both stores, applied to the table and to a plain model."""

  reservations = Bundle("reservations")

  def __init__(self) -> None:
    super().__init__()
    self.keep = 2
    self.table = _slots.SlotTable(self.keep)
    self.committed: dict[int, int] = {}          # step -> slot
    self.writing: dict[int, tuple[int, int]] = {}  # slot -> (step, owner)
    self.pins: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    self.lent: set[int] = set()
    self.held: set[int] = set()                  # steps held for their persist
    self.sizes: dict[int, int] = collections.defaultdict(int)
    self.spare = 0                               # slots memory allows beyond keep + 1
    self.most_spare = 0

  def _free(self) -> list[int]:
    busy = set(self.committed.values()) | set(self.writing)
    usable = min(len(self.table), self.keep + 1 + self.spare)
    return [i for i in range(usable) if i not in busy and not +self.pins[i]]

  def _capacity(self) -> int:
    newest = set(sorted(self.committed)[-self.keep:])
    return self.keep + 1 + min(self.spare, len(self.held - newest))

  def _room(self) -> int:
    return len(self._free()) + max(0, self._capacity() - len(self.table))

  @rule(n=st.integers(0, 3))
  def host_memory_allows(self, n: int):
    self.table.spare = self.spare = n
    self.most_spare = max(self.most_spare, n)
    idle = self.table.idle_beyond()         # beyond the usable slots: memory given back
    busy = set(self.committed.values()) | set(self.writing)
    assert idle == [i for i in range(self.keep + 1 + n, len(self.table))
                    if i not in busy and not +self.pins[i] and self.sizes[i]]
    for i in idle:
      self.sizes[i] = 0

  @rule(target=reservations, step=STEPS, nbytes=st.integers(0, 64), owner=OWNERS)
  def reserve(self, step: int, nbytes: int, owner: int):
    free = self._free()
    if not free and len(self.table) < self._capacity():
      free = [len(self.table)]                   # a slot added for a held step
    r = self.table.reserve(step, nbytes, owner)
    if not free:
      assert r is None
      return hypothesis.stateful.multiple()
    assert r is not None and r.index in free, "a busy or pinned slot was handed out"
    assert r.grow == (self.sizes[r.index] < nbytes or r.index in self.lent)
    if r.grow:
      self.sizes[r.index] = nbytes
    self.lent.discard(r.index)
    self.writing[r.index] = (step, owner)
    return (r.index, step)

  @rule(res=consumes(reservations), hold=st.booleans())
  def commit(self, res, hold: bool):
    index, step = res
    if self.writing.get(index, (None,))[0] != step:
      with pytest.raises(errors.CorruptSnapshotError, match="reservation was given up"):
        self.table.commit(index, step, hold=hold)
      return
    dropped = self.table.commit(index, step, hold=hold)
    expect = {s for s in self.committed if s >= step}
    was_held = {s for s in expect if s in self.held}
    del self.writing[index]
    for s in expect:
      del self.committed[s]
      self.held.discard(s)
    self.committed[step] = index
    if hold:
      self.held.add(step)
    expect |= self._trim()
    assert {d.step for d in dropped} == expect
    assert {d.step for d in dropped if d.held} == was_held, "a held step was trimmed"
    assert all(d.state == _slots.COMMITTED for d in dropped)
    assert step in self.table.steps(), "the newest step was dropped"
    if not self.table.room():       # no slot for the next save: every other step must stay
      assert all(s == step or s in self.held or +self.pins[i]
                 for s, i in self.committed.items()), "a step kept at the loop's expense"

  def _trim(self) -> set[int]:
    """The model of the keep rule: the newest ``keep`` and the held steps stay; then,
    while no slot is free or may be added, the oldest kept ones go (not the newest, a
    held one or a pinned one)."""
    steps = sorted(self.committed)
    out = {s for s in steps[:-self.keep] if s not in self.held}
    for s in out:
      del self.committed[s]
    for s in steps[-self.keep:]:
      if self._room():
        break
      if s != steps[-1] and s not in self.held and not +self.pins[self.committed[s]]:
        del self.committed[s]
        out.add(s)
    return out

  @rule(step=STEPS)
  def release(self, step: int):
    dropped = self.table.release(step)
    if step in self.held:
      self.held.discard(step)
      assert {d.step for d in dropped} == self._trim()
    else:
      assert dropped == []

  @rule(res=consumes(reservations))
  def abort(self, res):
    index, step = res
    d = self.table.abort(index)
    if index in self.writing:
      assert d == _slots.Dropped(index, self.writing.pop(index)[0], _slots.WRITING)
    else:
      assert d is None

  @rule(owner=OWNERS)
  def abandon(self, owner: int):
    dropped = self.table.abandon(owner)
    gone = {i for i, (_, o) in self.writing.items() if o == owner}
    assert {d.index for d in dropped} == gone
    for i in gone:
      del self.writing[i]

  @rule(step=STEPS, reader=OWNERS)
  def pin(self, step: int, reader: int):
    s = self.table.pin(step, reader)
    if step in self.committed:
      assert s is not None and s.index == self.committed[step]
      self.pins[s.index][reader] += 1
    else:
      assert s is None

  @precondition(lambda self: any(+c for c in self.pins.values()))
  @rule(data=st.data())
  def unpin(self, data):
    index, reader = data.draw(st.sampled_from(sorted(
        (i, r) for i, c in self.pins.items() for r in +c)))
    self.table.unpin(index, reader)
    self.pins[index][reader] -= 1

  @rule(index=st.integers(0, 2))
  def lend(self, index: int):
    ok = self.table.lend(index)
    assert ok == bool(+self.pins[index])
    if ok:
      self.lent.add(index)

  @rule(step=STEPS)
  def discard(self, step: int):
    d = self.table.discard(step)
    assert (d is not None) == (step in self.committed)
    assert d is None or d.held == (step in self.held)
    self.committed.pop(step, None)
    self.held.discard(step)

  @rule(owner=OWNERS)
  def owner_dies(self, owner: int):
    self.table.forget([owner])
    for i in [i for i, (_, o) in self.writing.items() if o == owner]:
      del self.writing[i]
    for c in self.pins.values():
      c.pop(owner, None)

  @invariant()
  def agrees_with_the_model(self):
    assert self.table.steps() == sorted(self.committed)
    assert self.table.held_steps() == sorted(self.held)
    assert len(self.committed) <= self.keep + len(self.held)
    assert len(self.table) <= self.keep + 1 + self.most_spare
    for s in self.table.slots:
      if s.index in self.writing:
        assert (s.state, s.step, s.owner) == (_slots.WRITING, *self.writing[s.index])
      elif s.index in self.committed.values():
        assert s.state == _slots.COMMITTED and self.committed[s.step] == s.index
      else:
        assert (s.state, s.step, s.owner) == (_slots.FREE, None, None)
      assert s.pins == {r: n for r, n in self.pins[s.index].items() if n}
      assert s.size == self.sizes[s.index]


TestSlotTable = SlotTableMachine.TestCase
TestSlotTable.settings = hypothesis.settings(max_examples=150, stateful_step_count=40,
                                             deadline=None)


def test_a_pinned_slot_freed_by_a_newer_commit_is_not_reused_until_unpinned():
  t = _slots.SlotTable(1)
  a = t.reserve(1, 8, owner=1)
  t.commit(a.index, 1)
  t.pin(1, reader=7)
  b = t.reserve(2, 8, owner=1)
  assert [d.step for d in t.commit(b.index, 2)] == [1]
  assert t.reserve(3, 8, owner=1) is None      # slot a is free but still read
  t.unpin(a.index, 7)
  assert t.reserve(3, 8, owner=1).index == a.index


def test_a_held_step_outlives_the_keep_rule_until_released():
  t = _slots.SlotTable(1)                       # two slots
  a = t.reserve(5, 8, owner=1)
  t.commit(a.index, 5, hold=True)               # due for storage: held until persisted
  b = t.reserve(6, 8, owner=1)
  assert t.commit(b.index, 6) == []             # 5 is held: not dropped by keep=1
  assert t.steps() == [5, 6] and t.held_steps() == [5]
  assert t.reserve(7, 8, owner=1) is None       # every slot is held or newest: none free
  assert [d.step for d in t.release(5)] == [5]  # its persist ended: the keep rule applies
  assert t.reserve(7, 8, owner=1).index == a.index


def _commit(t, step, hold=False):
  return [d.step for d in t.commit(t.reserve(step, 8, owner=1).index, step, hold=hold)]


def test_a_step_held_for_its_persist_takes_a_slot_of_its_own_not_the_loops():
  t = _slots.SlotTable(2)                       # the loop's 3 slots
  t.spare = 1                                   # host memory has room for one more
  assert _commit(t, 10, hold=True) == [] and _commit(t, 11) == [] and _commit(t, 12) == []
  assert t.steps() == [10, 11, 12]              # the newest 2, and 10 held for its persist
  for step in range(13, 20):                    # the loop goes on while 10 is persisted
    assert _commit(t, step) == [step - 2]
    assert t.steps() == [10, step - 1, step] and len(t) == 4
  assert [d.step for d in t.release(10)] == [10]
  assert t.steps() == [18, 19] and t.room() == 2


def test_without_room_for_a_held_steps_slot_the_loop_keeps_its_newest_step_and_one_free():
  t = _slots.SlotTable(2)                       # spare=0: host memory is too small
  _commit(t, 10, hold=True)
  _commit(t, 11)
  assert _commit(t, 12) == [11]                 # not 12: a slot stays free for 13
  assert t.steps() == [10, 12] and t.room() == 1 and len(t) == 3
  assert _commit(t, 15, hold=True) == [12]      # a second persist while the first runs
  assert _commit(t, 16) == []                   # both held: no slot left for the loop
  assert t.steps() == [10, 15, 16] and t.room() == 0
  assert t.reserve(17, 8, owner=1) is None


def test_slots_beyond_what_memory_allows_now_are_not_handed_out_and_give_back_memory():
  t = _slots.SlotTable(1)
  t.spare = 1
  _commit(t, 1, hold=True)
  _commit(t, 2)
  _commit(t, 3)                                 # the held step's own slot, index 2
  assert len(t) == 3 and t.committed(3).index == 2
  assert t.release(1) == [_slots.Dropped(0, 1, _slots.COMMITTED)]
  t.spare = 0                                   # a bigger state: no room for it now
  assert t.idle_beyond() == [] and t.usable() == 2   # (slot 2 holds step 3)
  assert _commit(t, 4) == [3] and t.committed(4).index != 2
  assert t.idle_beyond() == [2] and t.slots[2].size == 0
  assert _commit(t, 5) == [4] and t.committed(5).index != 2


def test_the_newest_protected_step_outlives_the_keep_rule_until_a_newer_one_is_protected():
  t = _slots.SlotTable(1, count=3)
  t.commit(t.reserve(5, 8, owner=1).index, 5)
  assert t.protect(5) == [] and t.protected_step() == 5
  assert t.commit(t.reserve(6, 8, owner=1).index, 6) == []   # 5 is the newest protected
  assert [d.step for d in t.commit(t.reserve(7, 8, owner=1).index, 7)] == [6]
  assert t.steps() == [5, 7]                                   # 6 went (keep=1), 5 stays
  assert [d.step for d in t.protect(7)] == [5]                 # a newer one is protected
  assert t.steps() == [7] and t.protected_step() == 7
  assert t.protect(99) == []                                   # not held here: a no-op


def test_the_protected_step_never_takes_the_last_free_slot():
  # keep=1, two slots: keeping protected step 10 beside the newest, 20, would leave no
  # slot for the next save until 20 is protected, which may never happen.
  t = _slots.SlotTable(1)
  t.commit(t.reserve(10, 8, owner=1).index, 10)
  t.protect(10)
  assert [d.step for d in t.commit(t.reserve(20, 8, owner=1).index, 20)] == [10]
  assert t.reserve(30, 8, owner=1) is not None


def test_a_protected_step_rolled_back_is_dropped_and_forgotten():
  t = _slots.SlotTable(2)
  t.commit(t.reserve(5, 8, owner=1).index, 5)
  t.protect(5)
  assert [d.step for d in t.commit(t.reserve(4, 8, owner=1).index, 4)] == [5]
  assert t.protected_step() is None and t.steps() == [4]


def test_a_rollback_drops_held_steps_and_says_so():
  t = _slots.SlotTable(3)
  for step, hold in ((5, True), (6, False), (10, True)):
    t.commit(t.reserve(step, 8, owner=1).index, step, hold=hold)
  dropped = t.commit(t.reserve(6, 8, owner=1).index, 6)
  assert {(d.step, d.held) for d in dropped} == {(6, False), (10, True)}
  assert t.held_steps() == [5]


def test_a_new_run_sees_none_of_the_earlier_runs_steps_and_its_own_step_numbers_spare_them():
  t = _slots.SlotTable(2)
  t.spare = 2
  t.new_run("r1")
  for step, hold in ((1, False), (2, True)):
    t.commit(t.reserve(step, 8, owner=1).index, step, hold=hold, attempt=f"r1-s{step}-0")
  held = t.committed(2)
  assert [(d.step, d.foreign) for d in t.new_run("r2")] == [(1, False)]   # not held: freed
  assert t.steps() == [] and t.held_steps() == [] and t.committed(2) is None
  assert t.foreign_steps() == [2] and t.pin(2, reader=7) is None
  # the new run's own step 2: no rollback of the earlier run's, each found by its attempt
  assert _commit(t, 1) == [] and t.commit(t.reserve(2, 8, owner=1).index, 2, hold=True,
                                          attempt="r2-s2-0") == []
  assert t.steps() == [1, 2] and t.foreign_steps() == [2]
  assert t.of_attempt("r1-s2-0") is held and t.of_attempt("r2-s2-0") is t.committed(2)
  assert t.committed(2) is not held
  assert t.pin(2, reader=7, attempt="r1-s2-0") is held
  t.unpin(held.index, 7)
  assert [(d.step, d.foreign) for d in t.release(2, "r1-s2-0")] == [(2, True)]
  assert t.foreign_steps() == [] and t.held_steps() == [2]     # the new run's still held


def _commit_of(t, step, run, hold=True):
  """Commits ``step`` held for its persist, with a manifest and saving process of ``run``'s."""
  index = t.reserve(step, 8, owner=1).index
  t.commit(index, step, hold=hold, attempt=f"{run}-s{step}-0", manifest=_manifest(step, run),
           process=(0, 1))
  return t.slots[index]


def _manifest(step, run):
  """A manifest of ``step`` that says its run (in its byte count: r1 -> 1)."""
  from jaxckpt.host.snapshot import SnapshotManifest   # pylint: disable=import-outside-toplevel
  return SnapshotManifest(step=step, leaves=(), nbytes=int(run[1:]) if run else 0).to_json()


def test_a_slots_record_carries_its_steps_facts_and_foreign_follows_its_run():
  """The case that hung the chaos soak once ``foreign`` was derived from the run (78e17f9):
  steps committed before the agent knew a run (a hello that named none) stayed the first
  run's own, not foreign for ever (never freed: the table filled and a stop hung). And the
  one before it (88280b4): a third run was given the first run's manifest of the same step
  number. Each record keeps its step's manifest, saving process, run and attempt, so each
  foreign step keeps its own whatever the step numbers of later runs."""
  t = _slots.SlotTable(1)
  t.spare = 3
  early = _commit_of(t, 2, run=None, hold=False)
  assert t.new_run("r1") == [] and t.run == "r1"       # a first run: the steps held are its own
  assert t.steps() == [2] and not early.foreign and early.run == "r1"
  assert [d.step for d in t.commit(t.reserve(3, 8, owner=1).index, 3)] == [2]  # keep=1 drops it
  t = _slots.SlotTable(1)
  t.spare = 3
  t.new_run("r1")
  first = _commit_of(t, 5, "r1")
  t.new_run("r2")
  second = _commit_of(t, 5, "r2")
  t.new_run("r3")
  third = _commit_of(t, 5, "r3", hold=False)
  assert [s.foreign for s in (first, second, third)] == [True, True, False]
  assert t.steps() == [5] and t.foreign_steps() == [5, 5]
  assert t.committed(5) is third and third.manifest == _manifest(5, "r3")
  for s, run in ((first, "r1"), (second, "r2")):       # each by its attempt, with its own facts
    assert t.of_attempt(f"{run}-s5-0") is s
    assert s.manifest == _manifest(5, run) and s.parsed() is s.parsed()
    assert s.parsed().nbytes == int(run[1:])
    assert (s.run, s.process, s.held) == (run, (0, 1), True)
  t.new_run("r1")                     # the first run comes back: its step is its own again
  assert t.committed(5) is first and not first.foreign and second.foreign
  assert [(d.step, d.foreign) for d in t.release(5, "r2-s5-0")] == [(5, True)]
  assert second.manifest is None and second.run is None and t.foreign_steps() == []


def test_a_slots_manifest_is_parsed_once_per_commit():
  """The manifest a record holds is parsed at its first use and kept while the slot holds
  that commit; the next commit of the slot brings its own."""
  from jaxckpt.host.snapshot import SnapshotManifest   # pylint: disable=import-outside-toplevel
  t = _slots.SlotTable(1)
  text = SnapshotManifest(step=1, leaves=(), nbytes=0).to_json()
  s = t.slots[t.reserve(1, 8, owner=1).index]
  t.commit(s.index, 1, manifest=text)
  assert s.parsed() is s.parsed() and s.parsed().step == 1
  parsed = SnapshotManifest(step=2, leaves=(), nbytes=0)       # a store that has it parsed
  s2 = t.slots[t.reserve(2, 8, owner=1).index]
  t.commit(s2.index, 2, manifest=parsed)
  assert s2.parsed() is parsed and s.manifest is None          # (step 1 dropped: keep=1)


def test_bad_slot_index_and_keep_are_refused():
  with pytest.raises(errors.InvalidArgumentError, match="keep=0"):
    _slots.SlotTable(0)
  t = _slots.SlotTable(1)
  with pytest.raises(errors.CorruptSnapshotError, match="slot index 5"):
    t.commit(5, 1)


def test_budget_error_names_the_sizes_and_the_fix():
  with pytest.raises(errors.HostMemoryBudgetError,
                     match=r"here: 2 snapshots kept \(max_snapshots=2\) \+ 1 being saved: 3 slots x 1.0 MiB = 3.0 MiB exceed .*lower max_snapshots"):
    _slots.check_budget(keep=2, nbytes=2**20, limit_bytes=2**20, where="here")


def test_a_host_of_a_job_drops_only_steps_older_than_the_newest_one_every_host_holds():
  # issue 46 (1): keep=2; this host is ahead. With steps 4 and 5 whole (held by every
  # host) it keeps 5 and every newer step, whatever keep says: a slower host may hold
  # only up to 5; the next save finds no slot until a newer step is whole.
  t = _slots.SlotTable(2)
  assert t.agree(None) == []
  for s in (4, 5):
    assert _commit(t, s) == []
  assert [d.step for d in t.agree(5)] == []                  # (4 is within keep)
  assert _commit(t, 6) == [4]                                # older than 5: it may go
  assert _commit(t, 7) == [] and t.steps() == [5, 6, 7]      # 5 is whole: kept
  assert t.reserve(8, 8, owner=1) is None                    # until a newer one is whole
  assert [d.step for d in t.agree(6)] == [5]
  assert t.reserve(8, 8, owner=1) is not None


def test_a_protected_step_never_replaces_the_step_every_host_holds():
  # host 0 of the issue: protected 4 kept beside the newest took the place of 5 and 6,
  # the steps the slower hosts held.
  t = _slots.SlotTable(2, count=4)
  t.agree(None)
  _commit(t, 4)
  t.protect(4)
  t.agree(4)
  for s in (5, 6):
    _commit(t, s)
  t.agree(5)
  assert _commit(t, 7) == [4] and t.steps() == [5, 6, 7]    # (before: [4, 7])


def test_a_rollback_past_the_whole_step_keeps_every_step_until_the_job_agrees_anew():
  t = _slots.SlotTable(2)
  t.agree(None)
  for s in (1, 2):
    _commit(t, s)
  t.agree(2)
  assert _commit(t, 2) == [2] and t.whole is None            # saved again: a rollback
  assert _commit(t, 3) == [] and t.steps() == [1, 2, 3]      # nothing goes unagreed
