"""The model-family fields of ModelSpec: their validation, per-layer attention kinds, and rotary tables.

One numpy implementation of the rotary frequencies (plain, `linear`, `llama3`, `yarn`) serves both sides, so their
cos/sin tables are bitwise identical; each side only gathers rows and multiplies. Formulas follow transformers'
`modeling_rope_utils` (`_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`,
`_compute_yarn_parameters`) but are computed in float64 and rounded to float32 once (HF computes in float32,
~1e-5 off at position 128; docs/hf.md).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from parity.errors import SpecError

__all__ = ["FAMILY_DEFAULTS", "validate", "layer_kinds", "layer_rope", "inv_freq",
           "attention_factor", "rope_tables", "ROPE_TYPES", "LAYER_KINDS"]

FAMILY_DEFAULTS: dict[str, Any] = {
    "qkv_bias": None, "out_bias": None, "mlp_bias": None, "d_head": None, "qk_norm": False, "rope_scaling": None,
    "norm_plus_one": False, "embed_scale": 1.0, "post_norms": False, "attn_softcap": None, "final_softcap": None,
    "sliding_window": None, "layer_types": [], "rope_local_theta": None}
"""The model-family ModelSpec fields and their defaults (to_dict form): config_hash leaves a field out at its default,
so a GPT-2 / LLaMA run keeps the hash it had before the fields existed (gate baselines, checkpoints)."""

LAYER_KINDS = ("full", "sliding")
ROPE_TYPES = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
"""rope_scaling.rope_type -> its required keys. Other HF rope types (dynamic, longrope) are refused by name."""
_YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")


def layer_kinds(spec: Any) -> tuple[str, ...]:
  """'full' or 'sliding' per layer: spec.layer_types, or every layer 'sliding' when spec.sliding_window is set
  (Mistral) and 'full' otherwise."""
  if spec.layer_types:
    return tuple(spec.layer_types)
  return ("sliding" if spec.sliding_window is not None else "full",) * spec.n_layers


def layer_rope(spec: Any, layer: int) -> tuple[float, dict | None]:
  """(theta, rope_scaling) of layer `layer`: a 'sliding' layer of a spec with rope_local_theta uses that base and
  no scaling (Gemma 3's local rotary embedding); every other layer rope_theta and rope_scaling."""
  if spec.rope_local_theta is not None and layer_kinds(spec)[layer] == "sliding":
    return float(spec.rope_local_theta), None
  return float(spec.rope_theta), spec.rope_scaling


def inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
  """Rotary inverse frequencies, float64, shape (head_dim // 2,): theta ** (-2j / head_dim), then scaled.

  linear: / factor. llama3 (Llama 3.1): wavelengths above original_max / low_freq_factor divided by factor, below
  original_max / high_freq_factor kept, in between interpolated by (original_max / wavelength - low) / (high - low).
  yarn (Peng et al. 2023): a linear ramp between the interpolated (/ factor) and extrapolated frequencies over the
  dims whose rotations at original_max fall between beta_slow and beta_fast.
  """
  base = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  if scaling is None:
    return base
  kind, factor = scaling["rope_type"], float(scaling["factor"])
  if kind == "linear":
    return base / factor
  if kind == "llama3":
    old = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > old / low, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
  return _yarn_inv_freq(head_dim, theta, scaling, base)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any], base: np.ndarray) -> np.ndarray:
  factor, old = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
  beta_fast, beta_slow = float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0))

  def dim_of(rotations: float) -> float:  # the dim whose frequency makes `rotations` turns over `old` positions
    return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  lo, hi = dim_of(beta_fast), dim_of(beta_slow)
  if scaling.get("truncate", True):
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, head_dim - 1)
  if lo == hi:
    hi += 0.001
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
  extrapolation = 1.0 - ramp
  return (base / factor) * (1.0 - extrapolation) + base * extrapolation


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
  """The factor yarn multiplies cos and sin by (HF `attention_factor`; 0.1 ln(factor) + 1 by default); 1 otherwise."""
  if scaling is None or scaling["rope_type"] != "yarn":
    return 1.0
  if scaling.get("attention_factor") is not None:
    return float(scaling["attention_factor"])
  factor = float(scaling["factor"])

  def mscale(m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

  if scaling.get("mscale") and scaling.get("mscale_all_dim"):
    return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
  return mscale(1.0)


def rope_tables(seq_len: int, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """Rotary cos/sin in HF's rotate-half layout, float32, shape (seq_len, head_dim).

  angle[t, j] = t * inv_freq[j mod head_dim / 2], in float64, times `attention_factor` (yarn), rounded once.
  """
  ang_th2 = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq(head_dim, theta, scaling))
  ang_th = np.concatenate([ang_th2, ang_th2], axis=-1)
  a = attention_factor(scaling)
  return (np.cos(ang_th) * a).astype(np.float32), (np.sin(ang_th) * a).astype(np.float32)


# ----------------------------------------------------------------------------- validation


def validate(spec: Any) -> None:
  """Raises SpecError naming the model-family model.<field> whose value cannot describe a model."""
  for name in ("qkv_bias", "out_bias", "mlp_bias"):
    if getattr(spec, name) is not None and not isinstance(getattr(spec, name), bool):
      raise SpecError(f"model.{name} must be null (follow model.bias) or true/false; got {getattr(spec, name)!r}")
  for name in ("qk_norm", "norm_plus_one", "post_norms"):
    if not isinstance(getattr(spec, name), bool):
      raise SpecError(f"model.{name} must be true or false; got {getattr(spec, name)!r}")
  if spec.d_head is not None and (isinstance(spec.d_head, bool) or not isinstance(spec.d_head, int) or spec.d_head < 1):
    raise SpecError(f"model.d_head must be null (d_model / n_heads) or an integer >= 1; got {spec.d_head!r}")
  for name in ("attn_softcap", "final_softcap", "rope_local_theta"):
    _positive_or_none(spec, name)
  if isinstance(spec.embed_scale, bool) or not isinstance(spec.embed_scale, (int, float)) or not spec.embed_scale > 0:
    raise SpecError(f"model.embed_scale must be a number > 0 (1.0: none); got {spec.embed_scale!r}")
  if spec.norm_plus_one and spec.norm != "rmsnorm":
    raise SpecError("model.norm_plus_one (Gemma's (1 + weight) scale) needs model.norm 'rmsnorm'; got "
                    f"{spec.norm!r}")
  _validate_windows(spec)
  _validate_rope(spec)


def _positive_or_none(spec: Any, name: str) -> None:
  v = getattr(spec, name)
  if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
    raise SpecError(f"model.{name} must be null (none) or a number > 0; got {v!r}")


def _validate_windows(spec: Any) -> None:
  w = spec.sliding_window
  if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
    raise SpecError(f"model.sliding_window must be null (full attention) or an integer >= 1; got {w!r}")
  if not isinstance(spec.layer_types, tuple):
    raise SpecError(f"model.layer_types must be a list of 'full' / 'sliding'; got {spec.layer_types!r}")
  if spec.layer_types:
    if len(spec.layer_types) != spec.n_layers:
      raise SpecError(f"model.layer_types has {len(spec.layer_types)} entries; it needs one per layer "
                      f"(model.n_layers = {spec.n_layers}), or [] for the default")
    bad = [k for k in spec.layer_types if k not in LAYER_KINDS]
    if bad:
      raise SpecError(f"model.layer_types: {bad[0]!r} is not a layer kind; use 'full' or 'sliding'")
    if "sliding" in spec.layer_types and w is None:
      raise SpecError("model.layer_types has 'sliding' layers but model.sliding_window is null; give the window")
  if spec.rope_local_theta is not None and "sliding" not in layer_kinds(spec):
    raise SpecError("model.rope_local_theta is the rotary base of 'sliding' layers, and this model has none; "
                    "leave it null or set model.layer_types / model.sliding_window")


def _validate_rope(spec: Any) -> None:
  sc = spec.rope_scaling
  if sc is None:
    return
  if not isinstance(sc, Mapping) or "rope_type" not in sc:
    raise SpecError(f"model.rope_scaling must be null or an object with a rope_type; got {sc!r}")
  kind = sc["rope_type"]
  if kind not in ROPE_TYPES:
    raise SpecError(f"model.rope_scaling.rope_type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
  allowed = set(ROPE_TYPES[kind]) | {"rope_type"} | (set(_YARN_OPTIONAL) if kind == "yarn" else set())
  unknown = sorted(set(sc) - allowed)
  if unknown:
    raise SpecError(f"model.rope_scaling ({kind}): unknown key(s) {', '.join(unknown)}; expected "
                    f"{', '.join(sorted(allowed))}")
  for key in ROPE_TYPES[kind]:
    v = sc.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
      raise SpecError(f"model.rope_scaling.{key} ({kind}) must be a number > 0; got {v!r}")
  for key in sorted(set(_YARN_OPTIONAL) & set(sc)) if kind == "yarn" else ():
    v = sc[key]
    if key == "truncate" and not isinstance(v, bool):
      raise SpecError(f"model.rope_scaling.truncate (yarn) must be true or false; got {v!r}")
    if key != "truncate" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v <= 0):
      raise SpecError(f"model.rope_scaling.{key} (yarn) must be a number > 0; got {v!r}")
  if kind == "llama3" and not float(sc["high_freq_factor"]) > float(sc["low_freq_factor"]):
    raise SpecError("model.rope_scaling (llama3): high_freq_factor must exceed low_freq_factor; got "
                    f"{sc['high_freq_factor']} and {sc['low_freq_factor']}")
