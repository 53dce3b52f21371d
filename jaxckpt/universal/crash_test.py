"""A persist SIGKILLed mid-write never leaves a step that is listed or restored (file, S3, GCS)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxckpt.universal as u
from jaxckpt.universal import _layout

WRITER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxckpt.universal as u
    from tests.support import fixtures as _fixtures
    d = sys.argv[1]
    mesh = Mesh(np.array(jax.devices()), ("x",))
    for step in range(1, 1000):
      host = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024) * step
      leaves = {"w": jax.device_put(host, NamedSharding(mesh, P("x"))), "b": np.full(7, step)}
      for manifest, buf in _fixtures.host_snapshots(step, leaves, process_count=2):
        u.write_process_shards(d, manifest, buf, max_inflight_bytes=1 << 18, attempt="t")
      u.commit_step(d, step, process_count=2, timeout_secs=30, attempt="t")
      print("committed", step, flush=True)
""")


def expected(step):
  return np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024) * step


def _keys(d, prefix):
  kv = _layout.open_kvstore(d)
  return [k.decode() for k in kv.list(_layout.prefix_range(prefix)).result()]


@pytest.mark.parametrize("delay_secs", [0.0, 0.02, 0.08])
def test_sigkill_mid_persist_leaves_only_whole_committed_steps(storage_dir, delay_secs):
  d = storage_dir
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  proc = subprocess.Popen([sys.executable, "-c", WRITER, d], stdout=subprocess.PIPE,
                          env=env, text=True)
  try:
    deadline = time.monotonic() + 120
    line = ""
    while "committed 2" not in line:
      assert time.monotonic() < deadline and proc.poll() is None, "writer did not reach step 3"
      line = proc.stdout.readline()
    while not any("/w-" in k for k in _keys(d, "step_0000000003/arrays/t/")):
      assert time.monotonic() < deadline, "writer did not start writing step 3"
      time.sleep(0.001)  # step 3 chunks are being written now
    time.sleep(delay_secs)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=10)
    proc.stdout.close()
  steps = u.all_steps(d)
  assert steps[:2] == [1, 2]
  last = steps[-1]
  if delay_secs == 0.0:
    assert last == 2, "step 3 was written and committed within microseconds?"
    assert _keys(d, "step_0000000003/")          # the killed, partial step
  on_disk = sorted({int(k[5:15]) for k in _keys(d, "step_")})
  assert set(steps) <= set(on_disk) and on_disk[-1] in (last, last + 1)
  assert u.latest_step(d) == last
  for s in steps:
    reader = u.open_step(d, s)
    out = u.restore_arrays(reader, {"w": None, "b": None})
    np.testing.assert_array_equal(out["w"], expected(s))
    np.testing.assert_array_equal(out["b"], np.full(7, s))
  with pytest.raises(FileNotFoundError, match=f"step {last + 1} is not committed"):
    u.open_step(d, last + 1)
  # gc leaves the partial step to whoever writes it; re-persisting it completes it.
  assert u.gc_steps(d, max_to_keep=1) == steps[:-1]
  assert u.all_steps(d) == [last]
  assert not _keys(d, _layout.step_dir(steps[0]))   # gc removed every key of a step
