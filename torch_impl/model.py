"""The GPT decoder in PyTorch, named so that canonical weights load key by key.

Every `parity.spec.ModelSpec` option is implemented: pre-norm blocks, LayerNorm (with or without bias) or RMSNorm,
GELU (tanh or exact) or SwiGLU MLP, learned positions or rotary embeddings (HF LLaMA rotate-half convention),
grouped-query attention, a tied or untied output head. There is no dropout.

Module attribute paths equal the canonical names of `parity.weights` (torch layout, linear weights [out, in]), so
`state_dict()` keys are the canonical keys and loading is a copy with a shape check; no tensor is transposed here.

Parameters are never initialised here: `build_model` constructs the module on the meta device, allocates storage
with `to_empty`, and `load_canonical` overwrites every parameter from the canonical file.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from parity.spec import ModelSpec
from parity.weights import decays, param_shapes

__all__ = ["GPT", "RMSNorm", "TapRecorder", "build_model", "load_canonical", "to_canonical", "lm_loss", "micro_loss",
           "rope_tables", "attention_mask", "additive_mask", "decay_groups", "count_params"]


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
  half = x.shape[-1] // 2
  return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
  """x: (B, nh, T, hd); cos, sin: (T, hd), or per token (B, 1, T, hd), float32 -> (B, nh, T, hd), dtype of x."""
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

  def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """x: (B, T, d_model) -> (B, T, d_model). mask: None (causal, SDPA's is_causal), or additive (B, 1, T, S) in
    x's dtype (`additive_mask(attention_mask(...))`: segment and causality in it, 0 = attend, -inf = not) given to
    SDPA as attn_mask, without is_causal."""
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
      self._attention_taps(q, k, t) if mask is None else self._attention_taps(q, k, t, mask)
    if mask is None:
      y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=s.scale)  # (B, nh, T, hd)
    else:
      y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.scale)  # (B, nh, T, hd)
    y = y.transpose(1, 2).reshape(b, t, q_dim)  # (B, T, nh * hd)
    self._tap("context", lambda: y)
    out = self.proj(y)
    self._tap("out", lambda: out)
    return out

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


class Block(_Tapped, nn.Module):
  """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.ln_1 = _norm(spec)
    self.attn = Attention(spec)
    self.ln_2 = _norm(spec)
    self.mlp = MLP(spec)

  def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """One pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)); with a TapRecorder set, every
    intermediate is recorded under its canonical tap name. x: (B, T, d_model) in the compute dtype; rope and
    mask: see `Attention.forward`."""
    if self._taps is None:
      x = x + self.attn(self.ln_1(x), rope, mask)
      return x + self.mlp(self.ln_2(x))
    h = self.ln_1(x)
    self._tap("ln_1", lambda: h)
    x = x + self.attn(h, rope, mask)
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

  def forward(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits.

    Args:
      tokens: int64 token ids, shape (B, T), T <= spec.max_seq_len.
      segment_ids: optional int (B, T) (the `padded` / `packed` layouts, docs/data-examples.md): query t
        attends key s iff segment_ids[t] == segment_ids[s] and s <= t (`attention_mask`, made additive once:
        `additive_mask`), as SDPA's attn_mask. None: causal only (SDPA is_causal), exactly as before.
      positions: optional int64 (B, T), each token's position within its example, in [0, max_seq_len): learned
        positions gather wpe[positions], rotary angles use them. None: 0 .. T-1 in every row.
    Returns:
      Logits, shape (B, T, vocab_size), in the module's dtype.
    Raises:
      ValueError: T exceeds spec.max_seq_len, or segment_ids / positions is not (B, T).
    """
    s = self.spec
    t = tokens.shape[1]
    if t > s.max_seq_len:
      raise ValueError(f"sequence of {t} tokens exceeds model.max_seq_len={s.max_seq_len}")
    for name, arr in (("segment_ids", segment_ids), ("positions", positions)):
      if arr is not None and tuple(arr.shape) != tuple(tokens.shape):
        raise ValueError(f"{name} has shape {tuple(arr.shape)}; it must be the inputs' shape {tuple(tokens.shape)}")
    x = self.wte(tokens)  # (B, T, d)
    rope = None
    if s.position == "learned":
      x = x + self.wpe(torch.arange(t, device=tokens.device) if positions is None else positions.long())  # (B, T, d)
    elif positions is None:
      rope = rope_tables(t, s.head_dim, s.rope_theta, device=tokens.device)
    else:  # each token's own angle: rows of the table, (B, 1, T, hd) against q/k (B, nh, T, hd)
      cos, sin = rope_tables(s.max_seq_len, s.head_dim, s.rope_theta, device=tokens.device)
      rope = (cos[positions.long()].unsqueeze(1), sin[positions.long()].unsqueeze(1))
    self._tap("embed", lambda: x)
    causal = all(b.attn.causal for b in self.h)  # False only under the diagnose plant no_causal_mask
    mask = None if segment_ids is None else additive_mask(attention_mask(segment_ids, causal), x.dtype)  # once
    for block in self.h:
      if mask is None:  # the stream layout: the call of before, unchanged
        x = block(x, rope) if self.checkpoint is None else self.checkpoint(block, x, rope)
      else:
        x = block(x, rope, mask) if self.checkpoint is None else self.checkpoint(block, x, rope, mask)
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


def micro_loss(forward, tokens_mtp1, device: torch.device, arrays=None, index: int = 0,
               plants: frozenset = frozenset()) -> torch.Tensor:
  """The loss of one micro batch as every torch trainer computes it (TorchTrainer, DeepSpeedTrainer, their evals).

  Args:
    forward: the module, its DDP wrapper or the DeepSpeed engine (called as GPT.forward).
    tokens_mtp1: uint16/uint32 token ids (M, T + 1) (inputs [:, :-1], targets [:, 1:]).
    device: where it computes.
    arrays: None (stream: the mean cross-entropy, exactly as before), or a parity.protocol.side.ExampleArrays of
      the step (A, M, T): micro batch `index`'s segment ids and positions go to the model (int64), its weights
      to lm_loss (float32): sum(weights * ce), docs/data-examples.md "The model level".
    plants: this side's planted data bugs (parity.protocol.layout.PLANT_KEYS; with arrays only), as jax_impl.step
      applies them: attention_mask_dropped gives the model no segment ids (causal over the row),
      positions_not_restarted no positions (0..T-1), labels_shifted_twice scores input t against token t + 2 with
      target t's weight (the row's last input, which has no such token, dropped).
  Returns:
    Scalar float32 loss, nats.
  """
  tokens = torch.from_numpy(np.asarray(tokens_mtp1, dtype=np.int64)).to(device)
  if arrays is None:
    return lm_loss(forward(tokens[:, :-1]), tokens[:, 1:])
  part = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a[index], dtype=dtype)).to(device)
  seg = None if "attention_mask_dropped" in plants else part(arrays.segment_ids, np.int64)
  pos = None if "positions_not_restarted" in plants else part(arrays.positions, np.int64)
  logits, weights = forward(tokens[:, :-1], segment_ids=seg, positions=pos), part(arrays.weights, np.float32)
  if "labels_shifted_twice" in plants:  # the plant: targets one further ahead, for the inputs that still have one
    keep = tokens.shape[1] - 2
    return lm_loss(logits[:, :keep], tokens[:, 2:], weights[:, :keep])
  return lm_loss(logits, tokens[:, 1:], weights)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
  """Token cross-entropy in float32: the mean over all targets, or the weighted sum.

  Args:
    logits: (B, T, V), any float dtype (cast to float32 before the softmax).
    targets: int64 next-token ids, (B, T).
    weights: optional float32 (B, T), the weight of each target (0 where it carries no loss: this micro batch's
      rows of parity.dataset.reference.token_weights, times what the trainer's gradient convention needs).
  Returns:
    Scalar float32 loss, nats: without weights, averaged over all B*T tokens (exactly as before); with weights,
    sum(weights * ce).
  Raises:
    ValueError: weights is not (B, T).
  """
  if weights is None:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
  if tuple(weights.shape) != tuple(targets.shape):
    raise ValueError(f"weights has shape {tuple(weights.shape)}; it must be the targets' shape {tuple(targets.shape)}")
  ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
  return (weights.float().reshape(-1) * ce).sum()


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
