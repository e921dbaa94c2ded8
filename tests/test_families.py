"""The model-family table (parity.hf.families.FAMILIES): one row per family, matching transformers' own classes, and
no family named anywhere (the code's comparisons, the writer's layouts, the presets, docs/hf.md) without its row."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from parity.hf import config as hf_config
from parity.hf import export, families
from parity.hf.families import FAMILIES
from parity.hf.presets import MODEL_PRESETS
from parity.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
NAMES = {f.name for f in FAMILIES}

NOT_CONFIG_FIELDS = {
    # LLaMA's keys, read for a Mistral config too: MistralAttention / MistralMLP have no biases (the reader sets none
    # whatever they say), and pretraining_tp is only ever a note
    "mistral": {"attention_bias", "mlp_bias", "pretraining_tp"},
    # Qwen2Config holds no head_dim; Qwen2Attention reads one from config.json when given (else hidden / heads)
    "qwen2": {"head_dim"},
    # the legacy key of Gemma 3 configs: Gemma3TextConfig turns it into layer_types (every 6th layer full)
    "gemma3": {"sliding_window_pattern"},
}
"""Keys a row reads that its transformers config class holds no field for, each with the reason."""


def _field_defaults(config_class) -> dict:
  out = {}
  for f in dataclasses.fields(config_class):
    if f.default is not dataclasses.MISSING:
      out[f.name] = f.default
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = f.default_factory()
  return out


@pytest.mark.parametrize("row", FAMILIES, ids=lambda r: r.name)
def test_each_row_is_transformers_own_class_and_config(row):
  """The row's causal-LM class exists in transformers, its config class is the row's, with the row's model_type,
  and every default the row gives is that config class's default (keys it holds no field for: NOT_CONFIG_FIELDS)."""
  transformers = pytest.importorskip("transformers")
  cls = getattr(transformers, row.hf_class)
  assert cls.config_class.__name__ == row.config_class
  assert cls.config_class.model_type == row.model_type
  held = _field_defaults(cls.config_class)
  assert {k for k in row.defaults if k not in held} == NOT_CONFIG_FIELDS.get(row.name, set())
  assert {k: v for k, v in row.defaults.items() if k in held} == {k: held[k] for k in row.defaults if k in held}


def test_rows_are_unique_and_the_reader_maps_follow_them():
  for key in ("name", "hf_class", "model_type"):
    values = [getattr(f, key) for f in FAMILIES]
    assert len(set(values)) == len(values), key
  assert hf_config.ARCHITECTURES == {f.hf_class: f.name for f in FAMILIES}
  assert {t: c for t, c in hf_config.MODEL_TYPES.items() if c not in hf_config.REFUSED} == {
      f.model_type: f.hf_class for f in FAMILIES}
  assert not set(hf_config.ARCHITECTURES) & set(hf_config.REFUSED)
  assert {f.tensor_names for f in FAMILIES} == {"gpt2", "llama"}


@pytest.mark.parametrize("row", FAMILIES, ids=lambda r: r.name)
def test_a_config_of_only_the_model_type_reads_as_its_family_and_writes_back(row):
  """config.json {"model_type": ...} takes every key from the row's defaults: read as the row's family, written
  back with the row's class and model_type, and read again to the same spec."""
  family, spec, _ = hf_config.parse_hf_config({"model_type": row.model_type})
  assert family == row.name
  cfg = export.hf_config_from_spec(spec)
  assert (cfg["architectures"], cfg["model_type"]) == ([row.hf_class], row.model_type)
  assert hf_config.parse_hf_config(cfg)[:2] == (row.name, spec)


@pytest.mark.parametrize("table, field", [(PRESETS, "run_presets"), (MODEL_PRESETS, "model_presets")],
                         ids=["run", "model-size"])
def test_every_preset_is_named_by_the_row_of_its_family(table, field):
  named = [p for f in FAMILIES for p in getattr(f, field)]
  assert len(named) == len(set(named)) and set(named) == set(table)
  for f in FAMILIES:
    for name in getattr(f, field):
      spec = table[name].model if field == "run_presets" else table[name]
      assert export.family_of_spec(spec) == f.name, name


def family_literals(source: str) -> set[str]:
  """Every string the code compares a family with: `family == "x"`, `family in ("x", "y")`, `by_name("x")`,
  `naming("x")`, and the keys of a dict literal assigned to a name ending in `_LAYOUTS` (per-family tables)."""
  out: set[str] = set()

  def strings(node: ast.AST) -> list[str]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]

  def is_family(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "family") or (
        isinstance(node, ast.Attribute) and node.attr == "family")

  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare) and (is_family(node.left) or any(is_family(c) for c in node.comparators)):
      for side in (node.left, *node.comparators):
        out.update(strings(side))
    elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
        "by_name", "naming") and node.args:
      out.update(strings(node.args[0]))
    elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
        isinstance(t, ast.Name) and t.id.endswith("_LAYOUTS") for t in node.targets):
      out.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
  return out


def test_every_family_the_code_names_has_a_row():
  """Every family parity's code compares with, looks up or keys a per-family table by (parity/, jax_impl/,
  torch_impl/, harness/) has a row; the writer's layouts are one per row, in the rows' order."""
  seen: dict[str, set[str]] = {}
  for top in ("parity", "jax_impl", "torch_impl", "harness"):
    for p in (ROOT / top).rglob("*.py"):
      for name in family_literals(p.read_text()):
        seen.setdefault(name, set()).add(str(p.relative_to(ROOT)))
  assert set(seen) >= {"gpt2", "qwen2", "gemma2"}, seen  # the scan sees the reader's and the writer's comparisons
  assert {n: w for n, w in seen.items() if n not in NAMES} == {}
  assert list(export._LAYOUTS) == [f.name for f in FAMILIES]


def test_the_scan_finds_a_planted_family_without_a_row():
  planted = ('def f(family):\n  if family == "phi":\n    return 1\n  return family in ("olmo", "gpt2")\n'
             '_LAYOUTS = {"falcon": {}}\nx = by_name("mamba")\n')
  assert family_literals(planted) - NAMES == {"phi", "olmo", "falcon", "mamba"}


def test_docs_table_has_one_line_per_row():
  """docs/hf.md's family table lists exactly the rows, each with its class."""
  text = (ROOT / "docs" / "hf.md").read_text()
  rows = dict(re.findall(r"^\| `(\w+)` \| (\w+)", text, flags=re.M))
  assert rows == {f.name: f.hf_class for f in FAMILIES}


def test_lookups():
  assert families.names() == tuple(f.name for f in FAMILIES)
  assert families.by_name("gemma3").model_type == "gemma3_text"
  assert families.by_class("Qwen2ForCausalLM").name == "qwen2" and families.by_class("PhiForCausalLM") is None
  with pytest.raises(KeyError):
    families.by_name("phi")
