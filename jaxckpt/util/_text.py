"""Words for log lines and messages."""

from __future__ import annotations


def counted(n: int, one: str, many: str | None = None) -> str:
  """``n`` things, the word agreeing with the count.

  >>> counted(1, "process", "processes"), counted(4, "leaf", "leaves"), counted(0, "step")
  ('1 process', '4 leaves', '0 steps')
  """
  return f"{n} {one if n == 1 else many or one + 's'}"
