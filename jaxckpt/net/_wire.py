"""One message framing for every jaxckpt socket: agents, the lighthouse, replica groups.

A message is a ZeroMQ multipart message ``[mac, header, *raw]``:

* ``header`` is MessagePack (msgspec's encoder) of a dict with an ``op``, the sender's clock ``ts``, a
  random ``nonce``, optionally the ``deadline`` after which the sender has given
  up, and, when arrays follow, their dtypes and shapes (``arrays``);
* ``mac`` is the HMAC-SHA256 of ``header`` under the job's secret; a receiver
  refuses a message whose mac does not verify (compared in constant time),
  whose ``ts`` is more than ``MAX_SKEW_SECS`` off its own clock, or whose
  ``nonce`` it accepted before (:class:`Replays`: a captured message replayed
  inside the window is refused, so a request is applied at most once);
* ``raw`` frames carry bulk bytes (array data, snapshot ranges) without a copy
  into msgpack and outside the mac: they are either checked against checksums in
  an authenticated header (snapshots) or arrive on a connection only the job
  opens (ZeroMQ delivers a multipart message whole, from one peer).

A message that is not sealed (``mac`` empty) is a refusal a receiver sends to a
sender whose mac did not verify: the sender learns why instead of waiting.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import math
import os
import secrets as _secrets
import threading
import time
from typing import Annotated, Any, Callable, Sequence

import msgspec
import numpy as np
import zmq
from msgspec import Meta

from jaxckpt import errors
from jaxckpt.host.snapshot import dtype_from_name
from jaxckpt.net import _schema

Header = dict[str, Any]
MAX_SKEW_SECS = 300.0
SECRET_ENV = "JAXCKPT_JOB_SECRET"
_MAC_BYTES = hashlib.sha256().digest_size

# A clock reading of the framing (``ts``, ``deadline``): seconds since the epoch, finite
# (NaN compares false with every bound: a NaN ``ts`` would pass the replay window, and
# stay in the replay set for ever).
_Clock = Annotated[float, Meta(ge=0.0, le=1e11)]


class Framing(msgspec.Struct, frozen=True, kw_only=True):
  """The fields :func:`seal` adds to every header, checked by :func:`open_` (before the
  window, the replay set or the deadline use them) with the message's own fields
  left to the message's schema: a malformed one is refused, never raised where it
  is used."""
  ts: _Clock
  nonce: Annotated[bytes, Meta(max_length=64)] | None = None
  deadline: _Clock | None = None
  arrays: Annotated[list[tuple[Annotated[str, Meta(min_length=1, max_length=32)],
                               Annotated[list[Annotated[int, Meta(ge=0, le=_schema.INT64)]],
                                         Meta(max_length=64)]]],
                    Meta(max_length=1 << 16)] | None = None


def pack(obj: dict[str, Any]) -> bytes:
  return msgspec.msgpack.encode(obj)


def unpack(b: Any) -> dict[str, Any]:
  return msgspec.msgpack.decode(_bytes(b))


def sign(secret: bytes, header: bytes) -> bytes:
  return hmac.new(secret, header, hashlib.sha256).digest()


def normalize_secret(given: str | bytes | None) -> bytes | None:
  """A secret as every jaxckpt process uses it: bytes, without surrounding
  whitespace (a token read from a file keeps its newline); None if empty."""
  if given is None:
    return None
  b = (given.encode() if isinstance(given, str) else bytes(given)).strip()
  return b or None


def secret_bytes(given: str | bytes | None, *, who: str) -> bytes:
  """The job's secret: ``given``, else ``$JAXCKPT_JOB_SECRET``; else a clear error."""
  given = normalize_secret(given or os.environ.get(SECRET_ENV) or None)
  if given is None:
    raise errors.InvalidArgumentError(
        f"{who} needs the job's secret, which every message carries proof of: pass "
        f"secret= (e.g. the Lighthouse's .secret) or set ${SECRET_ENV} in every process "
        "of the job (the launcher's job, e.g. `export JAXCKPT_JOB_SECRET=$(python -c "
        "'import secrets; print(secrets.token_hex(32))')`)")
  return given


def new_secret() -> str:
  return _secrets.token_hex(32)


