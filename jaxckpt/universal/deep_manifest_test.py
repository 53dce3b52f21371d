"""A manifest nested far deeper than any parser goes (valid JSON, resealed so that its
checksum holds) is damage like any other: restore(None) goes back to the step before,
and `jaxckpt verify` and `inspect` report it (exit 1, the damage found), never a
traceback; `verify` says 1 for every damaged manifest, as it does for a damaged chunk."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import damage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W = np.arange(16, dtype=np.float32).reshape(4, 4)


def _cli(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "jaxckpt", *argv], capture_output=True,
                        text=True, timeout=300, cwd=REPO, check=False)


def _two_steps(d: str) -> None:
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False,
                                                    persist_interval_steps=1)) as m:
    for s in (1, 2):
      assert m.save(s, {"w": W + s})
      m.wait_until_finished()


def _beyond_int64(doc, marker):
  del marker
  leaf, = doc["leaves"]
  leaf["shape"] = leaf["chunk_shape"] = leaf["inner_chunk_shape"] = [2**64, 4]


DAMAGE = {
    "nested 200,000 deep": lambda d: damage.nest_manifest(d, 2, 200_000),
    # (past the interpreter's recursion limit at the time: hypothesis raises it while its
    # state machines run in the same worker, so a fixed 1,000 may parse)
    "nested past the parser (the recursion limit)": lambda d: damage.nest_manifest(
        d, 2, sys.getrecursionlimit() + 100),
    "off-schema": lambda d: damage.reseal_manifest(
        d, 2, lambda doc, marker: doc.update(leaves="not a list")),
    "a leaf beyond int64": lambda d: damage.reseal_manifest(d, 2, _beyond_int64),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_newest_manifest_is_skipped_for_the_step_before(tmp_path, how):
  d = str(tmp_path / "ck")
  _two_steps(d)
  DAMAGE[how](d)
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    with pytest.raises((errors.ManifestError, errors.CorruptSnapshotError), match="step 2"):
      m.restore(2)
    out = m.restore()
    assert m.last_restore.step == 1 and [s for s, _ in m.last_restore.skipped] == [2]
  np.testing.assert_array_equal(out["w"], W + 1)


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_verify_and_inspect_report_a_damaged_newest_manifest_with_exit_1(tmp_path, how):
  d = str(tmp_path / "ck")
  _two_steps(d)
  DAMAGE[how](d)
  for argv in (["verify", d], ["verify", d, "--step", "2"], ["verify", d, "--all-steps"]):
    p = _cli(*argv, "--no-progress")
    assert p.returncode == 1, (argv, p.returncode, p.stdout, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "RecursionError" not in p.stdout + p.stderr, p.stderr
    assert "step 2" in p.stdout + p.stderr and f"jaxckpt delete {d} --step 2" in p.stderr, p.stderr
    assert ("step 1: OK" in p.stdout) == ("--all-steps" in argv), p.stdout
  p = _cli("inspect", d)
  assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
  assert p.stdout.startswith(f"{d}: step 1 ") and "DAMAGED step 2" in p.stderr, p.stderr
