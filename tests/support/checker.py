"""The checker of a run's whole history (:mod:`jaxckpt.testing.history`) against the
model of docs/reliability.md ("The model the checker holds the history to").

:func:`check` takes every event of a run (``history.read_run``) and returns a
:class:`Report`: a :class:`Violation` for each broken rule, named, and the figures
per fault kind (how many, steps lost: median and max, recovery seconds: median and
max). The rules (each a :data:`RULES` name):

- ``restore_not_saved``: every restore returns exactly the bytes (the digest) that
  the same process saved for that step on the current timeline: the saves of the
  incarnations the restores have not gone back past, less the steps deleted or
  damaged on purpose since. A fresh start's step 0 is a save.
- ``restores_differ``: every process of an incarnation restores the same step.
- ``persisted_lost``: a step a process was told is on storage (``listing.stored``)
  is on storage when the run ends, unless a delete the user made removed it after.
- ``resume_too_old``: after each fault, the next incarnation restores a step no
  older than the newest one whose promised tier survives that kind of fault
  (:data:`FLOORS`); the steps lost are the progress at the fault less the step
  restored (reported per kind).
- ``resurrected``: no deleted step comes back (restored, or listed by
  ``all_steps()``) unless it was saved again after its delete; no abandoned
  step (one a restore went back past) is restored.
- ``cut_off_success``: a process cut off from the job (``cut``, until ``heal``)
  never reports a step snapshotted, persisted or deleted that the job does not
  hold at the end (not on storage, not restored later).
- ``wait_unbounded``: every wait ends within its timeout (plus
  :data:`WAIT_SLACK`), and one that failed names whom it could not reach.
- ``groups_commit_differ``, ``batch_twice``, ``batch_skipped``: replica groups
  that commit a step commit the same bytes; the batches of the committed steps
  are each consumed once, none skipped.

>>> report = check([])
>>> report.ok, report.violations
(True, [])
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
from typing import Any, Iterable

RULES = ("restore_not_saved", "restores_differ", "persisted_lost", "resume_too_old",
         "resurrected", "cut_off_success", "wait_unbounded", "groups_commit_differ",
         "batch_twice", "batch_skipped")

#: fault kind -> the newest step the next restore must reach at least: ``"committed"``
#: (the newest step snapshotted on every process: host memory survives), ``"protected"``
#: (the newest step every process was told is protected by parity, or a stored one,
#: whichever is newer: one host's memory is lost), ``"stored"`` (the newest step on
#: storage), ``"stored_undamaged"`` (the newest stored step not damaged on purpose) or
#: None (no promise the history can check). Kinds not named: ``"stored"``.
FLOORS: dict[str, str | None] = {
    "kill_trainer": "committed", "restart": "committed", "delete": "stored",
    "second_manager": "committed", "stray_tcp": "committed", "dead_claim": "committed",
    "s3_pause": "committed", "s3_errors": "committed", "clock_jump": "committed",
    "kill_agent": "protected", "lose_host": "protected",
    "truncate_slots": "stored", "disk_full": "stored", "power_loss": "stored",
    "damage_newest": "stored_undamaged", "impossible_newest": "stored_undamaged",
    "unplanned": "stored",
}
#: seconds a wait may run past its timeout (a loaded machine's scheduling)
WAIT_SLACK = 10.0
#: a failed wait names whom it could not reach: a host, process, agent, address, peer...
_NAMES_WHO = re.compile(r"host|process|agent|peer|storage|lighthouse|etcd|group|rank|"
                        r"\d+\.\d+\.\d+\.\d+|:\d{2,5}\b", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Violation:
  rule: str
  detail: str

  def __str__(self) -> str:
    return f"{self.rule}: {self.detail}"


@dataclasses.dataclass
class Report:
  violations: list[Violation]
  faults: dict[str, dict[str, Any]]     # kind -> count, steps_lost, recovery_secs
  torn_lines: int = 0

  @property
  def ok(self) -> bool:
    return not self.violations

  def rules_broken(self) -> set[str]:
    return {v.rule for v in self.violations}

  def to_json(self) -> dict[str, Any]:
    return {"faults": self.faults, "torn_lines": self.torn_lines,
            "violations": [str(v) for v in self.violations]}


def _spread(xs: list[float]) -> dict[str, float] | None:
  return None if not xs else {"median": round(statistics.median(xs), 2),
                              "max": round(max(xs), 2)}


class _Checker:
  def __init__(self, events: Iterable[dict[str, Any]], torn: int) -> None:
    self.v: list[Violation] = []
    self.torn = torn
    trainers: dict[int, list[dict]] = collections.defaultdict(list)
    self.nemesis: list[dict] = []
    self.groups: list[dict] = []
    for e in events:
      role = e.get("role", "trainer")
      if role == "nemesis":
        self.nemesis.append(e)
      elif role == "group":
        self.groups.append(e)
      else:
        trainers[int(e["incarnation"])].append(e)
    for evs in trainers.values():
      evs.sort(key=lambda e: (e.get("process", 0), e.get("seq", 0)))
    self.nemesis.sort(key=lambda e: e.get("seq", 0))
    self.incarnations = dict(sorted(trainers.items()))
    ends = [e for e in self.nemesis if e["event"] == "end"]
    self.end_stored: set[int] | None = set(ends[-1]["stored"]) if ends else None

  def add(self, rule: str, detail: str) -> None:
    self.v.append(Violation(rule, detail))

  # -- trainers -----------------------------------------------------------------

  def timelines(self) -> None:
    """Walks the incarnations in order, keeping per process the bytes of each step on
    the current timeline; checks restores, deletes, listings and floors on the way."""
    saved: dict[int, dict[int, str]] = collections.defaultdict(dict)   # process -> step -> digest
    deleted: set[int] = set()          # deleted (by an earlier incarnation), not saved since
    abandoned: set[int] = set()        # a restore went back past it, not saved since
    damaged: list[tuple[int, int]] = []          # (incarnation it applies from, step)
    faults_before = collections.defaultdict(list)   # incarnation -> faults that ended the one before
    for e in self.nemesis:
      if e["event"] == "damaged":
        damaged.append((int(e["incarnation"]), int(e["step"])))
      elif e["event"] == "fault" and e.get("relaunch", True):
        faults_before[int(e["incarnation"]) + 1].append(e)
    self.stored_all: set[int] = set()        # steps the job was told are on storage
    self.lost: dict[str, list[float]] = collections.defaultdict(list)
    self.cut_reports: list[tuple[int, int, str, int]] = []
    told_stored: dict[int, tuple[int, int]] = {}   # step -> (incarnation, process) that was told
    committed_floor = protected_floor = None       # of the incarnation before
    cuts = self._cuts()
    for inc, evs in self.incarnations.items():
      due = [d for d in damaged if d[0] <= inc]
      damaged = [d for d in damaged if d[0] > inc]
      for _, step in due:                          # its bytes changed on purpose: gone
        for p in saved:
          saved[p].pop(step, None)
        abandoned.add(step)
        self.stored_all.discard(step)
        told_stored.pop(step, None)
      by_p: dict[int, list[dict]] = collections.defaultdict(list)
      for e in evs:
        by_p[int(e.get("process", 0))].append(e)
      steps = {}                                   # process -> the step it began at
      for p, es in by_p.items():
        first = next((e for e in es if e["event"] == "restore"
                      or (e["event"] == "start" and e.get("fresh"))), None)
        if first is not None:
          steps[p] = 0 if first["event"] == "start" else int(first["step"])
      if len(set(steps.values())) > 1:
        self.add("restores_differ", f"incarnation {inc}: processes restored steps {steps}")
      rolled: set[int] = set()                     # saved steps this restore went back past
      if steps:
        back_to = min(steps.values())
        for f in faults_before.pop(inc, ()):
          self._floor(f, back_to, inc, committed_floor, protected_floor)
        rolled = {s for q in saved for s in saved[q] if s > back_to}
        for q in saved:
          for s in rolled:
            saved[q].pop(s, None)
      elif inc in faults_before:     # an incarnation that never began (its start failed)
        faults_before[inc + 1] = faults_before.pop(inc) + faults_before.get(inc + 1, [])
      committed: dict[int, set[int]] = collections.defaultdict(set)
      protected_told: dict[int, set[int]] = {}
      # the steps each process's host tier still holds by its keep rule (max_snapshots)
      held: dict[int, list[int]] = collections.defaultdict(list)
      keep = max([int(e.get("max_snapshots") or 1) for e in evs if e["event"] == "start"],
                 default=1)
      deletes: set[int] = set()
      for p, es in by_p.items():
        gone, dropped = set(deleted), abandoned | rolled     # as this process sees them
        mine = dict(saved.get(p, {}))
        for e in es:
          ev = e["event"]
          if ev == "start" and e.get("fresh"):
            mine[0] = e["digest"]
            gone.discard(0)
          elif ev == "restore":
            self._restore(inc, p, e, mine, gone, dropped)
          elif ev == "save" and e.get("snapshotted"):
            s = int(e["step"])
            mine[s] = e["digest"]
            committed[s].add(p)
            held[p] = [x for x in held[p] if x != s][-(keep - 1):] + [s] if keep > 1 else [s]
            gone.discard(s)
            dropped.discard(s)
            self._cut_report(cuts, inc, p, e, s, "snapshotted")
          elif ev == "listing":
            if e.get("protected") is not None:
              protected_told[p] = set(e["protected"])
            for s in e.get("stored") or ():
              told_stored.setdefault(int(s), (inc, p))
              self.stored_all.add(int(s))
              self._cut_report(cuts, inc, p, e, int(s), "persisted")
          elif ev == "available":
            back = sorted(set(e["steps"]) & gone)
            if back:
              self.add("resurrected", f"incarnation {inc} process {p}: all_steps() lists "
                       f"deleted step(s) {back}")
          elif ev == "delete":
            s = int(e["step"])
            deletes.add(s)
            gone.add(s)
            mine.pop(s, None)
            self._cut_report(cuts, inc, p, e, s, "deleted")
            if s in (e.get("after") or ()):
              self.add("resurrected", f"incarnation {inc} process {p}: step {s} is still "
                       f"listed by all_steps() after its delete: {e['after']}")
          elif ev == "wait":
            self._wait(inc, p, e)
          elif ev == "error" and "timed out" in str(e.get("message", "")).lower():
            self._wait(inc, p, {"what": f"step {e.get('step')}", "ok": False,
                                "message": e["message"]})
        saved[p] = mine
      # the job's view once this incarnation ended: its rollback, its saves, its deletes
      abandoned |= rolled
      deleted -= set(committed)
      abandoned -= set(committed)
      deleted |= deletes
      for s in deletes:
        for q in saved:
          saved[q].pop(s, None)
        told_stored.pop(s, None)
        self.stored_all.discard(s)
      # held on every host: the newest step in every process's kept window
      on_all = set.intersection(*(set(held[p]) for p in by_p)) - deletes if by_p else set()
      committed_floor = max(on_all, default=None)
      protected_floor = None
      if protected_told and len(protected_told) == len(by_p):
        both = set.intersection(*protected_told.values()) & on_all
        protected_floor = max(both, default=None)
    self._persisted(told_stored)

  def _restore(self, inc: int, p: int, e: dict, saved: dict[int, str], deleted: set[int],
               abandoned: set[int]) -> None:
    s = int(e["step"])
    if e.get("tier") == "none":
      return                                    # nothing was left: checked by the floors
    if s in deleted:
      self.add("resurrected", f"incarnation {inc} process {p}: restored step {s}, which "
               "was deleted")
    elif s in abandoned:
      self.add("resurrected", f"incarnation {inc} process {p}: restored step {s}, which a "
               "rollback abandoned")
    elif s not in saved:
      self.add("restore_not_saved", f"incarnation {inc} process {p}: restored step {s} from "
               f"{e.get('tier')}, never saved by it on this timeline")
    elif saved[s] != e.get("digest"):
      self.add("restore_not_saved", f"incarnation {inc} process {p}: step {s} from "
               f"{e.get('tier')} has digest {e.get('digest')}, saved as {saved[s]}")

  def _floor(self, fault: dict, restored: int, inc: int, committed: int | None,
             protected: int | None) -> None:
    kind = fault["kind"]
    how = FLOORS.get(kind, "stored")
    stored = max(self.stored_all, default=None)     # damaged steps already taken out
    tier = {"committed": committed, "protected": protected}.get(how)
    floor = None if how is None else max([x for x in (tier, stored) if x is not None],
                                         default=None)
    if floor is not None and restored < floor:
      self.add("resume_too_old", f"after {kind} (fault {fault.get('id')}) incarnation {inc} "
               f"restored step {restored}, older than step {floor} whose tier ({how}) "
               "survives that fault")
    at = next((e.get("at_step") for e in self.nemesis if e["event"] == "recovered"
               and e.get("id") == fault.get("id") and e.get("at_step") is not None),
              fault.get("at_step"))
    if at is not None:
      self.lost[kind].append(max(0, int(at) - restored))

  def _persisted(self, told_stored: dict[int, tuple[int, int]]) -> None:
    if self.end_stored is None:
      return
    for s, (inc, p) in sorted(told_stored.items()):
      if s not in self.end_stored:
        self.add("persisted_lost", f"step {s}, which process {p} of incarnation {inc} was told "
                 "is on storage, is not on storage at the end (no delete removed it)")

  def _wait(self, inc: int, p: int, e: dict) -> None:
    secs, timeout = e.get("secs"), e.get("timeout_secs")
    if secs is not None and timeout is not None and secs > timeout + WAIT_SLACK:
      self.add("wait_unbounded", f"incarnation {inc} process {p}: {e.get('what')} waited "
               f"{secs:.1f} s, past its timeout of {timeout} s")
    if not e.get("ok", True) and not _NAMES_WHO.search(str(e.get("message", ""))):
      self.add("wait_unbounded", f"incarnation {inc} process {p}: {e.get('what')} failed "
               f"without naming whom it could not reach: {e.get('message')!r}")

  # -- cut-off processes --------------------------------------------------------

  def _cuts(self) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """(incarnation, process) -> the spans it was cut off (t of cut, t of heal)."""
    out: dict[tuple[int, int], list[list[float]]] = collections.defaultdict(list)
    for e in self.nemesis:
      key = (int(e.get("incarnation", 0)), int(e.get("process", -1)))
      if e["event"] == "cut":
        out[key].append([e["t"], float("inf")])
      elif e["event"] == "heal" and out.get(key):
        out[key][-1][1] = e["t"]
    return {k: [tuple(x) for x in v] for k, v in out.items()}

  def _cut_report(self, cuts, inc: int, p: int, e: dict, step: int, what: str) -> None:
    if any(a <= e["t"] <= b for a, b in cuts.get((inc, p), ())):
      self.cut_reports.append((inc, p, what, step))

  def cut_off(self) -> None:
    held = set(self.end_stored or ())
    restored = {int(e["step"]) for evs in self.incarnations.values() for e in evs
                if e["event"] == "restore"}
    for inc, p, what, step in self.cut_reports:
      if what == "deleted" or step not in held | restored:
        self.add("cut_off_success", f"incarnation {inc} process {p}, cut off from the job, "
                 f"reported step {step} {what}, which the job does not hold")

  # -- replica groups -----------------------------------------------------------

  def replica_groups(self) -> None:
    commits = [e for e in self.groups if e["event"] == "commit" and e.get("should_commit")]
    by_step: dict[int, dict[str, str]] = collections.defaultdict(dict)
    batches: dict[int, set[Any]] = collections.defaultdict(set)   # batch -> steps that trained it
    for e in commits:
      by_step[int(e["step"])][str(e["group"])] = e.get("digest")
      if e.get("batch") is not None:
        batches[int(e["batch"])].add(int(e["step"]))
    for s, got in sorted(by_step.items()):
      if len(set(got.values())) > 1:
        self.add("groups_commit_differ", f"step {s}: the groups committed different bytes "
                 f"{dict(sorted(got.items()))}")
    for b, steps in sorted(batches.items()):
      if len(steps) > 1:
        self.add("batch_twice", f"batch {b} was trained by committed steps {sorted(steps)}")
    if batches:
      lo, hi = min(batches), max(batches)
      missing = sorted(set(range(lo, hi + 1)) - set(batches))
      if missing:
        self.add("batch_skipped", f"batches {missing[:20]} were never trained by a committed "
                 f"step (committed: {lo}..{hi})")

  # -- figures ------------------------------------------------------------------

  def figures(self) -> dict[str, dict[str, Any]]:
    count: collections.Counter[str] = collections.Counter()
    start: dict[Any, tuple[str, float]] = {}
    rec: dict[str, list[float]] = collections.defaultdict(list)
    for e in self.nemesis:
      if e["event"] == "fault":
        count[e["kind"]] += 1
        start[e["id"]] = (e["kind"], e["t"])
      elif e["event"] == "recovered" and e["id"] in start:
        kind, t0 = start[e["id"]]
        rec[kind].append(e["t"] - t0)
    return {k: {"count": n, "steps_lost": _spread(self.lost.get(k, [])),
                "recovery_secs": _spread(rec.get(k, []))} for k, n in sorted(count.items())}


def check(events: Iterable[dict[str, Any]], *, torn: int = 0) -> Report:
  """Checks a run's events (see the module docstring); ``torn``: lines dropped by
  :func:`~jaxckpt.testing.history.read_run`."""
  c = _Checker(events, torn)
  c.timelines()
  c.cut_off()
  c.replica_groups()
  return Report(c.v, c.figures(), torn)


def check_run(directory: str) -> Report:
  """Reads every history file of a run (``directory``) and checks it."""
  from jaxckpt.testing import history  # pylint: disable=import-outside-toplevel
  events, torn = history.read_run(directory)
  return check(events, torn=torn)
