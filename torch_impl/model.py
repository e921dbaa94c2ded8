"""The GPT decoder in PyTorch, named so that canonical weights load key by key.

Every `parity.spec.ModelSpec` option is implemented: pre-norm blocks, LayerNorm (with or without bias) or RMSNorm
(Gemma's (1 + w) form under norm_plus_one), GELU (tanh or exact), SwiGLU or GeGLU MLP, learned positions or rotary
embeddings (HF LLaMA rotate-half convention; linear / llama3 / yarn scaling, a local base per sliding layer),
grouped-query attention with its own head_dim, per-projection biases, q/k norms, Gemma's embedding scale, post
norms and soft-caps, sliding-window layers, a tied or untied output head. There is no dropout. The parts (norms,
rotary, masks, soft-cap, attention, MLP) are in `torch_impl.layers` and re-exported here.

Module attribute paths equal the canonical names of `parity.weights` (torch layout, linear weights [out, in]), so
`state_dict()` keys are the canonical keys and loading is a copy with a shape check; no tensor is transposed here.

Parameters are never initialised here: `build_model` constructs the module on the meta device, allocates storage
with `to_empty`, and `load_canonical` overwrites every parameter from the canonical file.
"""
from __future__ import annotations

import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from parity import architecture
from parity.spec import ModelSpec
from parity.weights import decays, param_shapes
from torch_impl.layers import (MLP, Attention, RMSNorm, TapRecorder, _Tapped, additive_mask, attention_mask,
                               make_norm, mlp_activation, planted, rope_tables, softcap, window_mask)

__all__ = ["GPT", "RMSNorm", "TapRecorder", "build_model", "load_canonical", "to_canonical", "lm_loss", "micro_loss",
           "rope_tables", "attention_mask", "window_mask", "additive_mask", "softcap", "decay_groups", "count_params",
           "Attention", "MLP", "Block", "mlp_activation"]

Rope = tuple[torch.Tensor, torch.Tensor]


