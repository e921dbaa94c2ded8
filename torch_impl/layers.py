"""The parts of the PyTorch decoder (`torch_impl.model` assembles them and re-exports the public ones): diagnose
taps, norms, rotary tables, attention masks, the soft-cap, attention and the MLP.

Module attribute paths are the canonical names of `parity.weights` (q/k norms `attn.ln_q` / `attn.ln_k`), so a
module's `state_dict()` keys are canonical keys. Semantics of the model-family fields follow transformers 5.24
(modeling_llama, qwen2, qwen3, mistral, gemma2, gemma3); each function names the HF counterpart it matches.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from parity import architecture
from parity.protocol.layout import FAMILY_PLANT_KEYS
from parity.spec import ModelSpec

__all__ = ["TapRecorder", "RMSNorm", "make_norm", "rope_tables", "attention_mask", "window_mask", "additive_mask",
           "softcap", "Attention", "mlp_activation", "MLP", "set_model_plants", "planted"]

_MODEL_PLANTS: frozenset = frozenset()
"""This process's planted model-family porting bugs (parity.protocol.layout.FAMILY_PLANT_KEYS): one side per worker
process, so the side sets them once before it builds its model (`set_model_plants`); read while the model runs."""


def set_model_plants(plants) -> None:
  """Makes the family plants among `plants` (a side's SideIO.plants) this process's; the others are ignored here."""
  global _MODEL_PLANTS
  _MODEL_PLANTS = frozenset(p for p in plants if p in FAMILY_PLANT_KEYS)


def planted(key: str) -> bool:
  """Whether the family plant `key` is on in this process (`set_model_plants`)."""
  return key in _MODEL_PLANTS


class TapRecorder:
  """Collects the diagnose taps of a forward pass (`parity diagnose`, docs/diagnose.md).

  `GPT.record_taps(recorder)` attaches it; each module then stores its intermediates under
  canonical tap names (module name + tap, e.g. `h.0.attn.q`). Only the first value of each
  name is kept, so with gradient accumulation the taps are those of the first micro batch.

  Attributes:
    values: canonical tap name -> detached float32 copy, canonical layout (q/k/v and the q/k norms `attn.ln_q` /
      `attn.ln_k` (B, heads, T, hd), scores/scores_capped/probs (B, nh, T, S), all else (B, T, features)).
    where: canonical tap name -> the torch module and tap, e.g. 'h.0.attn (Attention) q'.
  """

  def __init__(self):
    self.values: dict[str, torch.Tensor] = {}
    self.where: dict[str, str] = {}

  def record(self, module: nn.Module, name: str, make) -> None:
    prefix = module._tap_prefix
    key = f"{prefix}.{name}" if prefix else name
    if key not in self.values:
      self.values[key] = make().detach().float().clone()
      self.where[key] = f"{prefix or '<model>'} ({type(module).__name__}) {name}"


class _Tapped:
  """Mixin: a module that can report diagnose taps. No cost unless a TapRecorder is attached."""
  _taps: TapRecorder | None = None
  _tap_prefix: str = ""

  def _tap(self, name: str, make) -> None:
    """Records `make()` as tap `name` when a recorder is attached; `make` is not called otherwise."""
    if self._taps is not None:
      self._taps.record(self, name, make)


class RMSNorm(nn.Module):
  """Root-mean-square norm: x / sqrt(mean(x^2) + eps) * weight, statistics in float32.

  Matches HF `LlamaRMSNorm` (normalise in fp32, cast back, then scale) and Flax `nn.RMSNorm`; identical to
  `torch.nn.RMSNorm` for fp32 inputs. With `plus_one` (Gemma, HF `Gemma2RMSNorm` / `Gemma3RMSNorm`): the scale is
  (1 + weight) in float32, weight initialised to 0, and the product is rounded to x's dtype once.

  Args:
    dim: size of the last axis.
    eps: added to the mean square (unitless).
    plus_one: scale by (1 + weight) (ModelSpec.norm_plus_one).
  """

  def __init__(self, dim: int, eps: float, plus_one: bool = False):
    super().__init__()
    self.eps = eps
    self.plus_one = plus_one
    self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: (..., dim), any float dtype -> same shape and dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.plus_one and planted("norm_plus_one_rounded"):  # the planted porting bug: Llama's rounding order
      return y.to(x.dtype) * (1.0 + self.weight.float()).to(x.dtype)
    if self.plus_one:
      return (y * (1.0 + self.weight.float())).to(x.dtype)
    return self.weight * y.to(x.dtype)


def make_norm(spec: ModelSpec, *, final: bool = False) -> nn.Module:
  """The model's norm over d_model: RMSNorm (with (1 + w) under norm_plus_one) or LayerNorm (bias with spec.bias),
  eps spec.norm_eps. `final`: the final norm (ln_f), whose eps the planted family bug 'final_norm_eps_tenth'
  (parity.protocol.layout.FAMILY_PLANT_KEYS) makes a tenth of it, as a Llama-1 eps of 1e-6 left in a Llama-2 (1e-5)
  port (jax_impl.layers.norm_eps plants the same)."""
  eps = spec.norm_eps / 10.0 if final and planted("final_norm_eps_tenth") else spec.norm_eps
  if spec.norm == "rmsnorm":
    return RMSNorm(spec.d_model, eps, spec.norm_plus_one)
  return nn.LayerNorm(spec.d_model, eps=eps, bias=spec.bias)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
  """Rotary cos/sin tables in the HF LLaMA rotate-half layout, from `parity.architecture.rope_tables`.

  angle[t, j] = t * inv_freq[j mod head_dim / 2] (`parity.architecture.inv_freq`, scaled by `scaling`), computed
  in float64 and rounded once to float32 (yarn's attention factor folded in), the same numpy tables the JAX side
  uses, so both sides agree bitwise.

  Args:
    seq_len: number of positions T.
    head_dim: per-head width (even).
    theta: rotary base (unitless).
    device: where the tables go.
    scaling: ModelSpec.rope_scaling form (None: plain rotary).
  Returns:
    (cos, sin), each float32 of shape (T, head_dim).
  References:
    Su et al. 2021 (RoFormer); HF transformers `LlamaRotaryEmbedding`, `rotate_half`, `modeling_rope_utils`.
  """
  cos, sin = architecture.rope_tables(seq_len, head_dim, theta, scaling)
  return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


def attention_mask(segment_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
  """bool (B, 1, T, S), [query, key], SDPA's `attn_mask` (True = attend): query t may attend key s iff
  segment_ids[t] == segment_ids[s] and s <= t (parity.dataset.reference.attention_mask). Padding (segment 0)
  attends earlier padding only, so no row is empty. `causal=False` (the diagnose plant) keeps the segment test.

  Args:
    segment_ids: int (B, T): 0 = padding, 1, 2, ... = the example's order in its row.
  """
  t = segment_ids.shape[-1]
  same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (B, 1, T, S)
  if not causal:
    return same
  return same & _causal(t, segment_ids.device)


def window_mask(t: int, window: int, device: torch.device, segment_ids: torch.Tensor | None = None,
                causal: bool = True) -> torch.Tensor:
  """bool mask of a 'sliding' layer (True = attend): query t sees key s iff s <= t and t - s < window (HF
  `sliding_window_causal`: kv_idx > q_idx - sliding_window), and, with segment_ids, the same segment.

  Every query sees itself, so no row is empty. `causal=False` (the diagnose plant) drops only s <= t.
  Returns: (1, 1, T, S) without segment_ids, else (B, 1, T, S).
  """
  pos = torch.arange(t, device=device)
  band = (pos[:, None] - pos[None, :]) < window  # (T, S)
  if causal:
    band = band & _causal(t, device)
  if segment_ids is None:
    return band[None, None]
  return attention_mask(segment_ids, causal) & band


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
  """bool (B, 1, T, S) (True = attend) -> `dtype` (B, 1, T, S): 0 where attended, -inf elsewhere; exactly what SDPA
  makes of a bool `attn_mask` in every call (aten `convert_boolean_attn_mask`: where(~mask, -inf, 0) in the query's
  dtype), so the outputs are bit-identical; built once per forward instead of once per layer and pass."""
  return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@functools.lru_cache(maxsize=16)
def _causal(t: int, device: torch.device) -> torch.Tensor:
  """bool (T, S) lower triangle (s <= t), built once per length and device: `tril` on a bool tensor cost ~0.9 ms
  of a ~20 ms gpt2-tiny step when built every forward (torch.profiler, benchmarks/results/train_step_layouts.md)."""
  return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
  """Soft-cap: cap * tanh(x / cap), elementwise, same shape and dtype (HF Gemma 2 attn_logit_softcapping and
  final_logit_softcapping: (x / cap).tanh() * cap, the same two roundings). cap > 0, in x's units."""
  return torch.tanh(x / cap) * cap


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
  half = x.shape[-1] // 2
  return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """x: (B, nh, T, hd); cos, sin: (T, hd), or per token (B, 1, T, hd), float32 -> (B, nh, T, hd), dtype of x."""
  return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)).to(x.dtype)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float,
                        mask: torch.Tensor | None, causal: bool, tap) -> torch.Tensor:
  """Attention with soft-capped scores, which SDPA cannot do: HF `eager_attention_forward` of Gemma 2, op for op.

  In the compute dtype, as HF runs a bf16/fp16 model: scores = q.k (a matmul in the dtype: float32 accumulation,
  rounded once), times scale (rounded), soft-capped (`softcap`: / cap, tanh, * cap, each rounded), plus the mask;
  then softmax in float32 (HF's `softmax(..., dtype=torch.float32)`), the probs rounded to v's dtype and multiplied
  by v. In float32 every step is the float32 op. (The scores were float32 before: where a bf16 run rounds them, HF
  rounds them, and the JAX side followed the float32 form, a gap of their own besides rounding noise.)
  q, k, v: (B, nh, T, hd) in the compute dtype (k, v already repeated to nh heads); mask: None (causal when
  `causal`) or additive (B or 1, 1, T, S) in that dtype, 0 / -inf. tap(name, make): the Attention's `_tap` (scores,
  scores_capped, probs). Returns (B, nh, T, hd) in v's dtype.
  """
  scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, nh, T, S) in the compute dtype
  tap("scores", lambda: scores)
  capped = scores if planted("attn_softcap_skipped") else softcap(scores, cap)
  tap("scores_capped", lambda: capped)
  if mask is not None:  # additive, 0 / -inf: exact in every dtype
    capped = capped + mask.to(capped.dtype)
  elif causal:
    capped = capped.masked_fill(~_causal(q.shape[-2], q.device), float("-inf"))
  probs = torch.softmax(capped, dim=-1, dtype=torch.float32)  # float32, from the compute-dtype scores
  tap("probs", lambda: probs)
  return torch.matmul(probs.to(v.dtype), v)


