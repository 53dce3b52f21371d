"""orbax's errors that jaxckpt raises, so that orbax code's ``except`` catches them too."""

from __future__ import annotations

import functools

from jaxckpt import errors


@functools.lru_cache(maxsize=None)
def _already_exists_cls() -> type:
  from orbax.checkpoint import checkpoint_manager as ocm  # pylint: disable=import-outside-toplevel  (orbax's own error, so orbax code catches it)

  class StepAlreadyExistsError(errors.StepAlreadyExistsError, ocm.StepAlreadyExistsError):
    """jaxckpt's StepAlreadyExistsError that orbax's ``except`` catches too."""
  return StepAlreadyExistsError


def already_exists(message: str) -> Exception:
  """orbax's StepAlreadyExistsError (a ValueError), also jaxckpt's."""
  return _already_exists_cls()(message)
