"""examples/metrics_tensorboard.py writes jaxckpt's figures as TensorBoard scalars."""

from __future__ import annotations

import glob
import struct

from tensorboardX.proto import event_pb2

from examples import metrics_tensorboard


def _scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in the run's event files (TFRecord: length, crc, data, crc)."""
  out: dict[str, list[tuple[int, float]]] = {}
  for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      n, = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_the_example_writes_blocking_rates_and_the_restore_tier(tmp_path):
  logdir = str(tmp_path / "tb")
  assert metrics_tensorboard.main(["--logdir", logdir, "--steps", "12",
                                   "--directory", str(tmp_path / "ckpt")]) == 0
  s = _scalars(logdir)
  assert len(s["jaxckpt/save/blocking_secs"]) >= 1
  assert all(0 < v < 60 for _, v in s["jaxckpt/save/blocking_secs"])
  assert all(v > 0 for _, v in s["jaxckpt/snapshot/snapshot_GBps"])
  assert s["jaxckpt/snapshot/nbytes"][0][1] == 1024 * 256 * 4      # this process's bytes
  persisted = dict(s["jaxckpt/persist/persist_GBps"])
  assert 1 in persisted and 12 in persisted and all(v > 0 for v in persisted.values())
  assert s["jaxckpt/restore/tier"] == [(12, 0.0)]                    # host memory
  assert s["jaxckpt/restore/restore_GBps"][0][1] > 0
