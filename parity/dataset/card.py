"""The data card of a run on examples: what was read and how it was laid out, as one JSON-ready dict."""
from __future__ import annotations

import dataclasses

import numpy as np

from parity.dataset.examples import ExampleSet
from parity.dataset.layouts import ExampleBatches

__all__ = ["data_card", "CARD_FIELDS"]

CARD_FIELDS = ("source", "sha256", "formats", "tokenizer", "tokenizer_sha256", "tokenizer_notes", "chat_masking",
               "chat_template", "vocab_size", "layout", "examples", "examples_seen", "pieces", "examples_per_step",
               "length_min", "length_median", "length_max", "tokens_per_step", "padding_fraction",
               "loss_tokens_per_step", "loss_tokens_total", "truncation")


def data_card(examples: ExampleSet, batches: ExampleBatches) -> dict:
  """The data card (every key of CARD_FIELDS, in that order; JSON types only).

  Fields and units:
    source: the example file's path (or the built-in set's name). sha256: hex sha256 of its bytes (built-in: of
      its ids and loss flags).
    formats: record format -> number of records (parity.dataset.examples.FORMATS).
    tokenizer: the tokenizer folder, or None (pre-tokenized / byte-level). tokenizer_sha256: hex sha256 of its
      tokenizer.json, or None. tokenizer_notes: list of what loading the tokenizer did beyond reading its files (a
      special token the vocabulary lacked, added as transformers adds it). chat_masking: 'generation' /
      'prefix-diff' for chat records, else None.
      chat_template: the file whose chat template rendered the chat and Alpaca (instruction) records
      (chat_template.jinja or tokenizer_config.json), or None: none was rendered by one (Alpaca records then get
      the built-in Stanford Alpaca prompt, parity.dataset.examples.ALPACA_PROMPT).
    vocab_size: ids, the vocabulary every id was checked against.
    layout: 'padded' or 'packed'.
    examples: examples read (records). examples_seen: distinct examples at least one step trains on (fewer than
      `examples` when steps x examples_per_step is smaller than the set). pieces: examples after truncation /
      splitting. examples_per_step: pieces per optimizer step (E).
    length_min / length_median / length_max: tokens per example as read, before truncation (median: float).
    tokens_per_step: input positions per optimizer step, padding included (A x B x T).
    padding_fraction: padded input positions / all input positions over the whole run, in [0, 1].
    loss_tokens_per_step: list (one int per optimizer step), loss-carrying targets of the step over all micro
      batches and ranks (the `tokens` normalisation's divisor). loss_tokens_total: their sum.
    truncation: {mode, examples_cut, tokens_dropped, loss_tokens_dropped, pieces_added} (parity.dataset.layouts.
      Truncation; counts of examples / tokens).
  """
  lengths = np.array([ex.ids.size for ex in examples.examples], dtype=np.int64)
  seen = {batches.pieces[int(p)].example for p in np.unique(batches.step_pieces)}
  per_step = batches.loss_tokens_per_step
  card = {
      "source": examples.source, "sha256": examples.sha256, "formats": dict(examples.formats),
      "tokenizer": examples.tokenizer, "tokenizer_sha256": examples.tokenizer_sha256,
      "tokenizer_notes": list(examples.tokenizer_notes),
      "chat_masking": examples.chat_masking, "chat_template": examples.chat_template,
      "vocab_size": int(examples.vocab_size), "layout": batches.layout,
      "examples": len(examples.examples), "examples_seen": len(seen), "pieces": len(batches.pieces),
      "examples_per_step": int(batches.examples_per_step), "length_min": int(lengths.min()),
      "length_median": float(np.median(lengths)), "length_max": int(lengths.max()),
      "tokens_per_step": int(np.prod(batches.segment_ids.shape[1:])),
      "padding_fraction": float(np.mean(batches.segment_ids == 0)),
      "loss_tokens_per_step": [int(x) for x in per_step], "loss_tokens_total": int(per_step.sum()),
      "truncation": dataclasses.asdict(batches.truncation),
  }
  return card