def seal(secret: bytes, header: Header, arrays: Sequence[np.ndarray] = (), *,
         timeout_secs: float | None = None) -> list[Any]:
  """The frames of a message: signed ``header`` (with ``arrays``' dtypes and
  shapes) and the arrays' bytes, sent without a copy. A message with
  ``timeout_secs`` carries its deadline (see :func:`expired`)."""
  arrays = [np.asarray(a, order="C") for a in arrays]  # (ascontiguousarray makes 0-d 1-d)
  now = time.time()
  h = dict(header, ts=now, nonce=os.urandom(8))
  if timeout_secs is not None:
    h["deadline"] = now + timeout_secs
  if arrays:
    h["arrays"] = [(a.dtype.name, list(a.shape)) for a in arrays]
  body = pack(h)
  return [sign(secret, body), body, *(a.reshape(-1).view(np.uint8) for a in arrays)]


def refusal(error: str, **extra: Any) -> list[bytes]:
  """An unsealed refusal (the receiver could not verify the sender's mac)."""
  return [b"", pack(dict(extra, op="refused", error=error))]


def open_(secret: bytes, frames: Sequence[Any], *,
          replays: "Replays | NewerPerSender | None" = None) -> tuple[Header, list[Any]]:
  """The verified header of a message and its raw frames; PermissionDeniedError
  if it is not sealed with ``secret``, too old, or (given the receiver's
  ``replays``) seen before. A refusal (see :func:`refusal`) raises
  PermissionDeniedError with its reason."""
  if len(frames) < 2:
    raise errors.PermissionDeniedError("a message without the job's secret was refused")
  mac, body = _bytes(frames[0]), _bytes(frames[1])
  if not mac:
    try:
      reason = unpack(body).get("error")
    except Exception:  # pylint: disable=broad-except
      reason = None
    raise errors.PermissionDeniedError(f"refused: {reason or 'an unsealed message'}")
  if len(mac) != _MAC_BYTES or not hmac.compare_digest(sign(secret, body), mac):
    raise errors.PermissionDeniedError(
        "a message with a wrong mac was refused (not sealed with the job's secret)")
  header = unpack(body)
  try:
    framing = msgspec.convert(header, Framing)
  except msgspec.ValidationError as e:
    raise errors.PermissionDeniedError(
        "a sealed message with a malformed framing field was refused ("
        f"{_schema.refused(e, header, 'its framing', tail='')}); nothing was applied") from None
  if abs(time.time() - framing.ts) > MAX_SKEW_SECS:
    raise errors.PermissionDeniedError("a message too old or from the future was refused (a replay?)")
  del header["ts"]
  header.pop("nonce", None)
  if replays is not None:
    replays.check(framing.nonce, framing.ts, header)
  return header, list(frames[2:])


def reply_of(raw: Any, who: str, where: str) -> dict[str, Any]:
  """A peer's reply frame as a dict; anything else (not msgpack, not a map, no
  ``ok``) is an AgentUnavailableError naming the peer and its address."""
  try:
    reply = unpack(raw)
  except Exception as e:  # pylint: disable=broad-except  (a decoder raises several kinds)
    raise errors.AgentUnavailableError(
        f"{who} at {where} answered with bytes that are not a reply ({type(e).__name__}); "
        "is something else listening there, or another jaxckpt version?") from None
  if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
    raise errors.AgentUnavailableError(
        f"{who} at {where} answered with a {type(reply).__name__} that is not a reply "
        f"(a map with 'ok'); is something else listening there, or another jaxckpt version?")
  return reply


