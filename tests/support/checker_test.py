"""The history checker: a clean history passes; each planted violation fails it, named.

Each history is written through :class:`jaxckpt.testing.history.History` (one file
per process and incarnation, as the soak writes them) and read back with
``read_run``, so the files' format is what is checked.
"""

from __future__ import annotations

import os

import pytest

from jaxckpt.testing import history
from tests.support import checker

P = 2            # processes of the job
DUE = 5          # every 5th step is persisted


def dg(step: int, p: int, version: str = "") -> str:
  return f"d{step}p{p}{version}"


class Run:
  """A small run's history: the nemesis's file and one per (incarnation, process)."""

  def __init__(self, d: str) -> None:
    self.d = d
    self.nemesis = history.History(d, "nemesis", role="nemesis")
    self.files: dict[tuple[int, int], history.History] = {}
    self.faults = 0

  def h(self, inc: int, p: int) -> history.History:
    if (inc, p) not in self.files:
      self.files[inc, p] = history.History(self.d, f"inc{inc:02d}-p{p}", role="trainer",
                                           incarnation=inc, process=p)
    return self.files[inc, p]

  def fresh(self, inc: int = 0) -> None:
    for p in range(P):
      self.h(inc, p).record("start", fresh=True, digest=dg(0, p))

  def restore(self, inc: int, step: int, *, digests=None, tier="host") -> None:
    for p in range(P):
      d = (digests or {}).get(p, dg(step, p))
      self.h(inc, p).record("start", fresh=False)
      self.h(inc, p).record("restore", step=step, tier=tier, digest=d, skipped=[], secs=0.1)

  def train(self, inc: int, first: int, last: int, *, stored_lag: int = 0,
            version: str = "", told=None) -> None:
    """Saves steps first..last on every process; at each due step a listing (process 0
    is told the due steps up to ``stored_lag`` intervals back are on storage)."""
    for s in range(first, last + 1):
      for p in range(P):
        self.h(inc, p).record("save", step=s, accepted=True, snapshotted=True,
                              digest=dg(s, p, version))
        if s % DUE == 0:
          stored = [x for x in range(DUE, s - stored_lag * DUE + 1, DUE)] if p == 0 else None
          if told is not None and p == 0:
            stored = told
          self.h(inc, p).record("listing", step=s, protected=[s - DUE] if s > DUE else [],
                                stored=stored)

  def fault(self, kind: str, inc: int, at: int, relaunch: bool = True) -> int:
    self.faults += 1
    self.nemesis.record("fault", id=self.faults, kind=kind, host=0, at_step=at,
                        incarnation=inc, relaunch=relaunch)
    return self.faults

  def recovered(self, fid: int, inc: int, step: int) -> None:
    self.nemesis.record("recovered", id=fid, incarnation=inc, restored_step=step)

  def end(self, stored: list[int]) -> checker.Report:
    self.nemesis.record("end", stored=stored)
    for f in [self.nemesis, *self.files.values()]:
      f.close()
    return checker.check_run(self.d)


def clean(run: Run) -> list[int]:
  """Start, train to 12, kill a trainer, restore 12, train to 20, restart, restore 20,
  delete 25 at the end of a third incarnation, the fourth restores 20 and ends at 30."""
  run.fresh(0)
  run.train(0, 1, 12)
  f = run.fault("kill_trainer", 0, at=12)
  run.restore(1, 12)
  run.recovered(f, 1, 12)
  run.train(1, 13, 20)
  f = run.fault("restart", 1, at=20)
  run.restore(2, 20)
  run.recovered(f, 2, 20)
  run.train(2, 21, 25)
  for p in range(P):
    run.h(2, p).record("delete", step=25, after=[20, 24])
  f = run.fault("delete", 2, at=25)
  run.restore(3, 24)
  run.recovered(f, 3, 24)
  run.train(3, 25, 30, version="b")
  return [5, 10, 15, 20, 25, 30]


def test_a_clean_history_passes_and_gives_the_figures_per_kind(tmp_path):
  run = Run(str(tmp_path))
  report = run.end(clean(run))
  assert report.ok, report.violations
  assert report.faults["kill_trainer"] == {"count": 1, "steps_lost": {"median": 0, "max": 0},
                                           "recovery_secs": report.faults["kill_trainer"][
                                               "recovery_secs"]}
  assert report.faults["delete"]["steps_lost"] == {"median": 1, "max": 1}
  assert report.faults["restart"]["recovery_secs"]["max"] >= 0
  assert report.to_json()["violations"] == []


