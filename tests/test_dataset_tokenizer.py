"""The tokenizer path of parity.dataset: text, prompt/completion, chat messages, ShareGPT and
Alpaca records tokenized by a local Hugging Face tokenizer, with the loss on completion / assistant tokens only.
The tokenizer is a tiny byte-level BPE trained offline inside the test and saved as tokenizer.json, with a
tokenizer_config.json holding a ChatML chat template (with and without generation tags)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from parity.data import DataError
from parity.dataset.examples import ALPACA_PROMPT_INPUT, read_examples
from parity.dataset.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML_GEN = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
              "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML = CHATML_GEN.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
          "Summarise the text below in one line.", "Sure: foxes jump; dogs rest.", "hello world, hello tokens"] * 20
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "hello tokens"}]


def _save(folder, template):
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": "<pad>"}
  if template is not None:
    config["chat_template"] = template
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("tok")
  return {name: _save(root / name, t) for name, t in (("gen", CHATML_GEN), ("diff", CHATML), ("none", None))}


def _read(tmp_path, rows, folder, **kw):
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return read_examples(path, tokenizer=load_tokenizer(folder), **kw)


def _decode(tok, ids):
  return tok._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def test_text_gets_bos_eos_and_loss_on_every_target(tmp_path, folders):
  tok = load_tokenizer(folders["none"])
  s = _read(tmp_path, [{"text": "hello world"}], folders["none"])
  ex = s.examples[0]
  assert ex.ids[0] == tok._tok.token_to_id("<s>") and ex.ids[-1] == tok.eos_id
  assert _decode(tok, ex.ids[1:-1]) == "hello world" and ex.loss.tolist() == [False] + [True] * (ex.ids.size - 1)
  assert s.tokenizer_sha256 == tok.sha256 and s.vocab_size == tok.vocab_size == 320


def test_prompt_completion_puts_the_loss_on_the_completion_and_eos_only(tmp_path, folders):
  tok = load_tokenizer(folders["none"])
  ex = _read(tmp_path, [{"prompt": "Say hello.", "completion": " hello world"}], folders["none"]).examples[0]
  assert _decode(tok, ex.ids[ex.loss]) == " hello world</s>"
  assert _decode(tok, ex.ids[~ex.loss]) == "<s>Say hello."
  with_prompt = _read(tmp_path, [{"prompt": "Say hello.", "completion": " hi"}], folders["none"],
                      prompt_loss=True).examples[0]
  assert with_prompt.loss[1:].all()


@pytest.mark.parametrize("kind", ["gen", "diff"])
def test_chat_loss_falls_on_assistant_turns_only(tmp_path, folders, kind):
  tok = load_tokenizer(folders[kind])
  s = _read(tmp_path, [{"messages": CHAT}], folders[kind])
  ex = s.examples[0]
  assert s.chat_masking == ("generation" if kind == "gen" else "prefix-diff")
  text = _decode(tok, ex.ids)
  assert text == tok.render(CHAT).replace("\ue000", "").replace("\ue001", "")
  # the loss-carrying tokens are exactly the two assistant turns with their closing <|im_end|>\n
  runs = np.split(ex.ids, np.flatnonzero(np.diff(ex.loss.astype(int))) + 1)
  flags = np.split(ex.loss, np.flatnonzero(np.diff(ex.loss.astype(int))) + 1)
  assert [_decode(tok, r) for r, f in zip(runs, flags) if f[0]] == ["hello world<|im_end|>\n",
                                                                     "hello tokens<|im_end|>\n"]


def test_the_generation_tags_and_the_prefix_diff_agree_on_chatml(tmp_path, folders):
  gen = _read(tmp_path, [{"messages": CHAT}], folders["gen"]).examples[0]
  diff = _read(tmp_path, [{"messages": CHAT}], folders["diff"]).examples[0]
  assert np.array_equal(gen.ids, diff.ids) and np.array_equal(gen.loss, diff.loss)


def test_sharegpt_and_alpaca_become_the_same_chat(tmp_path, folders):
  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarise\nfoxes and dogs"},
          {"role": "assistant", "content": "Sure: foxes jump; dogs rest."}]
  rows = [{"messages": chat},
          {"system": "Be brief.", "conversations": [{"from": "human", "value": "Summarise\nfoxes and dogs"},
                                                    {"from": "gpt", "value": "Sure: foxes jump; dogs rest."}]},
          {"system": "Be brief.", "instruction": "Summarise", "input": "foxes and dogs",
           "output": "Sure: foxes jump; dogs rest."}]
  s = _read(tmp_path, rows, folders["gen"])
  a, b, c = s.examples
  assert s.formats == {"messages": 1, "conversations": 1, "instruction": 1}
  for other in (b, c):
    assert np.array_equal(a.ids, other.ids) and np.array_equal(a.loss, other.loss)


def test_alpaca_without_a_chat_template_uses_the_stanford_prompt(tmp_path, folders):
  tok = load_tokenizer(folders["none"])
  ex = _read(tmp_path, [{"instruction": "Summarise", "input": "foxes", "output": "They jump."}],
             folders["none"]).examples[0]
  assert _decode(tok, ex.ids[~ex.loss]) == "<s>" + ALPACA_PROMPT_INPUT.format(instruction="Summarise", input="foxes")
  assert _decode(tok, ex.ids[ex.loss]) == "They jump.</s>"


@pytest.mark.parametrize("kind, row, match", [
    ("none", {"messages": CHAT}, "d.jsonl line 1: .*tokenizer_config.json: no chat_template"),
    ("gen", {"conversations": [{"from": "human", "value": "hi"}, {"from": "tool", "value": "x"}]},
     "line 1: conversations\\[1\\] has from='tool'; parity reads assistant, gpt, human, system, user"),
    ("gen", {"conversations": [{"from": "human", "value": "hi"}]}, "line 1: `conversations` has no gpt/assistant turn"),
    ("gen", {"messages": [{"role": "user"}]}, "messages\\[0\\] must be an object with string `role` and `content`"),
    ("none", {"prompt": "a"}, "line 1: `completion` must be a string; got NoneType \\(the key is missing\\)"),
    ("gen", {"instruction": "a", "output": "b", "history": [["only one"]]}, "history\\[0\\] must be a \\[user, "),
])
def test_a_bad_text_record_is_refused_naming_line_key_and_fix(tmp_path, folders, kind, row, match):
  with pytest.raises(DataError, match=match):
    _read(tmp_path, [row], folders[kind])


def test_a_template_that_rewrites_earlier_turns_is_refused_for_prefix_diff(tmp_path, folders):
  folder = tmp_path / "unstable"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((folders["none"] / "tokenizer.json").read_bytes())
  unstable = "{% for m in messages %}{{ m['content'] + ('!' if loop.last else '') }}{% endfor %}"
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": unstable}))
  with pytest.raises(DataError, match="not a prefix of its rendering .*use a template with \\{% generation %\\} tags"):
    _read(tmp_path, [{"messages": CHAT}], folder)


def test_the_template_sees_the_special_tokens_and_no_clock(folders):
  tok = load_tokenizer(folders["none"])
  tok.chat_template = "{{ bos_token }}{{ eos_token }}{% if strftime_now is defined %}today{% else %}fixed{% endif %}"
  assert tok.render([]) == "<s></s>fixed"  # a date-printing template takes its own default: same tokens every day


def test_the_vocabulary_must_hold_the_tokenizers_ids(tmp_path, folders):
  with pytest.raises(DataError, match="the tokenizer has 320 ids but model.vocab_size is 256; set model.vocab_size"):
    _read(tmp_path, [{"text": "hi"}], folders["none"], vocab_size=256)


def test_missing_packages_and_files_name_the_fix(tmp_path, folders, monkeypatch):
  with pytest.raises(DataError, match="is a folder without tokenizer.json; give the folder of a Hugging Face"):
    load_tokenizer(tmp_path)
  (tmp_path / "afile").write_text("x")  # a file and a missing path are told apart
  with pytest.raises(DataError, match="afile' is a file, not a tokenizer folder"):
    load_tokenizer(tmp_path / "afile")
  with pytest.raises(DataError, match="nowhere' does not exist"):
    load_tokenizer(tmp_path / "nowhere")
  monkeypatch.setitem(sys.modules, "tokenizers", None)
  with pytest.raises(DataError, match="need the `tokenizers` package to tokenize: pip install tokenizers"):
    load_tokenizer(folders["gen"])
  monkeypatch.undo()
  tok = load_tokenizer(folders["gen"])
  monkeypatch.setitem(sys.modules, "jinja2", None)
  with pytest.raises(DataError, match="needs jinja2 to render the tokenizer's chat template: pip install jinja2"):
    tok.chat(CHAT)


def test_the_assistant_mask_matches_transformers_apply_chat_template(folders):
  """The oracle: transformers' own rendering and return_assistant_tokens_mask on the same tokenizer files."""
  transformers = pytest.importorskip("transformers")
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folders["gen"] / "tokenizer.json"))
  out = hf.apply_chat_template(CHAT, chat_template=CHATML_GEN, tokenize=True, return_dict=True,
                               return_assistant_tokens_mask=True)
  ids, mask, _ = load_tokenizer(folders["gen"]).chat(CHAT)
  assert ids.tolist() == list(out["input_ids"])
  assert mask.astype(int).tolist() == list(out["assistant_masks"])


