"""Paths read from a manifest stay inside the step, checked before any read, by a
restore and by ``jaxckpt verify``: a forged manifest whose
array path climbs into another checkpoint (its checksums copied from there, its
commit marker fixed up) loads nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.testing import damage
from jaxckpt.universal import _layout as lay

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OURS = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
THEIRS = {"w": -np.arange(64, dtype=np.float32).reshape(8, 8)}


def _save(directory: str, state: dict) -> None:
  with jc.CheckpointManager(directory, jc.CheckpointOptions(handle_sigterm=False)) as m:
    assert m.save(1, state)
    m.wait_until_finished()


def _forge(ours: str, theirs: str, how: str) -> None:
  """Points our step 1's leaf at their data (their checksums copied), or names a
  climbing attempt in our marker; the marker's checksum fixed up either way."""
  src, = [leaf for leaf in damage.stored_manifest(theirs, 1)["leaves"] if leaf["path"] == "['w']"]

  def edit(doc, marker):
    leaf, = [leaf for leaf in doc["leaves"] if leaf["path"] == "['w']"]
    if how == "array":
      leaf["array"] = f"../../../{os.path.basename(theirs)}/{lay.step_dir(1)}arrays/{src['array']}"
      leaf["chunks"] = src["chunks"]
    else:
      marker["attempt"] = f"../../{os.path.basename(theirs)}/{lay.step_dir(1)}attempts/x"
  damage.reseal_manifest(ours, 1, edit)


@pytest.mark.parametrize("how", ["array", "marker attempt"])
def test_a_manifest_path_out_of_the_step_is_refused_before_any_read(tmp_path, how):
  ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
  _save(ours, OURS)
  _save(theirs, THEIRS)
  _forge(ours, theirs, how)
  with jc.CheckpointManager(ours, jc.CheckpointOptions(handle_sigterm=False)) as m:
    with pytest.raises(errors.CorruptSnapshotError, match=r"outside the step|not a key-safe"):
      m.restore(1, target={"w": np.zeros((8, 8), np.float32)})
  p = subprocess.run([sys.executable, "-m", "jaxckpt", "verify", ours, "--no-progress"],
                     capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
  assert p.returncode != 0 and "OK" not in p.stdout, (p.stdout, p.stderr)
  assert "outside the step" in p.stderr or "not a key-safe" in p.stderr, p.stderr
  assert "Traceback" not in p.stderr


def test_a_part_record_path_out_of_the_step_is_never_committed(tmp_path):
  # A peer's part record (what process 0 merges) naming another step's arrays.
  d = str(tmp_path / "ckpt")
  info = jc.universal.LeafInfo(path="['w']", kind="numpy", shape=(8, 8), dtype="float32")
  attempt = jc.universal.write_leaves(d, 1, {"['w']": info}, {"['w']": OURS["w"]},
                                      metadata={}, commit=False)
  key = os.path.join(d, lay.part_key(1, 0, attempt))
  with open(key) as f:
    part = json.load(f)
  part["leaves"][0]["array"] = f"{attempt}/../../../elsewhere"
  with open(key, "w") as f:
    json.dump(part, f)
  with pytest.raises(errors.CorruptSnapshotError, match="outside the step"):
    jc.universal.commit_step(d, 1, process_count=1, timeout_secs=10, attempt=attempt)
  assert jc.universal.all_steps(d) == []


def test_a_manifest_whose_shape_disagrees_with_its_chunk_table_is_refused(tmp_path):
  # A forged shape (2**40 rows) would have sized the restore's buffers: refused first.
  d = str(tmp_path / "ckpt")
  _save(d, OURS)

  def edit(doc, marker):
    del marker
    leaf, = [leaf for leaf in doc["leaves"] if leaf["path"] == "['w']"]
    leaf["shape"] = [2**40, 8]
  damage.reseal_manifest(d, 1, edit)
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    for target in (None, {"w": np.zeros((8, 8), np.float32)}):
      with pytest.raises(errors.CorruptSnapshotError, match="chunk checksums disagree"):
        m.restore(1, target=target)