class Attention(_Tapped, nn.Module):
  """Causal self-attention with grouped-query heads.

  qkv rows are [q heads | k heads | v heads] (parity.weights); query head i attends with key/value head
  i // (n_heads // kv_heads), as HF `repeat_kv` and SDPA `enable_gqa` do. With qk_norm, `ln_q` / `ln_k` (RMSNorm
  over head_dim, the model's norm form and eps) normalise each head of q and k after the projection and before
  rotary (HF Qwen3 / Gemma 3 q_norm, k_norm). With attn_softcap the scores are soft-capped (`_explicit_attention`);
  otherwise SDPA computes the attention.

  Attributes:
    causal: apply the causal mask. Always True in training; False only as a planted bug of
      `parity diagnose` (`--plant SIDE:no_causal_mask`).
  """

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.spec = spec
    self.causal = True
    hd = spec.head_dim
    self.qkv = nn.Linear(spec.d_model, (spec.n_heads + 2 * spec.kv_heads) * hd, bias=spec.linear_bias("qkv"))
    if spec.qk_norm:
      self.ln_q = RMSNorm(hd, spec.norm_eps, spec.norm_plus_one)
      self.ln_k = RMSNorm(hd, spec.norm_eps, spec.norm_plus_one)
    self.proj = nn.Linear(spec.n_heads * hd, spec.d_model, bias=spec.linear_bias("out"))

  def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """x: (B, T, d_model) -> (B, T, d_model). mask: None (causal, SDPA's is_causal), or additive (B or 1, 1, T, S)
    in x's dtype (`additive_mask` of `attention_mask(...)` or `window_mask(...)`: segment, causality and window in
    it, 0 = attend, -inf = not) given to SDPA as attn_mask, without is_causal."""
    s = self.spec
    b, t, _ = x.shape
    q, k, v = self._heads(x, rope)
    if s.kv_heads != s.n_heads:
      rep = s.n_heads // s.kv_heads
      k = k.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
      v = v.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
    if s.attn_softcap is not None:
      y = _explicit_attention(q, k, v, s.scale, s.attn_softcap, mask, self.causal, self._tap)  # (B, nh, T, hd)
    else:
      if self._taps is not None:  # SDPA hides scores and probs: recompute them from the same q, k for the taps
        self._attention_taps(q, k, t) if mask is None else self._attention_taps(q, k, t, mask)
      if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=s.scale)  # (B, nh, T, hd)
      else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.scale)  # (B, nh, T, hd)
    y = y.transpose(1, 2).reshape(b, t, s.n_heads * s.head_dim)  # (B, T, nh * hd)
    self._tap("context", lambda: y)
    out = self.proj(y)
    self._tap("out", lambda: out)
    return out

  def _heads(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, nh, T, hd), k and v (B, nkv, T, hd) of x (B, T, d_model): projected, q/k-normed (qk_norm), rotated;
    taps ln_q, ln_k (qk_norm), q, k, v."""
    s = self.spec
    b, t, _ = x.shape
    q_dim, kv_dim = s.n_heads * s.head_dim, s.kv_heads * s.head_dim
    q, k, v = self.qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
    q = q.view(b, t, s.n_heads, s.head_dim).transpose(1, 2)  # (B, nh, T, hd)
    k = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
    v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
    after = planted("qk_norm_after_rope")  # the planted porting bug: the q/k norms after rotary
    if s.qk_norm and not after:
      q, k = self.ln_q(q), self.ln_k(k)
      self._tap("ln_q", lambda: q)
      self._tap("ln_k", lambda: k)
    if rope is not None:
      q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
    if s.qk_norm and after:
      q, k = self.ln_q(q), self.ln_k(k)
    self._tap("q", lambda: q)
    self._tap("k", lambda: k)
    self._tap("v", lambda: v)
    return q, k, v

  def _attention_taps(self, q: torch.Tensor, k: torch.Tensor, t: int, mask: torch.Tensor | None = None) -> None:
    """Taps `scores` (scaled q.k, before the mask) and `probs` (after mask and softmax), (B, nh, T, S).

    The forward output still comes from SDPA; these are the same math spelled out (SDPA's
    math backend), so a bug in the SDPA call itself shows up first at `context`.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * self.spec.scale  # (B, nh, T, S)
    self._tap("scores", lambda: scores)
    if mask is not None:  # additive: s + 0 = s and s + -inf = -inf exactly, as masked_fill
      scores = scores + mask
    elif self.causal:
      keep = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
      scores = scores.masked_fill(~keep, float("-inf"))
    self._tap("probs", lambda: torch.softmax(scores.float(), dim=-1))


