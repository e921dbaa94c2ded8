"""The GPT decoder in PyTorch, named so that canonical weights load key by key.

Every `parity.spec.ModelSpec` option is implemented: pre-norm blocks, LayerNorm
(with or without bias) or RMSNorm, GELU (tanh or exact) or SwiGLU MLP, learned
positions or rotary embeddings (HF LLaMA rotate-half convention), grouped-query
attention, a tied or untied output head. There is no dropout.

Module attribute paths equal the canonical names of `parity.weights` (torch
layout, linear weights [out, in]), so `state_dict()` keys are the canonical keys
and loading is a copy with a shape check; no tensor is transposed on this side.

Parameters are never initialised here: `build_model` constructs the module on
the meta device, allocates storage with `to_empty`, and `load_canonical`
overwrites every parameter from the canonical file.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from parity.spec import ModelSpec
from parity.weights import decays, param_shapes

__all__ = ["GPT", "RMSNorm", "TapRecorder", "build_model", "load_canonical", "to_canonical", "lm_loss",
           "rope_tables", "decay_groups", "count_params"]


class TapRecorder:
  """Collects the diagnose taps of a forward pass (`parity diagnose`, docs/diagnose.md).

  `GPT.record_taps(recorder)` attaches it; each module then stores its intermediates under
  canonical tap names (module name + tap, e.g. `h.0.attn.q`). Only the first value of each
  name is kept, so with gradient accumulation the taps are those of the first micro batch.

  Attributes:
    values: canonical tap name -> detached float32 copy, canonical layout (q/k/v (B, heads, T, hd),
      scores/probs (B, nh, T, S), all else (B, T, features)).
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

  Matches HF `LlamaRMSNorm` (normalise in fp32, cast back, then scale) and
  Flax `nn.RMSNorm`; identical to `torch.nn.RMSNorm` for fp32 inputs.

  Args:
    dim: size of the last axis.
    eps: added to the mean square (unitless).
  """

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.eps = eps
    self.weight = nn.Parameter(torch.ones(dim))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: (..., dim), any float dtype -> same shape and dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * y.to(x.dtype)


def _norm(spec: ModelSpec) -> nn.Module:
  if spec.norm == "rmsnorm":
    return RMSNorm(spec.d_model, spec.norm_eps)
  return nn.LayerNorm(spec.d_model, eps=spec.norm_eps, bias=spec.bias)


def rope_tables(seq_len: int, head_dim: int, theta: float,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
  """Rotary cos/sin tables in the HF LLaMA rotate-half layout.

  angle[t, j] = t * theta^(-2j / head_dim) for j < head_dim / 2, repeated once
  along the last axis ([a_0..a_{h/2-1}, a_0..a_{h/2-1}]). Computed in float64
  and rounded once to float32, so any implementation that rounds the exact
  values agrees bitwise (a float32 angle computation is off by up to ~1e-5 at
  position 128).

  Args:
    seq_len: number of positions T.
    head_dim: per-head width (even).
    theta: rotary base (unitless).
  Returns:
    (cos, sin), each float32 of shape (T, head_dim).
  References:
    Su et al. 2021 (RoFormer); HF transformers `LlamaRotaryEmbedding`, `rotate_half`.
  """
  inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # (hd/2,)
  angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (T, hd/2)
  angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
  return angles.cos().float().to(device), angles.sin().float().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
  half = x.shape[-1] // 2
  return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """x: (B, nh, T, hd); cos, sin: (T, hd) float32 -> (B, nh, T, hd), dtype of x."""
  return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)).to(x.dtype)


class Attention(_Tapped, nn.Module):
  """Causal self-attention with grouped-query heads.

  qkv rows are [q heads | k heads | v heads] (parity.weights); query head i
  attends with key/value head i // (n_heads // kv_heads), as HF `repeat_kv` and
  SDPA `enable_gqa` do.

  Attributes:
    causal: apply the causal mask. Always True in training; False only as a planted bug of
      `parity diagnose` (`--plant SIDE:no_causal_mask`).
  """

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.spec = spec
    self.causal = True
    hd = spec.head_dim
    self.qkv = nn.Linear(spec.d_model, (spec.n_heads + 2 * spec.kv_heads) * hd, bias=spec.bias)
    self.proj = nn.Linear(spec.n_heads * hd, spec.d_model, bias=spec.bias)

  def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x: (B, T, d_model) -> (B, T, d_model)."""
    s = self.spec
    b, t, _ = x.shape
    q_dim, kv_dim = s.n_heads * s.head_dim, s.kv_heads * s.head_dim
    q, k, v = self.qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
    q = q.view(b, t, s.n_heads, s.head_dim).transpose(1, 2)  # (B, nh, T, hd)
    k = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
    v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
    if rope is not None:
      q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
    self._tap("q", lambda: q)
    self._tap("k", lambda: k)
    self._tap("v", lambda: v)
    if s.kv_heads != s.n_heads:
      rep = s.n_heads // s.kv_heads
      k = k.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
      v = v.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
    if self._taps is not None:  # SDPA hides scores and probs: recompute them from the same q, k for the taps
      self._attention_taps(q, k, t)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=s.scale)  # (B, nh, T, hd)
    y = y.transpose(1, 2).reshape(b, t, q_dim)  # (B, T, nh * hd)
    self._tap("context", lambda: y)
    out = self.proj(y)
    self._tap("out", lambda: out)
    return out

  def _attention_taps(self, q: torch.Tensor, k: torch.Tensor, t: int) -> None:
    """Taps `scores` (scaled q.k, before the mask) and `probs` (after mask and softmax), (B, nh, T, S).

    The forward output still comes from SDPA; these are the same math spelled out (SDPA's
    math backend), so a bug in the SDPA call itself shows up first at `context`.
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * self.spec.scale  # (B, nh, T, S)
    self._tap("scores", lambda: scores)
    if self.causal:
      keep = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
      scores = scores.masked_fill(~keep, float("-inf"))
    self._tap("probs", lambda: torch.softmax(scores.float(), dim=-1))


class MLP(_Tapped, nn.Module):
  """fc -> GELU -> proj (gelu), or proj(silu(gate(x)) * up(x)) (swiglu)."""

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.spec = spec
    d, f = spec.d_model, spec.ffn_dim
    if spec.mlp == "gelu":
      self.fc = nn.Linear(d, f, bias=spec.bias)
    else:
      self.gate = nn.Linear(d, f, bias=spec.bias)
      self.up = nn.Linear(d, f, bias=spec.bias)
    self.proj = nn.Linear(f, d, bias=spec.bias)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """x: (B, T, d_model) -> (B, T, d_model)."""
    if self.spec.mlp == "gelu":
      fc = self.fc(x)  # (B, T, d_ff)
      self._tap("fc", lambda: fc)
      h = F.gelu(fc, approximate="tanh" if self.spec.gelu_approximate else "none")  # (B, T, d_ff)
    else:
      gate, up = self.gate(x), self.up(x)  # (B, T, d_ff) each
      self._tap("gate", lambda: gate)
      self._tap("up", lambda: up)
      h = F.silu(gate) * up  # (B, T, d_ff)
    self._tap("act", lambda: h)
    out = self.proj(h)
    self._tap("out", lambda: out)
    return out


class Block(_Tapped, nn.Module):
  """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.ln_1 = _norm(spec)
    self.attn = Attention(spec)
    self.ln_2 = _norm(spec)
    self.mlp = MLP(spec)

  def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)); with a TapRecorder set, every
    intermediate is recorded under its canonical tap name. x: (B, T, d_model) in the compute dtype."""
    if self._taps is None:
      x = x + self.attn(self.ln_1(x), rope)
      return x + self.mlp(self.ln_2(x))
    h = self.ln_1(x)
    self._tap("ln_1", lambda: h)
    x = x + self.attn(h, rope)
    self._tap("resid_mid", lambda: x)
    h = self.ln_2(x)
    self._tap("ln_2", lambda: h)
    x = x + self.mlp(h)
    self._tap("out", lambda: x)
    return x


class GPT(_Tapped, nn.Module):
  """GPT-2 / LLaMA-family decoder described by a ModelSpec.

  Args:
    spec: the model spec (validated here).

  Attributes:
    checkpoint: None (store every activation), or a function `checkpoint(block, x, rope) -> y` that runs a
      block without keeping its internal activations and recomputes them in the backward pass (activation
      checkpointing; set by `torch_impl.engine` under DeepSpeedPlan.activation_checkpointing). Recomputation
      repeats the same fp32 ops, so the loss and gradients are unchanged.
  """

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.spec = spec.validate()
    self.checkpoint = None
    self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
    if spec.position == "learned":
      self.wpe = nn.Embedding(spec.max_seq_len, spec.d_model)
    self.h = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
    self.ln_f = _norm(spec)
    if not spec.tie_embeddings:
      self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token logits.

    Args:
      tokens: int64 token ids, shape (B, T), T <= spec.max_seq_len.
    Returns:
      Logits, shape (B, T, vocab_size), in the module's dtype.
    Raises:
      ValueError: T exceeds spec.max_seq_len.
    """
    s = self.spec
    t = tokens.shape[1]
    if t > s.max_seq_len:
      raise ValueError(f"sequence of {t} tokens exceeds model.max_seq_len={s.max_seq_len}")
    x = self.wte(tokens)  # (B, T, d)
    rope = None
    if s.position == "learned":
      x = x + self.wpe(torch.arange(t, device=tokens.device))  # (B, T, d)
    else:
      rope = rope_tables(t, s.head_dim, s.rope_theta, device=tokens.device)
    self._tap("embed", lambda: x)
    for block in self.h:
      x = block(x, rope) if self.checkpoint is None else self.checkpoint(block, x, rope)
    x = self.ln_f(x)
    self._tap("ln_f", lambda: x)
    logits = F.linear(x, self.wte.weight) if s.tie_embeddings else self.lm_head(x)  # (B, T, V)
    self._tap("logits", lambda: logits)
    return logits

  def record_taps(self, recorder: TapRecorder | None) -> None:
    """Attaches (or, with None, detaches) a TapRecorder to this model and every tapped submodule.

    Module names are the canonical prefixes (`h.0.attn`), so tap names match the JAX side's.
    Raises:
      ValueError: activation checkpointing is on (a recomputed block would record again).
    """
    if recorder is not None and self.checkpoint is not None:
      raise ValueError("diagnose taps need a model without activation checkpointing (GPT.checkpoint is set)")
    for name, module in self.named_modules():
      if isinstance(module, _Tapped):
        module._taps = recorder
        module._tap_prefix = name


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
  """Mean token cross-entropy in float32.

  Args:
    logits: (B, T, V), any float dtype (cast to float32 before the softmax).
    targets: int64 next-token ids, (B, T).
  Returns:
    Scalar float32 loss, nats per token, averaged over all B*T tokens.
  """
  return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def load_canonical(model: GPT, params: dict[str, np.ndarray]) -> None:
  """Overwrites every parameter of `model` with the canonical tensor of the same name.

  Args:
    model: a GPT; its state_dict keys are the canonical names.
    params: canonical name -> float32 array of the canonical (torch) shape.
  Raises:
    ValueError: a name is missing or unexpected, or a shape differs (each named).
  """
  own = dict(model.named_parameters())
  missing = [k for k in own if k not in params]
  extra = [k for k in params if k not in own]
  wrong = [f"{k}: canonical {tuple(params[k].shape)} != model {tuple(own[k].shape)}"
           for k in own if k in params and tuple(params[k].shape) != tuple(own[k].shape)]
  problems = []
  if missing:
    problems.append(f"missing {missing}")
  if extra:
    problems.append(f"unexpected {extra}" + (" (tie_embeddings=True has no lm_head)" if "lm_head.weight" in extra else ""))
  if wrong:
    problems.append(f"wrong shape {wrong}")
  if problems:
    raise ValueError("canonical weights do not match the torch model: " + "; ".join(problems))
  with torch.no_grad():
    for name, p in own.items():
      p.copy_(torch.from_numpy(np.ascontiguousarray(params[name])).to(dtype=p.dtype))


