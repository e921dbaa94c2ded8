"""Example datasets (SFT and packed pretraining), framework-free: read, tokenize, lay out, describe.

  records    JSONL / JSON array / Parquet records, each with the place errors name
  tokenizer  a local Hugging Face tokenizer (tokenizer.json, chat template), loaded offline
  examples   records -> Example (token ids + which carry the loss), in every supported format
  layouts    examples -> the arrays the sides read (padded / packed), the step assignment, loss-token counts
  reference  the arrays as the sides must read them (NumPy): attention mask, per-token loss weights
  card       the data card (a dict)
  demo       a built-in SFT set from this Python's stdlib sources, byte-level
See docs/data-examples.md. Every error is a parity.data.DataError naming the file, the record, the key and the fix.
"""
from parity.dataset.card import CARD_FIELDS, data_card
from parity.dataset.demo import DEMO_VOCAB, EOS_ID, PAD_ID, sft_demo
from parity.dataset.examples import Example, ExampleSet, examples_from_records, read_examples
from parity.dataset.layouts import (ARRAY_FILES, LAYOUTS, TRUNCATIONS, ExampleBatches, Truncation, build_batches,
                                    split_holdout)
from parity.dataset.records import read_records
from parity.dataset.reference import NORMALIZATIONS, attention_mask, token_weights
from parity.dataset.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["CARD_FIELDS", "data_card", "DEMO_VOCAB", "EOS_ID", "PAD_ID", "sft_demo", "Example", "ExampleSet",
           "examples_from_records", "read_examples", "ARRAY_FILES", "LAYOUTS", "TRUNCATIONS", "ExampleBatches",
           "Truncation", "build_batches", "split_holdout", "read_records", "NORMALIZATIONS", "attention_mask",
           "token_weights", "HFTokenizer", "load_tokenizer"]
