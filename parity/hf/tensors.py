"""HF tensor names and layouts <-> canonical weights, through one table of rules (`hf_rules`).

See the package docstring (`parity.hf`) for the full table of names, shapes and transposes.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import numpy as np

from parity import weights
from parity.hf.config import HFFormatError
from parity.hf.export import family_of_spec
from parity.hf.families import by_name
from parity.spec import ModelSpec

# Tensors in older HF checkpoints that are buffers, not parameters: dropped with the reason.
_IGNORED = {
    "gpt2": [(re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$"), "causal-mask buffer of old GPT-2 checkpoints")],
    "llama": [(re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
               "rotary frequency buffer; recomputed from rope_theta")],
}
"""Buffers dropped, per tensor naming (`naming`)."""


def naming(family: str) -> str:
  """The tensor naming of an HF family: 'gpt2' for GPT-2, 'llama' for every rotary family (LLaMA, Mistral,
  Qwen2/3, Gemma 1/2/3: the same model.layers.i.* names, plus q_norm/k_norm and Gemma 2/3's four norms); its row's
  `tensor_names` (parity.hf.families)."""
  return by_name(family).tensor_names


# ----------------------------------------------------------------------------- tensor naming


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
  """One canonical tensor and the HF tensor(s) it comes from.

  Attributes:
    canonical: canonical name (parity.weights).
    hf: HF names; several are concatenated along axis 0 in this order (LLaMA q|k|v).
    rows: row count of each HF part when there are several, else ().
    transpose: the single HF tensor is the transpose of the canonical one (GPT-2 Conv1D [in, out]).
  """
  canonical: str
  hf: tuple[str, ...]
  rows: tuple[int, ...] = ()
  transpose: bool = False

  def hf_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Expected HF shapes given the canonical shape."""
    if self.rows:
      return [(r, *shape[1:]) for r in self.rows]
    return [tuple(reversed(shape)) if self.transpose else shape]


def hf_rules(spec: ModelSpec, family: str) -> list[Rule]:
  """The mapping of every canonical tensor of `spec` to HF names, in canonical order.

  GPT-2 names carry the `transformer.` prefix that `save_pretrained` writes; unprefixed
  names (the original OpenAI upload) are accepted by `hf_to_canonical`.
  """
  rules = []
  hd = spec.head_dim
  for name in weights.param_shapes(spec):
    if naming(family) == "gpt2":
      rules.append(_gpt2_rule(name))
    else:
      rules.append(_llama_rule(name, (spec.n_heads * hd, spec.kv_heads * hd, spec.kv_heads * hd), spec.post_norms))
  return rules


_GPT2_CONV1D = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
_GPT2_RENAME = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def _gpt2_rule(name: str) -> Rule:
  if name == "lm_head.weight":
    return Rule(name, (name,))
  hf = name
  for ours, theirs in _GPT2_RENAME.items():
    hf = hf.replace(f".{ours}.", f".{theirs}.")
  conv = name.endswith(".weight") and any(f".{m}." in name for m in _GPT2_CONV1D)
  return Rule(name, (f"transformer.{hf}",), transpose=conv)


_LLAMA_LAYER = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
                "attn.proj.weight": "self_attn.o_proj.weight", "attn.proj.bias": "self_attn.o_proj.bias",
                "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.gate.bias": "mlp.gate_proj.bias",
                "mlp.up.weight": "mlp.up_proj.weight", "mlp.up.bias": "mlp.up_proj.bias",
                "mlp.proj.weight": "mlp.down_proj.weight", "mlp.proj.bias": "mlp.down_proj.bias",
                "attn.ln_q.weight": "self_attn.q_norm.weight", "attn.ln_k.weight": "self_attn.k_norm.weight"}
_GEMMA2_NORMS = {"ln_1_post.weight": "post_attention_layernorm.weight",  # after attention, before the residual add
                 "ln_2.weight": "pre_feedforward_layernorm.weight",
                 "ln_2_post.weight": "post_feedforward_layernorm.weight"}
"""Gemma 2/3 (post_norms): HF's post_attention_layernorm is the attention branch's output norm, not the MLP's
input norm as in LLaMA."""


