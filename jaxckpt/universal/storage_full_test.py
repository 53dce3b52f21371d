"""Storage full on the local-filesystem store (a size-limited tmpfs mounted for the test):
a persist that runs out of space fails loudly and at once (it was tried again for its
whole timeout, 5 minutes by default), commits nothing and leaves the steps before it intact; once space is back the next persist commits; a delete with the disk
full still deletes.

Needs root (``mount -t tmpfs``); the test fails, never skips, without it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time

import numpy as np
import pytest

import jaxckpt as jc
from jaxckpt import errors


@contextlib.contextmanager
def small_disk(path: str, size: str):
  """A tmpfs of ``size`` mounted at ``path``, unmounted however the test ends."""
  os.makedirs(path, exist_ok=True)
  out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, text=True, check=False)
  if out.returncode != 0:
    pytest.fail(f"mounting a {size} tmpfs at {path} failed ({out.stderr.strip()}): the "
                "storage-full tests run as root (mount -t tmpfs needs CAP_SYS_ADMIN)")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)


def fill(path: str) -> str:
  """Writes a file in ``path`` until the disk is full; returns its name."""
  name = os.path.join(path, "filler")
  with open(name, "wb") as f:
    try:
      while True:
        f.write(b"\0" * (64 << 10))
        f.flush()
    except OSError as e:
      assert e.errno == errno.ENOSPC, e
  return name


def state(step: int) -> dict:
  rng = np.random.default_rng(step)
  return {"w": rng.integers(0, 2**32, (256, 256), dtype=np.uint32),   # 256 KiB
          "b": rng.standard_normal(64).astype(np.float32)}


def same(a: dict, b: dict) -> bool:
  return all(np.asarray(a[k]).tobytes() == b[k].tobytes() for k in b)


@pytest.mark.timeout(300)
def test_a_persist_that_runs_out_of_space_commits_nothing_and_the_next_one_commits(tmp_path):
  with small_disk(str(tmp_path / "disk"), "4m") as disk:
    d = os.path.join(disk, "ckpt")
    opts = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1,
                                timeout_secs=300)
    with jc.CheckpointManager(d, opts) as m:
      m.save(1, state(1))
      m.wait_until_finished()
      filler = fill(disk)
      m.save(2, state(2))
      t0 = time.monotonic()
      with pytest.raises(errors.StorageError) as got:
        m.wait_until_finished()
      assert "step 2" in str(got.value) and "No space left on device" in str(got.value), got.value
      # at once, not after the persist's 300 s timeout (it was tried again until then)
      assert time.monotonic() - t0 < 60
      assert jc.universal.all_steps(d) == [1]            # nothing of step 2 committed
      os.unlink(filler)
      m.save(3, state(3))
      m.wait_until_finished()
      assert jc.universal.all_steps(d) == [1, 3]
    with jc.CheckpointManager(d, opts) as m:            # from storage, bit for bit
      assert same(m.restore(1, target=None), state(1))
      assert same(m.restore(3, target=None), state(3))


@pytest.mark.timeout(300)
def test_a_delete_with_the_disk_full_deletes(tmp_path):
  with small_disk(str(tmp_path / "disk"), "4m") as disk:
    d = os.path.join(disk, "ckpt")
    opts = jc.CheckpointOptions(handle_sigterm=False, persist_interval_steps=1)
    with jc.CheckpointManager(d, opts) as m:
      for step in (1, 2):
        m.save(step, state(step))
        m.wait_until_finished()
      fill(disk)
      m.delete(2)                                        # a rollback's delete, disk full
      assert 2 not in m.all_steps()
    assert jc.universal.all_steps(d) == [1]
    with jc.CheckpointManager(d, opts) as m:
      assert same(m.restore(target=None), state(1)) and m.last_restore.step == 1
