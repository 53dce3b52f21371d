"""Storage that fails for a while: an HTTP proxy on loopback that forwards every request
to a real server, and, once told, fails the next N requests instead, in turn with each
way a cloud store's front end fails: a ``503`` answer, a connection reset before the
request reaches the server, and a reset after the server did it (its answer is lost).

Put it in front of a real object store (``FakeGcs``, ``SeaweedS3``) and point the job's
processes at its endpoint: every request that is not failed is the real server's.

>>> with FakeGcs() as gcs, FlakyProxy(gcs.endpoint) as flaky:   # doctest: +SKIP
...   env = {"TENSORSTORE_GCS_HTTP_URL": flaky.endpoint}
...   flaky.fail(9)                     # 3 of each kind, then forward again
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import socket
import struct
import threading
import time
import urllib.parse

from jaxckpt import errors

#: The ways a request fails, taken in turn.
KINDS = ("503", "reset", "reset-after")
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "content-length"}


class FlakyProxy:
  """A context manager: ``endpoint`` (``http://127.0.0.1:PORT``) forwards each HTTP/1.1
  request to ``target`` (``http://host:port``), one upstream connection per request, and
  fails the requests :meth:`fail` arms. Exiting closes every connection and joins its
  threads.

  Attributes:
    endpoint: the proxy's URL. forwarded: requests answered with the server's answer.
    failed: how many requests failed so far, by kind (``KINDS``).
  """

  def __init__(self, target: str, *, host: str = "127.0.0.1") -> None:
    url = urllib.parse.urlsplit(target)
    if url.scheme != "http" or not url.hostname or not url.port:
      raise errors.InvalidArgumentError(
          f"FlakyProxy(target={target!r}): give the server as http://HOST:PORT")
    self.target = (url.hostname, url.port)
    self.host = host
    self.endpoint = ""
    self.forwarded = 0
    self.failed = {k: 0 for k in KINDS}
    self._arms: list[list] = []       # [requests still to fail, the text their URL holds]
    self._next_kind = 0
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._socks: set[socket.socket] = set()
    self._server: http.server.ThreadingHTTPServer | None = None
    self._thread: threading.Thread | None = None

  def fail(self, count: int, *, where: str = "") -> None:
    """The next ``count`` requests whose URL (path and query, as sent) contains ``where``
    fail, the kinds in turn, whoever sends them; the ones after are forwarded again.
    Arms add up: a request takes the first armed failure its URL matches."""
    if count < 0:
      raise errors.InvalidArgumentError(f"FlakyProxy.fail(count={count!r}): a count is >= 0")
    with self._lock:
      self._arms.append([count, where])

  def _armed(self) -> int:
    return sum(n for n, _ in self._arms)

  def wait_failed(self, timeout_secs: float) -> None:
    """Returns once every request armed by :meth:`fail` has failed; raises naming how
    many are still to fail (no request came for them: the job did not touch storage)."""
    deadline = time.monotonic() + timeout_secs
    with self._changed:
      while self._armed():
        left = deadline - time.monotonic()
        if left <= 0:
          raise errors.SnapshotTimeoutError(
              f"FlakyProxy at {self.endpoint}: {self._armed()} armed failures were not used "
              f"within {timeout_secs} s (no request came for them: "
              f"{[tuple(a) for a in self._arms if a[0]]}; failed so far: {self.failed})")
        self._changed.wait(left)

  def __enter__(self) -> "FlakyProxy":
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args: object) -> None:   # (quiet)
        del args

      def setup(self) -> None:
        super().setup()
        with proxy._lock:
          proxy._socks.add(self.connection)

      def finish(self) -> None:
        with contextlib.suppress(OSError):
          super().finish()
        with proxy._lock:
          proxy._socks.discard(self.connection)

      def _relay(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
          self.send_error(501, "FlakyProxy forwards bodies with a Content-Length only")
          return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        kind = proxy._take_failure(self.path)
        if kind == "503":
          self._answer(503, json.dumps({"error": {"code": 503, "message": "Backend Error "
                                                  "(FlakyProxy)"}}).encode(),
                       [("Content-Type", "application/json")])
          return
        if kind == "reset":
          self._reset()
          return
        status, headers, answer = proxy._forward(self.command, self.path, self.headers, body)
        if kind == "reset-after":
          self._reset()
          return
        with proxy._lock:               # (counted before the client can see it)
          proxy.forwarded += 1
        self._answer(status, answer, headers)

      def _answer(self, status: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        for k, v in headers:
          self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
          self.wfile.write(body)

      def _reset(self) -> None:
        """Closes the connection with a TCP reset (SO_LINGER 0), answering nothing."""
        self.close_connection = True
        with contextlib.suppress(OSError):
          self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                     struct.pack("ii", 1, 0))
          self.connection.close()

      do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

    self._server = http.server.ThreadingHTTPServer((self.host, 0), Handler)
    self._server.daemon_threads = True
    self.endpoint = f"http://{self.host}:{self._server.server_address[1]}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                    name="flaky-http-proxy")
    self._thread.start()
    return self

  def __exit__(self, *exc: object) -> None:
    self._server.shutdown()
    with self._lock:
      socks = list(self._socks)
    for s in socks:            # idle keep-alive connections: their threads end now
      with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    self._server.server_close()
    self._thread.join(10)
    if self._thread.is_alive():
      raise errors.SnapshotTimeoutError(f"FlakyProxy at {self.endpoint}: its server thread "
                                        "still runs 10 s after shutdown")

  def _take_failure(self, path: str) -> str | None:
    with self._changed:
      arm = next((a for a in self._arms if a[0] and a[1] in path), None)
      if arm is None:
        return None
      arm[0] -= 1
      kind = KINDS[self._next_kind % len(KINDS)]
      self._next_kind += 1
      self.failed[kind] += 1
      self._changed.notify_all()
      return kind

  def _forward(self, method: str, path: str, headers, body: bytes):
    conn = http.client.HTTPConnection(*self.target, timeout=120)
    try:
      conn.request(method, path, body=body if body or method in ("POST", "PUT", "PATCH") else None,
                   headers={k: v for k, v in headers.items() if k.lower() not in _HOP})
      r = conn.getresponse()
      answer = r.read()
      return r.status, [(k, v) for k, v in r.getheaders() if k.lower() not in _HOP], answer
    finally:
      conn.close()