def _llama_rule(name: str, qkv_rows: tuple[int, int, int], post_norms: bool) -> Rule:
  top = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
         "lm_head.weight": "lm_head.weight"}
  if name in top:
    return Rule(name, (top[name],))
  _, i, rest = name.split(".", 2)
  p = f"model.layers.{i}"
  if rest.startswith("attn.qkv."):
    leaf = rest.rsplit(".", 1)[1]
    return Rule(name, tuple(f"{p}.self_attn.{x}_proj.{leaf}" for x in "qkv"), rows=qkv_rows)
  table = {**_LLAMA_LAYER, **_GEMMA2_NORMS} if post_norms else _LLAMA_LAYER
  if rest not in table:
    raise HFFormatError(f"canonical tensor {name!r} has no HF counterpart in the LLaMA-style naming")
  return Rule(name, (f"{p}.{table[rest]}",))


def _normalise_names(tensors: Mapping[str, np.ndarray], family: str) -> dict[str, np.ndarray]:
  """Adds the `transformer.` prefix to unprefixed GPT-2 names; other names are kept."""
  if naming(family) != "gpt2":
    return dict(tensors)
  out = {}
  for k, v in tensors.items():
    out[k if k.startswith("transformer.") or k == "lm_head.weight" else f"transformer.{k}"] = v
  return out


def hf_to_canonical(tensors: Mapping[str, np.ndarray], spec: ModelSpec, family: str,
                    *, notes: list[str] | None = None) -> dict[str, np.ndarray]:
  """HF state dict (numpy, any float dtype; float64 only when exact in float32) -> canonical float32 weights.

  Args:
    tensors: HF name -> array, e.g. from `read_safetensors`; weights [out, in] (LLaMA) or
      Conv1D [in, out] (GPT-2). A tied checkpoint may include or omit `lm_head.weight`.
    spec: the spec from the same checkpoint's config.json.
    family: a value of parity.hf.ARCHITECTURES ('gpt2', 'llama', 'qwen3', ...; see `naming`).
    notes: if given, receives one line per dropped buffer kind.
  Returns:
    Canonical name -> float32 C-contiguous array, in canonical order.
  Raises:
    HFFormatError: a tensor is missing, unexpected or misshapen (each named, with the
      expected shape), a float64 tensor holds a value float32 cannot represent (named), a tensor holds NaN or inf
      (named, with the count), or a tied checkpoint's lm_head differs from its embedding.
  """
  src = _normalise_names(tensors, family)
  dropped: dict[str, int] = {}
  for k in list(src):
    bare = k.removeprefix("transformer.")
    for pattern, why in _IGNORED[naming(family)]:
      if pattern.match(bare):
        del src[k]
        dropped[why] = dropped.get(why, 0) + 1
  if notes is not None:
    notes.extend(f"dropped {n} tensor(s): {why}" for why, n in dropped.items())
  if spec.tie_embeddings and "lm_head.weight" in src:
    head = src.pop("lm_head.weight")
    wte = src.get("transformer.wte.weight" if naming(family) == "gpt2" else "model.embed_tokens.weight")
    if wte is not None and not (head.shape == wte.shape and np.array_equal(head, wte)):
      raise HFFormatError("lm_head.weight differs from the token embedding, but config.json has "
                          "tie_word_embeddings=true; set it to false if the head is untied")
  rules = hf_rules(spec, family)
  shapes = weights.param_shapes(spec)
  expected = {h: s for r in rules for h, s in zip(r.hf, r.hf_shapes(shapes[r.canonical]))}
  problems = _mismatches(src, expected)
  if problems:
    raise HFFormatError(f"HF {family} tensors do not match config.json: " + "; ".join(problems))
  _check_float64(src, notes)
  out = {}
  for r in rules:
    parts = [np.asarray(src[h], dtype=np.float32) for h in r.hf]
    arr = np.concatenate(parts, axis=0) if r.rows else (parts[0].T if r.transpose else parts[0])
    out[r.canonical] = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(out[r.canonical]).all():
      bad = [h for h in r.hf if not np.isfinite(np.asarray(src[h], dtype=np.float32)).all()]
      n = int(out[r.canonical].size - np.isfinite(out[r.canonical]).sum())
      raise HFFormatError(f"tensor {', '.join(map(repr, bad))} holds {n:,} NaN/inf value(s); a model cannot train "
                          "from non-finite weights: re-export the checkpoint from a healthy model")
  return out


