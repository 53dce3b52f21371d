"""Bytes between processes: an agent's remote pieces against a raw TCP stream (issue 14).

An agent process (its own run root, its own loopback address) holds one
committed snapshot of ``--size-mib``. Measured side by side in the same run,
moving the same bytes between the same kind of processes:

  (a) ``agent fetch``: this process reads the snapshot from the agent over TCP,
      as a restore reads another host's piece and a recovering replica group
      reads a healthy group's snapshot (``RemotePiece``: the one bulk path of
      both), with every shard's checksum verified on arrival;
  (b) ``raw tcp``: a child process writes the same number of bytes from memory
      into one TCP socket, this process reads them into a buffer;
  (c) ``raw tcp x 4``: the same over four sockets at once;
  (d) ``raw tcp x 4, fresh``: (c) into a new buffer each time, as a fetch
      that returns new arrays must (its first touch zeroes the pages).

Prints one JSON object with medians over ``--repeats`` and the ratio of (a) to
(b) and (c) (target: >= 0.5).

  python benchmarks/transfer.py [--quick] [--size-mib 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import jaxckpt as jc
from jaxckpt.agent._protocol import Client
from jaxckpt.agent.trainer._remote import open_remote_piece  # pylint: disable=wrong-import-position
from jaxckpt.agent.trainer.client import AgentStore
from jaxckpt.host.snapshot import LeafRecord, ShardRecord, SnapshotManifest, checksum
from jaxckpt.testing import processes

SHARD = 64 << 20

_SENDER = r"""
import socket, sys
import numpy as np
port, n, streams = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
data = np.ones(n // streams, np.uint8)
srv = socket.create_server(("127.0.1.2", port))
print("ready", flush=True)
while True:
    conns = [srv.accept()[0] for _ in range(streams)]
    import threading
    ts = [threading.Thread(target=c.sendall, args=(memoryview(data),)) for c in conns]
    [t.start() for t in ts]; [t.join() for t in ts]; [c.close() for c in conns]
"""


def raw_tcp(n: int, streams: int, repeats: int, *, fresh: bool = False) -> list[float]:
  port = processes.free_port()
  proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(n), str(streams)],
                          stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "ready"
    buf = np.empty(n, np.uint8)
    parts = np.array_split(buf, streams)
    out = []
    for _ in range(repeats + 1):
      t0 = time.perf_counter()
      if fresh:
        buf = np.empty(n, np.uint8)
        parts = np.array_split(buf, streams)
      socks = [socket.create_connection(("127.0.1.2", port)) for _ in range(streams)]

      def read(s: socket.socket, into: np.ndarray) -> None:
        view, got = memoryview(into).cast("B"), 0
        while got < len(view):
          r = s.recv_into(view[got:])
          if not r:
            raise ConnectionError("sender closed early")
          got += r
      ts = [threading.Thread(target=read, args=(s, p)) for s, p in zip(socks, parts)]
      for t in ts:
        t.start()
      for t in ts:
        t.join()
      out.append(time.perf_counter() - t0)
      for s in socks:
        s.close()
    return out[1:]
  finally:
    proc.kill()
    proc.wait()


def agent_fetch(n: int, repeats: int) -> tuple[list[float], int]:
  with processes.agent_sandbox() as (root, job):
    store = AgentStore(jc.AgentOptions(job_name=job, run_root=root, tcp_host="127.0.1.2"),
                       host=1, max_snapshots=1, limit_bytes=4 * n + (1 << 30))
    try:
      data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
      slot = store.reserve(1, n, timeout_secs=10)
      np.asarray(slot.buffer)[:n] = data
      shards = tuple(ShardRecord(((o, min(n, o + SHARD)),), o, min(SHARD, n - o),
                                 checksum(data[o:o + SHARD])) for o in range(0, n, SHARD))
      leaf = LeafRecord("['x']", "numpy", (n,), "uint8", shards)
      store.commit(slot, SnapshotManifest(step=1, leaves=(leaf,), nbytes=n, process_index=1,
                                          process_count=2))
      client = Client(store.info["tcp"], who="agent", timeout_secs=120, secret=store.secret,
                      bulk=store.info["bulk"])
      out = []
      for _ in range(repeats + 1):
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
          piece = open_remote_piece(client, 1, stack)
          leaf = piece.manifest.leaves[0]
          piece.fetch([(leaf, s) for s in leaf.shards])       # as a restore reads ahead
          got = 0
          for shard in leaf.shards:
            got += piece.shard_array(piece.manifest.leaves[0], shard).nbytes   # verified
        out.append(time.perf_counter() - t0)
      client.close()
      return out[1:], got
    finally:
      store.close()


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true")
  p.add_argument("--size-mib", type=int, default=512)
  p.add_argument("--repeats", type=int, default=5)
  a = p.parse_args()
  if a.quick:
    a.size_mib, a.repeats = 128, 3
  n = a.size_mib << 20
  fetch, got = agent_fetch(n, a.repeats)
  assert got == n, (got, n)
  one, four = raw_tcp(n, 1, a.repeats), raw_tcp(n, 4, a.repeats)
  fresh = raw_tcp(n, 4, a.repeats, fresh=True)
  gbps = lambda secs: round(n / statistics.median(secs) / 1e9, 3)
  out = {"benchmark": "transfer", "bytes": n, "cores": os.cpu_count(), "repeats": a.repeats,
         "agent_fetch_GBps": gbps(fetch), "raw_tcp_GBps": gbps(one), "raw_tcp_x4_GBps": gbps(four),
         "raw_tcp_x4_fresh_memory_GBps": gbps(fresh),
         "agent_over_raw_tcp": round(gbps(fetch) / gbps(one), 3),
         "agent_over_raw_tcp_x4": round(gbps(fetch) / gbps(four), 3),
         "agent_over_raw_tcp_x4_fresh_memory": round(gbps(fetch) / gbps(fresh), 3),
         "target_ratio": 0.5}   # (against one raw stream and four, into a reused buffer)
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
