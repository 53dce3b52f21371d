"""The record of a rollback under way on storage (``rollback.json``): written before any
step of the abandoned timeline is unlisted, read (and checked: it is data) by whoever
comes next after a crash, removed once every step is deleted (core/_deletes.py)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from jaxckpt import errors
from jaxckpt.universal import _commit
from jaxckpt.universal import _layout as lay
from jaxckpt.universal import _local
from jaxckpt.util._text import shown


def record_rollback(directory: str, record: dict[str, Any]) -> None:
  """Records a rollback under way (one put): the steps of the abandoned timeline, named
  before any of them is unlisted, so that whoever comes next after a crash completes it
  (:func:`rollback_record`); :func:`clear_rollback` once every one is deleted."""
  _commit.write_json(directory, lay.ROLLBACK_KEY, record)


_RecordStep = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _RollbackRecord(msgspec.Struct, forbid_unknown_fields=True):
  """What :func:`record_rollback` writes: the rollback's id, the step restored (``fork``),
  the step that started the new timeline, and the abandoned steps (each after ``fork``)."""
  id: Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")]
  fork: _RecordStep
  step: _RecordStep
  steps: Annotated[list[_RecordStep], msgspec.Meta(max_length=1 << 16)]


def rollback_record(directory: str) -> dict[str, Any] | None:
  """The rollback under way in ``directory`` (:func:`record_rollback`), or None. Its
  contents are data, checked before anything uses them: a record that is not one
  jaxckpt wrote (another type, a step that is no step or not after the one restored) is
  damage, a ManifestError naming the file and the fix, never a delete it asks for."""
  doc = _commit.read_json(directory, lay.ROLLBACK_KEY)
  if doc is None:
    return None
  try:
    rec = msgspec.convert(doc, _RollbackRecord, strict=True)
    if rec.step <= rec.fork or any(s <= rec.fork for s in rec.steps):
      raise msgspec.ValidationError(
          f"its steps must all come after the restored step {rec.fork}")
  except msgspec.ValidationError as e:
    raise errors.ManifestError(
        f"{directory!r}: {lay.ROLLBACK_KEY} (the record of a rollback under way) is not one "
        f"jaxckpt wrote ({shown(str(e))}); nothing it names was deleted. If no rollback of "
        f"this run was interrupted, remove {lay.ROLLBACK_KEY} from the directory") from None
  return msgspec.to_builtins(rec)


def clear_rollback(directory: str) -> None:
  """The rollback recorded in ``directory`` is complete: its record goes."""
  local = lay.local_path(directory)
  if local is not None:
    _local.remove(local, lay.ROLLBACK_KEY, what=f"ending the rollback of {directory!r}")
  else:
    _commit._delete(lay.open_kvstore(directory), lay.ROLLBACK_KEY)  # pylint: disable=protected-access