def to_canonical(model: GPT) -> dict[str, np.ndarray]:
  """Canonical name -> float32 numpy copy of each parameter, in canonical order."""
  own = dict(model.named_parameters())
  return {k: own[k].detach().float().cpu().numpy().copy() for k in param_shapes(model.spec)}


def build_model(spec: ModelSpec, params: dict[str, np.ndarray], device: torch.device | str = "cpu") -> GPT:
  """Constructs a GPT without initialising it, then loads the canonical weights.

  Args:
    spec: model spec.
    params: canonical float32 weights (parity.weights layout).
    device: where the float32 parameters are allocated.
  Returns:
    The model in train mode (no dropout exists, so the mode changes nothing).
  Raises:
    ValueError: the weights do not match the spec (see `load_canonical`).
  """
  with torch.device("meta"):
    model = GPT(spec)
  model = model.to_empty(device=device)
  load_canonical(model, params)
  return model


def decay_groups(model: GPT, weight_decay: float) -> list[dict]:
  """AdamW param groups from the canonical decay mask (`parity.weights.decays`).

  Args:
    model: a GPT (parameter names are canonical names).
    weight_decay: decoupled weight decay of the decayed group (multiplied by the lr).
  Returns:
    [{'params': decayed, 'weight_decay': weight_decay}, {'params': others, 'weight_decay': 0.0}],
    empty groups dropped; used verbatim by torch AdamW and `deepspeed.initialize`.
  """
  named = list(model.named_parameters())
  groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": float(weight_decay)},
            {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
  return [g for g in groups if g["params"]]


def count_params(model: nn.Module) -> int:
  """Number of distinct parameters (a tied head counted once)."""
  return sum(math.prod(p.shape) for p in model.parameters())
