"""A Qwen-style checkpoint as transformers 5.x saves it trains on chat data with its own template.

`save_pretrained` of transformers 5.x writes the chat template to chat_template.jinja, not tokenizer_config.json. The
checkpoint here is a tiny random Qwen2ForCausalLM and a byte-level BPE with Qwen's special tokens (no BOS,
eos_token <|im_end|>, pad_token <|endoftext|>) and a Qwen-style ChatML template written for this test (a default
system turn when the conversation has none, whitespace-trimming tags, no generation tags), both saved by
transformers. parity reads `messages` and Alpaca records through that template: every example's token ids equal
`apply_chat_template`'s (Alpaca records as the messages LLaMA-Factory builds: user = instruction, "\\n" and the input
when there is one, assistant = output, an optional system and history), and `parity compare --hf-model` on a file
mixing both formats trains on exactly those ids and PASSes (jax and torch, padded rows: one example a row)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import requires_jax, requires_torch

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for m in turns -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
"""Qwen-style ChatML: the system turn Qwen's templates add when a conversation has none, `{%-`/`-%}` trimming."""
WORDS = ("sum the list of numbers return a reversed string sort the words count vowels in text parse a date merge two "
         "dicts you are helpful").split()
MESSAGES = [
    [{"role": "user", "content": "sum the list of numbers"},
     {"role": "assistant", "content": "return a reversed string"}],
    [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "sort the words"},
     {"role": "assistant", "content": "count vowels in text"}, {"role": "user", "content": "parse a date"},
     {"role": "assistant", "content": "merge two dicts"}],
    [{"role": "user", "content": "count the vowels"}, {"role": "assistant", "content": "the list of numbers"}],
    [{"role": "user", "content": "merge the words"}, {"role": "assistant", "content": "sum two dicts"}],
    [{"role": "user", "content": "parse the string"}, {"role": "assistant", "content": "a date"}],
    [{"role": "user", "content": "reversed words"}, {"role": "assistant", "content": "sort the list"}],
]
ALPACA = [
    {"instruction": "sum the list", "input": "of numbers", "output": "return a reversed string"},
    {"instruction": "sort the words", "output": "count vowels in text"},
    {"instruction": "parse a date", "input": "", "output": "merge two dicts", "system": "you are helpful"},
    {"instruction": "count vowels", "output": "in text", "history": [["sum two", "dicts"]]},
    {"instruction": "merge two", "input": "dicts", "output": "the words"},
    {"instruction": "return a string", "output": "reversed"},
]


def alpaca_messages(rec: dict) -> list[dict]:
  """The conversation LLaMA-Factory's Alpaca converter builds from a record (written here from its documented rule,
  independently of parity.dataset.examples)."""
  out = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
  for user, assistant in rec.get("history", []):
    out += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
  query = rec["instruction"] + ("\n" + rec["input"] if rec.get("input") else "")
  return out + [{"role": "user", "content": query}, {"role": "assistant", "content": rec["output"]}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
  """The checkpoint folder, written by transformers' save_pretrained (model and tokenizer)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  root = tmp_path_factory.mktemp("qwen") / "Qwen-style-tiny"
  corpus = [" ".join(WORDS[i % len(WORDS):] + WORDS[:i % len(WORDS)]) for i in range(60)]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
  hf_tok.chat_template = TEMPLATE
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
      vocab_size=304, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=None,
      eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id))
  model.save_pretrained(root)
  hf_tok.save_pretrained(root)
  assert (root / "chat_template.jinja").read_text() == TEMPLATE
  assert "chat_template" not in json.loads((root / "tokenizer_config.json").read_text())
  return root


def _want(folder: Path, conversations: list[list[dict]]) -> list[list[int]]:
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  return [list(hf.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in conversations]


def _jsonl(path: Path, rows: list[dict]) -> Path:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


@pytest.mark.parametrize("fmt", ["messages", "alpaca"])
def test_each_example_is_the_ids_apply_chat_template_gives(qwen, tmp_path, fmt):
  from parity.dataset.examples import read_examples
  from parity.dataset.tokenizer import load_tokenizer
  rows = [{"messages": m} for m in MESSAGES] if fmt == "messages" else ALPACA
  conversations = MESSAGES if fmt == "messages" else [alpaca_messages(r) for r in ALPACA]
  s = read_examples(_jsonl(tmp_path / "d.jsonl", rows), tokenizer=load_tokenizer(qwen))
  assert [ex.ids.tolist() for ex in s.examples] == _want(qwen, conversations)
  assert s.chat_template == str(qwen / "chat_template.jinja") and s.chat_masking == "prefix-diff"
  hf = transformers.AutoTokenizer.from_pretrained(qwen)
  text = hf.decode(s.examples[0].ids)
  assert text.startswith("<|im_start|>system\n") and "<|endoftext|>" not in text  # its own template, no BOS
  for ex, conv in zip(s.examples, conversations):  # the loss: each assistant reply and the <|im_end|>\n closing it
    assert hf.decode(ex.ids[ex.loss]) == "".join(m["content"] + "<|im_end|>\n" for m in conv
                                                 if m["role"] == "assistant")


@pytest.mark.process
@pytest.mark.slow
@requires_jax
@requires_torch
def test_compare_on_the_checkpoint_trains_on_those_ids_and_passes(qwen, tmp_path):
  rows = [{"messages": m} for m in MESSAGES] + ALPACA
  data = _jsonl(tmp_path / "chat.jsonl", rows)
  out = tmp_path / "run"
  p = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--hf-model", str(qwen), "--data", str(data),
                      "--set", "train.layout=padded", "--steps", "4", "--sides", "jax,torch", "--determinism-steps",
                      "0", "--no-progress", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["passed"] is True
  card = rep["data"]["card"]
  assert card["formats"] == {"messages": len(MESSAGES), "instruction": len(ALPACA)}
  assert card["chat_template"] == str(qwen / "chat_template.jinja") and card["tokenizer"] == str(qwen)
  want = {tuple(w) for w in _want(qwen, MESSAGES + [alpaca_messages(r) for r in ALPACA])}
  rows_, seg = np.load(out / "batches.npy"), np.load(out / "segment_ids.npy")
  rows_, seg = rows_.reshape(-1, rows_.shape[-1]), seg.reshape(-1, seg.shape[-1])
  trained = {tuple(r[:int((s > 0).sum())].tolist()) for r, s in zip(rows_, seg)}
  assert trained <= want and len(trained) >= 6, (len(trained), len(want))  # every row is one rendered example
