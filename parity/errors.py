"""The error every layer of parity raises for bad input; the CLI turns it into `parity X: error: ...`, exit 2.

It lives below every other module (parity.inputs reads files with it, parity.spec validates with it), so that
the readers do not import the spec and the spec does not import the readers lazily.
"""
from __future__ import annotations

__all__ = ["SpecError"]


class SpecError(ValueError):
  """A spec field or a user's input has a value that is out of range or inconsistent (the message names it)."""
