"""The framing every sealed message shares (jaxckpt.net._wire): its fields are checked
before anything uses them, and the replay set holds only the nonces of its window."""

from __future__ import annotations

import os
import time

import pytest

from jaxckpt import errors
from jaxckpt.net import _wire
from jaxckpt.util import _wait

SECRET = b"s" * 32


def _sealed(**framing) -> list[bytes]:
  """A ``ping`` sealed with ``framing`` as given (a buggy peer's), fresh otherwise."""
  body = _wire.pack({"op": "ping", "ts": time.time(), "nonce": os.urandom(8), **framing})
  return [_wire.sign(SECRET, body), body]


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_timestamp_is_refused_and_the_replay_set_stays_bounded(ts):
  """NaN passes ``abs(now - ts) > window`` (every comparison with it is false): it was
  accepted, and its nonce, at the replay heap's root, never expired and kept every later
  one from expiring. It is refused; nonces of the window's edge then expire as time goes."""
  replays = _wire.Replays()
  with pytest.raises(errors.PermissionDeniedError, match=rf"field ts={ts!r} is refused"):
    _wire.open_(SECRET, _sealed(ts=ts), replays=replays)
  with pytest.raises(errors.PermissionDeniedError, match="with ts="):
    replays.check(os.urandom(8), ts, {})                   # (its own guard, too)
  with pytest.raises(errors.PermissionDeniedError, match="with ts="):
    _wire.NewerPerSender(lambda h: "group-a").check(os.urandom(8), ts, {})
  assert len(replays) == 0
  edge = lambda: time.time() - _wire.MAX_SKEW_SECS + 0.5   # expires ~1.5 s from now
  for _ in range(100):
    _wire.open_(SECRET, _sealed(ts=edge()), replays=replays)
  assert len(replays) == 100

  def expired() -> bool:
    _wire.open_(SECRET, _sealed(ts=edge()), replays=replays)   # (a check expires old ones)
    return len(replays) < 10
  _wait.until(expired, timeout_secs=60, poll_secs=0.5,   # (each ask adds one: ~3 held)
              late=lambda: f"the replay set still holds {len(replays)} nonces")


@pytest.mark.parametrize("framing, why", [
    ({"deadline": "soon"}, r"field deadline='soon' is refused"),
    ({"deadline": [1.0]}, r"field deadline=\[1.0\] is refused"),
    ({"arrays": [["float32", [-1]]]}, r"field arrays\[0\]\[1\]\[0\]=-1 is refused"),
    ({"arrays": "x"}, r"field arrays='x' is refused"),
])
def test_a_malformed_framing_field_is_refused_before_it_is_used(framing, why):
  """``expired`` and ``arrays_of`` then read fields the schema checked: never a
  ValueError out of a serving loop."""
  with pytest.raises(errors.PermissionDeniedError, match=why):
    _wire.open_(SECRET, _sealed(**framing), replays=_wire.Replays())
  header, _ = _wire.open_(SECRET, _sealed(deadline=time.time() + 60))
  assert header == {"op": "ping", "deadline": header["deadline"]} and not _wire.expired(header)
