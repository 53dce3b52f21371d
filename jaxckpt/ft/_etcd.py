"""A small etcd v3 client over etcd's JSON gateway (HTTP/JSON at ``/v3/...``), no library.

The control plane needs five of etcd's calls: a range (get), a put, a
transaction (compare-and-put), and a lease's grant, keep-alive and revoke.
etcd's gRPC gateway serves each as a POST of JSON (keys and values base64,
64-bit integers as strings), so a standard-library HTTP connection per member
is the whole client. The PyPI clients are either stale (``etcd3`` last
released in 2020, built on an old protobuf) or pull in gRPC; etcd 3.4 (Debian's
``etcd-server``) serves this gateway on its client port by default.

A call goes to the member that answered last and, when that one does not
(refused, reset, no answer within a quarter of ``timeout_secs``, or "no leader"
while its cluster elects one), to the next, until ``timeout_secs`` have passed:
losing one member of three costs a call a failed try, not an error. So a
transaction may be applied by a try whose answer was lost and then fail its
compare on the next try: callers compare what they read back (who holds a key)
rather than trust the outcome alone.

>>> client = Etcd(["http://127.0.0.1:2379"])           # doctest: +SKIP
>>> client.put("k", b"v"); client.get("k").value        # doctest: +SKIP
b'v'
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
from typing import Any, Sequence

from jaxckpt import errors

_RETRY_PAUSE_SECS = 0.02


@dataclasses.dataclass(frozen=True, slots=True)
class KeyValue:
  """One key as etcd holds it."""
  key: str
  value: bytes
  create_revision: int
  mod_revision: int
  lease: int


class EtcdError(errors.JaxckptError, ConnectionError):
  """No member of the etcd cluster answered a call within its timeout (or one refused it)."""


def _b64(data: str | bytes) -> str:
  return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _kv(obj: dict[str, Any]) -> KeyValue:
  return KeyValue(key=base64.b64decode(obj["key"]).decode(), value=base64.b64decode(obj.get("value", "")),
                  create_revision=int(obj.get("create_revision", 0)),
                  mod_revision=int(obj.get("mod_revision", 0)), lease=int(obj.get("lease", 0)))


def put_op(key: str, value: bytes | str, lease: int = 0) -> dict[str, Any]:
  """A transaction's put of ``value`` at ``key`` (under ``lease``, if not 0)."""
  req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
  if lease:
    req["lease"] = str(lease)
  return {"request_put": req}


def get_op(key: str) -> dict[str, Any]:
  """A transaction's read of ``key``."""
  return {"request_range": {"key": _b64(key)}}


def compare(key: str, target: str, value: Any, result: str = "EQUAL") -> dict[str, Any]:
  """A transaction's condition: ``key``'s ``target`` (``CREATE``, ``MOD``, ``VALUE``, ``LEASE``)
  compared with ``value`` (``CREATE`` 0: the key does not exist)."""
  field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value", "LEASE": "lease",
           "VERSION": "version"}[target]
  return {"key": _b64(key), "target": target, "result": result,
          field: _b64(value) if target == "VALUE" else str(value)}


