"""What every group of a job's run must hold the same, as the lighthouse keeps it.

:class:`JobTerms` is held by the lighthouse's state (:class:`jaxckpt.ft._members.Members`): the job's terms
(:class:`jaxckpt.ft._terms.Terms`: ``max_groups``, ``data_order``, ``averaging``, the gradient's layout), fixed
from the first quorum's requests of a *run* (or, on a replica that takes over as leader, read from etcd), and
the check that refuses a group whose terms differ, naming the field and both values.

The terms are a run's, not the job's for ever: a run lives while a group of it does (a group that was in one of
its quorums: it holds a view, or goes on with a lineage). When none is left and groups that were in no quorum
ask (the job launched again, maybe with other options), their first quorum starts a new run with their terms,
as a new lighthouse would; the run ended is not consulted. A group that joins a live run is held to its terms.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

from jaxckpt.ft import _intake, _terms

logger = logging.getLogger("jaxckpt.ft.lighthouse")   # (its owner's log, as before the split)

# on_terms(terms, run, new) -> (terms, run): see JobTerms.on_terms
OnTerms = Callable[[_terms.Terms, str, bool], tuple[_terms.Terms, str | None]]


def new_run_id() -> str:
  """A fresh run's id (random: two runs of a job, on any lighthouse, never share one)."""
  return os.urandom(6).hex()


class JobTerms:
  """The job's terms at one lighthouse, and the run they are of.

  Args:
    address: the lighthouse's address (its log lines name it).
    malformed: the lighthouse's count of sealed messages it refused (a refused group counts).

  Attributes:
    terms: the run's terms; None until the first quorum fixes them.
    run: the id of the run they are of (None while not fixed, or read from an older record).
    on_terms: ``on_terms(terms, run, new) -> (terms, run)`` when they are fixed or change (``new``: they
      start run ``run``, else they are a live run's); a replica on etcd stores them there, and gets the
      stored ones back. None: taken as they are.
  """

  def __init__(self, address: str, malformed: _intake.Refusals):
    self.address, self._malformed = address, malformed
    self.terms: _terms.Terms | None = None
    self.run: str | None = None
    self.on_terms: OnTerms | None = None

  def refused(self, gid: str, terms: _terms.Terms) -> str | None:
    """Why ``gid`` cannot join the live run under ``terms`` (None if it can; an unknown layout
    of the run's is taken from it). Only once the run's terms are fixed."""
    why = _terms.differ(terms, self.terms, gid)
    if why is not None:
      self._malformed.add(why)
      logger.warning("lighthouse at %s refused group %s: %s", self.address, gid, why,
                     extra={"group_id": gid})
      return why
    if self.terms.layout is None and terms.layout is not None:
      self.set(dataclasses.replace(self.terms, layout=terms.layout))
    return None

  def set(self, terms: _terms.Terms, new_run: bool = False) -> None:
    run = new_run_id() if new_run or self.run is None else self.run
    self.terms, self.run = (terms, run) if self.on_terms is None else self.on_terms(terms, run, new_run)

  def fix(self, asking: list[tuple[str, bool, _terms.Terms]], run_live: bool) -> list[tuple[str, str]]:
    """The run's terms, from ``asking`` (each pending member's id, whether it holds a view,
    and its terms) if not fixed yet, or if no group of the run they are of is left
    (``run_live`` False, and no asking group holds a view): a new run; the members whose
    terms differ, and why each is refused."""
    fresh = bool(asking) and not run_live and not any(view for _, view, _ in asking)
    if asking and (self.terms is None or fresh):
      ended = self.run if self.terms is not None else None
      self.set(_terms.chosen(asking), new_run=fresh)
      logger.info("lighthouse at %s: the job's terms are %s (run %s%s)", self.address, self.terms, self.run,
                  f"; run {ended} ended: none of its groups is left" if ended and ended != self.run else "")
    if self.terms is None:
      return []
    refused = []
    for gid, _, terms in asking:
      why = self.refused(gid, terms)
      if why is not None:
        refused.append((gid, why))
    return refused
