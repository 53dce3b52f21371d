"""A read that storage refuses is an error of this attempt, never damage.

A real SeaweedFS S3 server answers 403 AccessDenied to the reads of the newest
step (an IAM policy denying s3:GetObject there, as when credentials rotate): a
relaunched manager's ``restore()`` falls back to the older step for this
restore only and says so at WARNING, an explicit restore of the step raises a
StorageError naming it and the cause, ``jaxckpt verify`` exits 2 without
calling anything damaged, and nothing is set aside: once reads are allowed
again the step is listed and restored.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from tests.support.s3 import SeaweedS3
from tests.support import fixtures as _fixtures
from jaxckpt.universal import _layout as lay

RNG = np.random.default_rng(39)
W = {s: RNG.standard_normal((64, 32)).astype(np.float32) for s in (1, 2)}
KEY = "['w']"


@pytest.fixture(scope="module")
def s3():
  """A server of this module's own: refusing reads turns its authentication on for good."""
  with SeaweedS3() as server:
    yield server


def state(step: int) -> dict:
  return {"w": W[step], "step": step}


def target() -> dict:
  return {"w": np.zeros((64, 32), np.float32), "step": 0}


def _opts() -> jc.CheckpointOptions:
  return jc.CheckpointOptions(persist_interval_steps=1, handle_sigterm=False)


def _saved(d: str, steps=(1, 2)) -> str:
  with jc.CheckpointManager(d, _opts()) as m:
    for s in steps:
      assert m.save(s, state(s))
    m.wait_until_finished()
  assert jc.universal.all_steps(d) == list(steps)
  return d


def _aside(d: str) -> list[str]:
  """What is in the directory's quarantine (nothing, when nothing was set aside)."""
  kv = lay.open_kvstore(d)
  return [k.decode() for k in kv.list(lay.prefix_range("quarantine/")).result()]


def _chunks(d: str, step: int) -> str:
  """Where the stored chunks of ``step``'s leaf ``w`` lie (its array's ``c/``)."""
  return f"{d}/{lay.step_dir(step)}arrays/{jc.universal.open_step(d, step).leaves[KEY].array}/c/"


@pytest.mark.parametrize("refused", ["chunks", "step"])
def test_a_refused_newest_step_falls_back_for_this_restore_only(s3, caplog, refused):
  d = _saved(s3.url())
  with s3.refusing_reads(_chunks(d, 2) if refused == "chunks" else f"{d}/{lay.step_dir(2)}"):
    with jc.CheckpointManager(d, _opts()) as m:            # a relaunch: storage only
      with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        out = m.restore(target=target())
      assert (m.last_restore.step, m.last_restore.tier) == (1, "storage")
      np.testing.assert_array_equal(out["w"], W[1])
      (step, why), = m.last_restore.skipped
      assert step == 2 and "StorageError" in why and "PERMISSION_DENIED" in why, why
      assert ("(chunk 0.0)" if refused == "chunks" else "its manifest") in why, why
      warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
      assert any("step 2 could not be read now" in w and "stays listed" in w
                 for w in warned), warned
      assert not any("set aside" in w for w in warned), warned
      with pytest.raises(errors.StorageError, match=r"step 2: .*could not be read: "
                         r"PERMISSION_DENIED.*not damage"):
        m.restore(step=2, target=target())
      assert m.all_steps() == [1, 2]
    assert jc.universal.all_steps(d) == [1, 2] and _aside(d) == []
  with jc.CheckpointManager(d, _opts()) as m:              # reads allowed again
    assert m.all_steps() == [1, 2]
    out = m.restore(target=target())
    assert m.last_restore.step == 2 and m.last_restore.skipped == ()
    assert out["w"].tobytes() == W[2].tobytes() and out["step"] == 2


def test_with_nothing_older_the_refusal_is_raised_and_verify_calls_nothing_damaged(s3, capsys):
  d = _saved(s3.url(), steps=(2,))
  with s3.refusing_reads(f"{d}/{lay.step_dir(2)}arrays/"):
    with jc.CheckpointManager(d, _opts()) as m:
      with pytest.raises(errors.StorageError, match=r"step 2: .*leaf .*PERMISSION_DENIED"):
        m.restore(target=target())
    r = _fixtures.run_cli(capsys, "verify", d, "--no-progress")
    assert r.returncode == 2, r
    assert "step 2 was not verified" in r.stderr and "PERMISSION_DENIED" in r.stderr, r
    assert "DAMAGED" not in r.stdout + r.stderr
    assert _aside(d) == []
  r = _fixtures.run_cli(capsys, "verify", d, "--no-progress")
  assert r.returncode == 0 and "step 2: OK" in r.stdout, r
