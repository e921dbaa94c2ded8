"""A built-in SFT set that needs no download: docstring -> function body pairs cut from this Python's stdlib.

Each example is one function of the standard library with a docstring (methods and nested functions included),
read with `ast` from DEMO_MODULES in that order, functions in source order:
  prompt      the source lines from the `def` (decorators excluded) through the end of the docstring;
  completion  the remaining lines of the function (its body), then EOS.
Token ids are byte-level: the UTF-8 bytes 0-255 of the text, then two special ids, PAD_ID = 256 (padding slots)
and EOS_ID = 257 (end of the completion; it carries the loss), so the vocabulary is DEMO_VOCAB = 258. The loss falls
on the completion bytes and EOS only. The set depends only on this interpreter's stdlib sources (its sha256 names
them), so it is the same on every run of one Python.
"""
from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np

from parity.data import DataError
from parity.dataset.examples import Example, ExampleSet

__all__ = ["sft_demo", "PAD_ID", "EOS_ID", "DEMO_VOCAB", "DEMO_MODULES", "demo_pairs", "short_prompt_jsonl"]

PAD_ID = 256
EOS_ID = 257
DEMO_VOCAB = 258
DEMO_MODULES = ("operator.py", "numbers.py", "datetime.py", "collections/__init__.py", "fractions.py", "calendar.py",
                "statistics.py", "functools.py", "pathlib.py", "ipaddress.py", "logging/__init__.py", "enum.py",
                "_pydecimal.py", "tarfile.py", "inspect.py")
"""Stdlib files read, in order (relative to the stdlib folder; a file this Python lacks is skipped)."""


def _functions(path: Path):
  """(prompt, completion) of each function with a docstring and a body after it, in source order."""
  try:
    text = path.read_text(encoding="utf-8")
  except OSError:
    return
  lines = text.splitlines(keepends=True)
  for node in ast.walk(ast.parse(text)):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
      continue
    if len(node.body) < 2:  # a docstring alone: nothing to complete
      continue
    doc_end = node.body[0].end_lineno
    prompt = "".join(lines[node.lineno - 1:doc_end])
    completion = "".join(lines[doc_end:node.end_lineno])
    if completion.strip():
      yield node.lineno, prompt, completion


def demo_pairs(max_examples: int, max_tokens: int) -> list[tuple[str, str, str]]:
  """(where 'file:line', prompt, completion) of up to `max_examples` functions whose prompt + completion + EOS fit
  in `max_tokens` byte-level tokens, in DEMO_MODULES order (ast.walk order within a file, sorted by line)."""
  root, out = Path(sysconfig.get_paths()["stdlib"]), []
  for rel in DEMO_MODULES:
    for line, prompt, completion in sorted(_functions(root / rel)):
      if len(prompt.encode()) + len(completion.encode()) + 1 <= max_tokens:
        out.append((f"{rel}:{line}", prompt, completion))
        if len(out) == max_examples:
          return out
  return out


def sft_demo(max_examples: int = 512, max_tokens: int = 512) -> ExampleSet:
  """The demo set (this module's docstring) as byte-level examples.

  Args:
    max_examples: examples wanted (fewer if the stdlib files hold fewer that fit).
    max_tokens: longest example, tokens (bytes + EOS); longer functions are skipped, so no truncation is needed at
      seq_len + 1 >= max_tokens.
  Returns:
    ExampleSet with vocab_size DEMO_VOCAB, format 'prompt', source 'sft-demo (stdlib of Python X.Y)'.
  Raises:
    DataError: fewer than 8 functions found (a stdlib without sources?), or max_tokens < 16.
  """
  if max_tokens < 16:
    raise DataError(f"sft demo: max_tokens={max_tokens} is too short for a function; use >= 16")
  pairs, examples, h = demo_pairs(max_examples, max_tokens), [], hashlib.sha256()
  for i, (_, prompt, completion) in enumerate(pairs):
    p = np.frombuffer(prompt.encode(), dtype=np.uint8)
    c = np.frombuffer(completion.encode(), dtype=np.uint8)
    ids = np.concatenate([p, c, [EOS_ID]]).astype(np.uint32)
    loss = np.concatenate([np.zeros(p.size, dtype=bool), np.ones(c.size + 1, dtype=bool)])
    examples.append(Example(ids=ids, loss=loss, record=i + 1))
    h.update(ids.tobytes())
    h.update(loss.tobytes())
  if len(examples) < 8:
    raise DataError(f"sft demo: only {len(examples)} documented functions found in this Python's stdlib "
                    f"({sysconfig.get_paths()['stdlib']}); it needs the .py sources (a python3-stdlib package?)")
  version = sysconfig.get_python_version()
  return ExampleSet(examples=tuple(examples), source=f"sft-demo (stdlib of Python {version})", sha256=h.hexdigest(),
                    formats={"prompt": len(examples)}, vocab_size=DEMO_VOCAB)


def short_prompt_jsonl(path: str | Path, n: int = 120, seed: int = 3, lengths: tuple[int, int] = (6, 40)) -> Path:
  """Writes `n` pre-tokenized records of `lengths` (low inclusive, high exclusive; default 6..39) random byte ids to
  `path` (JSONL: input_ids, labels), each with a prompt of 1..len/2 tokens without loss (-100 labels): rows of 48
  then hold prompts, completions and, packed, several examples, which every planted data bug acts on (the data of
  the plant tests, the equivalence tests and benchmarks/tpu.sh's plant table). Returns the path."""
  rng = np.random.default_rng(seed)
  lines = []
  for size in rng.integers(*lengths, n):
    ids = rng.integers(0, 256, int(size)).tolist()
    prompt = int(rng.integers(1, size // 2))
    lines.append(json.dumps({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}))
  path = Path(path)
  path.write_text("\n".join(lines) + "\n")
  return path