class Etcd:
  """A client of one etcd cluster, safe to share between threads (calls are serialized)."""

  def __init__(self, endpoints: Sequence[str], *, timeout_secs: float = 2.0) -> None:
    if not endpoints:
      raise errors.InvalidArgumentError("Etcd needs at least one endpoint (http://HOST:PORT)")
    self.endpoints = [e if "://" in e else f"http://{e}" for e in endpoints]
    for e in self.endpoints:
      parsed = urllib.parse.urlsplit(e)
      if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        raise errors.InvalidArgumentError(f"an etcd endpoint must be http://HOST:PORT, got {e!r}")
    self.timeout_secs = timeout_secs
    self._try_secs = max(0.25, timeout_secs / 4)
    self._conns: dict[str, http.client.HTTPConnection] = {}
    self._at = 0                          # the member that answered last
    self._lock = threading.Lock()

  # ---- the calls ---------------------------------------------------------------------------------------

  def get(self, key: str) -> KeyValue | None:
    kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
    return _kv(kvs[0]) if kvs else None

  def put(self, key: str, value: bytes | str, lease: int = 0) -> None:
    self.call("/v3/kv/put", put_op(key, value, lease)["request_put"])

  def delete(self, key: str) -> None:
    self.call("/v3/kv/deleterange", {"key": _b64(key)})

  def txn(self, compares: list[dict[str, Any]], success: list[dict[str, Any]],
          failure: list[dict[str, Any]] = ()) -> tuple[bool, list[dict[str, Any]]]:
    """Whether every compare held, and the responses of the branch that ran (a range's
    ``kvs`` as :class:`KeyValue` under ``"kvs"``)."""
    reply = self.call("/v3/kv/txn", {"compare": compares, "success": success, "failure": list(failure)})
    out = []
    for r in reply.get("responses", []):
      rng = r.get("response_range")
      out.append({"kvs": [_kv(x) for x in rng.get("kvs", [])]} if rng is not None else r)
    return bool(reply.get("succeeded", False)), out

  def grant(self, ttl_secs: int) -> int:
    """A new lease of ``ttl_secs`` (etcd rounds it up to its minimum); its id."""
    return int(self.call("/v3/lease/grant", {"TTL": str(int(ttl_secs))})["ID"])

  def keepalive(self, lease: int) -> int:
    """Renews ``lease``; the seconds it has left (0 or less: it expired, it is gone)."""
    reply = self.call("/v3/lease/keepalive", {"ID": str(lease)})
    return int(reply.get("result", reply).get("TTL", 0))

  def revoke(self, lease: int) -> None:
    """Ends ``lease`` now: its keys are deleted (a clean exit hands leadership over at once)."""
    try:
      self.call("/v3/lease/revoke", {"ID": str(lease)})
    except EtcdError as e:
      if "not found" not in str(e):
        raise

  def close(self) -> None:
    with self._lock:
      for conn in self._conns.values():
        conn.close()
      self._conns.clear()

  # ---- the transport -----------------------------------------------------------------------------------

  def call(self, path: str, body: dict[str, Any], timeout_secs: float | None = None) -> dict[str, Any]:
    """POSTs ``body`` to ``path`` on a member that answers (the last one that did first)."""
    deadline = time.monotonic() + (self.timeout_secs if timeout_secs is None else timeout_secs)
    data = json.dumps(body).encode()
    tried: list[str] = []
    with self._lock:
      while True:
        endpoint = self.endpoints[self._at]
        left = deadline - time.monotonic()
        try:
          # (a member whose cluster lost its leader holds a call until a new one is elected,
          # or drops it: a try gets a share of the time, then the next member is asked)
          status, reply = self._post(endpoint, path, data, max(0.05, min(left, self._try_secs)))
        except (OSError, http.client.HTTPException) as e:
          self._drop(endpoint)
          tried.append(f"{endpoint}: {type(e).__name__}: {e}")
        else:
          if status == 200:
            return reply
          message = str(reply.get("message") or reply.get("error") or reply)
          if status < 500 and "no leader" not in message and "timed out" not in message:
            raise EtcdError(f"etcd at {endpoint} refused {path}: {message}")
          tried.append(f"{endpoint}: HTTP {status}: {message}")
        self._at = (self._at + 1) % len(self.endpoints)
        if time.monotonic() >= deadline:
          raise EtcdError(f"no etcd member answered {path} within {self.timeout_secs:g} s: "
                          + "; ".join(tried[-len(self.endpoints):]))
        if len(tried) % len(self.endpoints) == 0:
          time.sleep(_RETRY_PAUSE_SECS)

  def _post(self, endpoint: str, path: str, data: bytes, timeout: float) -> tuple[int, dict[str, Any]]:
    conn = self._conns.get(endpoint)
    if conn is None:
      parsed = urllib.parse.urlsplit(endpoint)
      conn = self._conns[endpoint] = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    conn.timeout = timeout
    if conn.sock is not None:
      conn.sock.settimeout(timeout)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    # The keep-alive stream endpoint answers one JSON object per line: the first is ours.
    text = raw.split(b"\n", 1)[0] if path.endswith("keepalive") else raw
    try:
      return resp.status, json.loads(text or b"{}")
    except ValueError:
      return resp.status, {"error": raw[:200].decode(errors="replace")}

  def _drop(self, endpoint: str) -> None:
    conn = self._conns.pop(endpoint, None)
    if conn is not None:
      conn.close()
