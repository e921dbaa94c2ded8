"""A local Hugging Face tokenizer, loaded offline: `tokenizer.json` (the `tokenizers` package), the special tokens of
`tokenizer_config.json` and the chat template (rendered with jinja2, as transformers renders it), read where
transformers reads it: `chat_template.jinja` (what transformers 5.x `save_pretrained` writes) and the templates of
`additional_chat_templates/` take priority over a `chat_template` key of tokenizer_config.json (older versions).

Assistant tokens of a chat get the loss by one of two methods, both giving character spans of the rendered text that
are then mapped to tokens through the tokenizer's offsets (a token is an assistant token when its characters overlap
a span):
  generation  the template marks assistant text with `{% generation %}...{% endgeneration %}` (the transformers
              convention behind `return_assistant_tokens_mask`): the spans are exactly the marked text.
  prefix-diff no such tag: for each assistant message i, the span runs from the end of the rendering of messages[:i]
              with add_generation_prompt=True to the end of the rendering of messages[:i+1]; so it covers the
              assistant's text and whatever the template closes its turn with (e.g. `<|im_end|>`), which the model
              must learn to emit. It needs each rendering to be a prefix of the next (a template that rewrites earlier
              turns, e.g. one that drops past reasoning, is refused: use one with generation tags or pre-tokenize).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from parity.data import DataError
from parity.dataset.chat_template import GEN_CLOSE, GEN_OPEN, compile_template, render
from parity.inputs import read_text

__all__ = ["HFTokenizer", "load_tokenizer", "TOKENIZER_FILE", "CONFIG_FILE", "TEMPLATE_FILE", "TEMPLATE_DIR",
           "GEN_OPEN", "GEN_CLOSE"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
"""The default chat template as its own file (transformers' CHAT_TEMPLATE_FILE)."""
TEMPLATE_DIR = "additional_chat_templates"
"""Named templates, one NAME.jinja each (transformers' CHAT_TEMPLATE_DIR)."""
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
ADDED_ORDER = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The order transformers (5.x, SPECIAL_TOKENS_ATTRIBUTES) adds special tokens the vocabulary lacks, each a new id."""


def _token_str(value) -> str | None:
  """A special token of tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


@dataclasses.dataclass
class HFTokenizer:
  """A tokenizer.json with its tokenizer_config.json (module docstring).

  Attributes:
    folder: the folder both files are in.
    sha256: hex sha256 of tokenizer.json's bytes (the data card's tokenizer hash).
    vocab_size: ids the tokenizer can produce (added tokens included).
    chat_template: the template text, or None.
    chat_template_source: the file it was read from (chat_template.jinja, additional_chat_templates/default.jinja
      or tokenizer_config.json), or None.
    special: bos_token / eos_token / pad_token / unk_token as strings, where the config names them.
    eos_id: id of eos_token, or None.
    notes: what loading did beyond reading the files (special tokens the vocabulary lacked, added as transformers
      adds them), each naming the file and the token.
  """
  folder: Path
  sha256: str
  vocab_size: int
  chat_template: str | None
  special: dict
  eos_id: int | None
  chat_template_source: Path | None = None
  notes: tuple[str, ...] = ()
  _tok: object = dataclasses.field(repr=False, default=None)
  _template: object = dataclasses.field(repr=False, default=None)

  def encode(self, text: str, *, special: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids, offsets) of `text`: ids int64 shape (n,); offsets int64 shape (n, 2), character [start, end) of each
    token in `text` ((0, 0) for a token the post-processor added). `special`: apply the post-processor (BOS...)."""
    enc = self._tok.encode(text, add_special_tokens=special)
    return (np.asarray(enc.ids, dtype=np.int64).reshape(-1),
            np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2))

  @property
  def has_generation_tags(self) -> bool:
    """Whether the template marks assistant text with {% generation %} (else prefix-diff is used)."""
    return self.chat_template is not None and GENERATION_TAG.search(self.chat_template) is not None

  def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    """The chat template rendered on `messages` (generation markers left in), in parity.dataset.chat_template's
    sandbox. Raises DataError: no template, it is not valid jinja2 (its line named), it passes a limit of that
    sandbox (steps, size, time: the limit named), or it raises (its message given)."""
    if self.chat_template is None:
      raise DataError(f"{self.folder / CONFIG_FILE}: no chat_template, and no {TEMPLATE_FILE} (nor a default "
                      f"{TEMPLATE_DIR}/default.jinja) beside it, which chat data (messages / conversations) needs; use "
                      "a tokenizer folder that has one, or give prompt/completion")
    source = self.chat_template_source or self.folder
    if self._template is None:
      self._template = compile_template(self.chat_template, source)
    return render(self._template, source, messages=messages, add_generation_prompt=add_generation_prompt,
                  **self.special)

  def chat(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray, str]:
    """(ids int64 (n,), assistant bool (n,), method) of a rendered chat; method 'generation' or 'prefix-diff'
    (module docstring). Raises DataError: a message holds a marker character, or prefix-diff finds a rendering
    that is not a prefix of the next."""
    for m in messages:
      if GEN_OPEN in str(m.get("content", "")) or GEN_CLOSE in str(m.get("content", "")):
        raise DataError("a message holds U+E000 or U+E001, which parity reserves to mark assistant text")
    if self.has_generation_tags:
      (text, spans), method = _strip_markers(self.render(messages)), "generation"
    else:
      (text, spans), method = self._prefix_spans(messages), "prefix-diff"
    ids, offsets = self.encode(text)
    mask = np.zeros(ids.shape, dtype=bool)
    for a, b in spans:
      mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a) & (offsets[:, 1] > offsets[:, 0])
    return ids, mask, method

  def _prefix_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    full = self.render(messages)
    spans = []
    for i, m in enumerate(messages):
      if m.get("role") != "assistant":
        continue
      before = self.render(messages[:i], add_generation_prompt=True)
      upto = self.render(messages[:i + 1])
      if not (upto.startswith(before) and full.startswith(upto)):
        raise DataError(f"{self.chat_template_source or self.folder}: the chat template's rendering of the first "
                        f"{i} messages (with the generation prompt) is not a prefix of its rendering of the first "
                        f"{i + 1}, so the assistant's tokens cannot be found by prefix difference; use a template with "
                        "{% generation %} tags, or pre-tokenize the data (input_ids + labels)")
      spans.append((len(before), len(upto)))
    return full, spans


def _strip_markers(text: str) -> tuple[str, list[tuple[int, int]]]:
  """(text without GEN_OPEN/GEN_CLOSE, the [start, end) character spans they enclosed in that text)."""
  out, spans, start, n = [], [], None, 0
  for ch in text:
    if ch == GEN_OPEN:
      start = n
    elif ch == GEN_CLOSE:
      if start is not None:
        spans.append((start, n))
      start = None
    else:
      out.append(ch)
      n += 1
  return "".join(out), spans


def load_tokenizer(folder: str | Path) -> HFTokenizer:
  """Loads `folder/tokenizer.json` offline with the `tokenizers` package, and `folder/tokenizer_config.json` (chat
  template, special tokens) when it exists.

  Raises:
    DataError: the folder or tokenizer.json is missing, `tokenizers` is not installed, or either file cannot be
      parsed (the message names the file).
  """
  folder = Path(folder).expanduser()
  path = folder / TOKENIZER_FILE if folder.is_dir() else folder
  if path.name != TOKENIZER_FILE or not path.is_file():
    what = ("does not exist" if not folder.exists() else
            f"is a folder without {TOKENIZER_FILE}" if folder.is_dir() else
            f"is a file, not a tokenizer folder (nor its {TOKENIZER_FILE})")
    raise DataError(f"tokenizer {str(folder)!r} {what}; give the folder of a Hugging Face tokenizer (the one "
                    f"holding {TOKENIZER_FILE}, e.g. the --hf-model checkpoint's)")
  try:  # optional: only text data needs it
    from tokenizers import Tokenizer
  except ImportError:
    raise DataError(f"{path}: text examples need the `tokenizers` package to tokenize: pip install tokenizers "
                    "(or give pre-tokenized input_ids)") from None
  text = read_text(path, what="tokenizer file", error=DataError, max_bytes=None)
  blob = text.encode("utf-8")  # the file's bytes (a BOM aside): what its hash is of
  try:
    tok = Tokenizer.from_str(text)
  except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
    raise DataError(f"{path}: not a tokenizer.json the tokenizers package can load ({exc})") from None
  config = {}
  cfg_path = path.parent / CONFIG_FILE
  if cfg_path.is_file():
    try:
      config = json.loads(read_text(cfg_path, what="tokenizer config", error=DataError, max_bytes=None))
    except json.JSONDecodeError as exc:
      raise DataError(f"{cfg_path}: not JSON ({exc}); fix or remove it") from None
  special = {k: s for k in SPECIAL_KEYS if (s := _token_str(config.get(k))) is not None}
  template, source = _chat_template(path.parent, config)
  notes = _add_missing_specials(tok, special, cfg_path)
  eos = special.get("eos_token")
  return HFTokenizer(folder=path.parent, sha256=hashlib.sha256(blob).hexdigest(),
                     vocab_size=tok.get_vocab_size(with_added_tokens=True),
                     chat_template=template, chat_template_source=source, special=special,
                     eos_id=None if eos is None else tok.token_to_id(eos), notes=tuple(notes), _tok=tok)


def _add_missing_specials(tok, special: dict, cfg_path: Path) -> list[str]:
  """Adds each special token tokenizer_config.json names but tokenizer.json's vocabulary lacks as a new special id,
  in transformers' order (ADDED_ORDER), as transformers' from_pretrained does (so the ids, the EOS appended and the
  vocabulary size agree with it); one note per token added. Before, a missing eos_token meant no EOS, silently."""
  from tokenizers import AddedToken
  notes = []
  for key in ADDED_ORDER:
    s = special.get(key)
    if s is None or tok.token_to_id(s) is not None:
      continue
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)])
    notes.append(f"{cfg_path}: {key} {s!r} is not in {TOKENIZER_FILE}'s vocabulary; added as id "
                 f"{tok.token_to_id(s)} as transformers adds it (the model's vocabulary must hold that id)")
  return notes


def _chat_template(folder: Path, config: dict) -> tuple[str | None, Path | None]:
  """(template, the file it came from) as transformers' `from_pretrained` picks it (tokenization_utils_base,
  transformers 5.x): template files (chat_template.jinja as 'default', additional_chat_templates/NAME.jinja) take
  priority over tokenizer_config.json's `chat_template`; of several named templates the one named 'default' (none:
  no template, as transformers' apply_chat_template refuses to choose). (None, None) when there is none."""
  files = {}
  if (folder / TEMPLATE_FILE).is_file() or (folder / TEMPLATE_FILE).is_symlink():  # a broken link: read_text names it
    files["default"] = folder / TEMPLATE_FILE
  if (folder / TEMPLATE_DIR).is_dir():
    for f in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
      files.setdefault(f.name.removesuffix(".jinja"), f)
  if files:
    chosen = files.get("default")
    if chosen is None:
      return None, None
    return read_text(chosen, what="chat template", error=DataError, max_bytes=None), chosen
  template = config.get("chat_template")
  if isinstance(template, list):  # several named templates: transformers takes the one named 'default'
    template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
  return (template, folder / CONFIG_FILE) if isinstance(template, str) else (None, None)
