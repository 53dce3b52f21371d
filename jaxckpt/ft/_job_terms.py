"""What every group of a job must hold the same, as the lighthouse keeps it.

:class:`JobTerms` is held by the lighthouse's state (:class:`jaxckpt.ft._members.Members`): the job's terms
(:class:`jaxckpt.ft._terms.Terms`: ``max_groups``, ``data_order``, ``averaging``, the gradient's layout), fixed
from the first quorum's requests (or, on a replica that takes over as leader, read from etcd), and the check
that refuses a group whose terms differ, naming the field and both values.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from jaxckpt.ft import _intake, _terms

logger = logging.getLogger("jaxckpt.ft.lighthouse")   # (its owner's log, as before the split)


class JobTerms:
  """The job's terms at one lighthouse.

  Args:
    address: the lighthouse's address (its log lines name it).
    malformed: the lighthouse's count of sealed messages it refused (a refused group counts).

  Attributes:
    terms: the job's terms; None until the first quorum fixes them.
    on_terms: ``on_terms(terms) -> terms`` when they are fixed or change (a replica on etcd stores them
      there, and gets the stored ones back); None: taken as they are.
  """

  def __init__(self, address: str, malformed: _intake.Refusals):
    self.address, self._malformed = address, malformed
    self.terms: _terms.Terms | None = None
    self.on_terms: Callable[[_terms.Terms], _terms.Terms] | None = None

  def refused(self, gid: str, terms: _terms.Terms) -> str | None:
    """Why ``gid`` cannot join under ``terms`` (None if it can; an unknown layout of the
    job's is taken from it). Only once the job's terms are fixed."""
    why = _terms.differ(terms, self.terms, gid)
    if why is not None:
      self._malformed.add(why)
      logger.warning("lighthouse at %s refused group %s: %s", self.address, gid, why,
                     extra={"group_id": gid})
      return why
    if self.terms.layout is None and terms.layout is not None:
      self.set(dataclasses.replace(self.terms, layout=terms.layout))
    return None

  def set(self, terms: _terms.Terms) -> None:
    self.terms = terms if self.on_terms is None else self.on_terms(terms)

  def fix(self, asking: list[tuple[str, bool, _terms.Terms]]) -> list[tuple[str, str]]:
    """The job's terms, from ``asking`` (each pending member's id, whether it holds a view,
    and its terms) if not fixed yet; the members whose terms differ, and why each is refused."""
    if self.terms is None and asking:
      self.set(_terms.chosen(asking))
      logger.info("lighthouse at %s: the job's terms are %s", self.address, self.terms)
    if self.terms is None:
      return []
    refused = []
    for gid, _, terms in asking:
      why = self.refused(gid, terms)
      if why is not None:
        refused.append((gid, why))
    return refused
