"""Examples (token ids and which of them carry the loss) read from a file of records.

Record formats, tried in this order (the first key present decides; the card counts each):
  input_ids       pre-tokenized: `input_ids` (list of ids); the loss from `labels` (same length, -100 = no loss,
                  otherwise equal to input_ids: the model shifts, as in Hugging Face) or `loss_mask` (same length,
                  1 = token carries the loss, 0 = not); neither: every token. `attention_mask`, if given, must be
                  all 1 (parity pads itself).
  messages        chat: [{"role": "system"|"user"|"assistant"|..., "content": str}], rendered by the tokenizer's chat
                  template; the loss on assistant tokens only (parity.dataset.tokenizer: generation tags, or
                  prefix-diff).
  conversations   ShareGPT as LLaMA-Factory reads it: [{"from": "human"|"gpt"|"system"|"user"|"assistant",
                  "value": str}], plus an optional top-level `system`; mapped to messages.
  instruction     Alpaca: `instruction`, optional `input`, `output`, optional `system` and `history` ([[user,
                  assistant], ...]) as LLaMA-Factory reads it. With a chat template: messages (user = instruction,
                  then "\n" and input when there is one; assistant = output). Without: the Stanford Alpaca prompt
                  (ALPACA_PROMPT / ALPACA_PROMPT_INPUT) and output as completion.
  prompt          `prompt` and `completion` strings: prompt tokens (post-processor's BOS included) then completion
                  tokens, each tokenized on its own, then EOS; the loss on completion + EOS only.
  text            `text`: all tokens (BOS from the post-processor, then EOS) carry the loss.
Text formats need a tokenizer (parity.dataset.tokenizer.load_tokenizer). `prompt_loss=True` puts the loss on the
prompt tokens too (and on every chat token). EOS is appended to prompt/completion, Alpaca-without-template and text
examples when the tokenizer names an eos_token (tokenizer_config.json) and the ids do not already end with it.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np

from parity.data import DataError
from parity.dataset.chat_template import TemplateSyntax
from parity.dataset.records import Record, file_sha256, read_records
from parity.dataset.tokenizer import HFTokenizer
from parity.spec import MAX_VOCAB

__all__ = ["Example", "ExampleSet", "read_examples", "examples_from_records", "FORMATS", "ALPACA_PROMPT",
           "ALPACA_PROMPT_INPUT", "IGNORE_INDEX", "SHAREGPT_ROLES"]

IGNORE_INDEX = -100
"""The label of a token without loss (Hugging Face / PyTorch cross_entropy's ignore_index)."""
FORMATS = ("input_ids", "messages", "conversations", "instruction", "prompt", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
"""ShareGPT `from` values parity maps to chat roles (LLaMA-Factory's defaults; tool roles are refused)."""
ALPACA_PROMPT_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n"
                       "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                 "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
"""Stanford Alpaca's train.py PROMPT_DICT, used for Alpaca records when the tokenizer has no chat template."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One training example.

  Attributes:
    ids: token ids, uint32, shape (L,), L >= 2.
    loss: bool, shape (L,): loss[i] is True when token i is a target that carries the loss (predicted from tokens
      0..i-1). loss[0] is always False (nothing precedes it).
    record: 1-based record number in the source (parity.dataset.records.Record.number).
  """
  ids: np.ndarray
  loss: np.ndarray
  record: int

  @property
  def loss_tokens(self) -> int:
    return int(self.loss.sum())


@dataclasses.dataclass(frozen=True)
class ExampleSet:
  """The examples of one source.

  Attributes:
    examples: in file order.
    source: the path read (or a description for a built-in set).
    sha256: hex sha256 of the source file's bytes (built-in: of its examples' ids and loss flags).
    formats: record format (FORMATS) -> number of records of it.
    vocab_size: the vocabulary the ids were checked against (every id < vocab_size).
    tokenizer: folder of the tokenizer used, or None (pre-tokenized, or a built-in byte-level set).
    tokenizer_sha256: hex sha256 of its tokenizer.json, or None.
    chat_masking: 'generation' / 'prefix-diff' when chat records were read (parity.dataset.tokenizer), else None.
    chat_template: the file whose chat template rendered chat / Alpaca records (chat_template.jinja or
      tokenizer_config.json), or None: no record went through a template (Alpaca records then use ALPACA_PROMPT).
    tokenizer_notes: the tokenizer's notes (parity.dataset.tokenizer.HFTokenizer.notes), () without one.
  """
  examples: tuple[Example, ...]
  source: str
  sha256: str
  formats: dict
  vocab_size: int
  tokenizer: str | None = None
  tokenizer_sha256: str | None = None
  chat_masking: str | None = None
  chat_template: str | None = None
  tokenizer_notes: tuple[str, ...] = ()


def _ids(rec: Record, key: str, value, flags: bool = False) -> np.ndarray:
  """`value` as int64 (n,): a list of integers (`flags`: JSON true/false too, for masks)."""
  ok = lambda v: isinstance(v, int) and (flags or not isinstance(v, bool))
  if not isinstance(value, (list, tuple)) or not all(ok(v) for v in value):
    bad = next((v for v in value if not ok(v)), None) if isinstance(value, (list, tuple)) else None
    raise DataError(f"{rec.where}: `{key}` must be a list of integers; got {type(value).__name__}"
                    + ("" if bad is None else f" holding {type(bad).__name__} {bad!r}"))
  try:
    return np.asarray(value, dtype=np.int64)
  except OverflowError:
    raise DataError(f"{rec.where}: `{key}` holds an integer beyond int64; token ids are below "
                    f"{MAX_VOCAB}") from None


def _pretokenized(rec: Record) -> tuple[np.ndarray, np.ndarray]:
  d = rec.data
  ids = _ids(rec, "input_ids", d["input_ids"])
  if "attention_mask" in d and not np.all(_ids(rec, "attention_mask", d["attention_mask"], flags=True) == 1):
    raise DataError(f"{rec.where}: `attention_mask` has zeros (the record is padded); give unpadded input_ids "
                    "(drop the padding and the attention_mask): parity pads and masks itself")
  if "labels" in d and "loss_mask" in d:
    raise DataError(f"{rec.where}: both `labels` and `loss_mask`; give one of them")
  loss = np.ones(ids.shape, dtype=bool)
  for key in ("labels", "loss_mask"):
    if key in d:
      arr = _ids(rec, key, d[key], flags=key == "loss_mask")
      if arr.shape != ids.shape:
        raise DataError(f"{rec.where}: `{key}` has {arr.size} entries but `input_ids` has {ids.size}; they must "
                        "be the same length (unshifted: the model shifts, as in Hugging Face)")
      if key == "labels":
        loss = arr != IGNORE_INDEX
        bad = np.flatnonzero(loss & (arr != ids))
        if bad.size:
          i = int(bad[0])
          raise DataError(f"{rec.where}: labels[{i}] = {int(arr[i])} differs from input_ids[{i}] = {int(ids[i])}; "
                          f"labels must be input_ids (unshifted) with {IGNORE_INDEX} where there is no loss; if "
                          "they are already shifted by one, unshift them (parity shifts)")
      else:
        bad = np.flatnonzero((arr != 0) & (arr != 1))
        if bad.size:
          raise DataError(f"{rec.where}: loss_mask[{int(bad[0])}] = {int(arr[bad[0]])}; a loss_mask holds 0 or 1")
        loss = arr == 1
  return ids, loss


def _with_eos(ids: np.ndarray, loss: np.ndarray, tok: HFTokenizer, eos_loss: bool) -> tuple[np.ndarray, np.ndarray]:
  if tok.eos_id is None or (ids.size and ids[-1] == tok.eos_id):
    return ids, loss
  return np.append(ids, tok.eos_id), np.append(loss, eos_loss)


def _str(rec: Record, key: str) -> str:
  v = rec.data.get(key)
  if not isinstance(v, str):
    raise DataError(f"{rec.where}: `{key}` must be a string; got {type(v).__name__}"
                    + ("" if key in rec.data else " (the key is missing)"))
  return v


def _prompt_completion(tok: HFTokenizer, prompt: str, completion: str,
                       prompt_loss: bool) -> tuple[np.ndarray, np.ndarray]:
  p, _ = tok.encode(prompt, special=True)
  c, _ = tok.encode(completion)
  ids = np.concatenate([p, c])
  loss = np.concatenate([np.full(p.shape, prompt_loss), np.ones(c.shape, dtype=bool)])
  return _with_eos(ids, loss, tok, True)


def _messages(rec: Record, key: str, roles: dict | None) -> list[dict]:
  """A record's chat as [{"role", "content"}]: `messages` as given, or ShareGPT `conversations` mapped."""
  turns = rec.data[key]
  if not isinstance(turns, list) or not turns:
    raise DataError(f"{rec.where}: `{key}` must be a non-empty list of turns")
  role_key, text_key = ("role", "content") if roles is None else ("from", "value")
  out = []
  if roles is not None and isinstance(rec.data.get("system"), str) and rec.data["system"]:
    out.append({"role": "system", "content": rec.data["system"]})
  for i, t in enumerate(turns):
    if not isinstance(t, dict) or not isinstance(t.get(role_key), str) or not isinstance(t.get(text_key), str):
      raise DataError(f"{rec.where}: {key}[{i}] must be an object with string `{role_key}` and `{text_key}`")
    role = t[role_key] if roles is None else roles.get(t[role_key])
    if role is None:
      raise DataError(f"{rec.where}: {key}[{i}] has from={t[role_key]!r}; parity reads "
                      f"{', '.join(sorted(roles))} (tool turns are not supported: drop them or pre-tokenize)")
    out.append({"role": role, "content": t[text_key]})
  if not any(m["role"] == "assistant" for m in out) and roles is not None:
    raise DataError(f"{rec.where}: `{key}` has no gpt/assistant turn, so no token would carry the loss")
  return out


def _alpaca_messages(rec: Record) -> list[dict]:
  d = rec.data
  user = _str(rec, "instruction") + (("\n" + d["input"]) if isinstance(d.get("input"), str) and d["input"] else "")
  out = [{"role": "system", "content": d["system"]}] if isinstance(d.get("system"), str) and d["system"] else []
  for j, pair in enumerate(d.get("history") or []):
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
      raise DataError(f"{rec.where}: history[{j}] must be a [user, assistant] pair of strings")
    out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
  return out + [{"role": "user", "content": user}, {"role": "assistant", "content": _str(rec, "output")}]


def _chat(rec: Record, tok: HFTokenizer, messages: list[dict], prompt_loss: bool) -> tuple[np.ndarray, np.ndarray, str]:
  try:
    ids, assistant, method = tok.chat(messages)
  except TemplateSyntax:  # the template's fault, whatever the record: its file and line name it
    raise
  except DataError as exc:
    raise DataError(f"{rec.where}: {exc}") from None
  return ids, (np.ones_like(assistant) if prompt_loss else assistant), method


def _tokenized(rec: Record, fmt: str, tok: HFTokenizer, prompt_loss: bool) -> tuple[np.ndarray, np.ndarray, str | None]:
  """(ids, loss, chat masking method or None) of a text record."""
  d = rec.data
  if fmt in ("messages", "conversations"):
    return _chat(rec, tok, _messages(rec, fmt, None if fmt == "messages" else SHAREGPT_ROLES), prompt_loss)
  if fmt == "instruction":
    if tok.chat_template is not None:
      return _chat(rec, tok, _alpaca_messages(rec), prompt_loss)
    inp = d.get("input")
    prompt = (ALPACA_PROMPT_INPUT if isinstance(inp, str) and inp else ALPACA_PROMPT).format(
        instruction=_str(rec, "instruction"), input=inp)
    return (*_prompt_completion(tok, prompt, _str(rec, "output"), prompt_loss), None)
  if fmt == "prompt":
    return (*_prompt_completion(tok, _str(rec, "prompt"), _str(rec, "completion"), prompt_loss), None)
  ids, _ = tok.encode(_str(rec, "text"), special=True)
  return (*_with_eos(ids, np.ones(ids.shape, dtype=bool), tok, True), None)


def _format(rec: Record) -> str:
  fmt = next((f for f in FORMATS if f in rec.data), None)
  if fmt is None:
    raise DataError(f"{rec.where}: no example key (keys: {', '.join(sorted(rec.data)) or 'none'}); an example has "
                    f"one of {', '.join(FORMATS)} (see docs/data-examples.md)")
  return fmt


class _OutOfVocab(DataError):
  """An id >= the vocabulary in one record; `examples_from_records` reads on to name the file's largest id."""

  def __init__(self, where: str, top: int):
    super().__init__(where)
    self.where, self.top = where, top


def _checked(rec: Record, ids: np.ndarray, loss: np.ndarray, vocab_size: int) -> Example:
  if ids.size < 2:
    raise DataError(f"{rec.where}: {ids.size} token(s); an example needs at least 2 (a target needs a token before "
                    "it): drop the record")
  bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
  if bad.size:
    i = int(bad[0])
    if ids[i] < 0:  # no vocabulary holds it: a label or padding value in input_ids
      raise DataError(f"{rec.where}: token id {int(ids[i])} at position {i} is negative (padding, or an ignore label "
                      "like -100 put in input_ids?); input_ids hold token ids >= 0: mark no-loss positions in "
                      "`labels` (-100) or `loss_mask`, and leave padding out (parity pads the rows itself)")
    raise _OutOfVocab(f"{rec.where}: token id {int(ids[i])} at position {i} is outside the vocabulary "
                      f"[0, {vocab_size})", int(ids.max()))
  loss = loss.copy()
  loss[0] = False
  return Example(ids=ids.astype(np.uint32), loss=loss, record=rec.number)


def examples_from_records(records, *, vocab_size: int, tokenizer: HFTokenizer | None = None,
                          prompt_loss: bool = False) -> tuple[list[Example], Counter, set]:
  """(examples, format counts, chat masking methods used) of `records` (formats: this module's docstring).

  Raises:
    DataError: naming the record's place, the key and the fix: a record with no example key, a malformed value, a
      text record without a tokenizer, fewer than 2 tokens, or an id outside [0, vocab_size).
  """
  examples, formats, methods = [], Counter(), set()
  first: _OutOfVocab | None = None
  for rec in records:
    if first is not None:  # after an id past the vocabulary: only the largest id of the file is still wanted
      ids = _pretokenized(rec)[0] if _format(rec) == "input_ids" else np.zeros(0, np.int64)
      first.top = max(first.top, int(ids.max(initial=0)))
      continue
    fmt = _format(rec)
    if fmt == "input_ids":
      (ids, loss), method = _pretokenized(rec), None
    elif tokenizer is None:
      raise DataError(f"{rec.where}: a `{fmt}` record needs a tokenizer to become token ids; pass the folder of a "
                      "Hugging Face tokenizer (tokenizer.json: parity compare --tokenizer DIR, or an --hf-model "
                      "checkpoint holding one), or give pre-tokenized input_ids")
    else:
      ids, loss, method = _tokenized(rec, fmt, tokenizer, prompt_loss)
    try:
      examples.append(_checked(rec, ids, loss, vocab_size))
    except _OutOfVocab as exc:
      first = exc
      continue
    formats[fmt] += 1
    if method:
      methods.add(method)
  if first is not None:
    raise DataError(f"{first.where}; the file's largest id is {first.top}: set model.vocab_size > {first.top} (at most "
                    f"{MAX_VOCAB}), or fix the ids (another tokenizer's?)")
  return examples, formats, methods


def read_examples(path: str | Path, *, vocab_size: int | None = None, tokenizer: HFTokenizer | None = None,
                  prompt_loss: bool = False) -> ExampleSet:
  """Reads an example file (JSONL, JSON array, Parquet: parity.dataset.records) into examples.

  Args:
    path: the file.
    vocab_size: the model's vocabulary: every id must be below it. None: the tokenizer's vocab_size, or, for
      pre-tokenized data without a tokenizer, MAX_VOCAB (check against model.vocab_size later).
    tokenizer: for text records (parity.dataset.tokenizer.load_tokenizer).
    prompt_loss: put the loss on prompt / non-assistant tokens too.
  Raises:
    DataError: the file cannot be read as examples (parity.dataset.records.read_records), a record is refused
      (examples_from_records), or the file holds no example.
  """
  vocab = vocab_size if vocab_size is not None else (tokenizer.vocab_size if tokenizer is not None else MAX_VOCAB)
  if tokenizer is not None and vocab < tokenizer.vocab_size:
    raise DataError(f"{tokenizer.folder}: the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                    f"{vocab}; set model.vocab_size >= {tokenizer.vocab_size}")
  examples, formats, methods = examples_from_records(read_records(path), vocab_size=vocab, tokenizer=tokenizer,
                                                     prompt_loss=prompt_loss)
  if not examples:
    raise DataError(f"{path}: holds no example record")
  return ExampleSet(examples=tuple(examples), source=str(path), sha256=file_sha256(Path(path).expanduser()),
                    formats=dict(formats), vocab_size=vocab,
                    tokenizer=None if tokenizer is None else str(tokenizer.folder),
                    tokenizer_sha256=None if tokenizer is None else tokenizer.sha256,
                    chat_masking="/".join(sorted(methods)) or None,
                    chat_template=str(tokenizer.chat_template_source) if methods and tokenizer is not None else None,
                    tokenizer_notes=() if tokenizer is None else tokenizer.notes)