def _check_float64(src: Mapping[str, np.ndarray], notes: list[str] | None) -> None:
  """float64 (F64) tensors are taken only when every value is a float32, so nothing is rounded: the models train
  float32 weights, and HF -> ours -> HF then keeps every value (written back as F32)."""
  f64 = [k for k, v in src.items() if np.asarray(v).dtype == np.float64]
  for k in f64:
    v = np.asarray(src[k])
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf: not exact, refused below
      narrowed = v.astype(np.float32).astype(np.float64)
    if not np.array_equal(narrowed, v, equal_nan=True):
      raise HFFormatError(f"tensor {k!r} is float64 (F64) and its values do not fit float32 exactly; the models "
                          "train float32 weights: save the checkpoint in float32 (model.float().save_pretrained)")
  if f64 and notes is not None:
    notes.append(f"{len(f64)} F64 tensor(s) narrowed to float32 (exact: every value is a float32); written back "
                 "as F32")


def _mismatches(src: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
  """One line per kind of problem (missing, unexpected, wrong shape, not floating point), naming the tensors."""
  missing = [k for k in expected if k not in src]
  extra = sorted(k for k in src if k not in expected)
  wrong = [f"{k}: {tuple(src[k].shape)} (expected {expected[k]})" for k in expected
           if k in src and tuple(src[k].shape) != expected[k]]
  not_float = [f"{k}: {np.asarray(src[k]).dtype}" for k in expected
               if k in src and not np.issubdtype(np.asarray(src[k]).dtype, np.floating)]
  problems = []
  for label, items in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong),
                       ("not floating point", not_float)):
    if items:
      problems.append(f"{label} {len(items)}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}")
  return problems


def hf_tensor_table(spec: ModelSpec, family: str) -> dict[str, tuple[tuple[int, ...], str | None]]:
  """Every tensor of the HF model: HF name -> (shape, the HF name it is tied to or None), in rule order.

  A tied head is listed as lm_head.weight tied to the embedding (`save_pretrained` does not store it); dtypes are
  any floating point on import (widened to float32 exactly; float64 only when exact in float32, else refused) and
  float32 on export.
  """
  shapes = weights.param_shapes(spec)
  table: dict[str, tuple[tuple[int, ...], str | None]] = {}
  for r in hf_rules(spec, family):
    for h, shape in zip(r.hf, r.hf_shapes(shapes[r.canonical])):
      table[h] = (shape, None)
  if spec.tie_embeddings:
    wte = "transformer.wte.weight" if naming(family) == "gpt2" else "model.embed_tokens.weight"
    table["lm_head.weight"] = (table[wte][0], wte)
  return table


def canonical_to_hf(params: Mapping[str, np.ndarray], spec: ModelSpec, family: str | None = None
                    ) -> dict[str, np.ndarray]:
  """Canonical weights -> HF state dict (float32) of the family's *ForCausalLM.

  A tied head is omitted (HF re-ties `lm_head.weight` to the embedding on load).
  Raises:
    parity.inputs.InputError (bad input, a ValueError): the canonical weights do not match the spec (named).
    HFFormatError: the spec has no HF family.
  """
  family = family or family_of_spec(spec)
  weights.check_names_and_shapes(dict(params), spec, source="canonical_to_hf")
  out = {}
  for r in hf_rules(spec, family):
    arr = np.asarray(params[r.canonical], dtype=np.float32)
    if r.rows:
      for h, piece in zip(r.hf, np.split(arr, np.cumsum(r.rows)[:-1], axis=0)):
        out[h] = np.ascontiguousarray(piece)
    else:
      out[r.hf[0]] = np.ascontiguousarray(arr.T if r.transpose else arr)
  return out
