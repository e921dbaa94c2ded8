"""The semantics card: the conventions a side's training step actually runs, read from the side's
own built objects after `build` and before step 1 (`parity.protocol.loop.Side.semantics`; jax_impl.semantics,
torch_impl.semantics), written to run_dir/<side>/semantics.json and diffed between sides (parity.protocol.semantics
writes and gates it; parity.verdict.sides.semantics_check is the report's check).

Card (schema 'parity.semantics/1'): {schema, side, run_id, items {item: value}, info {item: value}}.
`items` are the conventions that change the math (DIFFED; a difference between two sides is a FAIL at step 0);
`info` are names that legitimately differ between correct sides (optimizer classes, foreach vs fused, where a value
was read) and are shown, never diffed. Values are JSON scalars, lists or null ("the side has no such thing").
The framework-free halves of the probes live here too (each side calls its own function, these classify the
output), so both sides name a convention by the same rule.

Imports neither jax nor torch.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = ["SEMANTICS_SCHEMA", "DIFFED", "make_card", "diff_cards", "diff_text", "sig", "GELU_PROBE_X", "GELU_FORMS",
           "classify_gelu",
           "classify_rotary", "rope_row", "window_of", "CAP_PROBE", "NAME_LISTS", "layers_text",
           "norm_probe", "REDUCTION_PROBE", "classify_reduction", "IMPORT_PERMUTATION", "PRECISION_ENV",
           "precision_settings", "precision_rows", "moments_dtype", "PROBE_LOSS_ATOL",
           "probe_loss_tolerance", "probe_spec", "probe_params",
           "probe_tokens",
           "ROUNDING_PROBE", "rounding_probe", "bf16_round", "classify_norm_rounding", "norm_eps_item", "one_or_each",
           "BETA_ATOL"]

SEMANTICS_SCHEMA = "parity.semantics/1"

DIFFED = ("rotary.layout", "rotary.import_permutation", "rotary.per_layer", "mlp.gelu_form", "norm.form", "norm.eps",
          "norm.eps_all", "norm.stats_dtype", "norm.rounding", "attention.qk_norm", "attention.qk_norm_eps",
          "attention.scale", "attention.softcap", "attention.window", "embedding.scale", "logits.final_softcap",
          "loss.label_shift", "loss.reduction", "optimizer.decay_set", "optimizer.weight_decay",
          "optimizer.weight_decay_groups", "optimizer.betas", "optimizer.eps", "optimizer.eps_placement",
          "optimizer.bias_correction", "clip.rule", "clip.max_norm", "lr.step0", "dtypes.params", "dtypes.master",
          "dtypes.moments", "dtypes.grads", "matmul.precision", "dropout", "forward.probe_loss")
"""The card items diffed between sides, each a convention that changes the math:
  rotary.layout             'half-split' (HF rotate_half) | 'interleaved' | null (no rotary): the side's rotary
                            function applied to a basis vector
  rotary.import_permutation the q/k permutation applied on import (parity.hf applies none: 'none')
  rotary.per_layer          per layer, [angle at position 1 of dim 0, of dim H/2 - 1 (radians), the cos/sin factor
                            (yarn's attention factor; 1 otherwise), a digest of the whole row] of the side's rotary
                            tables for that layer (6 significant digits, `rope_row`); null without rotary
  mlp.gelu_form             'tanh' | 'erf' | 'silu' | 'other': the MLP nonlinearity object at GELU_PROBE_X
                            (classify_gelu: the nearest form, by a margin far above any backend's rounding)
  norm.form, norm.eps       'layernorm' | 'rmsnorm' | 'rmsnorm(1+w)' and the eps inferred from the norm's output
                            (the first block's first norm)
  norm.eps_all              the eps of every norm module the side's model holds (each block's, the q/k norms, the
                            final norm), as that module adds it (`norm_eps_item`): one number when all are equal, else
                            one 'NAMES EPS' text per norm and eps, so a final norm's eps 10x off (a Llama-1 1e-6 left
                            in a Llama-2 1e-5 port, which the first block's norm.eps does not see) differs here
  norm.stats_dtype          the dtype its statistics are computed in ('float32')
  norm.rounding             how the norm's bf16 output is rounded (`classify_norm_rounding`): 'one rounding' (the
                            normalised value times the scale in float32, rounded once: LayerNorm, HF Gemma's (1 + w))
                            | 'rounded factors' (the normalised value and the scale each rounded to bf16, then their
                            product: HF LlamaRMSNorm) | 'other'
  attention.qk_norm(_eps)   the per-head q/k norm of the first block's attention: its form and eps; null: none
  attention.scale           the factor of q.k the attention module uses (6 significant digits)
  attention.softcap, logits.final_softcap   the caps: the side's `softcap` function at CAP_PROBE with the cap the
                            attention module / model passes it (null: none)
  attention.window          per layer, the sliding window of the side's mask for that layer at T = train.seq_len:
                            the largest visible distance + 1, or 'full' (every earlier key visible; `window_of`)
  embedding.scale           the factor the embedding path multiplies the token embeddings by (1.0: none)
  loss.label_shift          the target offset the loss function scores input t against (1: next token)
  loss.reduction            'mean' (over tokens) | 'sum' (the stream layout's reduction)
  optimizer.decay_set       the canonical parameter names actually decayed (sorted), per layer
  optimizer.weight_decay    the decay factor of the decayed set
  optimizer.weight_decay_groups  the distinct weight decays the optimizer applies, ascending: one per param group
                            (torch: the groups holding params; JAX: the built decay for the masked leaves, 0.0 for the
                            others), so [0.0, 0.1] for decayed and undecayed params, [0.1] when every param decays
  optimizer.betas           [beta1, beta2] the optimizer was built with (at step 0, where a schedule cycles beta1), a
                            list of such pairs when the param groups differ; null: no betas (SGD). Compared within
                            BETA_ATOL per element
  optimizer.eps             the eps the optimizer was built with (per group when they differ; null: none, SGD)
  optimizer.eps_placement   'outside' (sqrt(v) + eps) | 'inside' (sqrt(v + eps)) | null (no Adam)
  optimizer.bias_correction true | false | null
  clip.rule, clip.max_norm  'global-l2' | 'none', and its threshold as the built optimizer / step holds it (JAX: the
                            clip transform's own; torch: the value its step clips with; DeepSpeed: the engine's
                            gradient_clipping())
  lr.step0                  the learning rate the first update applies
  dtypes.*                  params (the forward's), master weights, moments, gradients (the optimizer's input);
                            moments: 'first X, second Y' when Adam's two moments differ (moments_dtype)
                            (fsdp: the coarser of that and its gradient reduce dtype)
  matmul.precision          'highest' | 'high' (TF32) | 'medium'
  dropout                   the largest dropout probability of the model's modules (0.0: none)
  forward.probe_loss        the loss of the side's own model class, in float32 on the host CPU, of `probe_spec` (at
                            most 3 layers, 512 tokens; null above PROBE_MAX_PARAMS) on probe weights and tokens
                            (`probe_params`, `probe_tokens`): non-uniform norm gains, O(1) activations and
                            logits that reach the soft-caps. Equal within probe_loss_tolerance, not bit for bit
                            (`diff_cards`). A forward porting bug the init weights hide (q/k norms after rotary: the
                            norms' gains are uniform at init; a skipped soft-cap: scores ~0.04 at init) moves it
                            by orders of magnitude more; computed on the host CPU, it tests the code, not a device"""


NAME_LISTS = ("optimizer.decay_set",)
"""The items whose value is a list of parameter names (the diff text gives counts and the names only one side has)."""

IMPORT_PERMUTATION = "none"
"""The q/k permutation applied on import: none. parity.hf maps HF tensors to canonical names by name and transposes
only (parity/hf/__init__.py: HF's rotate-half layout, which both models use, so no permutation); both sides load
those canonical tensors as they are."""

GELU_PROBE_X = (1.0, -3.0)
"""Where the MLP nonlinearity is probed. Two points where the forms are far apart relative to any backend's rounding:
at x = 1 tanh-GELU and erf-GELU differ by 1.5e-4, at x = -3 by 4.1e-4 (10% of the value); SiLU is far from both at
each."""

GELU_FORMS = {
    "tanh": lambda x: 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
    "erf": lambda x: 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))),
    "silu": lambda x: x / (1.0 + math.exp(-x)),
}
"""Each candidate form in float64."""

GELU_MARGIN = 0.25
"""A form is named when the probe's value lies within this fraction of the gap to the nearest other form, at every
probe point: 3.8e-5 at x = 1 and 1.0e-4 at x = -3 for tanh vs erf. Backend rounding measured (float32 against the
float64 form, tests/data/tpu_v5e/numerics.json): TPU v5e tanh-GELU 3.7e-6 at x = 1 and 1.1e-5 at x = -3 (its tanh is
an approximation, 7e-5 relative at worst), erf-GELU <= 4e-7; CPU <= 2e-7. So the nearest-form test keeps ~10x over the
worst backend measured, and a value between two forms by more than that is 'other'."""


def classify_gelu(ys: Sequence[float]) -> str:
  """'tanh' | 'erf' | 'silu' | 'other': the nonlinearity whose values at GELU_PROBE_X are ys (GELU_MARGIN)."""
  try:
    ys = [float(y) for y in ys]
  except (TypeError, ValueError, OverflowError):  # not numbers: no form
    return "other"
  if len(ys) != len(GELU_PROBE_X) or not all(math.isfinite(y) for y in ys):
    return "other"
  for form, f in GELU_FORMS.items():
    ok = True
    for x, y in zip(GELU_PROBE_X, ys):
      gap = min(abs(f(x) - g(x)) for k, g in GELU_FORMS.items() if k != form)
      ok = ok and abs(y - f(x)) < GELU_MARGIN * gap
    if ok:
      return form
  return "other"


def classify_rotary(y: np.ndarray) -> str:
  """'half-split' | 'interleaved' | 'other': the layout of a rotary function whose image of e_0 (H,) is y: the
  rotated mass on index H/2 (HF rotate_half) or on index 1 (interleaved pairs)."""
  h = len(y)
  moved = [i for i in range(1, h) if abs(y[i]) > 1e-3]
  return "half-split" if moved == [h // 2] else "interleaved" if moved == [1] else "other"


def rope_row(cos_h: np.ndarray, sin_h: np.ndarray) -> list[float | str]:
  """[angle of dim 0, angle of dim H/2 - 1, factor, digest] of a rotary table's row at position 1 (cos, sin (H,)
  float32 values): the angles atan2(sin, cos) in radians and the factor hypot(cos, sin) of dim 0, each to 6
  significant digits, and 'sha256:' + 12 hex digits of the whole row's float32 bytes, so that a difference in any
  dim (a yarn beta, a llama3 band edge) shows, not only at the two ends read out."""
  c, s = np.asarray(cos_h, np.float64), np.asarray(sin_h, np.float64)
  last = len(c) // 2 - 1
  blob = np.concatenate([c, s]).astype(np.float32).tobytes()
  return [sig(np.arctan2(s[0], c[0]), 6), sig(np.arctan2(s[last], c[last]), 6), sig(np.hypot(c[0], s[0]), 6),
          "sha256:" + hashlib.sha256(blob).hexdigest()[:12]]


def window_of(visible_ts: np.ndarray) -> int | str:
  """The sliding window of a bool (T, S) attention mask (True = attend): 'full' when every key s <= t is visible,
  else the largest visible distance t - s + 1."""
  v = np.asarray(visible_ts, bool)
  t = v.shape[-1]
  causal = np.tril(np.ones((t, t), bool))
  if v[causal].all():
    return "full"
  dist = np.arange(t)[:, None] - np.arange(t)[None, :]
  return int(dist[v & causal].max()) + 1


CAP_PROBE = 1.0e4
"""The input the soft-cap probes pass to the side's `softcap`: cap * tanh(1e4 / cap) is the cap to float32 for every
cap under ~1e3."""


def norm_probe(apply: Callable[[np.ndarray], np.ndarray], d: int) -> dict[str, Any]:
  """{form, eps, stats_dtype} of a norm `apply(x (D,) numpy) -> y (D,)` with unit scale and zero bias."""
  alt = np.tile(np.array([1.0, -1.0]), d // 2)
  y = apply((1.0 + 2.0 * (alt < 0)).astype(np.float32))  # 1, 3, 1, 3: LayerNorm -1, +1; RMS 1/sqrt(5)
  ratio = y[0] / (1.0 / np.sqrt(5.0))
  form = ("layernorm" if abs(y[0] + 1.0) < 1e-3 else "rmsnorm" if abs(ratio - 1.0) < 1e-3
          else "rmsnorm(1+w)" if abs(ratio - 2.0) < 2e-3 else "other")
  gain = 2.0 if form == "rmsnorm(1+w)" else 1.0
  best = None
  for a in (10.0 ** -k for k in range(1, 8)):
    y0 = abs(apply((a * alt).astype(np.float32))[0]) / gain
    if 0.0 < y0 < 1.0 and (best is None or abs(y0 - 0.5) < abs(best[1] - 0.5)):
      best = (a, y0)
  eps = sig(best[0] ** 2 * (1.0 / best[1] ** 2 - 1.0)) if best is not None else None
  big = abs(apply((300.0 * alt).astype(np.float16))[0]) / gain
  return {"form": form, "eps": eps, "stats_dtype": "float32" if abs(big - 1.0) < 1e-2 else "reduced"}


PROBE_SEED, PROBE_BATCH, PROBE_LEN = 20261206, 2, 24
"""The forward probe's weights seed, rows and tokens per row (at most model.max_seq_len)."""
PROBE_LOSS_ATOL = 1e-5
"""The floor of forward.probe_loss's tolerance, nats: the fp32 loss tolerance (parity.verdict.tolerances), and the
bound transformers' oracle holds our torch and JAX models to on such weights (tests/test_hf_oracle.py, 1e-5). Above
it the tolerance grows with the loss (`probe_loss_tolerance`)."""
F32_UNIT_ROUNDOFF = 2.0 ** -24
PROBE_LAMBDA = 3.0
"""The probabilistic rounding model's lambda (Higham & Mary 2019): a float32 sum of n terms, in any order, is within
lambda * sqrt(n) * u * sum|terms| of the exact sum with probability >= 1 - 2 exp(-lambda^2 / 2) per rounding chain's
bound (lambda 3: the worst-case bound n * u is ~10x looser and would hide nothing more here)."""


def probe_loss_tolerance(a: float, b: float) -> float:
  """How far two sides' forward.probe_loss may sit apart from rounding alone, nats: the float32 rounding of the probe's
  two last reductions on each side (their order, the vector width and FMA use differ by framework and by CPU), in the
  probabilistic model: the token mean over N = PROBE_BATCH * (PROBE_LEN - 1) per-token losses (lambda * (sqrt(N) + 1)
  * u * |loss|: the sum and the division), and each token's log-sum-exp over the vocabulary V <= 512 (`probe_spec`;
  terms <= 1 after the max shift, sum >= 1: the log turns the sum's relative error into lambda * sqrt(V) * u nats),
  twice (two sides), and never under PROBE_LOSS_ATOL. The matmuls before them add less: measured, the sides agree bit
  for bit on qwen2-, qwen3- and mistral-tiny and differ by 0-3 ulps of the loss on the others, on CPUs with and
  without AVX-512 (tests/test_card_probes.py). At gpt2-tiny's loss of 8.0: 3.0e-5; the forward family plants (q/k
  norms after rotary, skipped soft-caps) move it by 8.1e-3 and more; a norm's eps is the card's norm.eps_all item,
  under this tolerance here. Non-finite values agree only when equal (`_item_same`) (benchmarks/results/*-family-
  plants.md)."""
  n = PROBE_BATCH * (PROBE_LEN - 1)
  per_side = PROBE_LAMBDA * F32_UNIT_ROUNDOFF * ((math.sqrt(n) + 1.0) * max(abs(a), abs(b))
                                                 + math.sqrt(512.0))
  return max(PROBE_LOSS_ATOL, 2.0 * per_side)


PROBE_MAX_PARAMS = 200_000_000
"""Above this many parameters of `probe_spec` (float32: 0.8 GB) the forward probe is not run (its item null on every
side): it builds the model once more on the host."""


def probe_spec(spec: Any) -> Any:
  """The spec the forward probe runs: the run's model with at most 3 layers (their kinds kept: every Gemma pattern's
  first period has both kinds) and a vocabulary of at most 512; every other field, the code paths it selects, as
  the run's. None when that is still over PROBE_MAX_PARAMS."""
  import dataclasses
  from parity.weights import n_params
  n = min(spec.n_layers, 3)
  small = dataclasses.replace(spec, n_layers=n, vocab_size=min(spec.vocab_size, 512),
                              layer_types=tuple(spec.layer_kinds[:n]) if spec.layer_types else ())
  return small if n_params(small) <= PROBE_MAX_PARAMS else None


def probe_params(spec: Any) -> dict[str, np.ndarray]:
  """Canonical float32 weights of `spec` for the forward probe, the same on every side: matrices ~ N(0, 1/fan_in),
  embeddings ~ N(0, 0.3^2) (logits of std ~0.3 sqrt(d_model), reaching ~10: past Gemma's caps), norm gains
  1 + N(0, 0.3^2) (0 + ... under norm_plus_one: the scale is 1 + weight), other 1-D tensors N(0, 0.1^2); drawn in
  canonical order from one generator (PROBE_SEED). As transformers' oracle tests draw a checkpoint."""
  from parity.weights import param_shapes
  rng = np.random.default_rng(PROBE_SEED)
  out = {}
  for name, shape in param_shapes(spec).items():
    noise = rng.standard_normal(shape)
    if len(shape) == 1:
      norm = ".ln_" in name or name.startswith("ln_f")
      base = 1.0 if norm and name.endswith(".weight") and not spec.norm_plus_one else 0.0
      arr = base + (0.3 if norm else 0.1) * noise
    elif name.startswith(("wte", "wpe")):
      arr = 0.3 * noise
    else:
      arr = noise / math.sqrt(shape[-1])
    out[name] = arr.astype(np.float32)
  return out


def probe_tokens(spec: Any) -> np.ndarray:
  """int64 (PROBE_BATCH, T + 1) token ids of the forward probe, T = min(PROBE_LEN, model.max_seq_len): inputs
  tokens[:, :-1], targets tokens[:, 1:]."""
  t = min(PROBE_LEN, spec.max_seq_len)
  return np.random.default_rng(PROBE_SEED + 1).integers(0, spec.vocab_size, (PROBE_BATCH, t + 1), dtype=np.int64)


def bf16_round(x: np.ndarray) -> np.ndarray:
  """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32 (numpy has no bfloat16)."""
  u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
  return u.astype(np.uint32).view(np.float32)


ROUNDING_PROBE = 0.37
"""The norm rounding probe's scale weights start here (bf16-exact values from it up, one per element): 1 + 0.369 is
no bfloat16 value, so rounding the scale (and the normalised value) first moves the product on some elements."""


def rounding_probe(d: int, plus_one: bool) -> tuple[np.ndarray, np.ndarray]:
  """(x (R, d), weight (d,)) of the norm rounding probe, float32 holding bfloat16 values: R = ceil(256 / d) rows of x
  from 1 to ~4 in uneven steps (no normalised value is a bfloat16 value; at least 256 elements, so that some dozen
  tell the two roundings apart at any width), the weight ROUNDING_PROBE upwards (plus 1 when the scale is the weight
  itself, so the scale is ~1.37-1.77 either way)."""
  rows = -(-256 // d)
  i = np.arange(rows * d, dtype=np.float64).reshape(rows, d)
  x = bf16_round((1.0 + 3.0 * ((i * 0.618034) % 1.0)).astype(np.float32))
  j = np.arange(d, dtype=np.float64)
  w = bf16_round((ROUNDING_PROBE + 0.4 * ((j * 0.414214) % 1.0) + (0.0 if plus_one else 1.0)).astype(np.float32))
  return x, w


def classify_norm_rounding(x: np.ndarray, w: np.ndarray, y: np.ndarray, form: str, eps: float | None) -> str:
  """'one rounding' | 'rounded factors' | 'other': how a norm of `form` ('layernorm' | 'rmsnorm' | 'rmsnorm(1+w)')
  with weight w (bias 0) rounded its bfloat16 output y (float32 copy) of input x (`rounding_probe`): the normalised
  value times the scale in float32 rounded once, or both rounded to bfloat16 first. Judged on the elements where the
  two differ; a 1-ulp float32 difference in the statistics may flip one element, so 90% of them decide."""
  x64 = np.asarray(x, np.float64)
  e = float(eps or 0.0)
  if form == "layernorm":
    c = x64 - x64.mean(-1, keepdims=True)
    n = (c / np.sqrt((c * c).mean(-1, keepdims=True) + e)).astype(np.float32)
  else:
    n = (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + e)).astype(np.float32)
  scale = (1.0 + np.asarray(w, np.float32)).astype(np.float32) if form == "rmsnorm(1+w)" else np.asarray(w, np.float32)
  one = bf16_round(n * scale)
  two = bf16_round(bf16_round(n) * bf16_round(scale))
  tell = one != two
  if tell.sum() < 4:
    return "other"
  y = np.asarray(y, np.float32)
  if np.mean(y[tell] == one[tell]) >= 0.9:
    return "one rounding"
  if np.mean(y[tell] == two[tell]) >= 0.9:
    return "rounded factors"
  return "other"


REDUCTION_PROBE = (4, 6)
"""(V, N): the loss probes score N targets of logits 0 over V classes (each term log V)."""


def classify_reduction(y: float) -> str:
  """'mean' | 'sum' | 'other' of a loss whose value on REDUCTION_PROBE's logits 0 is y."""
  v, n = REDUCTION_PROBE
  return "mean" if abs(y - np.log(v)) < 1e-5 else "sum" if abs(y - n * np.log(v)) < 1e-4 else "other"

def moments_dtype(first: Sequence[str], second: Sequence[str]) -> str | None:
  """dtypes.moments of an Adam state from the dtypes of its first (mu / exp_avg) and second (nu / exp_avg_sq) moment
  tensors: the one dtype when all agree ('float32'), else 'first X, second Y' (several dtypes in one moment: joined
  by '/'), so a bfloat16 first moment beside a float32 second one differs from two float32 moments on the card.
  None when there is no second moment (no Adam)."""
  a, b = sorted(set(first)), sorted(set(second))
  if not b:
    return None
  if a == b and len(a) == 1:
    return a[0]
  return f"first {'/'.join(a) or 'none'}, second {'/'.join(b)}"


def norm_eps_item(eps_by_name: Mapping[str, float | None]) -> float | list[str] | None:
  """norm.eps_all of {a norm module's canonical name ('h.0.ln_1', 'h.3.attn.ln_q', 'ln_f'): the eps it adds}: the
  one eps (6 significant digits) when every norm has it; else one 'NAMES EPS' text per norm role and eps, blocks
  first, by role and first layer: a role every block shares an eps of is 'h.*.ROLE', a part of the blocks
  'h.{0-2,5}.ROLE' ('h.*.ln_1 1e-05', 'ln_f 1e-06'). None: no norm. The same map gives the same value on every side,
  whatever order its modules come in."""
  vals = {str(k): (None if v is None else sig(v, 6)) for k, v in eps_by_name.items()}
  if not vals:
    return None
  distinct = {json.dumps(v) for v in vals.values()}
  if len(distinct) == 1:
    return next(iter(vals.values()))
  blocks = sorted({int(k.split(".")[1]) for k in vals if _block_index(k) is not None})
  groups: dict[tuple[str, str], list[int]] = {}  # (role, eps text) -> its layers; outside the blocks: [-1]
  for name, v in vals.items():
    i = _block_index(name)
    role = name.split(".", 2)[2] if i is not None else name
    groups.setdefault((role, "default" if v is None else f"{v:g}"), []).append(-1 if i is None else i)
  rows = []
  for (role, eps), layers in groups.items():
    if layers == [-1]:
      rows.append(((1, role, 0), f"{role} {eps}"))
      continue
    layers = sorted(layers)
    at = "*" if layers == blocks else str(layers[0]) if len(layers) == 1 else "{" + _ranges(layers) + "}"
    rows.append(((0, role, layers[0]), f"h.{at}.{role} {eps}"))
  return [text for _, text in sorted(rows)]


def _block_index(name: str) -> int | None:
  """i of a block module's canonical name 'h.i.ROLE', else None."""
  parts = name.split(".", 2)
  return int(parts[1]) if len(parts) == 3 and parts[0] == "h" and parts[1].isdigit() else None


def _ranges(xs: Sequence[int]) -> str:
  """'0-2,5' of the sorted layer indices [0, 1, 2, 5]."""
  out, start = [], xs[0]
  for a, b in zip(xs, list(xs[1:]) + [None]):
    if b != a + 1:
      out.append(str(start) if start == a else f"{start}-{a}")
      start = b
  return ",".join(out)


def one_or_each(values: Sequence[Any]) -> Any:
  """The one value of a setting every param group holds alike (compared as JSON), else the list of each group's:
  a torch optimizer keeps betas and eps per group, and a group that differs must not hide behind the first."""
  values = list(values)
  if not values:
    return None
  return values[0] if len({json.dumps(v) for v in values}) == 1 else values


def sig(x: float, digits: int = 3) -> float:
  """x rounded to `digits` significant digits (a probe's inferred value, so both frameworks' float noise agrees)."""
  return float(f"{float(x):.{digits}g}") if math.isfinite(float(x)) else float(x)


def make_card(side: str, run_id: str | None, items: Mapping[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
  """The card as written: schema, side, run_id, items (every DIFFED key; a missing one is null), info.

  Raises:
    ValueError: an item that is not in DIFFED (a typo would never be diffed).
  """
  unknown = sorted(set(items) - set(DIFFED))
  if unknown:
    raise ValueError(f"semantics card items {unknown} are not in parity.semantics.DIFFED")
  return {"schema": SEMANTICS_SCHEMA, "side": side, "run_id": run_id,
          "items": {k: items.get(k) for k in DIFFED}, "info": dict(info)}


ITEM_ATOL = {"forward.probe_loss": probe_loss_tolerance}
"""Items compared within a tolerance of their two values rather than as JSON (`diff_cards`)."""

BETA_ATOL = 1e-7
"""How far two sides' optimizer.betas may sit apart, per element: a beta in [0.5, 1) held in float32 (the JAX side's
beta1 table where a schedule cycles it) is within half an ulp, 2^-25 = 3.0e-8, of the float64 value a torch param
group holds; 1e-7 is 3.3x that. A beta2 that matters is 1e-5 or more away (0.99999 vs 0.999999: 1 - beta2 ten times
larger; the planted 0.949 vs 0.95: 1e-3), 100x over. The generic relative 1e-5 of `_same` would call 0.99999 and
0.999999 equal."""
LIST_ATOL = {"optimizer.betas": BETA_ATOL}
"""Items whose value is a list of numbers compared element by element within an absolute tolerance (`diff_cards`)."""


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
          and not isinstance(b, bool):
    return math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=0.0) or a == b  # float32 vs float64 reads
  return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def diff_cards(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """(item, a's value, b's value) for every DIFFED item the two cards' `items` disagree on, in DIFFED order. Numbers
  agree within a relative 1e-5 (a float32 read on one side against a float64 one on the other, each rounded to 6
  significant digits for the table: at most 5e-7 each); ITEM_ATOL's items within their tolerance; LIST_ATOL's
  number lists element by element within theirs; the rest as JSON. An item one card does not hold at all is not
  compared: `make_card` writes every DIFFED item (null when the side has no such thing), so only a card of an older
  parity (a folder joined from before the item existed) lacks one."""
  ia, ib = a.get("items") or {}, b.get("items") or {}
  return [(k, ia.get(k), ib.get(k)) for k in DIFFED
          if k in ia and k in ib and not _item_same(k, ia.get(k), ib.get(k))]


def _item_same(k: str, a: Any, b: Any) -> bool:
  if k in ITEM_ATOL and isinstance(a, (int, float)) and isinstance(b, (int, float)):
    if not (math.isfinite(a) and math.isfinite(b)):  # an overflowed loss agrees with nothing but the same value
      return float(a) == float(b) or (math.isnan(a) and math.isnan(b))
    return abs(float(a) - float(b)) <= ITEM_ATOL[k](float(a), float(b))
  if k in LIST_ATOL and _numbers(a) and _numbers(b) and len(a) == len(b):
    return all(abs(float(x) - float(y)) <= LIST_ATOL[k] for x, y in zip(a, b))
  return _same(a, b)


def _numbers(v: Any) -> bool:
  """A list of plain numbers (not bools)."""
  return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)


def _value_text(v: Any, other: Any, names: bool = False) -> str:
  """A value for the message; of two name lists (`names`: the decay sets), the count and the names only this one
  has; a list of per-layer values in round brackets (no square brackets: a terminal's markup would eat them)."""
  if isinstance(v, list) and not (names and isinstance(other, list)):
    return layers_text(v)
  if isinstance(v, list) and isinstance(other, list):
    only = [x for x in v if x not in other]
    if not only:
      return f"{len(v)} names (none the other lacks)"
    return (f"{len(v)} names ({len(only)} the other lacks: " + ", ".join(map(str, only[:4]))
            + (", ..." if len(only) > 4 else "") + ")")
  return json.dumps(v) if not isinstance(v, str) else v


def layers_text(v: Any) -> str:
  """A per-layer value list as '((1, 0.5, 1), (1, 0.5, 1))' / '(8, full)' text (round brackets: `_value_text`)."""
  if isinstance(v, list):
    return "(" + ", ".join(layers_text(x) for x in v) + ")"
  return v if isinstance(v, str) else json.dumps(v)


def diff_text(na: str, nb: str, diffs: Sequence[tuple[str, Any, Any]]) -> str:
  """'semantics: mlp.gelu_form jax=tanh deepspeed=erf; ...' for the differences of sides na and nb."""
  return "semantics: " + "; ".join(
      f"{k} {na}={_value_text(va, vb, k in NAME_LISTS)} {nb}={_value_text(vb, va, k in NAME_LISTS)}"
      for k, va, vb in diffs)


PRECISION_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_DEFAULT_MATMUL_PRECISION", "JAX_ENABLE_X64",
                 "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")
"""The environment variables that can change how a side's numbers round: XLA's flags (XLA_FLAGS; on TPU also
LIBTPU_INIT_ARGS, which carries XLA:TPU's own flags), jax's default matmul precision and x64 switch, and the TF32
overrides of torch and of NVIDIA's libraries."""


def precision_settings(environ: Mapping[str, str], backend: str, device: str, matmul: str) -> dict[str, Any]:
  """The precision settings one side ran with, for its card's info ('precision_settings'): the backend and device
  its step ran on, its framework's float32 matmul setting as the framework states it (jax.config's
  default_matmul_precision, torch's get_float32_matmul_precision and TF32 switches), and PRECISION_ENV as set (None:
  unset). Shown side by side in the report (`precision_rows`); the normalised matmul.precision item is what gates."""
  return {"backend": backend, "device": device, "matmul": matmul,
          **{f"env {k}": environ.get(k) for k in PRECISION_ENV}}


def precision_rows(cards: Mapping[str, Any]) -> list[dict[str, Any]]:
  """[{setting, values {side: value}, agree}] over the sides whose card carries info.precision_settings, one row per
  setting any of them recorded; [] when none does. agree is None for 'matmul', each framework's own words for its
  setting (not comparable as text; the normalised matmul.precision item is compared)."""
  have = {s: ((c or {}).get("info") or {}).get("precision_settings") for s, c in cards.items()}
  have = {s: v for s, v in have.items() if isinstance(v, dict)}
  keys = list(dict.fromkeys(k for v in have.values() for k in v))
  return [{"setting": k, "values": {s: v.get(k) for s, v in have.items()},
           "agree": None if k == "matmul" else len({json.dumps(v.get(k)) for v in have.values()}) <= 1}
          for k in keys]

