"""Porting a real SFT job end to end: LLaMA-Factory's ZeRO-0 DeepSpeed config (its "auto"
values filled from the run spec, as the HF Trainer fills them) runs with `--deepspeed-config` and `--data` pointing
at a prompt/completion JSONL tokenized by a BPE trained here, offline. All three sides, padded, GA 2: it must PASS,
and report.json, report.md, report.html and card.json carry the data card, whose figures are recomputed here from
the file, the tokenizer and the run folder's arrays. One compare for every assertion (module-scoped)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import requires_all

ROOT = Path(__file__).resolve().parents[1]
# The real DeepSpeed configs (tests/data/realworld/ds_configs, SOURCES.md there); PARITY_REALWORLD may name others.
REALWORLD = Path(os.environ.get("PARITY_REALWORLD") or Path(__file__).parent / "data" / "realworld" / "ds_configs")
LLAMA_FACTORY_Z0 = REALWORLD / "hiyouga__LLaMA-Factory__examples__deepspeed__ds_z0_config.json"
SEQ_LEN = 128  # the sft-tiny preset's; an example of more than SEQ_LEN + 1 tokens is truncated
LONG = 3       # examples written first (so in the training split) that the layout must truncate
pytestmark = [pytest.mark.process, pytest.mark.slow]
WORDS = ("sum the list of numbers return a reversed string sort the words count vowels in text parse a date "
         "merge two dicts").split()


def _pairs() -> list[dict]:
  """36 prompt/completion pairs, 21 to ~80 tokens, after LONG long ones (~230 tokens)."""
  rows = [{"prompt": f"Long task {i}: " + " ".join(WORDS * 2), "completion": " " + " ".join(reversed(WORDS * 2))}
          for i in range(LONG)]
  for i in range(36):
    prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (i * 7) % 11))
    completion = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(3 + (i * 5) % 17))
    rows.append({"prompt": f"Q{i}: {prompt}?", "completion": f" {completion}."})
  return rows


def _tokenizer(folder: Path, rows: list[dict]):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # optional package
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([r["prompt"] + r["completion"] for r in rows] * 4, trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
  folder.mkdir()
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "pad_token": "<pad>"}))
  return tok


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  pytest.importorskip("tokenizers")
  root = tmp_path_factory.mktemp("sft_port")
  rows = _pairs()
  data = root / "sft.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  tok = _tokenizer(root / "tok", rows)
  # prompt through the post-processor (BOS), completion without it, then EOS (docs/data-examples.md)
  lengths = [len(tok.encode(r["prompt"]).ids) + len(tok.encode(r["completion"], add_special_tokens=False).ids) + 1
             for r in rows]
  out = root / "run"
  p = subprocess.run([sys.executable, "-m", "parity.cli", "compare", "--preset", "sft-tiny", "--steps", "3",
                      "--determinism-steps", "0", "--deepspeed-config", str(LLAMA_FACTORY_Z0), "--data", str(data),
                      "--tokenizer", str(root / "tok"), "--set", "model.vocab_size=300", "--out", str(out)],
                     cwd=ROOT, capture_output=True, text=True, timeout=1200)
  return {"proc": p, "out": out, "data": data, "lengths": lengths, "rows": rows}


@requires_all
def test_the_real_sft_config_passes_on_all_three_sides(run):
  p, out = run["proc"], run["out"]
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  rep = json.loads((out / "report.json").read_text())
  assert rep["verdict"]["passed"] is True and set(rep["sides"]) == {"jax", "deepspeed", "torch"}
  assert all(s["status"] == "ok" and len(s["series"]["loss"]) == 3 for s in rep["sides"].values())
  assert (out / "deepspeed_config.given.json").read_bytes() == LLAMA_FACTORY_Z0.read_bytes()
  resolved = json.loads((out / "deepspeed_config.resolved.json").read_text())
  assert resolved["gradient_accumulation_steps"] == 2 and resolved["zero_optimization"]["stage"] == 0
  mig = json.loads((out / "migration.json").read_text())
  assert mig["status"] == "ported" and mig["loss_normalization"]["decided_by"] == "hf_trainer"
  # the run notes (printed with the progress lines): what this run trains beside what the config implies
  assert "parity compare: loss normalisation: this run trains train.loss_normalization=tokens; the DeepSpeed " \
         "config: not stated by the config" in p.stderr


@requires_all
def test_its_data_card_describes_the_file_and_the_batches(run):
  out, lengths = run["out"], run["lengths"]
  assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
  card = json.loads((out / "report.json").read_text())["data"]["card"]
  assert card["source"] == str(run["data"]) and card["sha256"] == hashlib.sha256(run["data"].read_bytes()).hexdigest()
  assert card["layout"] == "padded" and card["formats"] == {"prompt": len(run["rows"])}
  assert card["examples"] == len(run["rows"]) and card["tokenizer"] == str(out.parent / "tok")
  assert (card["length_min"], card["length_max"], card["length_median"]) == (
      min(lengths), max(lengths), float(np.median(lengths)))
  seg, mask = np.load(out / "segment_ids.npy"), np.load(out / "loss_mask.npy")
  assert card["tokens_per_step"] == int(np.prod(seg.shape[1:])) == 2 * 4 * SEQ_LEN
  assert card["padding_fraction"] == float(np.mean(seg == 0)) and 0 < card["padding_fraction"] < 1
  per_step = mask.reshape(mask.shape[0], -1).sum(axis=1).tolist()
  assert card["loss_tokens_per_step"] == per_step and len(set(per_step)) > 1  # varying lengths: tokens != micro_mean
  cut = [n for n in lengths[:LONG] if n > SEQ_LEN + 1]
  assert len(cut) == LONG and card["truncation"]["mode"] == "truncate"
  assert card["truncation"]["examples_cut"] == LONG
  assert card["truncation"]["tokens_dropped"] == sum(n - SEQ_LEN - 1 for n in cut)
  assert json.loads((out / "card.json").read_text())["compared"]["data_card"] == card
  md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
  assert "## Data card" in md and card["sha256"] in md and card["sha256"] in html
  assert "Loss normalisation the config implies: not stated by the config" in md
