"""The failing-S3 proxy against a small HTTP server on loopback: requests it does not
fail get the server's answer (several on one kept-alive connection), the ones it
fails get 503 SlowDown, 500 InternalError or a reset, and closing it ends every
connection at once, an idle client's too."""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time

import pytest

from tests.support.faulty_s3 import Fault, FaultyS3Proxy


class _Echo(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"

  def _answer(self) -> None:
    n = int(self.headers.get("Content-Length") or 0)
    body = self.command.encode() + b" " + self.path.encode() + b" " + self.rfile.read(n)
    self.send_response(200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)

  do_GET = do_PUT = _answer

  def log_message(self, *args) -> None:
    pass


@pytest.fixture
def server():
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
  t = threading.Thread(target=srv.serve_forever, daemon=True)
  t.start()
  yield f"http://127.0.0.1:{srv.server_address[1]}"
  srv.shutdown()
  srv.server_close()
  t.join(timeout=30)


def _conn(proxy: FaultyS3Proxy) -> http.client.HTTPConnection:
  host, port = proxy.endpoint.removeprefix("http://").split(":")
  return http.client.HTTPConnection(host, int(port), timeout=30)


def test_requests_not_failed_get_the_servers_answer_on_one_connection(server):
  with FaultyS3Proxy(server) as proxy:
    c = _conn(proxy)
    for i in range(3):
      c.request("PUT", f"/b/k{i}", body=b"x" * 1000 * i)
      r = c.getresponse()
      assert (r.status, r.read()) == (200, f"PUT /b/k{i} ".encode() + b"x" * 1000 * i)
    c.close()


def test_chosen_requests_get_503_500_or_a_reset(server):
  with FaultyS3Proxy(server) as proxy:
    slow = Fault("503", method="PUT", path="/arrays/", every=2)
    proxy.fail(slow, Fault("500", method="GET", count=1))
    c = _conn(proxy)
    got = []
    for path in ("/b/arrays/0", "/b/arrays/1", "/b/other", "/b/arrays/2", "/b/arrays/3"):
      c.request("PUT", path, body=b"v")
      r = c.getresponse()
      got.append((r.status, b"SlowDown" in r.read()))
    assert got == [(200, False), (503, True), (200, False), (200, False), (503, True)]
    assert (slow.matched, slow.served) == (4, 2)
    c.request("GET", "/b/x")
    r = c.getresponse()
    assert r.status == 500 and b"InternalError" in r.read()
    c.request("GET", "/b/x")                      # count=1: the next one goes through
    assert c.getresponse().read() == b"GET /b/x "
    proxy.fail(Fault("reset", method="PUT"))
    c.request("PUT", "/b/y", body=b"v")
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
      c.getresponse()
    proxy.heal()
    c = _conn(proxy)
    c.request("PUT", "/b/y", body=b"v")
    assert c.getresponse().read() == b"PUT /b/y v"
    c.close()


def test_closing_ends_every_connection_an_idle_clients_too(server):
  proxy = FaultyS3Proxy(server)
  with proxy:
    idle = socket.create_connection(proxy.endpoint.removeprefix("http://").split(":")[0:1]
                                    + [int(proxy.endpoint.rsplit(":", 1)[1])], timeout=30)
    deadline = time.monotonic() + 30    # until the proxy accepted it (its thread in recv)
    while not proxy._socks:  # pylint: disable=protected-access
      assert time.monotonic() < deadline, "the proxy did not accept a connection in 30 s"
      time.sleep(0.01)
    t0 = time.monotonic()
  assert time.monotonic() - t0 < 10
  assert idle.recv(1) == b""       # closed by the proxy
  idle.close()