# ------------------------------------------------------------------ transformers 5.x: chat_template.jinja
def _saved_by_transformers(root, raw, template, *, config_template=None):
  """The tokenizer of `raw` saved by transformers' save_pretrained (which writes the template to
  chat_template.jinja, not tokenizer_config.json); `config_template`: also put one in tokenizer_config.json."""
  transformers = pytest.importorskip("transformers")
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(raw / "tokenizer.json"), bos_token="<s>",
                                            eos_token="</s>", pad_token="<pad>")
  hf.chat_template = template
  hf.save_pretrained(root)
  assert (root / "chat_template.jinja").is_file()
  if config_template is not None:
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": config_template}))
  return root, transformers.AutoTokenizer.from_pretrained(root)


def test_a_template_in_chat_template_jinja_renders_as_transformers_does(tmp_path, folders):
  folder, hf = _saved_by_transformers(tmp_path / "saved", folders["none"], CHATML)
  assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
  rows = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
  s = _read(tmp_path, rows, folder)
  for row, ex in zip(rows, s.examples):
    want = hf.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert ex.ids.tolist() == list(want)
  assert s.chat_template == str(folder / "chat_template.jinja")
  # Alpaca records go through the template too, and the card says which template file rendered them
  alpaca = _read(tmp_path, [{"instruction": "Summarise", "output": "They jump."}], folder)
  assert alpaca.chat_template == str(folder / "chat_template.jinja") and alpaca.chat_masking == "prefix-diff"
  assert _read(tmp_path, [{"instruction": "Summarise", "output": "They jump."}], folders["none"]).chat_template is None


