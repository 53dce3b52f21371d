"""One classifier tells proven damage from an error of this attempt, on every read path."""

import errno
import glob
import os

import numpy as np
import pytest

import jaxckpt.universal as u
from jaxckpt import errors
from jaxckpt.universal import _failures
from jaxckpt.universal import _manifest as man

ARR = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)


def _stored(d: str) -> str:
  """Step 1 of ``d``: one leaf ``w`` in one chunk file; returns that file's path."""
  info = man.LeafInfo(path="['w']", kind="numpy", shape=ARR.shape, dtype="float32")
  u.write_leaves(d, 1, {"['w']": info}, {"['w']": ARR}, metadata={})
  (chunk,) = [f for f in glob.glob(f"{d}/step_*/arrays/**/c/**", recursive=True)
              if os.path.isfile(f)]
  return chunk


@pytest.mark.parametrize("how", ["truncated", "flipped", "not_a_shard", "no_zarr_json"])
def test_real_damage_of_a_stored_chunk_or_array_is_damage(tmp_path, how):
  d = str(tmp_path)
  chunk = _stored(d)
  body = open(chunk, "rb").read()
  if how == "truncated":
    body = body[:len(body) // 2]
  elif how == "flipped":
    body = body[:40] + bytes([body[40] ^ 0xFF]) + body[41:]
  elif how == "not_a_shard":
    body = b"garbage"
  else:
    os.remove(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(chunk))), "zarr.json"))
  if how != "no_zarr_json":
    open(chunk, "wb").write(body)
  with pytest.raises(errors.CorruptSnapshotError, match=r"step 1: .*\['w'\].* damaged"):
    u.open_step(d, 1).read("['w']")
  # a restore reads this chunk (one inner chunk) without tensorstore's decoding: the same
  with pytest.raises(errors.CorruptSnapshotError, match=r"step 1: .*\['w'\].* damaged"):
    u.restore_arrays(u.open_step(d, 1), {"['w']": None})


REFUSED = [   # what storage answers a read it does not make, as tensorstore says it
    'PERMISSION_DENIED: AccessDenied: Access Denied. [http_response_code=\'403\']',
    'UNAUTHENTICATED: Error reading "gs://b/k": HTTP response code: 401',
    'UNAVAILABLE: Connection refused',
    'DEADLINE_EXCEEDED: Timeout was reached',
    'RESOURCE_EXHAUSTED: SlowDown: Please reduce your request rate.',
    'ABORTED: OperationAborted', 'CANCELLED: the read was cancelled',
    # a damage code around a refused cause, or the refusal only in its HTTP form
    'NOT_FOUND: Error opening "zarr3" driver: PERMISSION_DENIED: AccessDenied',
    'FAILED_PRECONDITION: Error reading "k": [http_response_code=\'503\']',
    'DATA_LOSS: <Error><Code>InternalError</Code></Error>',
    # no code at all, or one that proves nothing of the bytes
    "INTERNAL: curl error", "UNKNOWN: something else", "a plain message",
]


@pytest.mark.parametrize("text", REFUSED)
def test_refused_throttled_or_unknown_reads_are_errors_of_this_attempt(text):
  got = _failures.classify(ValueError(text), "step 7: leaf 'w' in 's3://b/run'")
  assert isinstance(got, errors.StorageError) and not isinstance(got, errors.CorruptSnapshotError)
  assert "step 7: leaf 'w'" in str(got) and "not damage" in str(got), got
  assert got.errno in (errno.EACCES, errno.EAGAIN, errno.ETIMEDOUT, errno.ECANCELED, errno.EIO)


def test_a_timeout_is_an_error_of_this_attempt_naming_it():
  got = _failures.classify(TimeoutError("no answer within 120.0 s"), "step 3: its manifest")
  assert isinstance(got, errors.StorageError) and got.errno == errno.ETIMEDOUT
  assert "step 3: its manifest could not be read: DEADLINE_EXCEEDED (no answer within" in str(got)


@pytest.mark.parametrize("text", [
    "DATA_LOSS: Error reading shard entry {0, 0}: Digest mismatch",
    'NOT_FOUND: Metadata at local file "/c/zarr.json" does not exist',
    'FAILED_PRECONDITION: Error parsing object member "node_type"',
    "INVALID_ARGUMENT: Error decoding", "OUT_OF_RANGE: past the end",
    # orbax re-raises tensorstore's errors without their code: bytes that did not decode
    'Error reading "w/.zarray": ZSTD_decompressStream() failed: Data corruption detected',
    "Error decoding b-tree node: CRC-32C checksum verification failed: expected=1, actual=2"])
def test_damage_codes_without_a_refusal_are_damage(text):
  got = _failures.classify(ValueError(text), "step 5: leaf 'w'")
  assert isinstance(got, errors.CorruptSnapshotError)
  assert str(got).startswith("step 5: leaf 'w' is damaged (") and "restore another step" in str(got)
