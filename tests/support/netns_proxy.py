"""A TCP proxy on a cluster's path that delays, blackholes or resets traffic (as etcd's robustness suite's).

  python -m tests.support.netns_proxy LISTEN_ADDR LISTEN_PORT TARGET_ADDR TARGET_PORT CONTROL_FILE

Started by :meth:`tests.support.netns.Cluster.proxy` in the router's namespace; each
connection to LISTEN is forwarded to TARGET. CONTROL_FILE (JSON, re-read when it
changes) says what happens to the bytes: ``{"delay_secs": D}`` holds each chunk D
seconds before forwarding it (both ways), ``{"blackhole": true}`` forwards nothing
(connections stay open, bytes vanish), ``{"reset": N}`` closes every open connection
once per new N. Prints ``{"ready": PORT}`` once listening.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

_CHUNK = 64 * 1024


class Control:
  """The control file's settings, re-read when its mtime changes."""

  def __init__(self, path: str) -> None:
    self.path, self.mtime, self.settings = path, None, {}
    self.lock = threading.Lock()

  def get(self) -> dict:
    with self.lock:
      try:
        mtime = os.stat(self.path).st_mtime_ns
        if mtime != self.mtime:
          with open(self.path, encoding="utf-8") as f:
            self.settings, self.mtime = json.load(f), mtime
      except (OSError, ValueError):
        pass
      return dict(self.settings)


def pump(src: socket.socket, dst: socket.socket, control: Control, epoch: int) -> None:
  try:
    while True:
      data = src.recv(_CHUNK)
      if not data:
        break
      s = control.get()
      if s.get("reset", 0) != epoch:
        break
      if s.get("delay_secs"):
        time.sleep(float(s["delay_secs"]))
      if control.get().get("blackhole"):
        continue                          # the bytes vanish; the connection stays up
      dst.sendall(data)
  except OSError:
    pass
  finally:
    for s in (src, dst):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


def watch_resets(control: Control, conns: list, lock: threading.Lock) -> None:
  epoch = control.get().get("reset", 0)
  while True:
    now = control.get().get("reset", 0)
    if now != epoch:
      epoch = now
      with lock:
        for c in conns:
          try:
            c.shutdown(socket.SHUT_RDWR)
          except OSError:
            pass
        conns.clear()
    time.sleep(0.05)


def main(argv: list[str]) -> None:
  listen_addr, listen_port, target_addr, target_port, path = argv
  control, conns, lock = Control(path), [], threading.Lock()
  server = socket.socket()
  server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  server.bind((listen_addr, int(listen_port)))
  server.listen(128)
  threading.Thread(target=watch_resets, args=(control, conns, lock), daemon=True).start()
  print(json.dumps({"ready": server.getsockname()[1]}), flush=True)
  while True:
    client, _ = server.accept()
    try:
      upstream = socket.create_connection((target_addr, int(target_port)), timeout=30)
      upstream.settimeout(None)
    except OSError:
      client.close()
      continue
    with lock:
      conns.extend([client, upstream])
    epoch = control.get().get("reset", 0)
    for a, b in ((client, upstream), (upstream, client)):
      threading.Thread(target=pump, args=(a, b, control, epoch), daemon=True).start()


if __name__ == "__main__":
  main(sys.argv[1:])
