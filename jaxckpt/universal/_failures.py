"""What a failed storage read proves: damage to the step, or an error of this attempt.

Only proven damage may set a step aside (``universal.quarantine_step``): a chunk
that fails a checksum, a file that does not parse, a chunk or metadata file
NOT_FOUND in a committed step. A read refused or not answered (access denied,
unauthenticated, throttled, timed out, the connection or the service away,
aborted, cancelled, and their HTTP forms) says nothing about the bytes: it is
this attempt's error, a :class:`~jaxckpt.errors.StorageError`, and the step
stays listed for the next attempt. A failure of no known kind is not proof
either; bytes read that do not decode (a checksum, a compressed stream, JSON)
are, with or without a status code. Every read path (chunks, array and step metadata, commit markers, the
``verify`` command) asks :func:`classify`.

>>> status_code(ValueError("PERMISSION_DENIED: AccessDenied: Access Denied."))
'PERMISSION_DENIED'
>>> proves_damage(ValueError('DATA_LOSS: Error reading shard entry: Digest mismatch'))
True
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
from typing import Callable, Iterator

from jaxckpt import errors
from jaxckpt.universal import _layout as lay

#: tensorstore (absl) status codes that a damaged step gives: its bytes or files are wrong.
DAMAGE_CODES = frozenset({"DATA_LOSS", "NOT_FOUND", "FAILED_PRECONDITION", "INVALID_ARGUMENT",
                          "OUT_OF_RANGE"})
#: Codes of a read this attempt could not make: they say nothing of the bytes.
ATTEMPT_CODES = {"PERMISSION_DENIED": errno.EACCES, "UNAUTHENTICATED": errno.EACCES,
                 "UNAVAILABLE": errno.EAGAIN, "DEADLINE_EXCEEDED": errno.ETIMEDOUT,
                 "RESOURCE_EXHAUSTED": errno.EAGAIN, "ABORTED": errno.EAGAIN,
                 "CANCELLED": errno.ECANCELED}
#: HTTP statuses of the same (a store's answer quoted in a message).
ATTEMPT_HTTP = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 408: "DEADLINE_EXCEEDED",
                429: "RESOURCE_EXHAUSTED", 500: "UNAVAILABLE", 502: "UNAVAILABLE",
                503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
#: Object stores' error codes of the same (S3's and GCS's names).
ATTEMPT_NAMES = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                 "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "SlowDown",
                 "Throttling", "RequestTimeout", "RequestTimeTooSkewed", "ServiceUnavailable",
                 "InternalError", "OperationAborted")

_CODES = "|".join(sorted(DAMAGE_CODES | set(ATTEMPT_CODES) | {"UNKNOWN", "INTERNAL",
                                                               "UNIMPLEMENTED", "ALREADY_EXISTS"}))
_LEADING = re.compile(rf"\s*({_CODES})\b")
_ANYWHERE = re.compile(rf"\b({'|'.join(ATTEMPT_CODES)}):")     # as tensorstore nests causes
_HTTP = re.compile(r"(?:HTTP response code|http_response_code|http status|status code|HTTP)"
                   r"""[:= '"]+(\d{3})\b""", re.IGNORECASE)
_NAMES = re.compile(rf"\b({'|'.join(ATTEMPT_NAMES)})\b")
# What tensorstore says of bytes it read but could not decode, when a caller (orbax) drops the
# status code: proof of damage as well.
_DECODING = re.compile(r"checksum verification failed|Digest mismatch|Data corruption detected|"
                       r"Error decoding|Invalid JSON|Error parsing")
_DETAIL_CHARS = 400


def status_code(error: BaseException) -> str | None:
  """The status code a tensorstore error starts with (``'DATA_LOSS'``), or None."""
  m = _LEADING.match(str(error))
  return m.group(1) if m else None


def attempt_cause(error: BaseException) -> str | None:
  """Why ``error`` is this attempt's (a status code, an HTTP status or a store's error
  name anywhere in it, or a timeout), or None when it names none of them."""
  if isinstance(error, TimeoutError):
    return "DEADLINE_EXCEEDED"
  text = str(error)
  if (m := _ANYWHERE.search(text)):
    return m.group(1)
  for m in _HTTP.finditer(text):
    if int(m.group(1)) in ATTEMPT_HTTP:
      return f"{ATTEMPT_HTTP[int(m.group(1))]} (HTTP {m.group(1)})"
  if (m := _NAMES.search(text)):
    return m.group(1)
  return None


def proves_damage(error: BaseException) -> bool:
  """Whether a failed read proves the step damaged: what was read does not parse (JSON,
  text), or a damage code and no sign of a refused or unanswered request anywhere in
  the message."""
  if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
    return True
  return ((status_code(error) in DAMAGE_CODES or bool(_DECODING.search(str(error))))
          and attempt_cause(error) is None)


def detail(error: BaseException) -> str:
  """The error's text, cut to a readable length (tensorstore quotes whole specs and bodies:
  the spec it appends is dropped, :func:`jaxckpt.universal._layout.ts_error`)."""
  text = " ".join(lay.ts_error(error).split())
  return text if len(text) <= _DETAIL_CHARS else text[:_DETAIL_CHARS] + " ..."


def not_read(what: str, error: BaseException) -> errors.StorageError:
  """The StorageError of a read this attempt could not make, naming ``what`` and the cause."""
  cause = attempt_cause(error) or status_code(error) or type(error).__name__
  code = ATTEMPT_CODES.get(cause.split(" ")[0], errno.EIO)
  said = detail(error)
  return errors.StorageError(
      code, f"{what} could not be read: {cause}{f' ({said})' if said else ''}. This is an error of this "
      "attempt (access refused, throttling, a timeout or the connection), not damage: the step "
      "stays as it is on storage; try again once storage answers")


def classify(error: BaseException, what: str,
             damaged: Callable[[str], str] | None = None) -> errors.JaxckptError:
  """The error to raise for a failed read of ``what``: CorruptSnapshotError with the
  message ``damaged(cause)`` (default: "WHAT is damaged (cause); restore another step")
  if it proves damage, else this attempt's StorageError."""
  if isinstance(error, errors.JaxckptError):
    return error
  if proves_damage(error):
    text = (damaged or _damaged(what))(detail(error))
    return errors.CorruptSnapshotError(text)
  return not_read(what, error)


def _damaged(what: str) -> Callable[[str], str]:
  return lambda cause: f"{what} is damaged ({cause}); restore another step"


@contextlib.contextmanager
def reading(what: str, damaged: Callable[[str], str] | None = None) -> Iterator[None]:
  """Turns a raw failure of the storage reads in the body (tensorstore's ValueError, a
  timeout) into :func:`classify`'s error; jaxckpt's own errors pass through. Wrap the
  reads only: a ValueError of parsing what was read is not the store's."""
  try:
    yield
  except errors.JaxckptError:
    raise
  except (ValueError, TimeoutError) as e:
    raise classify(e, what, damaged) from None
