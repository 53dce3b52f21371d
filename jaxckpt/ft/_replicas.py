"""Lighthouse replicas on etcd: one leader, elected by a lease, fenced by a transaction per quorum.

Several lighthouse processes (``jaxckpt lighthouse --etcd URL,... --job NAME``)
serve one job. Every replica hears every group (a group sends each message to
all of them, :class:`jaxckpt.ft._route.Routes`), so a follower's view of the
membership is warm; only the *leader* answers, forms quorums and tells members
to abort or ask again.

* **Election.** Each replica holds an etcd lease (TTL ``lease_ttl``, renewed
  every third of it) and campaigns with a transaction that creates
  ``/jaxckpt/<job>/leader`` under its lease only if the key does not exist. The
  key's holder leads. A replica that exits cleanly revokes its lease, so a
  follower leads within its poll (0.05 s); one that dies leads the job until its
  lease expires (etcd's shortest is 1 s here).
* **Fencing.** Each quorum the leader forms is first written to
  ``/jaxckpt/<job>/quorum`` by a transaction that holds only while the leader
  key is still its own (the same create revision and value): a deposed leader
  (its lease expired while it was paused, or it lost etcd) learns it from the
  failed transaction, forms nothing and answers no one.
* **Terms.** A run's terms (:mod:`jaxckpt.ft._terms`) are recorded in
  ``/jaxckpt/<job>/terms`` with the run's id (``{"run": ..., "terms": ...}``) and
  read by every later leader, so a group relaunched into a live run with other
  options is refused whichever replica leads. A run ends when none of its groups
  is left (:mod:`jaxckpt.ft._job_terms`): the next run's first quorum records its
  own terms over them, as a new lighthouse would start afresh.

Groups never wait for any of this while their quorum holds: they go on without
asking (:meth:`jaxckpt.ft._quorum.Quorum.continued`). A new leader adopts the
quorum the groups go on with from their heartbeats.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from jaxckpt.ft import _etcd, _terms

logger = logging.getLogger(__name__)

_FOLLOWER_POLL_SECS = 0.05


class Candidacy:
  """One lighthouse replica's place in the election of job ``job`` on etcd ``endpoints``.

  ``on_elected()`` and ``on_deposed()`` are called from its thread; :meth:`fence` and
  :meth:`terms` from the lighthouse's."""

  def __init__(self, endpoints: list[str], job: str, me: str, *, lease_ttl_secs: int,
               on_elected: Callable[[], None], on_deposed: Callable[[], None]) -> None:
    self.me, self.job = me, job
    self._ttl = max(1, int(lease_ttl_secs))
    self._etcd = _etcd.Etcd(endpoints, timeout_secs=min(2.0, self._ttl))
    self._fence_etcd = _etcd.Etcd(endpoints, timeout_secs=min(2.0, self._ttl))   # (the serving thread's)
    prefix = f"/jaxckpt/{job}/"
    self.leader_key, self.quorum_key, self.terms_key = prefix + "leader", prefix + "quorum", prefix + "terms"
    self._on_elected, self._on_deposed = on_elected, on_deposed
    self.leading = False
    self._revision = 0                    # the create revision of our leader key
    self._lease = 0
    self._renewed = 0.0                   # when the lease was last renewed
    self.elections = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"candidacy-{me}", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    """Stops campaigning; a leader revokes its lease (a follower leads at once)."""
    self._stop.set()
    self._thread.join(timeout=5)
    if self._lease:
      try:
        self._etcd.revoke(self._lease)
      except _etcd.EtcdError as e:
        logger.warning("lighthouse %s could not revoke its etcd lease (it expires in %d s): %s",
                       self.me, self._ttl, e)
    self._etcd.close()
    self._fence_etcd.close()

  # ---- the election ------------------------------------------------------------------------------------

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self._round()
      except _etcd.EtcdError as e:
        if self.leading and time.monotonic() - self._renewed > self._ttl:
          self._step_down(f"etcd did not answer for {self._ttl} s ({e})")
        logger.debug("lighthouse %s: etcd: %s", self.me, e)
      self._stop.wait(self._ttl / 3 if self.leading else _FOLLOWER_POLL_SECS)

  def _round(self) -> None:
    now = time.monotonic()
    if not self._lease:
      self._lease, self._renewed = self._etcd.grant(self._ttl), now
    elif self.leading or now - self._renewed > self._ttl / 3:
      if self._etcd.keepalive(self._lease) <= 0:
        self._lease = 0
        if self.leading:
          self._step_down("its etcd lease expired")
        return
      self._renewed = now
    if self.leading:
      return
    ok, got = self._etcd.txn([_etcd.compare(self.leader_key, "CREATE", 0)],
                             [_etcd.put_op(self.leader_key, self.me, self._lease)],
                             [_etcd.get_op(self.leader_key)])
    if ok:
      held = self._etcd.get(self.leader_key)      # (our create revision, for the fence)
    else:
      kvs = got[0]["kvs"] if got else []
      held = kvs[0] if kvs else None
    if held is not None and held.value.decode() == self.me and held.lease == self._lease:
      self._revision, self.leading = held.create_revision, True
      self.elections += 1
      logger.warning("lighthouse %s leads job %s (etcd revision %d)", self.me, self.job, self._revision)
      self._on_elected()

  def _step_down(self, why: str) -> None:
    self.leading = False
    logger.warning("lighthouse %s no longer leads job %s: %s", self.me, self.job, why)
    self._on_deposed()

  # ---- what the leader writes -------------------------------------------------------------------------

  def fence(self, quorum_id: str) -> bool:
    """Records quorum ``quorum_id`` if this replica still leads (one transaction); False
    (and steps down) if it does not."""
    if not self.leading:
      return False
    try:
      ok, _ = self._fence_etcd.txn(
          [_etcd.compare(self.leader_key, "CREATE", self._revision),
           _etcd.compare(self.leader_key, "VALUE", self.me)],
          [_etcd.put_op(self.quorum_key, json.dumps({"id": quorum_id, "leader": self.me}))])
    except _etcd.EtcdError as e:
      logger.warning("lighthouse %s cannot record quorum %s in etcd (%s): it forms none until etcd "
                     "answers", self.me, quorum_id, e)
      return False
    if not ok:
      self._step_down(f"another lighthouse holds {self.leader_key}")
    return ok

  def terms(self, terms: _terms.Terms, run: str, new: bool) -> tuple[_terms.Terms, str | None]:
    """The job's terms and their run. ``new``: ``terms`` start run ``run`` (no group of the
    run recorded is left), recorded over it while this replica leads. Else the recorded ones
    when there are (with ``terms``' layout when they had none), or ``terms`` of ``run``, now
    recorded."""
    record = json.dumps({"run": run, "terms": terms.to_wire()})
    try:
      if new:
        ok, _ = self._fence_etcd.txn(
            [_etcd.compare(self.leader_key, "CREATE", self._revision),
             _etcd.compare(self.leader_key, "VALUE", self.me)],
            [_etcd.put_op(self.terms_key, record)])
        if not ok:
          logger.warning("lighthouse %s could not record run %s's terms: it no longer leads", self.me, run)
        return terms, run
      ok, got = self._fence_etcd.txn([_etcd.compare(self.terms_key, "CREATE", 0)],
                                     [_etcd.put_op(self.terms_key, record)], [_etcd.get_op(self.terms_key)])
    except _etcd.EtcdError as e:
      logger.warning("lighthouse %s cannot record the job's terms in etcd (%s): kept in memory", self.me, e)
      return terms, run
    if ok:
      return terms, run
    stored, stored_run = _record(got[0]["kvs"][0].value)
    if stored.layout is None and terms.layout is not None and _terms.differ(terms, stored, "-") is None:
      stored = _terms.Terms(max_groups=stored.max_groups, data_order=stored.data_order,
                            averaging=stored.averaging, layout=terms.layout)
      self._fence_etcd.put(self.terms_key, json.dumps({"run": stored_run, "terms": stored.to_wire()}))
    return stored, stored_run

  def stored_terms(self) -> tuple[_terms.Terms, str | None] | None:
    """The recorded terms and their run (None: no run recorded any)."""
    kv = self._fence_etcd.get(self.terms_key)
    return None if kv is None else _record(kv.value)


def _record(value: bytes) -> tuple[_terms.Terms, str | None]:
  """The terms and the run of ``/jaxckpt/<job>/terms`` (a record of before runs: its terms, no run)."""
  obj = json.loads(value)
  if isinstance(obj, dict):
    return _terms.Terms.from_wire(obj.get("terms")), obj.get("run") if isinstance(obj.get("run"), str) else None
  return _terms.Terms.from_wire(obj), None
