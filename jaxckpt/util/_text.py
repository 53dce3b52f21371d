"""Text from a checkpoint, a peer or a neighbour as a terminal may show it.

Names in a checkpoint (leaf paths, item names, Grain keys, directory names) and
in a peer's replies are data: written raw to a terminal, an escape sequence in
one could clear the screen, set the window title or write the clipboard (OSC
52), and a newline could forge a line of output. :func:`shown` escapes every
character that is not printable, as ``repr`` does inside its quotes; every
jaxckpt error message and every line a jaxckpt command prints goes through it.
It imports nothing of jaxckpt (``errors`` uses it).

>>> shown("params\\x1b]52;c;aGk=\\x07")
'params\\\\x1b]52;c;aGk=\\\\x07'
>>> shown("naïve – ok")
'naïve – ok'
"""

from __future__ import annotations


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(c: str) -> str:
  if c in _NAMED:
    return _NAMED[c]
  o = ord(c)
  return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def shown(text: str) -> str:
  """``text`` with every non-printable character (controls, escape, newline, tab,
  bidirectional overrides, other format characters) written as its escape."""
  if text.isprintable():
    return text
  return "".join(c if c.isprintable() else _escaped(c) for c in text)
