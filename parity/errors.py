"""The errors every layer of parity raises for bad input; the CLI turns them into `parity X: error: ...`, exit 2.

  ParityInputError (a ValueError)  the base: what the user gave cannot be used (a key, a file, a value)
    SpecError                      a spec field or a run option is out of range or inconsistent
      InputError                   parity.inputs: a file or number cannot be read (too big, not UTF-8, inf)
      RunFolderError, HFFormatError, ConvertError, CpuFallbackError ...   (their modules)
    DataError                      parity.data: the corpus cannot be read or is too small
    PortError                      parity.migrate: a DeepSpeed config cannot be read, resolved or ported

The rule (parity.cli.main): a ParityInputError, or an OS error on a path the user gave, is bad input (exit 2, the
message names the key/file/value and the fix); any other exception, a plain ValueError included, is a bug: one
line naming it as an internal error and the file its traceback was saved to, exit 1. They subclass ValueError so
that callers catching ValueError keep working.

It lives below every other module (parity.inputs reads files with it, parity.spec validates with it), so that
the readers do not import the spec and the spec does not import the readers lazily.
"""
from __future__ import annotations

__all__ = ["ParityInputError", "SpecError"]


class ParityInputError(ValueError):
  """Bad input: a key, file or value the user gave cannot be used (the message names it and the fix); exit 2."""


class SpecError(ParityInputError):
  """A spec field or a user's input has a value that is out of range or inconsistent (the message names it)."""
