"""Steps an orbax CheckpointManager wrote, read where they lie beside jaxckpt's own.

A directory that orbax's manager wrote holds one directory per finalized step,
``<N>`` or ``<prefix>_<N>`` (``step_format_fixed_length`` zero-pads N), with
orbax's ``_CHECKPOINT_METADATA`` file in it. A manager opened on it lists those
steps beside the ones jaxckpt committed there (``_commit.stored_steps``), reads
them onto any target through _orbax_files's lazy tensorstore views
(``_orbax_read.open_stored``), saves new steps in jaxckpt's format beside them but never
one that orbax holds (:func:`check_not_orbax`), and deletes exactly one step's
directory when retention or ``delete()`` drops it (:func:`discard_orbax_step`).

Never listed: orbax's temporary directories (``<N>.orbax-checkpoint-tmp-<t>``,
unfinalized), a step directory or its metadata file that is a symbolic link
(nothing here follows a link out of the directory), and a step that two
directories claim (``7`` beside ``ckpt_7``: which one is meant is unknown; a
warning names both). orbax steps are found in local directories (and
``file://`` URLs) only: _orbax_files reads orbax's files through the local
filesystem.

orbax's data has no jaxckpt checksums: a read of an orbax step is as verified
as orbax's own restore is (zarr and OCDBT), and a failed read is damage only when
it proves it (:mod:`jaxckpt.universal._failures`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import threading
from typing import Any, Callable

from jaxckpt import errors
from jaxckpt.universal import _layout as lay

log = logging.getLogger(__name__)

#: The file orbax writes into a step's directory when it finalizes the step.
FINALIZED = "_CHECKPOINT_METADATA"
_NAME = re.compile(r"(?:.*_)?(\d+)")
_warned: set[tuple[str, int]] = set()
_warned_lock = threading.Lock()


def warn_once(directory: str, step: int, message: str, *args: Any) -> None:
  with _warned_lock:
    if (directory, step) in _warned:
      return
    _warned.add((directory, step))
  log.warning(message, *args)


def _is_file(path: str) -> bool:
  """A regular file, not a link."""
  try:
    return stat.S_ISREG(os.lstat(path).st_mode)
  except OSError:
    return False


def orbax_steps(directory: str) -> dict[int, str]:
  """orbax's finalized steps in ``directory``: step -> its directory's path (see the module
  docstring for what is never listed). Empty for an object store or a missing directory."""
  local = lay.local_path(directory)
  if local is None:
    return {}
  try:
    entries = list(os.scandir(local))
  except (FileNotFoundError, NotADirectoryError):
    return {}
  found: dict[int, list[str]] = {}
  for e in entries:
    m = _NAME.fullmatch(e.name)
    if (m and e.is_dir(follow_symlinks=False)
        and _is_file(os.path.join(e.path, FINALIZED))):
      found.setdefault(int(m.group(1)), []).append(e.name)
  out = {}
  for step, names in found.items():
    if len(names) == 1:
      out[step] = os.path.join(local, names[0])
    else:
      warn_once(local, step, "orbax step %d in %s is claimed by directories %s: it is not "
                 "listed (which one is meant is unknown); remove or rename the others",
                 step, local, sorted(names))
  return out


def orbax_step_dir(directory: str, step: int) -> str | None:
  """The directory of orbax's finalized ``step`` in ``directory``, or None."""
  return orbax_steps(directory).get(step)


def orbax_found(directory: str | None) -> str | None:
  """The line to log at INFO when a manager opens ``directory`` and orbax wrote steps there
  (None when it did not): what was found, and what happens to it."""
  steps = sorted(orbax_steps(directory)) if directory is not None else []
  if not steps:
    return None
  shown = steps if len(steps) <= 20 else [*steps[:10], "...", *steps[-5:]]
  return (f"found {len(steps)} steps written by orbax in {directory}: "
          f"{', '.join(map(str, shown))}; they are listed, restored and kept or deleted as the "
          "manager's own, read where they lie (new steps are saved in jaxckpt's format beside "
          "them)")


def check_not_orbax(directory: str, step: int, *,
                    error: Callable[[str], Exception] = errors.StepAlreadyExistsError) -> None:
  """Raises ``error(message)`` if orbax holds ``step`` in ``directory``: a step is saved
  once, so jaxckpt never writes a step orbax wrote (a restore could not tell which is
  meant). The manager passes orbax's StepAlreadyExistsError (``orbax._verbs.already_exists``)."""
  where = orbax_step_dir(directory, step)
  if where is not None:
    raise error(
        f"save(step={step}): step {step} is already in {directory!r}, written by orbax "
        f"({where}); a step is saved once, so nothing was saved. Delete it first "
        f"(mgr.delete({step})), or save another step")


def discard_orbax_step(directory: str, step: int, *, todelete_subdir: str | None = None) -> bool:
  """Deletes orbax's ``step`` in ``directory``: exactly its step directory (a link inside is
  removed, never followed; a step directory that is a link is never listed, so never
  deleted). With ``todelete_subdir`` it is moved into ``directory/todelete_subdir/``
  instead, as orbax does. Returns whether there was one."""
  where = orbax_step_dir(directory, step)
  if where is None:
    return False
  local = os.path.dirname(where)
  if todelete_subdir:
    into = os.path.join(local, todelete_subdir)
    os.makedirs(into, exist_ok=True)
    os.replace(where, os.path.join(into, os.path.basename(where)))
  else:
    doomed = f"{where}.jaxckpt-deleting"     # not listed from here on, even if rmtree stops
    if os.path.isdir(doomed) and not os.path.islink(doomed):
      shutil.rmtree(doomed)                  # what an earlier delete of the step left
    os.replace(where, doomed)
    shutil.rmtree(doomed)                    # never follows a link (it removes the link)
  log.info("deleted orbax's step %d (%s)", step, where)
  return True