def mlp_activation(spec: ModelSpec) -> nn.Module:
  """The MLP nonlinearity: GELU of the `gelu_approximate` form (tanh or erf) for gelu and geglu, SiLU for swiglu.

  Returns a module mapping a tensor to one of the same shape and dtype."""
  if spec.mlp == "swiglu":
    return nn.SiLU()
  return nn.GELU(approximate="tanh" if spec.gelu_approximate else "none")


class MLP(_Tapped, nn.Module):
  """fc -> GELU -> proj (gelu), or proj(act(gate(x)) * up(x)) with act SiLU (swiglu) or GELU (geglu, HF Gemma MLP:
  down_proj(act_fn(gate_proj(x)) * up_proj(x))). Biases: spec.linear_bias('mlp')."""

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.spec = spec
    d, f, bias = spec.d_model, spec.ffn_dim, spec.linear_bias("mlp")
    if spec.mlp == "gelu":
      self.fc = nn.Linear(d, f, bias=bias)
    else:
      self.gate = nn.Linear(d, f, bias=bias)
      self.up = nn.Linear(d, f, bias=bias)
    self.proj = nn.Linear(f, d, bias=bias)
    self.act = mlp_activation(spec)
    """The elementwise nonlinearity forward applies (to fc, or to gate); the semantics card probes this object."""

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: (B, T, d_model) -> (B, T, d_model)."""
    if self.spec.mlp == "gelu":
      fc = self.fc(x)  # (B, T, d_ff)
      self._tap("fc", lambda: fc)
      h = self.act(fc)  # (B, T, d_ff)
    else:
      gate, up = self.gate(x), self.up(x)  # (B, T, d_ff) each
      self._tap("gate", lambda: gate)
      self._tap("up", lambda: up)
      h = self.act(gate) * up  # (B, T, d_ff)
    self._tap("act", lambda: h)
    out = self.proj(h)
    self._tap("out", lambda: out)
    return out
