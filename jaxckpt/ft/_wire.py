"""Wire format between the lighthouse, replica groups and their peers.

A message is a zmq multipart message: one msgpack header (a dict with an
``op``) followed by one raw frame per array. Array dtypes and shapes travel in
the header (``arrays``), so no array is ever pickled or copied into msgpack.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np
import zmq

from jaxckpt.snapshot import dtype_from_name

Header = dict[str, Any]


def pack(header: Header, arrays: Sequence[np.ndarray] = ()) -> list[Any]:
  """Frames for ``header`` and ``arrays`` (arrays are sent without a copy)."""
  arrays = [np.asarray(a, order="C") for a in arrays]  # (ascontiguousarray would make 0-d 1-d)
  meta = [(a.dtype.name, list(a.shape)) for a in arrays]
  frames: list[Any] = [msgpack.packb(dict(header, arrays=meta))]
  frames.extend(a.reshape(-1).view(np.uint8) for a in arrays)
  return frames


def unpack(frames: Sequence[Any]) -> tuple[Header, list[np.ndarray]]:
  """The header and read-only arrays of a received message (zero-copy views)."""
  header = msgpack.unpackb(_bytes(frames[0]))
  meta = header.pop("arrays", [])
  if len(meta) != len(frames) - 1:
    raise ValueError(f"message {header.get('op')!r} announces {len(meta)} arrays "
                     f"but carries {len(frames) - 1} frames")
  arrays = []
  for frame, (dtype, shape) in zip(frames[1:], meta):
    buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
    arrays.append(np.frombuffer(buf, dtype=dtype_from_name(dtype)).reshape(shape))
  return header, arrays


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
