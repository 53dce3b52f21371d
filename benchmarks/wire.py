"""The agent's wire protocol (issue 43, item 2): what a request costs to encode,
seal, open, decode and validate, and its reply to encode and decode, for the
common requests (reserve, commit with a manifest of ``--leaves`` leaves, steps,
status); and a round trip of each read-only one, and of reserve + abort, over
the local (ipc) socket to a real agent process; and what one parse of the
commit's manifest costs (``manifest_parse``: the agent parses it once per step).

Codec figures are microseconds per request (the median over ``--repeats`` runs
of ``--iters`` requests each), one process doing both sides, as the trainer and
the agent each do their half; the round trip is microseconds per request,
median over ``--repeats`` runs of ``--iters`` requests each.

  python benchmarks/wire.py [--quick] [--leaves 1000] [--repeats 7] [--iters 300]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from typing import Any, Callable, Iterator

import numpy as np

from jaxckpt.agent import _paths, _protocol, _requests
from jaxckpt.agent.trainer.client import start_agent
from jaxckpt.host._persist import PersistStatus
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest
from jaxckpt.net import _wire

SECRET = b"s" * 32
WHO = "agent pid 1"


def manifest_json(leaves: int, seed: int = 0) -> str:
  """A manifest of ``leaves`` float32 leaves of random shapes, one shard each."""
  rng = np.random.default_rng(seed)
  recs, offset = [], 0
  for i in range(leaves):
    shape = (int(rng.integers(1, 512)), int(rng.integers(1, 512)))
    n = shape[0] * shape[1] * 4
    recs.append(LeafRecord(path=f"params/layer_{i}/w", kind="jax", shape=shape, dtype="float32",
                           shards=(ShardRecord(((0, shape[0]), (0, shape[1])), offset, n,
                                               f"{int(rng.integers(0, 2**63)):016x}"),)))
    offset += n
  return SnapshotManifest(step=7, leaves=tuple(recs), nbytes=offset).to_json()


def requests(leaves: int) -> dict[str, tuple[_requests.Request, Any]]:
  """Each measured request, and a reply its agent would give."""
  text = manifest_json(leaves)
  steps = list(range(1, 6))
  return {
      "reserve": (_requests.Reserve(pid=4242, step=7, nbytes=1 << 30),
                  _requests.Reserve.Reply(index=1, path="/dev/shm/jaxckpt/s1", size=1 << 30)),
      f"commit_{leaves}_leaves": (
          _requests.Commit(index=1, manifest=text, step=7, nbytes=1 << 30, process=[0, 1],
                           persist_attempt="a1b2c3"),
          _requests.Commit.Reply(steps=steps, persist=PersistStatus(pending=(7,), persisted=(5,)),
                                 persist_errors=[])),
      "steps": (_requests.Steps(), _requests.Steps.Reply(steps=steps, free_slots=1, protected=5)),
      "status": (_requests.Status(), _requests.Status.Reply(
          pid=4242, job="job", host=0, steps=steps,
          slots=[_requests.SlotStatus(index=i, state="held", step=i, bytes=1 << 30, readers=0)
                 for i in range(6)],
          bytes=6 << 30, parity_bytes=0, trainers=[4243], max_snapshots=5,
          limit_bytes=1 << 40, lease=_requests.LeaseStatus(pid=4243, owner="m1", generation=1),
          served_bytes=0, idle_secs=None, idle_timeout_secs=600.0)),
  }


def codec_once(req: _requests.Request, reply: Any) -> Callable[[], None]:
  """One request's whole codec: the client checks and seals it; the agent opens it,
  checks its deadline and decodes it; the agent encodes the reply and the client
  decodes it."""
  cls = type(req)
  replays = _wire.Replays()

  def once() -> None:
    frames = _protocol.request(SECRET, req, 30.0)
    header = _protocol.verify(SECRET, frames, replays)
    _wire.expired(header)
    _requests.decode(header)
    body = _wire.pack({"ok": True, **_requests.encode_reply(reply)})
    _requests.decode_reply(cls, _wire.reply_of(body, WHO, "ipc://x"), WHO, "ipc://x")
  return once


def per_call_us(fn: Callable[[], None], iters: int, repeats: int) -> dict[str, float]:
  runs = []
  for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(iters):
      fn()
    runs.append((time.perf_counter() - t) / iters * 1e6)
  return {"median_us": round(statistics.median(runs), 2), "min_us": round(min(runs), 2),
          "max_us": round(max(runs), 2)}


@contextlib.contextmanager
def agent() -> Iterator[dict[str, Any]]:
  """A real agent process of a fresh job (its address record and secret); killed by pid,
  its files removed, on exit."""
  base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
  root = os.path.join(base, f"jbw-{os.getpid()}-{uuid.uuid4().hex[:6]}")
  os.makedirs(root)
  info, job = None, "bw" + uuid.uuid4().hex[:6]
  try:
    info = start_agent(job=job, host=0, run_root=root, max_snapshots=2,
                       limit_bytes=1 << 30, idle_timeout_secs=600.0, start_timeout_secs=60.0)
    yield dict(info, secret=_paths.job_secret(root, job))
  finally:
    if info is not None:
      with contextlib.suppress(ProcessLookupError):
        os.kill(info["pid"], signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def round_trips(iters: int, repeats: int) -> dict[str, Any]:
  with agent() as info:
    client = _protocol.Client(info["ipc"], who=WHO, timeout_secs=30.0, secret=info["secret"],
                              pid=info["pid"])
    try:
      client.call(_requests.Steps())                          # connected, warm

      def reserve_abort() -> None:
        r = client.call(_requests.Reserve(pid=os.getpid(), step=7, nbytes=4096))[0]
        client.call(_requests.Abort(index=r.index))
      out = {"steps": per_call_us(lambda: client.call(_requests.Steps()), iters, repeats),
             "status": per_call_us(lambda: client.call(_requests.Status()), iters, repeats),
             "reserve_and_abort": per_call_us(reserve_abort, iters // 2, repeats)}
    finally:
      client.close()
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--leaves", type=int, default=1000)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--iters", type=int, default=300)
  ap.add_argument("--quick", action="store_true", help="a smoke run: few iterations")
  args = ap.parse_args()
  if args.quick:
    args.repeats, args.iters = 3, 30
  codec = {}
  for name, (req, reply) in requests(args.leaves).items():
    fn = codec_once(req, reply)
    fn()
    codec[name] = per_call_us(fn, max(10, args.iters // (10 if "commit" in name else 1)),
                              args.repeats)
  text = manifest_json(args.leaves)
  parse = per_call_us(lambda: SnapshotManifest.from_json(text), max(10, args.iters // 10),
                      args.repeats)
  out = {"benchmark": "wire", "leaves": args.leaves, "repeats": args.repeats,
         "codec_per_request": codec, "manifest_parse": parse,
         "round_trip_ipc": round_trips(args.iters, args.repeats)}
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
