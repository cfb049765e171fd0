"""Text that other parties wrote, made safe to print on a terminal.

A model folder's manifest (a file name, a family), a device's strings (its model name, a command's
output) and the errors that quote them come from someone other than the user. An escape sequence in
them must not reach the terminal: it can retitle the window, clear the screen, or colour what follows.
"""

from __future__ import annotations

import unicodedata

# what is escaped: control and format characters (ESC, a bidirectional override), surrogates, private-use
# and unassigned ones, line and paragraph separators. Spaces are not: a no-break, thin or ideographic space in
# a path prints as the user typed it (str.isprintable refuses those)
ESCAPED = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"))


def printable(line: str) -> str:
    """`line` with every character that does not print as itself (`ESCAPED`) escaped as Python writes
    it (ESC as \\x1b, a line break as \\n): one line, as it was written, whatever a field in it held."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in ESCAPED else c for c in line)
