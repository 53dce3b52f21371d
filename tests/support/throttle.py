"""Storage at a capped speed: a TCP proxy on loopback that forwards at most so many
bytes per second each way, shared by every connection through it.

Put it in front of a real S3 server (``SeaweedS3``) and point the trainer (and the
agent it starts) at the proxy's endpoint: every request is the real server's, only
slower, as storage behind a thin link is.

>>> with SeaweedS3() as s3, ThrottledProxy(s3.endpoint, 10e6) as slow:  # doctest: +SKIP
...   env = {"AWS_ENDPOINT_URL": slow.endpoint}    # 10 MB/s to storage
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse

from jaxckpt import errors

CHUNK = 64 << 10


class _Bucket:
  """Hands out ``rate`` bytes per second (a burst of at most ``CHUNK``): ``take(n)``
  returns once the bytes are due."""

  def __init__(self, rate: float) -> None:
    self.rate = rate
    self._due = time.monotonic()
    self._lock = threading.Lock()

  def take(self, n: int) -> None:
    with self._lock:
      now = time.monotonic()
      self._due = max(self._due, now - CHUNK / self.rate) + n / self.rate
      wait = self._due - now
    if wait > 0:
      time.sleep(wait)


class ThrottledProxy:
  """A context manager: ``endpoint`` (``http://127.0.0.1:PORT``) forwards to
  ``target`` (``http://host:port``) at ``bytes_per_sec`` at most each way, all
  connections together. Exiting closes every connection and joins its threads.

  Attributes:
    endpoint: the proxy's URL. forwarded: bytes forwarded so far, both ways (counted
      as each chunk is sent on).
  """

  def __init__(self, target: str, bytes_per_sec: float, *, host: str = "127.0.0.1") -> None:
    if not bytes_per_sec > 0:
      raise errors.InvalidArgumentError(
          f"ThrottledProxy(bytes_per_sec={bytes_per_sec!r}): a speed cap is > 0 bytes/s")
    url = urllib.parse.urlsplit(target)
    if not url.hostname or not url.port:
      raise errors.InvalidArgumentError(
          f"ThrottledProxy(target={target!r}): give the server as http://HOST:PORT")
    self.target = (url.hostname, url.port)
    self.host = host
    self.forwarded = 0
    self.endpoint = ""
    self._buckets = (_Bucket(bytes_per_sec), _Bucket(bytes_per_sec))
    self._listener: socket.socket | None = None
    self._socks: list[socket.socket] = []
    self._threads: list[threading.Thread] = []
    self._lock = threading.Lock()
    self._closed = threading.Event()

  def __enter__(self) -> "ThrottledProxy":
    self._listener = socket.create_server((self.host, 0))
    self.endpoint = f"http://{self.host}:{self._listener.getsockname()[1]}"
    self._start(self._accept, "accept")
    return self

  def __exit__(self, *exc: object) -> None:
    self._closed.set()
    with self._lock:
      socks = [self._listener, *self._socks]
    for s in socks:
      with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
      s.close()
    for t in list(self._threads):
      t.join(10)
    alive = [t.name for t in self._threads if t.is_alive()]
    if alive:
      raise errors.SnapshotTimeoutError(f"ThrottledProxy: threads {alive} still run 10 s "
                                        "after their sockets closed")

  def _start(self, fn, name: str, *args) -> None:
    t = threading.Thread(target=fn, args=args, daemon=True, name=f"throttle-{name}")
    with self._lock:
      self._threads = [x for x in self._threads if x.is_alive()] + [t]
    t.start()

  def _accept(self) -> None:
    while not self._closed.is_set():
      try:
        client, _ = self._listener.accept()
      except OSError:
        return                                  # closed
      try:
        server = socket.create_connection(self.target, timeout=30)
        server.settimeout(None)
      except OSError:
        client.close()
        continue
      with self._lock:
        if self._closed.is_set():
          client.close()
          server.close()
          return
        self._socks += [client, server]
      ends = [2]                                # pumps of this connection still running
      self._start(self._pump, "up", client, server, self._buckets[0], (client, server, ends))
      self._start(self._pump, "down", server, client, self._buckets[1], (client, server, ends))

  def _pump(self, src: socket.socket, dst: socket.socket, bucket: _Bucket,
            conn: tuple[socket.socket, socket.socket, list[int]]) -> None:
    try:
      while True:
        data = src.recv(CHUNK)
        if not data:
          break
        bucket.take(len(data))
        with self._lock:
          self.forwarded += len(data)
        dst.sendall(data)
    except OSError:
      pass
    with contextlib.suppress(OSError):         # one side ended: so do the other's writes
      dst.shutdown(socket.SHUT_WR)
    client, server, ends = conn
    with self._lock:
      ends[0] -= 1
      if ends[0]:
        return
      for s in (client, server):               # both ended: the connection is gone
        s.close()
        with contextlib.suppress(ValueError):
          self._socks.remove(s)
