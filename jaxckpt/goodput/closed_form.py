"""Closed-form validation of the goodput simulator: one synchronous job, a fixed checkpoint interval.

Young (1974) and Daly (2006) give the optimum interval and the efficiency of a job
that fails as a Poisson process; :func:`simulate_synchronous` simulates the same job
so that ``jaxckpt simulate --mode synchronous --mtbf-hours H ...`` can print both.
Re-exported by :mod:`jaxckpt.goodput`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxckpt.errors import JaxckptError


class SimulationInputError(JaxckptError, ValueError):
  """An input of the goodput simulator is out of range."""


# --- Closed-form validation: one synchronous job, fixed checkpoint interval -------------------------------------
#
# Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), 2006. The job
# fails as a Poisson process with mean time between failures M (the whole job's, not one accelerator's); it writes
# a checkpoint (delta seconds) after every tau seconds of work; a failure (also during a restart or a checkpoint)
# costs a restart (R) and the work since the last completed checkpoint.


def young_optimal_interval(mtbf_secs: float, checkpoint_secs: float) -> float:
  """Young (1974)'s first-order optimum, ``sqrt(2 delta M)``."""
  return math.sqrt(2 * checkpoint_secs * mtbf_secs)


def daly_optimal_interval(mtbf_secs: float, checkpoint_secs: float) -> float:
  """Daly (2006)'s higher-order optimum (his eq. 37); ``M`` when ``delta >= 2M``."""
  if checkpoint_secs >= 2 * mtbf_secs:
    return mtbf_secs
  x = checkpoint_secs / (2 * mtbf_secs)
  return math.sqrt(2 * checkpoint_secs * mtbf_secs) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_secs


def first_order_efficiency(interval_secs: float, mtbf_secs: float, checkpoint_secs: float,
                           restart_secs: float) -> float:
  """Young/Daly first-order effective training time, ``1 - delta/tau - (tau + delta)/(2M) - R/M``.

  Valid while ``delta`` is small against ``tau`` and ``tau + delta + R`` against ``M``; it drops terms of order
  ``(delta/tau)^2`` and ``((tau + delta + R)/M)^2``.
  """
  return (1 - checkpoint_secs / interval_secs - (interval_secs + checkpoint_secs) / (2 * mtbf_secs)
          - restart_secs / mtbf_secs)


def daly_efficiency(interval_secs: float, mtbf_secs: float, checkpoint_secs: float, restart_secs: float) -> float:
  """Daly's exact expected effective training time, ``tau e^(-R/M) / (M (e^((tau+delta)/M) - 1))``."""
  return (interval_secs * math.exp(-restart_secs / mtbf_secs)
          / (mtbf_secs * math.expm1((interval_secs + checkpoint_secs) / mtbf_secs)))


@dataclasses.dataclass(frozen=True, slots=True)
class ClosedFormResult:
  """One synchronous job simulated against the closed-form model (all times in seconds)."""
  mtbf_secs: float
  checkpoint_secs: float
  restart_secs: float
  interval_secs: float
  effective_training_time: float
  failures: int
  seed: int
  optimal_interval_secs: float | None
  daly_optimal_interval_secs: float
  young_optimal_interval_secs: float
  daly_effective_training_time: float
  first_order_effective_training_time: float

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    if self.optimal_interval_secs is None:
      del d["optimal_interval_secs"]
    return d


class _FailureStream:
  """Seeded times between failures; evaluates the simulated job for any interval on the same stream.

  After each failure the job restarts (``R``); a failure before the restart ends wastes the whole gap. Otherwise
  the rest of the gap runs ``floor((x - R) / (tau + delta))`` completed work-plus-checkpoint segments; the work of
  the segment the failure interrupts is lost. Wall time is the sum of the gaps, so effective training time is
  ``tau * sum(segments) / sum(x)``. Using one stream for every interval (common random numbers) makes the
  optimum search smooth and deterministic.
  """

  def __init__(self, mtbf_secs: float, restart_secs: float, seed: int, failures: int) -> None:
    gaps = np.random.default_rng(seed).exponential(mtbf_secs, failures)
    self.after_restart = np.maximum(gaps - restart_secs, 0.0)
    self.wall = float(gaps.sum())
    self.failures = failures

  def efficiency(self, interval_secs: float, checkpoint_secs: float) -> float:
    segments = np.floor(self.after_restart / (interval_secs + checkpoint_secs)).sum()
    return float(interval_secs * segments / self.wall)