class Replays:
  """The nonces of the sealed messages a receiver accepted, kept while their
  timestamps are inside the window: a message seen before is refused (a
  replay), so every request is applied at most once."""

  def __init__(self) -> None:
    self._seen: set[bytes] = set()
    self._expiry: list[tuple[float, bytes]] = []     # a heap: (when the nonce may go, nonce)
    self._lock = threading.Lock()
    self.refused = 0

  def __len__(self) -> int:
    """How many nonces it holds (those of the last ``MAX_SKEW_SECS`` or so)."""
    with self._lock:
      return len(self._seen)

  def check(self, nonce: Any, ts: float, header: Header) -> None:
    """Records ``nonce``; PermissionDeniedError if it was seen before, or if ``ts`` is
    not a finite time."""
    del header
    if not isinstance(nonce, bytes) or len(nonce) < 8:
      raise errors.PermissionDeniedError("a sealed message without a nonce was refused")
    if not math.isfinite(ts):      # (it would never expire, nor let any nonce after it)
      raise errors.PermissionDeniedError(f"a sealed message with ts={ts!r} was refused")
    now = time.time()
    with self._lock:
      while self._expiry and self._expiry[0][0] < now:
        self._seen.discard(heapq.heappop(self._expiry)[1])
      if nonce in self._seen:
        self.refused += 1
        raise errors.PermissionDeniedError(
            "a replayed message was refused (its nonce was seen before)")
      self._seen.add(nonce)
      heapq.heappush(self._expiry, (ts + MAX_SKEW_SECS + 1.0, nonce))


class NewerPerSender:
  """Replay refusal in memory that grows with senders, not messages: a message
  that names its sender (``sender(header)``, e.g. a replica group's id) must be
  newer than the last one accepted from that sender (a replay, or an old message
  overtaken by a newer one, is refused: a sender's next message supersedes it);
  one that names none goes through ``others`` (a nonce cache) when given."""

  def __init__(self, sender: Callable[[Header], Any], others: Replays | None = None) -> None:
    self._sender = sender
    self._others = others
    self._newest: dict[Any, float] = {}
    self._lock = threading.Lock()
    self.refused = 0

  def check(self, nonce: Any, ts: float, header: Header) -> None:
    if not math.isfinite(ts):      # (every later message would compare as not newer)
      raise errors.PermissionDeniedError(f"a sealed message with ts={ts!r} was refused")
    key = self._sender(header)
    if key is None:
      if self._others is not None:
        self._others.check(nonce, ts, header)
      return
    with self._lock:
      if ts <= self._newest.get(key, -math.inf):
        self.refused += 1
        raise errors.PermissionDeniedError(
            "a replayed message was refused (not newer than the last one from its sender)")
      self._newest[key] = ts


def remote_error(reply: dict[str, Any], who: str, op: str) -> Exception:
  """The typed error a peer's ``{"ok": False, "type": ..., "error": ...}`` reply stands for."""
  cls = getattr(errors, reply.get("type", ""), None)
  if not (isinstance(cls, type) and issubclass(cls, errors.JaxckptError)):
    cls = errors.AgentUnavailableError
  return cls(f"{who} refused {op!r}: {reply.get('error')}")


def expired(header: Header) -> bool:
  """Whether the sender of ``header`` (opened by :func:`open_`, which checked its
  ``deadline``) has given up on it (its deadline passed)."""
  deadline = header.pop("deadline", None)
  return deadline is not None and time.time() > float(deadline)


def arrays_of(header: Header, raw: Sequence[Any]) -> list[np.ndarray]:
  """The read-only arrays a sealed message carries (zero-copy views of its frames)."""
  meta = header.pop("arrays", [])
  if len(meta) != len(raw):
    raise errors.CorruptSnapshotError(
        f"message {header.get('op')!r} announces {len(meta)} arrays but carries {len(raw)} frames")
  out = []
  for frame, (dtype, shape) in zip(raw, meta):
    buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
    out.append(np.frombuffer(buf, dtype=dtype_from_name(dtype)).reshape(shape))
  return out


def _bytes(frame: Any) -> bytes:
  return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)


def socket(ctx: zmq.Context, kind: int, *, immediate: bool = False) -> zmq.Socket:
  """A socket that never blocks close (linger 0), optionally dropping sends while unconnected."""
  sock = ctx.socket(kind)
  sock.setsockopt(zmq.LINGER, 0)
  if immediate:
    sock.setsockopt(zmq.IMMEDIATE, 1)
  return sock


def recv(sock: zmq.Socket, timeout_secs: float) -> list[Any] | None:
  """One multipart message from ``sock`` within ``timeout_secs``, or None."""
  if sock.poll(max(0, int(timeout_secs * 1000)), zmq.POLLIN):
    return sock.recv_multipart(copy=False)
  return None


def send(sock: zmq.Socket, frames: Sequence[Any]) -> bool:
  """Sends without blocking; False when the message could not be queued."""
  try:
    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
    return True
  except zmq.Again:
    return False
