"""A manifest's numbers are data, bounded and checked before anything is sized by them:
a stored step that claims an impossible leaf (shape, layout and
checksum table consistent) is damage like any other, so restore(None) goes back to the
intact older step, and `jaxckpt inspect` says so rather than "0 B"; a host snapshot's
manifest with a negative or huge offset is damage too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors
from jaxckpt.agent import _paths, _protocol, _requests
from jaxckpt.host import snapshot as snap
from jaxckpt.testing import damage, processes
from jaxckpt.universal import _manifest as man

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTS = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1)
W = np.arange(16, dtype=np.float32).reshape(4, 4)


def _two_steps(d: str) -> None:
  with jc.CheckpointManager(d, OPTS) as m:
    for s in (1, 2):
      assert m.save(s, {"w": W + s})
      m.wait_until_finished()


def _claim(d: str, shape, chunk, inner=None, dtype=None) -> None:
  """Reseals step 2 so that its leaf claims ``shape`` in chunks of ``chunk``, its
  checksum table one entry per chunk of that grid (consistent with the claim)."""
  def edit(doc, marker):
    del marker
    leaf, = doc["leaves"]
    one = next(iter(leaf["chunks"].values()))
    leaf["shape"], leaf["chunk_shape"] = shape, chunk
    leaf["inner_chunk_shape"] = chunk if inner is None else inner
    if dtype is not None:
      leaf["dtype"] = dtype
    grid = [max(1, -(-d // c)) if c else 1 for d, c in zip(shape, chunk)]
    n = int(np.prod(grid, dtype=object)) if len(grid) < 40 else 1
    leaf["chunks"] = {".".join(map(str, np.unravel_index(i, grid))) if grid else "0": one
                      for i in range(min(n, 4))}
  damage.reseal_manifest(d, 2, edit)


IMPOSSIBLE = {
    "2^40 x 2^40 in one chunk": dict(shape=[2**40, 2**40], chunk=[2**40, 2**40]),
    "int64 overflow of the shape": dict(shape=[2**62, 2**62, 4], chunk=[2**62, 2**62, 4]),
    "one chunk of 2^50 bytes": dict(shape=[2**24, 2**24], chunk=[2**24, 2**24]),
    "inner chunks larger than the chunk": dict(shape=[4, 4], chunk=[4, 4], inner=[8, 8]),
    "33 dimensions": dict(shape=[1] * 33, chunk=[1] * 33),
    "a dimension past tensorstore's": dict(shape=[2**63], chunk=[2**63], dtype="uint8"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_an_impossible_newest_step_is_damage_and_restore_takes_the_older_one(tmp_path, case):
  d = str(tmp_path / "ck")
  _two_steps(d)
  _claim(d, **IMPOSSIBLE[case])
  p = subprocess.run([sys.executable, "-m", "jaxckpt", "inspect", d, "--step", "2"],
                     capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
  assert p.returncode == 2 and "0 B" not in p.stdout and "Traceback" not in p.stderr, (
      p.stdout, p.stderr)
  assert "damaged or forged" in p.stderr, p.stderr
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    with pytest.raises(errors.CorruptSnapshotError, match="damaged or forged"):
      m.restore(2)
    out = m.restore()
    assert m.last_restore.step == 1 and [s for s, _ in m.last_restore.skipped] == [2]
  np.testing.assert_array_equal(out["w"], W + 1)


@pytest.mark.parametrize("shape,chunk", [([-4, 4], [4, 4]), ([4, 4], [0, 4])])
def test_a_negative_or_zero_number_is_refused_and_restore_takes_the_older_step(tmp_path, shape,
                                                                                chunk):
  d = str(tmp_path / "ck")
  _two_steps(d)
  _claim(d, shape, chunk)
  with jc.CheckpointManager(d, jc.CheckpointOptions(handle_sigterm=False)) as m:
    with pytest.raises((errors.CorruptSnapshotError, errors.ManifestError)):
      m.restore(2)
    out = m.restore()
    assert m.last_restore.step == 1
  np.testing.assert_array_equal(out["w"], W + 1)


def test_a_leaf_s_size_never_overflows():
  info = man.LeafInfo(path="['w']", kind="numpy", shape=(2**40, 2**40), dtype="float32")
  assert info.nbytes == 2**82


def _manifest(**shard) -> str:
  rec = snap.ShardRecord(**{"index": ((0, 4), (0, 4)), "offset": 0, "nbytes": 64,
                            "checksum": "0" * 16, **shard})
  leaf = snap.LeafRecord(path="['w']", kind="numpy", shape=(4, 4), dtype="float32",
                         shards=(rec,))
  return snap.SnapshotManifest(step=2, leaves=(leaf,), nbytes=64).to_json()


@pytest.mark.parametrize("shard", [{"offset": -64}, {"offset": 2**62}, {"offset": 32},
                                   {"nbytes": 2**40}, {"nbytes": -1},
                                   {"index": ((0, 4), (0, 2**40))}, {"index": ((-4, 0), (0, 4))},
                                   {"index": ((0, 4),)}])
def test_a_host_manifest_with_an_impossible_shard_is_damage(shard):
  assert snap.SnapshotManifest.from_json(_manifest()).nbytes == 64
  with pytest.raises(errors.CorruptSnapshotError, match="snapshot manifest of step 2"):
    snap.SnapshotManifest.from_json(_manifest(**shard))


def test_a_held_step_whose_manifest_has_a_negative_offset_is_skipped_for_the_older_one():
  with processes.agent_sandbox("jtm") as (root, job):
    opts = jc.CheckpointOptions(agent=jc.AgentOptions(job_name=job, run_root=root),
                                handle_sigterm=False)
    with jc.CheckpointManager(options=opts) as m:
      assert m.save(1, {"w": W})
      m.wait_until_finished()
      with open(_paths.address_file(_paths.agent_dir(root, job, 0))) as f:
        info = json.load(f)
      c = _protocol.Client(info["ipc"], who="a forger", timeout_secs=30,
                           secret=_paths.job_secret(root, job))
      try:                             # step 2 committed with a manifest that lies
        r = c.call(_requests.Reserve(pid=os.getpid(), step=2, nbytes=64))[0]
        c.call(_requests.Commit(index=r.index, manifest=_manifest(offset=-64), step=2, nbytes=64,
               process=[0, 1]))
      finally:
        c.close()
      assert m.all_steps() == [1, 2]
      out = m.restore()
      assert m.last_restore.step == 1 and [s for s, _ in m.last_restore.skipped] == [2]
      np.testing.assert_array_equal(out["w"], W)
      with pytest.raises(errors.CorruptSnapshotError, match="offset -64"):
        m.restore(2)
