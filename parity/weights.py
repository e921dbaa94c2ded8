"""Canonical weight naming, GPT-2 initialisation, and safetensors interchange.

The canonical layout is PyTorch's: a linear layer's weight is [out, in]. Names:

  wte.weight                [vocab, d_model]        token embedding (also the head when tied)
  wpe.weight                [max_seq_len, d_model]  learned positions (position == 'learned')
  h.{i}.ln_1.weight/.bias   [d_model]               pre-attention norm (bias only for layernorm+bias)
  h.{i}.attn.qkv.weight     [(n_heads + 2*kv_heads) * head_dim, d_model]  rows: q heads, k heads, v heads
  h.{i}.attn.qkv.bias       [(n_heads + 2*kv_heads) * head_dim]   (qkv_bias)
  h.{i}.attn.ln_q/ln_k.weight [head_dim]                  per-head q/k RMSNorm (qk_norm)
  h.{i}.attn.proj.weight    [d_model, n_heads * head_dim]
  h.{i}.attn.proj.bias      [d_model]                (out_bias)
  h.{i}.ln_1_post.weight    [d_model]                norm of the attention output (post_norms, Gemma 2/3)
  h.{i}.ln_2.weight/.bias   [d_model]
  h.{i}.mlp.fc.weight       [d_ff, d_model]         (gelu)   | mlp.gate.weight, mlp.up.weight (swiglu)
  h.{i}.mlp.fc.bias         [d_ff]
  h.{i}.mlp.proj.weight     [d_model, d_ff]
  h.{i}.mlp.proj.bias       [d_model]                (mlp_bias; geglu has gate/up as swiglu)
  h.{i}.ln_2_post.weight    [d_model]                norm of the MLP output (post_norms)
  ln_f.weight/.bias         [d_model]
  lm_head.weight            [vocab, d_model]        only when tie_embeddings is False

Each side maps these names to its own layout in exactly one place
(`jax_impl/model.py: to_flax/from_flax`, `torch_impl/model.py: load_canonical`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from parity.inputs import InputError, safetensors_header
from parity.spec import DECAY_MASKS, ModelSpec, to_dict

__all__ = ["param_shapes", "init_params", "decays", "save", "load", "check_names_and_shapes", "zero_grad_slices",
           "round_to_bfloat16", "master_weights",
           "RESIDUAL_PROJECTIONS",
           "SPEC_METADATA_KEY", "spec_metadata"]

RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")
"""Weights whose init std is scaled by 1/sqrt(2 * n_layers) (GPT-2 paper, section 2.3)."""


def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
  """Canonical name -> shape, in canonical (deterministic) order."""
  d, f, hd = spec.d_model, spec.ffn_dim, spec.head_dim
  qkv = (spec.n_heads + 2 * spec.kv_heads) * hd
  has_norm_bias = spec.bias and spec.norm == "layernorm"
  shapes: dict[str, tuple[int, ...]] = {"wte.weight": (spec.vocab_size, d)}
  if spec.position == "learned":
    shapes["wpe.weight"] = (spec.max_seq_len, d)

  def norm(prefix: str) -> None:
    shapes[f"{prefix}.weight"] = (d,)
    if has_norm_bias:
      shapes[f"{prefix}.bias"] = (d,)

  def linear(prefix: str, out_dim: int, in_dim: int, kind: str) -> None:
    shapes[f"{prefix}.weight"] = (out_dim, in_dim)
    if spec.linear_bias(kind):
      shapes[f"{prefix}.bias"] = (out_dim,)

  for i in range(spec.n_layers):
    p = f"h.{i}"
    norm(f"{p}.ln_1")
    linear(f"{p}.attn.qkv", qkv, d, "qkv")
    if spec.qk_norm:
      shapes[f"{p}.attn.ln_q.weight"] = (hd,)
      shapes[f"{p}.attn.ln_k.weight"] = (hd,)
    linear(f"{p}.attn.proj", d, spec.n_heads * hd, "out")
    if spec.post_norms:
      norm(f"{p}.ln_1_post")
    norm(f"{p}.ln_2")
    if spec.mlp == "gelu":
      linear(f"{p}.mlp.fc", f, d, "mlp")
    else:
      linear(f"{p}.mlp.gate", f, d, "mlp")
      linear(f"{p}.mlp.up", f, d, "mlp")
    linear(f"{p}.mlp.proj", d, f, "mlp")
    if spec.post_norms:
      norm(f"{p}.ln_2_post")
  norm("ln_f")
  if not spec.tie_embeddings:
    shapes["lm_head.weight"] = (spec.vocab_size, d)
  return shapes


def n_params(spec: ModelSpec) -> int:
  """Number of trainable parameters of `spec` (tied head counted once), from the canonical table param_shapes."""
  return sum(math.prod(s) for s in param_shapes(spec).values())


def init_params(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
  """GPT-2 initialisation in numpy, float32.

  Weight matrices and embeddings ~ N(0, init_std); residual projections
  (`attn.proj.weight`, `mlp.proj.weight`) ~ N(0, init_std / sqrt(2 * n_layers));
  biases 0; norm scales 1 (their weights 0 under norm_plus_one, whose scale is 1 + weight). Draws happen in
  canonical-name order from one `np.random.default_rng(seed)`, so the result depends only on (spec, seed).

  References: Radford et al. 2019 (GPT-2), section 2.3; nanoGPT `model.py _init_weights`.
  """
  rng = np.random.default_rng(seed)
  out: dict[str, np.ndarray] = {}
  for name, shape in param_shapes(spec).items():
    if ".ln_" in name or name.startswith("ln_f"):  # norm_plus_one (Gemma): the scale is 1 + weight
      arr = np.ones(shape) if name.endswith(".weight") and not spec.norm_plus_one else np.zeros(shape)
    elif name.endswith(".bias"):
      arr = np.zeros(shape)
    else:
      std = spec.init_std
      if name.endswith(RESIDUAL_PROJECTIONS):
        std /= math.sqrt(2 * spec.n_layers)
      arr = rng.standard_normal(shape) * std
    out[name] = np.ascontiguousarray(arr, dtype=np.float32)
  return out


def decays(name: str, mask: str = "matrices") -> bool:
  """True when AdamW weight decay applies to this canonical tensor under the decay mask `mask`
  (parity.spec.DECAY_MASKS, train.decay_mask):

  'matrices' (parity's own): the weight matrices of linear layers (qkv, proj, fc, gate, up, lm_head); not biases,
    norm scales, token and position embeddings (`wte`, `wpe`; with tied embeddings the head is `wte` and is
    therefore not decayed).
  'no_bias_norm' (the HF Trainer's and Megatron's two groups): every tensor but biases and norm scales, so the
    embeddings too (transformers `Trainer.get_decay_parameter_names`: no nn.LayerNorm and no name matching bias /
    layernorm / rmsnorm / norm; Megatron `get_param_groups`: no '.bias' and no 1-D tensor).
  'all' (one param group: an optimizer DeepSpeed builds over `model.parameters()`): every tensor.
  Every side builds its decay mask / param groups from this one function.
  """
  if mask == "all":
    return True
  if name.endswith(".bias") or name.startswith("ln_f.") or ".ln_" in name:
    return False
  if mask == "no_bias_norm":
    return True
  if mask != "matrices":
    raise ValueError(f"decay mask {mask!r}: expected one of {', '.join(DECAY_MASKS)}")
  return not name.startswith(("wte.", "wpe."))


def zero_grad_slices(spec: ModelSpec) -> dict[str, tuple[int, int]]:
  """Canonical tensors (or row slices of them) whose true gradient is exactly zero.

  The key bias: softmax is invariant to adding the same constant to every score
  of a query row, and q.(k + b_k) = q.k + q.b_k is such a constant, so dL/db_k = 0
  analytically. In floating point its gradient is rounding noise (~1e-10) that
  Adam normalises into lr-sized steps, so these values cannot be compared
  elementwise between implementations. Returns name -> (row_start, row_stop).
  """
  if not spec.linear_bias("qkv") or spec.qk_norm or spec.attn_softcap is not None:
    return {}  # a normed or soft-capped k no longer shifts every score of a row by one constant
  q = spec.n_heads * spec.head_dim
  k = spec.kv_heads * spec.head_dim
  return {f"h.{i}.attn.qkv.bias": (q, q + k) for i in range(spec.n_layers)}


SPEC_METADATA_KEY = "parity_model_spec"
"""safetensors metadata key holding the ModelSpec as JSON (read by `parity convert-weights`)."""


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
  """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32.

  The same rounding as `torch.Tensor.bfloat16()` and `jnp.bfloat16` casts, done on the bit pattern
  (bfloat16 is the top 16 bits of a float32), so parity/ needs neither framework.

  Args:
    x: finite float values, any shape.
  Returns:
    float32 array of the same shape.
  """
  bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
  return bits.astype(np.uint32).view(np.float32)


def master_weights(params: dict[str, np.ndarray], precision: str) -> dict[str, np.ndarray]:
  """The fp32 master weights a run starts from: the initial weights rounded to the compute dtype for bf16/fp16.

  DeepSpeed casts the module to half/bfloat16 first and copies its fp32 master partition from the cast
  params (`DeepSpeedZeroOptimizer.__init__`), so its masters start rounded. Every side starts from this
  function's result, so all sides train from the same numbers (measured on gpt2-small-cpu bf16: without
  it DeepSpeed alone takes a loss spike at step 24, 0.47 nats above the other sides).

  Args:
    params: canonical float32 weights.
    precision: 'fp32' (returned unchanged), 'bf16' or 'fp16'.
  Returns:
    name -> float32 array.
  Raises:
    ValueError: an unknown precision.
  """
  if precision == "fp32":
    return params
  if precision == "bf16":
    return {k: round_to_bfloat16(v) for k, v in params.items()}
  if precision == "fp16":
    return {k: np.asarray(v, np.float32).astype(np.float16).astype(np.float32) for k, v in params.items()}
  raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16'; got {precision!r}")


def spec_metadata(spec: ModelSpec) -> dict[str, str]:
  """{SPEC_METADATA_KEY: the spec as JSON}, so a canonical file says which model it holds."""
  return {SPEC_METADATA_KEY: json.dumps(to_dict(spec), sort_keys=True, separators=(",", ":"))}


def save(params: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
  """Writes canonical params to a safetensors file (float32, contiguous)."""
  from safetensors.numpy import save_file
  save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()}, str(path),
            metadata=metadata)


def load(path: str | Path, spec: ModelSpec | None = None) -> dict[str, np.ndarray]:
  """Reads canonical params; with a spec, checks names and shapes.

  Raises:
    FileNotFoundError: the file does not exist.
    parity.inputs.InputError (a ValueError): a tensor is missing, unexpected, or has the wrong shape (named), or
      when the file is not a valid safetensors file (truncated, bad header, entry without dtype).
  """
  from safetensors.numpy import load_file
  path = Path(path)
  if not path.exists():
    raise FileNotFoundError(f"weights file not found: {path}")
  safetensors_header(path)  # the header is checked before safetensors maps anything
  params = load_file(str(path))
  if spec is not None:
    check_names_and_shapes(params, spec, source=str(path))
  return params


def check_names_and_shapes(params: dict[str, np.ndarray], spec: ModelSpec, *, source: str) -> None:
  """Checks canonical params against the model spec: every expected tensor present, none extra, each shape as
  param_shapes(spec) gives it. Raises InputError (bad input, a ValueError) naming `source`, the missing/extra names and
  the wrong shapes."""
  expected = param_shapes(spec)
  missing = [k for k in expected if k not in params]
  extra = [k for k in params if k not in expected]
  wrong = [f"{k}: {tuple(params[k].shape)} != {expected[k]}" for k in expected
           if k in params and tuple(params[k].shape) != expected[k]]
  problems = []
  if missing:
    problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
  if extra:
    problems.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
  if wrong:
    problems.append(f"wrong shape {wrong[:5]}")
  if problems:
    raise InputError(f"{source}: weights do not match the model spec: " + "; ".join(problems))