def test_a_restore_of_other_bytes_than_saved_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 12)
  f = run.fault("kill_trainer", 0, at=12)
  run.restore(1, 12, digests={1: "flipped"})
  run.recovered(f, 1, 12)
  report = run.end([5, 10])
  assert report.rules_broken() == {"restore_not_saved"}, report.violations
  assert "process 1: step 12 from host has digest flipped, saved as d12p1" in str(
      report.violations[0])


def test_a_restore_of_a_step_never_saved_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 12)
  f = run.fault("kill_trainer", 0, at=12)
  run.restore(1, 13)
  run.recovered(f, 1, 13)
  report = run.end([5, 10])
  assert report.rules_broken() == {"restore_not_saved"}, report.violations
  assert "restored step 13 from host, never saved" in str(report.violations[0])


def test_processes_restoring_different_steps_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 12)
  run.fault("kill_trainer", 0, at=12)
  run.h(1, 0).record("restore", step=12, tier="host", digest=dg(12, 0), skipped=[])
  run.h(1, 1).record("restore", step=11, tier="host", digest=dg(11, 1), skipped=[])
  report = run.end([5, 10])
  assert "restores_differ" in report.rules_broken(), report.violations
  assert "processes restored steps {0: 12, 1: 11}" in str(report.violations)


def test_a_persisted_step_missing_at_the_end_is_named(tmp_path):
  run = Run(str(tmp_path))
  stored = clean(run)
  stored.remove(15)
  report = run.end(stored)
  assert report.rules_broken() == {"persisted_lost"}, report.violations
  assert "step 15, which process 0 of incarnation 1 was told is on storage" in str(
      report.violations[0])


def test_a_deleted_persisted_step_may_go_and_a_deleted_one_may_not_return(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 10)
  for p in range(P):
    run.h(0, p).record("delete", step=10, after=[9])
  f = run.fault("delete", 0, at=10)
  run.restore(1, 10)            # the deleted step, back
  run.recovered(f, 1, 10)
  report = run.end([5])         # 10 deleted: not on storage, as it should be
  assert report.rules_broken() == {"resurrected"}, report.violations
  assert "restored step 10, which was deleted" in str(report.violations[0])


def test_a_delete_that_still_lists_its_step_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 10)
  run.h(0, 0).record("delete", step=10, after=[9])
  run.h(0, 1).record("delete", step=10, after=[9, 10])
  run.h(0, 1).record("available", steps=[9, 10])
  report = run.end([5])
  assert report.rules_broken() == {"resurrected"}, report.violations
  assert len(report.violations) == 2
  assert "step 10 is still listed by all_steps() after its delete" in str(report.violations[0])


def test_an_abandoned_step_restored_after_a_rollback_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 12)
  f = run.fault("damage_newest", 0, at=12)
  run.nemesis.record("damaged", step=10, incarnation=1)
  run.restore(1, 5, tier="storage")
  run.recovered(f, 1, 5)
  run.train(1, 6, 8)
  f = run.fault("kill_trainer", 1, at=8)
  run.restore(2, 12)            # step 12 of incarnation 0: the rollback abandoned it
  run.recovered(f, 2, 12)
  report = run.end([5, 10])
  assert report.rules_broken() == {"resurrected"}, report.violations
  assert "restored step 12, which a rollback abandoned" in str(report.violations[0])


def test_a_resume_older_than_the_surviving_tier_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 12)
  f = run.fault("kill_trainer", 0, at=12)      # host memory survives: 12 is the floor
  run.restore(1, 10)
  run.recovered(f, 1, 10)
  run.train(1, 11, 22, stored_lag=0)
  f = run.fault("lose_host", 1, at=22)         # one host lost: protected 15 or stored 20
  run.restore(2, 15, tier="storage")
  run.recovered(f, 2, 15)
  report = run.end([5, 10, 15, 20])
  assert report.rules_broken() == {"resume_too_old"}, report.violations
  got = [str(v) for v in report.violations]
  assert "after kill_trainer (fault 1) incarnation 1 restored step 10, older than step 12" in got[0]
  assert "after lose_host (fault 2) incarnation 2 restored step 15, older than step 20" in got[1]
  assert report.faults["lose_host"]["steps_lost"] == {"median": 7, "max": 7}


def test_a_cut_off_process_reporting_a_step_the_job_cannot_hold_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 9)
  run.nemesis.record("cut", incarnation=0, process=1)
  run.h(0, 1).record("listing", step=10, protected=[], stored=[10])
  run.nemesis.record("heal", incarnation=0, process=1)
  run.h(0, 0).record("listing", step=10, protected=[], stored=[5])
  report = run.end([5])
  assert "cut_off_success" in report.rules_broken(), report.violations
  assert "process 1, cut off from the job, reported step 10 persisted" in str(report.violations)


