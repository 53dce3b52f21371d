"""EventInjector: events fire once, at the right group and step, and survive JSON."""

import pytest

from jaxckpt.testing.fault_injection import EventInjector, InjectedFailure


def test_fail_at_raises_once_for_that_group_and_step():
  injector = EventInjector().fail_at("g1", step=3)
  injector.on_attempt("g0", 3)
  injector.on_attempt("g1", 2)
  with pytest.raises(InjectedFailure, match="group 'g1' at step 3"):
    injector.on_attempt("g1", 3)
  injector.on_attempt("g1", 3)  # a retry of the same step does not fail again
  assert injector.fired == [("fail", "g1", 3)]


def test_drop_messages_counts_attempts_of_one_group():
  injector = EventInjector().drop_messages("g2", range(5, 8))
  assert [a for a in range(10) if injector.drops("g2", a)] == [5, 6, 7]
  assert not any(injector.drops("g0", a) for a in range(10))


def test_delay_and_json_round_trip():
  injector = EventInjector().delay_at("g0", 1, 0.01).fail_at("g1", 4, mode="kill").drop_messages("g2", [2])
  again = EventInjector.from_json(injector.to_json())
  assert again.to_json() == injector.to_json()
  again.on_attempt("g0", 1)
  assert again.fired == [("delay", "g0", 1)]
  assert again.drops("g2", 2) and not again.drops("g2", 3)


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match="mode must be"):
    EventInjector().fail_at("g0", 1, mode="explode")
  with pytest.raises(ValueError, match="seconds must be >= 0"):
    EventInjector().delay_at("g0", 1, -1.0)