class Block(_Tapped, nn.Module):
  """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); with post_norms (Gemma 2/3)
  x + ln_1_post(attn(ln_1(x))), then x + ln_2_post(mlp(ln_2(x)))."""

  def __init__(self, spec: ModelSpec):
    super().__init__()
    self.post_norms = spec.post_norms
    self.ln_1 = make_norm(spec)
    self.attn = Attention(spec)
    if spec.post_norms:
      self.ln_1_post = make_norm(spec)
    self.ln_2 = make_norm(spec)
    self.mlp = MLP(spec)
    if spec.post_norms:
      self.ln_2_post = make_norm(spec)

  def forward(self, x: torch.Tensor, rope: Rope | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One transformer block; with a TapRecorder set, every intermediate is recorded under its canonical tap name.
    x: (B, T, d_model) in the compute dtype; rope and mask: see `Attention.forward`."""
    if self._taps is None:
      h = self.attn(self.ln_1(x), rope, mask)
      x = x + (self.ln_1_post(h) if self.post_norms else h)
      h = self.mlp(self.ln_2(x))
      return x + (self.ln_2_post(h) if self.post_norms else h)
    h = self.ln_1(x)
    self._tap("ln_1", lambda: h)
    h = self.attn(h, rope, mask)
    if self.post_norms:
      h = self.ln_1_post(h)
      self._tap("ln_1_post", lambda: h)
    x = x + h
    self._tap("resid_mid", lambda: x)
    h = self.ln_2(x)
    self._tap("ln_2", lambda: h)
    h = self.mlp(h)
    if self.post_norms:
      h = self.ln_2_post(h)
      self._tap("ln_2_post", lambda: h)
    x = x + h
    self._tap("out", lambda: x)
    return x


class GPT(_Tapped, nn.Module):
  """GPT-2 / LLaMA / Qwen / Gemma / Mistral-family decoder described by a ModelSpec.

  Args:
    spec: the model spec (validated here).

  Attributes:
    checkpoint: None (store every activation), or a function `checkpoint(block, x, rope[, mask]) -> y` that runs a
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
    self.ln_f = make_norm(spec, final=True)
    if not spec.tie_embeddings:
      self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

  def forward(self, tokens: torch.Tensor, segment_ids: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token logits.

    Args:
      tokens: int64 token ids, shape (B, T), T <= spec.max_seq_len.
      segment_ids: optional int (B, T) (the `padded` / `packed` layouts, docs/data-examples.md): query t
        attends key s iff segment_ids[t] == segment_ids[s] and s <= t (`attention_mask`, made additive once:
        `additive_mask`), as SDPA's attn_mask. None: causal only (SDPA is_causal), exactly as before. 'sliding'
        layers (spec.layer_kinds) add the window (`window_mask`), with or without segment_ids.
      positions: optional int64 (B, T), each token's position within its example, in [0, max_seq_len): learned
        positions gather wpe[positions], rotary angles use them. None: 0 .. T-1 in every row.
    Returns:
      Logits, shape (B, T, vocab_size), in the module's dtype (soft-capped under spec.final_softcap).
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
    x = self._embed(tokens, positions)  # (B, T, d)
    self._tap("embed", lambda: x)
    ropes = self._ropes(t, positions, tokens.device)
    masks = self._masks(t, segment_ids, x.dtype, tokens.device)
    for block, rope, mask in zip(self.h, ropes, masks):
      if mask is None:  # the stream layout of a full layer: the call of before, unchanged
        x = block(x, rope) if self.checkpoint is None else self.checkpoint(block, x, rope)
      else:
        x = block(x, rope, mask) if self.checkpoint is None else self.checkpoint(block, x, rope, mask)
    x = self.ln_f(x)
    self._tap("ln_f", lambda: x)
    logits = F.linear(x, self.wte.weight) if s.tie_embeddings else self.lm_head(x)  # (B, T, V)
    self._tap("logits", lambda: logits)
    if s.final_softcap is not None and not planted("final_softcap_skipped"):
      logits = softcap(logits, s.final_softcap)
      self._tap("logits_capped", lambda: logits)
    return logits

  def _embed(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Token embeddings (times spec.embed_scale, rounded to the compute dtype first as HF Gemma's `normalizer`),
    plus learned positions: (B, T, d_model) in the module's dtype."""
    s = self.spec
    x = self.wte(tokens)  # (B, T, d)
    if s.embed_scale != 1.0:
      x = x * torch.tensor(s.embed_scale, dtype=x.dtype, device=x.device)
    if s.position == "learned":
      t = tokens.shape[1]
      x = x + self.wpe(torch.arange(t, device=tokens.device) if positions is None else positions.long())  # (B, T, d)
    return x

  def _ropes(self, t: int, positions: torch.Tensor | None, device: torch.device) -> list[Rope | None]:
    """Each layer's rotary (cos, sin) (`parity.architecture.layer_rope`: rope_theta and rope_scaling, or the local
    base of a sliding layer), one table per distinct (theta, scaling): (T, hd) each, or per token (B, 1, T, hd)
    with positions. None per layer for learned positions."""
    s = self.spec
    if s.position != "rope":
      return [None] * s.n_layers
    tables: dict[str, Rope] = {}
    out = []
    for i in range(s.n_layers):
      theta, scaling = architecture.layer_rope(s, i)
      key = json.dumps([theta, scaling], sort_keys=True)
      if key not in tables:
        if positions is None:
          tables[key] = rope_tables(t, s.head_dim, theta, device=device, scaling=scaling)
        else:  # each token's own angle: rows of the table, (B, 1, T, hd) against q/k (B, nh, T, hd)
          cos, sin = rope_tables(s.max_seq_len, s.head_dim, theta, device=device, scaling=scaling)
          tables[key] = (cos[positions.long()].unsqueeze(1), sin[positions.long()].unsqueeze(1))
      out.append(tables[key])
    return out

  def _masks(self, t: int, segment_ids: torch.Tensor | None, dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor | None]:
    """Each layer's additive mask, built once per kind: a full layer None (stream: SDPA's is_causal) or
    `additive_mask(attention_mask(segment_ids))`; a sliding layer `additive_mask(window_mask(...))`."""
    s = self.spec
    causal = all(b.attn.causal for b in self.h)  # False only under the diagnose plant no_causal_mask
    kinds = s.layer_kinds
    full = None
    if segment_ids is not None and "full" in kinds:
      full = additive_mask(attention_mask(segment_ids, causal), dtype)
    sliding = None
    if "sliding" in kinds:
      sliding = additive_mask(window_mask(t, s.sliding_window, device, segment_ids, causal), dtype)
    return [sliding if kind == "sliding" else full for kind in kinds]

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
    problems.append(f"unexpected {extra}"
                    + (" (tie_embeddings=True has no lm_head)" if "lm_head.weight" in extra else ""))
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