def test_a_wait_past_its_timeout_or_naming_no_one_is_named(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 3)
  run.h(0, 0).record("wait", what="wait_until_snapshotted(3)", timeout_secs=30, secs=55.0,
                     ok=True)
  run.h(0, 1).record("wait", what="wait_until_snapshotted(3)", timeout_secs=30, secs=30.2,
                     ok=False, message="timed out after 30 s")
  run.h(0, 1).record("wait", what="wait_until_snapshotted(3)", timeout_secs=30, secs=30.2,
                     ok=False, message="timed out after 30 s waiting for the agent of host 2 "
                                       "(127.0.1.3:4567)")
  report = run.end([])
  assert report.rules_broken() == {"wait_unbounded"}, report.violations
  got = [str(v) for v in report.violations]
  assert len(got) == 2
  assert "waited 55.0 s, past its timeout of 30 s" in got[0]
  assert "failed without naming whom it could not reach: 'timed out after 30 s'" in got[1]


def _groups(run: Run, commits: list[tuple[str, int, str, int]]) -> checker.Report:
  files = {}
  for g, step, digest, batch in commits:
    h = files.setdefault(g, history.History(run.d, f"group-{g}", role="group", group=g))
    h.record("quorum", step=step, quorum_id=step, members=sorted({c[0] for c in commits}))
    h.record("commit", step=step, should_commit=True, digest=digest, batch=batch)
  for h in files.values():
    h.close()
  return run.end([])


def test_replica_groups_committing_different_bytes_is_named(tmp_path):
  report = _groups(Run(str(tmp_path)), [("a", 1, "x1", 1), ("b", 1, "x1", 1),
                                        ("a", 2, "x2", 2), ("b", 2, "y2", 2)])
  assert report.rules_broken() == {"groups_commit_differ"}, report.violations
  assert "step 2: the groups committed different bytes {'a': 'x2', 'b': 'y2'}" in str(
      report.violations[0])


def test_a_batch_trained_twice_or_skipped_is_named(tmp_path):
  report = _groups(Run(str(tmp_path)), [("a", 1, "x1", 1), ("a", 2, "x2", 1),
                                        ("a", 3, "x3", 3), ("a", 4, "x4", 5)])
  assert report.rules_broken() == {"batch_twice", "batch_skipped"}, report.violations
  got = sorted(str(v) for v in report.violations)
  assert got[0] == "batch_skipped: batches [2, 4] were never trained by a committed step " \
                   "(committed: 1..5)"
  assert got[1] == "batch_twice: batch 1 was trained by committed steps [1, 2]"


def test_replica_groups_in_step_pass(tmp_path):
  report = _groups(Run(str(tmp_path)), [(g, s, f"x{s}", s) for s in (1, 2, 3) for g in "ab"])
  assert report.ok, report.violations


def test_a_torn_last_line_is_dropped_and_counted(tmp_path):
  run = Run(str(tmp_path))
  run.fresh(0)
  run.train(0, 1, 2)
  run.end([])
  with open(os.path.join(tmp_path, "inc00-p0.jsonl"), "ab") as f:
    f.write(b'{"event": "save", "st')           # killed in the middle of a write
  report = checker.check_run(str(tmp_path))
  assert report.ok and report.torn_lines == 1


@pytest.mark.parametrize("rule", checker.RULES)
def test_every_rule_has_a_planted_case(rule):
  """Each rule of the model is planted by one of the tests above (by its name)."""
  here = open(__file__).read()
  assert f'"{rule}"' in here.split("def test_every_rule_has_a_planted_case")[0]


def test_a_step_the_keep_rule_dropped_on_some_hosts_is_no_floor(tmp_path):
  """Process 1 skipped steps 11 and 12 (busy). With max_snapshots=2 process 0's keep rule
  dropped step 10, which process 1 still holds: no step is held on every host, and a
  resume at stored step 5 is no violation. With max_snapshots=3 both hold step 10, and a
  resume at 5 is one."""
  for keep, broken in ((2, set()), (3, {"resume_too_old"})):
    run = Run(str(tmp_path / str(keep)))
    for p in range(P):
      run.h(0, p).record("start", fresh=True, digest=dg(0, p), max_snapshots=keep)
    for s in range(1, 13):
      for p in range(P):
        ok = not (p == 1 and s > 10)
        run.h(0, p).record("save", step=s, accepted=ok, snapshotted=ok, digest=dg(s, p))
    run.h(0, 0).record("listing", step=None, protected=None, stored=[5])
    f = run.fault("kill_trainer", 0, at=12)
    run.restore(1, 5, tier="storage")
    run.recovered(f, 1, 5)
    report = run.end([5])
    assert report.rules_broken() == broken, (keep, report.violations)