def test_chat_template_jinja_wins_over_tokenizer_config_as_in_transformers(tmp_path, folders):
  other = CHATML.replace("\\n", " ")
  folder, hf = _saved_by_transformers(tmp_path / "both", folders["none"], CHATML, config_template=other)
  assert hf.chat_template == CHATML  # transformers' rule: the .jinja file takes priority
  tok = load_tokenizer(folder)
  assert tok.chat_template == CHATML and tok.chat_template_source == folder / "chat_template.jinja"
  assert tok.chat(CHAT)[0].tolist() == list(hf.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])


def test_an_eos_token_missing_from_the_vocabulary_is_added_as_transformers_adds_it(tmp_path, folders):
  """transformers (5.x from_pretrained) adds a special token tokenizer_config.json names but tokenizer.json lacks, as
  a new id after the vocabulary; parity appended no EOS at all, silently. It now does what transformers does and
  says so (the tokenizer's notes, the data card's tokenizer_notes, the data notes printed before the run)."""
  transformers = pytest.importorskip("transformers")
  from parity.report.progress import data_notes
  folder = tmp_path / "eosless"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((folders["none"] / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|endoftext|>"}))
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  tok = load_tokenizer(folder)
  assert tok.eos_id == hf.eos_token_id == 320 and tok.vocab_size == len(hf) == 321
  assert any("eos_token '<|endoftext|>'" in n and "tokenizer_config.json" in n and "id 320" in n for n in tok.notes)
  s = _read(tmp_path, [{"text": "hello world"}], folder)
  assert s.examples[0].ids[-1] == 320 and s.tokenizer_notes == tok.notes
  assert any("<|endoftext|>" in line for line in data_notes({"card": {"tokenizer_notes": list(tok.notes)}}))
  with pytest.raises(DataError, match="the tokenizer has 321 ids but model.vocab_size is 320"):
    _read(tmp_path, [{"text": "hi"}], folder, vocab_size=320)
  assert load_tokenizer(folders["none"]).notes == ()


# ------------------------------------------------------------------ hostile templates: refused fast, by name
def _with_template(tmp_path, folders, template):
  folder = tmp_path / "hostile"
  folder.mkdir()
  (folder / "tokenizer.json").write_bytes((folders["none"] / "tokenizer.json").read_bytes())
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  (folder / "chat_template.jinja").write_text(template)
  return folder


def test_a_template_with_a_syntax_error_is_refused_naming_its_file_and_line(tmp_path, folders):
  broken = "{% for m in messages %}\n{{ m['content'] }}\n{{ m['role'] }\n{% endfor %}"  # line 3: '}' for '}}'
  folder = _with_template(tmp_path, folders, broken)
  with pytest.raises(DataError, match=r"^\S*hostile/chat_template.jinja line 3: the chat template is not valid jinja2 "
                                      r"\(unexpected '}'\); fix the template there$"):
    _read(tmp_path, [{"messages": CHAT}], folder)
  tok = load_tokenizer(folders["none"])  # one held in tokenizer_config.json: its line within the template
  tok.chat_template, tok.chat_template_source = "ok\n{{ m|no_such_filter }}", folders["none"] / "tokenizer_config.json"
  with pytest.raises(DataError, match="tokenizer_config.json: its chat_template, line 2: .*No filter named"):
    tok.chat(CHAT)


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran past 1,000,000 steps"),
    ("{{ 'x' * 10**9 }}", "would build a repeated text or list of 1,000,000,000 characters"),
    ("{{ 10 ** (10 ** 10) }}", "would build an integer of more than 4,096 bits"),
    ("{% set s = 'x' * 10**7 %}{% set s = s ~ s %}{{ s }}", "would build a joined text of 20,000,000 characters"),
    ("{{ 'x'|center(10**9) }}{{ 'x'.ljust(10**9) }}", "would build a text \\(a width or count argument\\)"),
    ("{{ '{:>1000000000}'.format(1) }}", "would build a text \\(a width or count argument\\)"),
    ("{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}", "would build an output of 16,7"),
])
def test_a_template_past_a_limit_is_refused_fast_naming_the_limit(tmp_path, folders, template, match):
  """Nested range() loops rendered for over 600 s and 'x' * 10**9 for over 180 s (jinja2 folded it at compile
  time) before any side started; each limit now refuses within a second, naming itself and the fix."""
  import time
  folder = _with_template(tmp_path, folders, template)
  start = time.monotonic()
  with pytest.raises(DataError, match=f"d.jsonl line 1: .*hostile/chat_template.jinja: the chat template {match}.*; "
                                      "(remove|change) .*template"):
    _read(tmp_path, [{"messages": CHAT}], folder)
  assert time.monotonic() - start < 5


def test_a_chat_template_that_is_a_symlink_loop_is_named_as_one(tmp_path, folders):
  folder = _with_template(tmp_path, folders, "")
  (folder / "chat_template.jinja").unlink()
  (folder / "chat_template.jinja").symlink_to(folder / "chat_template.jinja")
  with pytest.raises(DataError, match="chat_template.jinja is a symbolic link that leads to no file \\(a loop\\)"):
    load_tokenizer(folder)