def simulate_synchronous(mtbf_secs: float, checkpoint_secs: float, restart_secs: float,
                         interval_secs: float | None = None, *, optimal_interval: bool = False, seed: int = 0,
                         failures: int = 1_000_000) -> ClosedFormResult:
  """Simulates a synchronous job with a fixed checkpoint interval (Daly's model) over ``failures`` failures.

  Args:
    mtbf_secs: the job's mean time between failures.
    checkpoint_secs: time to write one checkpoint (delta).
    restart_secs: time to restart after a failure (R).
    interval_secs: work between checkpoints (tau); default Daly's optimum.
    optimal_interval: also search the interval that maximizes the simulated effective training time (a
      log grid of 120 points from ``0.05 sqrt(2 delta M)`` to ``min(20 sqrt(2 delta M), 50 M)``, then the vertex of
      a parabola in ``log(tau)`` fitted around its best point);
      the result's ``interval_secs`` is then that optimum.
    seed: seed of the failure stream.
    failures: failures to simulate (the statistical error of the result shrinks as ``1/sqrt(failures)``).

  Raises:
    SimulationInputError: a time is not positive (restart may be 0), or ``failures < 1000``.
  """
  for name, v in (("mtbf_secs", mtbf_secs), ("checkpoint_secs", checkpoint_secs)):
    if not (math.isfinite(v) and v > 0):
      raise SimulationInputError(f"{name}={v!r} must be a positive number of seconds")
  if not (math.isfinite(restart_secs) and restart_secs >= 0):
    raise SimulationInputError(f"restart_secs={restart_secs!r} must be >= 0 seconds")
  if interval_secs is not None and not (math.isfinite(interval_secs) and interval_secs > 0):
    raise SimulationInputError(f"interval_secs={interval_secs!r} must be a positive number of seconds")
  if failures < 1000:
    raise SimulationInputError(f"failures={failures} is too few for a stable estimate; use at least 1000")
  stream = _FailureStream(mtbf_secs, restart_secs, seed, failures)
  daly = daly_optimal_interval(mtbf_secs, checkpoint_secs)
  best = None
  if optimal_interval:
    young = young_optimal_interval(mtbf_secs, checkpoint_secs)
    grid = np.geomspace(0.05 * young, min(20 * young, 50 * mtbf_secs), 120)
    effs = np.array([stream.efficiency(t, checkpoint_secs) for t in grid])
    i = int(np.argmax(effs))
    # The curve is flat at its top, so its raw argmax wanders with the sample; the vertex of a parabola in
    # log(tau) through the 13 points around it (+-35% in tau) does not.
    lo, hi = max(i - 6, 0), min(i + 7, len(grid))
    a, b, _ = np.polyfit(np.log(grid[lo:hi]), effs[lo:hi], 2)
    best = float(np.clip(np.exp(-b / (2 * a)), grid[lo], grid[hi - 1])) if a < 0 else float(grid[i])
  tau = best if best is not None else (interval_secs if interval_secs is not None else daly)
  return ClosedFormResult(
      mtbf_secs=mtbf_secs, checkpoint_secs=checkpoint_secs, restart_secs=restart_secs, interval_secs=tau,
      effective_training_time=stream.efficiency(tau, checkpoint_secs), failures=failures, seed=seed,
      optimal_interval_secs=best, daly_optimal_interval_secs=daly,
      young_optimal_interval_secs=young_optimal_interval(mtbf_secs, checkpoint_secs),
      daly_effective_training_time=daly_efficiency(tau, mtbf_secs, checkpoint_secs, restart_secs),
      first_order_effective_training_time=first_order_efficiency(tau, mtbf_secs, checkpoint_secs, restart_secs))


def first_order_remainder(interval_secs: float, mtbf_secs: float, checkpoint_secs: float,
                          restart_secs: float) -> float:
  """The second-order terms :func:`first_order_efficiency` drops (all positive: the first-order
  figure is low by about this much against :func:`daly_efficiency`).

  With ``d = delta / tau``, ``a = (tau + delta) / M`` and ``r = R / M``, Daly's efficiency is
  ``(1 - d + d^2 ...) (1 - a/2 + a^2/12 ...) (1 - r + r^2/2 ...)``; the terms of second order are
  ``d^2 + d (a/2 + r) + a^2/12 + a r / 2 + r^2 / 2``.

  >>> round(first_order_remainder(90, 232031, 0.0046, 613) * 1e6, 2)
  4.16
  """
  d = checkpoint_secs / interval_secs
  a = (interval_secs + checkpoint_secs) / mtbf_secs
  r = restart_secs / mtbf_secs
  return d * d + d * (a / 2 + r) + a * a / 12 + a * r / 2 + r * r / 2
