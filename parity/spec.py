"""Model, training and plan specifications shared by every side.

All specs are frozen dataclasses: one field per line, units in the docstring.
They are plain data (no jax, no torch) and round-trip through JSON with
`to_dict` / `from_dict`, which is how the harness hands them to the workers.
Dotted overrides (`--set key=value`) over a RunSpec live in parity.overrides. The sides' plans (`JaxPlan`,
`DeepSpeedPlan`, `FsdpPlan`) live in parity.side_plans and are importable from here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Literal

from parity.errors import SpecError
from parity.fields import INT_MAX, check_numbers, check_section_numbers, from_dict, to_dict
from parity import architecture
from parity.example_fields import (EXAMPLE_SUFFIXES, LAYOUT_DEFAULTS, SFT_DEMO, _check_example_data, is_example_data,
                                   validate_layout, without_layout_defaults)
from parity.numerics import schedule
from parity.side_plans import REMAT_POLICIES, DeepSpeedPlan, FsdpPlan, JaxPlan
from parity.sides import reads_plan, side_names

__all__ = [
    "ModelSpec", "TrainSpec", "JaxPlan", "DeepSpeedPlan", "FsdpPlan", "RunSpec", "SpecError",
    "to_dict", "from_dict", "config_hash", "check_numbers", "INT_MAX", "without_layout_defaults", "LAYOUT_DEFAULTS",
    "is_example_data", "SFT_DEMO", "EXAMPLE_SUFFIXES", "REMAT_POLICIES", "LATER_FIELDS", "without_later_defaults",
    "with_later_defaults", "DECAY_MASKS",
]

DECAY_MASKS = ("matrices", "no_bias_norm", "all")
"""train.decay_mask values: the tensors weight decay applies to (parity.weights.decays). 'matrices': parity's own
mask, the weight matrices only; 'no_bias_norm': every tensor but biases and norm scales (the HF Trainer's and Megatron's
two param groups; embeddings decayed); 'all': every tensor (one param group, as DeepSpeed builds an optimizer over
model.parameters()). A ported DeepSpeed config names the one its training stack runs (parity.migrate._stack)."""

MAX_SEQ_LEN = 1 << 17
"""Largest model.max_seq_len accepted (128 Ki tokens); a typo like 1e9 would otherwise allocate the table."""
MAX_VOCAB = 1 << 22
"""Largest model.vocab_size accepted (4 Mi ids): above Llama-3 (128,256), Qwen (151,936) and Gemma (262,144), and
under uint32 batches' 2**32 ids, while a typo like 1e9 is still refused before a 1e9-row embedding is allocated."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelSpec:
  """A GPT-style decoder. GPT-2 and LLaMA families differ only in these fields."""

  vocab_size: int = 256
  """Number of token ids; byte-level text uses 256."""
  d_model: int = 256
  """Residual stream width (hidden size)."""
  n_layers: int = 4
  """Number of transformer blocks."""
  n_heads: int = 4
  """Query heads per attention layer."""
  n_kv_heads: int | None = None
  """Key/value heads (grouped-query attention); None means n_heads (multi-head)."""
  d_ff: int | None = None
  """MLP hidden width; None means 4 * d_model."""
  max_seq_len: int = 128
  """Longest sequence the position table covers, in tokens."""
  norm: Literal["layernorm", "rmsnorm"] = "layernorm"
  """Normalisation layer: LayerNorm (GPT-2) or RMSNorm (LLaMA)."""
  norm_eps: float = 1e-5
  """Epsilon inside the norm. PyTorch LayerNorm default 1e-5; Flax default 1e-6."""
  mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"
  """MLP form: fc -> GELU -> proj (GPT-2), SwiGLU gate/up/down (LLaMA), or GeGLU: down(GELU(gate) * up), GELU of
  the `gelu_approximate` form (Gemma: tanh)."""
  gelu_approximate: bool = True
  """GELU form: True = tanh approximation (GPT-2 'gelu_new', Flax default), False = exact erf (torch default)."""
  position: Literal["learned", "rope"] = "learned"
  """Position encoding: learned absolute table `wpe` (GPT-2) or rotary (LLaMA)."""
  rope_theta: float = 10000.0
  """Rotary base; used only when position == 'rope'."""
  bias: bool = True
  """Biases on linear layers and LayerNorm (GPT-2 yes, LLaMA no)."""
  tie_embeddings: bool = True
  """Output head shares the token-embedding matrix `wte`."""
  attn_scale: float | None = None
  """Multiplier on q.k; None means 1/sqrt(head_dim)."""
  init_std: float = 0.02
  """Std of the normal init of every weight matrix (GPT-2 scheme)."""
  # ---- model-family fields (parity.architecture). At their defaults a spec is the GPT-2 / LLaMA one of
  # before, and config_hash leaves them out (FAMILY_DEFAULTS), so older runs keep their hash.
  qkv_bias: bool | None = None
  """Biases on the q/k/v projections (HF attention_bias; Qwen2 true with the others false); None: `bias`."""
  out_bias: bool | None = None
  """Bias on the attention output projection (HF attention_bias for LLaMA, none for Qwen2); None: `bias`."""
  mlp_bias: bool | None = None
  """Biases on the MLP projections (HF mlp_bias); None: `bias`."""
  d_head: int | None = None
  """Width of one attention head (HF head_dim: Qwen3, Gemma); None: d_model // n_heads."""
  qk_norm: bool = False
  """Per-head RMSNorm over head_dim on q and on k, before rotary (HF q_norm / k_norm: Qwen3, Gemma 3); its form and
  eps are the model's (norm_plus_one, norm_eps)."""
  rope_scaling: dict | None = None
  """Rotary frequency scaling under HF's rope_parameters keys: {"rope_type": "linear", "factor"},
  {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"} or
  {"rope_type": "yarn", "factor", "original_max_position_embeddings", optional "beta_fast", "beta_slow",
  "attention_factor", "mscale", "mscale_all_dim", "truncate"}; None: plain rotary. parity.architecture.inv_freq."""
  norm_plus_one: bool = False
  """RMSNorm scales by (1 + weight), weight initialised to 0 (Gemma); statistics and the scale in float32."""
  embed_scale: float = 1.0
  """Multiplier on the token embeddings before the first block (Gemma: sqrt(d_model), rounded to the compute
  dtype as HF's `normalizer`); 1.0: none."""
  post_norms: bool = False
  """Norms on each branch's output before its residual add, `ln_1_post` and `ln_2_post` (Gemma 2/3
  post_attention_layernorm and post_feedforward_layernorm)."""
  attn_softcap: float | None = None
  """Attention score soft-cap: scores = cap * tanh(scores / cap) after the scale, before the mask (Gemma 2
  attn_logit_softcapping); None: none."""
  final_softcap: float | None = None
  """Logit soft-cap: logits = cap * tanh(logits / cap) (Gemma 2 final_logit_softcapping); None: none."""
  sliding_window: int | None = None
  """Sliding-window attention: in a 'sliding' layer query t sees key s iff 0 <= t - s < sliding_window (HF
  sliding_window; Mistral, Qwen2 with use_sliding_window, Gemma 2/3 local layers); None: every layer full."""
  layer_types: tuple = ()
  """Per layer 'full' or 'sliding' (HF layer_types: Gemma 2 alternates, Gemma 3 is 5 local : 1 global); ():
  every layer 'sliding' when sliding_window is set (Mistral), else 'full'."""
  rope_local_theta: float | None = None
  """Rotary base of the 'sliding' layers, which then use no rope_scaling (Gemma 3 rope_local_base_freq); None:
  every layer uses rope_theta and rope_scaling."""

  def __hash__(self) -> int:  # rope_scaling is a dict: hash the canonical JSON (jit static args, caches)
    return hash(json.dumps(to_dict(self), sort_keys=True))

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads if self.d_head is None else self.d_head

  @property
  def kv_heads(self) -> int:
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def ffn_dim(self) -> int:
    return 4 * self.d_model if self.d_ff is None else self.d_ff

  @property
  def scale(self) -> float:
    return 1.0 / math.sqrt(self.head_dim) if self.attn_scale is None else self.attn_scale

  def linear_bias(self, kind: Literal["qkv", "out", "mlp"]) -> bool:
    """Whether the `kind` projections (q/k/v, attention output, MLP) have biases: qkv_bias / out_bias / mlp_bias,
    or `bias` where that field is None."""
    own = {"qkv": self.qkv_bias, "out": self.out_bias, "mlp": self.mlp_bias}[kind]
    return self.bias if own is None else own

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """'full' or 'sliding' per layer, n_layers long (layer_types, or its default; see the field)."""
    return architecture.layer_kinds(self)

  def validate(self) -> "ModelSpec":
    """Raises SpecError naming the field when the spec cannot describe a model."""
    check_section_numbers(self, "model")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
      if getattr(self, name) < 1:
        raise SpecError(f"model.{name} must be >= 1; got {getattr(self, name)}")
    for name, lo in (("n_kv_heads", 1), ("d_ff", 1)):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
        raise SpecError(f"model.{name} must be null or an integer >= {lo}; got {v!r}")
    if self.attn_scale is not None and (isinstance(self.attn_scale, bool) or
                                        not isinstance(self.attn_scale, (int, float)) or not self.attn_scale > 0):
      raise SpecError(f"model.attn_scale must be null (1/sqrt(head_dim)) or a number > 0; got {self.attn_scale!r}")
    if not self.init_std > 0:
      raise SpecError(f"model.init_std must be > 0; got {self.init_std}")
    if self.max_seq_len > MAX_SEQ_LEN or self.vocab_size > MAX_VOCAB:
      raise SpecError(f"model.max_seq_len <= {MAX_SEQ_LEN} and model.vocab_size <= {MAX_VOCAB}; got "
                      f"{self.max_seq_len} and {self.vocab_size}")
    for name in ("gelu_approximate", "bias", "tie_embeddings"):
      if not isinstance(getattr(self, name), bool):
        raise SpecError(f"model.{name} must be true or false; got {getattr(self, name)!r}")
    if self.d_head is None and self.d_model % self.n_heads:
      raise SpecError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
    if self.n_heads % self.kv_heads:
      raise SpecError(f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads})")
    if not self.norm_eps > 0:
      raise SpecError(f"model.norm_eps must be > 0; got {self.norm_eps}")
    if self.norm not in ("layernorm", "rmsnorm"):
      raise SpecError(f"model.norm must be 'layernorm' or 'rmsnorm'; got {self.norm!r}")
    if self.mlp not in ("gelu", "swiglu", "geglu"):
      raise SpecError(f"model.mlp must be 'gelu', 'swiglu' or 'geglu'; got {self.mlp!r}")
    if self.position not in ("learned", "rope"):
      raise SpecError(f"model.position must be 'learned' or 'rope'; got {self.position!r}")
    architecture.validate(self)
    if self.position == "rope" and self.head_dim % 2:
      raise SpecError(f"rotary embeddings need an even head_dim; got {self.head_dim}")
    return self



@dataclasses.dataclass(frozen=True, slots=True)
class TrainSpec:
  """Optimisation and data settings; every side applies them identically."""

  steps: int = 200
  """Optimizer steps to run."""
  micro_batch_size: int = 8
  """Sequences per micro batch (per data-parallel rank)."""
  grad_accum_steps: int = 1
  """Micro batches accumulated per optimizer step (DeepSpeed gradient_accumulation_steps)."""
  seq_len: int = 128
  """Tokens per sequence fed to the model (inputs; targets are shifted by one)."""
  lr: float = 1e-3
  """Peak learning rate (DeepSpeed optimizer.params.lr)."""
  warmup_steps: int = 20
  """Linear warmup steps of WarmupCosineLR (warmup_num_steps, >= 1; DeepSpeed clamps it to >= 2)."""
  warmup_min_ratio: float = 0.0
  """LR at step 0 as a fraction of lr (WarmupCosineLR warmup_min_ratio)."""
  cos_min_ratio: float = 0.1
  """Final LR as a fraction of lr (WarmupCosineLR cos_min_ratio)."""
  lr_schedule: str = "WarmupCosineLR"
  """DeepSpeed scheduler type: WarmupCosineLR, WarmupLR, WarmupDecayLR, LRRangeTest or Constant
  (parity.numerics.schedule)."""
  lr_schedule_params: dict | None = None
  """Scheduler params under DeepSpeed's names (e.g. from a ported config); None: WarmupCosineLR from
  warmup_steps / warmup_min_ratio / cos_min_ratio with linear warmup over `steps`."""
  beta1: float = 0.9
  """Adam first-moment decay."""
  beta2: float = 0.95
  """Adam second-moment decay."""
  eps: float = 1e-8
  """Adam epsilon, added to sqrt(v_hat) (optax eps; eps_root stays 0)."""
  weight_decay: float = 0.1
  """Decoupled (AdamW) weight decay; applied as p -= lr * wd * p on decayed tensors only."""
  decay_mask: Literal["matrices", "no_bias_norm", "all"] = "matrices"
  """Which tensors are decayed (DECAY_MASKS, parity.weights.decays): 'matrices' (parity's default: the weight
  matrices), 'no_bias_norm' (all but biases and norm scales: the HF Trainer's / Megatron's groups) or 'all' (one
  group). Every side builds its decay set from it; `parity port` sets it to what the config's training stack runs."""
  grad_clip: float = 1.0
  """Max global L2 norm of the gradient; 0 disables clipping (DeepSpeed gradient_clipping)."""
  optimizer: Literal["adamw", "adam", "lamb", "sgd"] = "adamw"
  """DeepSpeed optimizer type (parity.numerics.schedule.OPTIMIZERS): adamw (decoupled decay), adam (L2: DeepSpeed Adam
  with adam_w_mode false, g += wd * p), lamb (DeepSpeed FusedLamb; CUDA-only on the DeepSpeed side) or sgd
  (torch.optim.SGD). beta1/beta2/eps apply to adam/adamw/lamb; momentum/dampening/nesterov to sgd."""
  momentum: float = 0.0
  """SGD momentum factor, in [0, 1) (torch.optim.SGD momentum; 0 = plain SGD)."""
  dampening: float = 0.0
  """SGD dampening of the momentum buffer's gradient term, in [0, 1] (torch.optim.SGD dampening)."""
  nesterov: bool = False
  """SGD Nesterov momentum (needs momentum > 0 and dampening 0, as torch.optim.SGD)."""
  lamb_max_coeff: float = 10.0
  """Lamb: upper clamp of the trust ratio ||w|| / ||update|| (DeepSpeed FusedLamb max_coeff)."""
  lamb_min_coeff: float = 0.01
  """Lamb: lower clamp of the trust ratio (DeepSpeed FusedLamb min_coeff)."""
  eps_inside_sqrt: bool = False
  """Lamb: denominator sqrt(v + eps) instead of sqrt(v) + eps (DeepSpeed FusedLamb eps_inside_sqrt)."""
  precision: Literal["fp32", "bf16", "fp16"] = "fp32"
  """Compute precision; master weights and optimizer state stay fp32. fp16 adds loss scaling (below)."""
  loss_scale: float = 0.0
  """fp16 only: a static loss scale, or 0 for dynamic loss scaling (DeepSpeed fp16.loss_scale)."""
  initial_scale_power: int = 16
  """fp16 dynamic scaling starts at 2**initial_scale_power (DeepSpeed fp16.initial_scale_power)."""
  loss_scale_window: int = 1000
  """fp16: clean steps after the last overflow before the scale doubles (DeepSpeed fp16.loss_scale_window)."""
  hysteresis: int = 2
  """fp16: overflows tolerated (update skipped, scale kept) before the scale halves (DeepSpeed fp16.hysteresis)."""
  consecutive_hysteresis: bool = False
  """fp16: refill the hysteresis on every clean step, not only when the scale grows
  (DeepSpeed fp16.consecutive_hysteresis)."""
  min_loss_scale: float = 1.0
  """fp16: the dynamic scale never halves below this (DeepSpeed fp16.min_loss_scale)."""
  seed: int = 0
  """Seed of the numpy weight init."""
  data_seed: int = 1234
  """Seed of the batch sampler."""
  eval_every: int = 50
  """Steps between validation-loss evaluations (also at the last step); 0 disables."""
  eval_batches: int = 4
  """Micro batches of held-out data per validation-loss evaluation."""
  layout: Literal["stream", "padded", "packed"] = "stream"
  """Batch layout (docs/data-examples.md): 'stream' (windows of one token stream, the default), 'padded' (one
  example per row, right-padded) or 'packed' (several examples per row, segment ids); the last two need example data
  (a .jsonl / .json / .parquet file of examples, or 'sft-demo')."""
  loss_normalization: Literal["tokens", "micro_mean"] = "tokens"
  """'tokens': the step's summed token losses over its loss tokens (every micro batch and rank); 'micro_mean': the
  mean of micro-batch means. On 'stream' both are the same (every micro batch has T * M loss tokens)."""
  truncation: Literal["truncate", "split"] = "truncate"
  """An example longer than seq_len + 1 tokens is truncated, or split into pieces ('split'); counted in the data
  card."""
  examples_per_step: int | None = None
  """Examples (pieces) per optimizer step, padded/packed; None: the layout's default (parity.dataset.layouts)."""

  @property
  def tokens_per_step(self) -> int:
    return self.micro_batch_size * self.grad_accum_steps * self.seq_len

  def validate(self, model: ModelSpec | None = None) -> "TrainSpec":
    """Raises SpecError naming the field when a value is out of range or inconsistent with `model`."""
    check_section_numbers(self, "train")
    for name in ("steps", "micro_batch_size", "grad_accum_steps", "seq_len"):
      if getattr(self, name) < 1:
        raise SpecError(f"train.{name} must be >= 1; got {getattr(self, name)}")
    if not self.lr > 0:
      raise SpecError(f"train.lr must be > 0; got {self.lr}")
    if self.warmup_steps < 1:
      raise SpecError(f"train.warmup_steps must be >= 1 (DeepSpeed WarmupCosineLR rejects 0); got {self.warmup_steps}")
    for name in ("beta1", "beta2"):
      if not 0 <= getattr(self, name) < 1:
        raise SpecError(f"train.{name} must be in [0, 1); got {getattr(self, name)}")
    if self.decay_mask not in DECAY_MASKS:
      raise SpecError(f"train.decay_mask {self.decay_mask!r}: expected one of {', '.join(DECAY_MASKS)}")
    if self.weight_decay < 0 or self.grad_clip < 0 or self.eps <= 0:
      raise SpecError("train.weight_decay and train.grad_clip must be >= 0 and train.eps > 0")
    for name in ("warmup_min_ratio", "cos_min_ratio"):
      if not 0 <= getattr(self, name) <= 1:
        raise SpecError(f"train.{name} must be in [0, 1]; got {getattr(self, name)}")
    if self.eval_every < 0 or self.eval_batches < 1:  # data.make_batches draws at least one validation batch
      raise SpecError(f"train.eval_every must be >= 0 (0 disables the validation loss) and train.eval_batches >= 1; "
                      f"got {self.eval_every}, {self.eval_batches}")
    for name in ("seed", "data_seed"):
      if getattr(self, name) < 0:
        raise SpecError(f"train.{name} must be >= 0; got {getattr(self, name)}")
    if self.lr_schedule_params is not None and not isinstance(self.lr_schedule_params, dict):
      raise SpecError(f"train.lr_schedule_params must be null or a mapping of DeepSpeed scheduler params; "
                      f"got {self.lr_schedule_params!r}")
    if self.precision not in ("fp32", "bf16", "fp16"):
      raise SpecError(f"train.precision must be 'fp32', 'bf16' or 'fp16'; got {self.precision!r}")
    if self.loss_scale < 0 or not self.min_loss_scale > 0:
      raise SpecError(f"train.loss_scale must be >= 0 (0: dynamic) and train.min_loss_scale > 0; "
                      f"got {self.loss_scale}, {self.min_loss_scale}")
    if self.loss_scale_window < 1 or self.hysteresis < 1 or not 0 <= self.initial_scale_power <= 127:
      raise SpecError(f"train.loss_scale_window and train.hysteresis must be >= 1 and train.initial_scale_power "
                      f"in [0, 127]; got {self.loss_scale_window}, {self.hysteresis}, {self.initial_scale_power}")
    if self.lr_schedule not in schedule.COMPARE_SCHEDULERS:
      raise SpecError(f"train.lr_schedule {self.lr_schedule!r}: parity compare runs "
                      f"{', '.join(schedule.COMPARE_SCHEDULERS)}")
    if self.optimizer not in schedule.OPTIMIZERS:
      raise SpecError(f"train.optimizer {self.optimizer!r}: expected one of {', '.join(schedule.OPTIMIZERS)}")
    if not 0 <= self.momentum < 1 or not 0 <= self.dampening <= 1 or not isinstance(self.nesterov, bool):
      raise SpecError(f"train.momentum must be in [0, 1), train.dampening in [0, 1] and train.nesterov true or false; "
                      f"got {self.momentum}, {self.dampening}, {self.nesterov!r}")
    if self.nesterov and (self.momentum == 0 or self.dampening != 0):
      raise SpecError(f"train.nesterov needs train.momentum > 0 and train.dampening 0 (torch.optim.SGD raises "
                      f"otherwise); got momentum {self.momentum}, dampening {self.dampening}")
    if not 0 <= self.lamb_min_coeff <= self.lamb_max_coeff or not isinstance(self.eps_inside_sqrt, bool):
      raise SpecError(f"train.lamb_min_coeff must be in [0, train.lamb_max_coeff] and train.eps_inside_sqrt true or "
                      f"false; got {self.lamb_min_coeff}, {self.lamb_max_coeff}, {self.eps_inside_sqrt!r}")
    schedule.scheduler_params(self)  # SpecError naming train.lr_schedule / lr_schedule_params (a bug would show)
    validate_layout(self)
    if model is not None and self.seq_len > model.max_seq_len:
      raise SpecError(f"train.seq_len ({self.seq_len}) exceeds model.max_seq_len ({model.max_seq_len}); lower it "
                      f"(--set train.seq_len={model.max_seq_len}) or raise model.max_seq_len")
    return self


@dataclasses.dataclass(frozen=True, slots=True)
class RunSpec:
  """Everything one comparison needs, resolved."""

  model: ModelSpec = ModelSpec()
  train: TrainSpec = TrainSpec()
  jax: JaxPlan = JaxPlan()
  deepspeed: DeepSpeedPlan = DeepSpeedPlan()
  fsdp: FsdpPlan = FsdpPlan()
  """The FSDP2 side's plan (used by side 'fsdp' only; config_hash leaves it out at its defaults)."""
  data: str = "stdlib"
  """Corpus: 'stdlib' (this Python's standard library sources), a text file or folder, a .bin of token ids
  (llm.c header; headerless uint16, nanoGPT; NAME.uint32.bin) or a 1-D integer .npy (parity.data.load_corpus)."""
  sides: tuple[str, ...] = ("jax", "deepspeed", "torch")
  """Sides to run; the first is the reference of each pairwise check."""
  timeout_s: float = 1800.0
  """Wall-clock limit of one side, seconds; a side past it is killed and reported as 'timeout'."""

  def reads_plan(self, section: str) -> bool:
    """Whether one of this run's sides runs the plan in RunSpec section `section` (its record's `plan`)."""
    return reads_plan(self.sides, section)

  def validate(self) -> "RunSpec":
    """Checks every section (model, train against the model, deepspeed, jax, fsdp) and the run-level rules (micro batch
    divisible by jax.data_parallel, Lamb without scan_layers, timeout, sides). Returns self. Raises SpecError naming
    the key and the value."""
    check_section_numbers(self, "")
    self.model.validate()
    self.train.validate(self.model)
    self.deepspeed.validate()
    self.jax.validate()
    self.fsdp.validate()
    _check_example_data(self.data, self.train.layout)
    if self.train.micro_batch_size % self.jax.data_parallel:
      raise SpecError(f"train.micro_batch_size ({self.train.micro_batch_size}) must be divisible by "
                      f"jax.data_parallel ({self.jax.data_parallel}): the micro batch is split over the data axis")
    if self.train.optimizer == "lamb" and self.jax.scan_layers and self.reads_plan("jax"):
      raise SpecError("train.optimizer 'lamb' with jax.scan_layers=true: Lamb's trust ratio is per tensor and a "
                      "layer-stacked tensor holds every layer's; set jax.scan_layers=false (or another optimizer)")
    if not self.timeout_s > 0:
      raise SpecError(f"timeout_s must be > 0 seconds; got {self.timeout_s}")
    known = set(side_names())  # every registered side (parity.sides)
    bad = [s for s in self.sides if s not in known]
    if bad or not self.sides:
      raise SpecError(f"sides must be a non-empty subset of {sorted(known)}; got {list(self.sides)}")
    if len(set(self.sides)) != len(self.sides):
      raise SpecError(f"sides lists a side twice: {list(self.sides)}")
    return self


LATER_FIELDS: tuple[tuple[str, dict, bool], ...] = (
    ("train", LAYOUT_DEFAULTS, False),  # padded/packed example data
    ("model", architecture.FAMILY_DEFAULTS, False),  # model families: Llama 3, Qwen, Gemma, Mistral
    ("fsdp", {"activation_checkpointing": False}, False),  # FSDP2 remat pairs; before the whole section
    ("fsdp", {k: v for k, v in to_dict(FsdpPlan()).items() if k != "activation_checkpointing"}, True),  # the FSDP2 side
    ("deepspeed", {"cpu_checkpointing": False}, False),  # zero3-act-offload
    ("train", {"decay_mask": "matrices"}, False),  # the training stack's decay mask (parity port --stack)
    ("jax", {"offload_opt_ratio": 1.0}, False),  # partial optimizer-state offload (DeepSpeed offload_optimizer.ratio)
)
"""Fields added after runs, baselines and checkpoints were written, with their defaults: (section, field -> default,
whole). A field that holds its default is left out (`without_later_defaults`), so an earlier run and one written since
that leaves the field alone are the same configuration to `config_hash` and to the gate
(parity.report.runconfig.run_as_compared). With whole=True the section goes only when every field holds its default,
as its first hash had it. A field added later goes here, with its default."""


def without_later_defaults(data: dict) -> dict:
  """`to_dict(RunSpec)` (or report.json's `run`) without the LATER_FIELDS that hold their defaults; sections that are
  not dicts are kept as they are. Returns a new dict; `data` is not changed."""
  out = dict(data)
  for section, defaults, whole in LATER_FIELDS:
    sec = out.get(section)
    if not isinstance(sec, dict):
      continue
    if whole:
      if sec == defaults:
        del out[section]
      continue
    out[section] = {k: v for k, v in sec.items() if not (k in defaults and v == defaults[k])}
  return out


def with_later_defaults(data: dict) -> dict:
  """`to_dict(RunSpec)` (or report.json's `run`) with every LATER_FIELDS field it lacks filled with its default: a
  run written before a field existed reads as the run that holds its default (the gate's comparison,
  parity.report.runconfig.run_as_compared, so a difference names only the fields that differ). Sections that are
  not dicts are kept as they are. Returns a new dict."""
  out = dict(data)
  for section, defaults, _ in LATER_FIELDS:
    sec = out.get(section, {})
    if isinstance(sec, dict):
      out[section] = {**defaults, **sec}
  return out


def config_hash(spec: RunSpec) -> str:
  """sha256 (first 16 hex) of the canonical JSON of the resolved spec, LATER_FIELDS at their defaults left out
  (`without_later_defaults`), so the runs from before a field existed keep their hash."""
  blob = json.dumps(without_later_defaults(to_dict(spec)), sort_keys=True, separators=(",", ":")).encode()
  return hashlib.sha256(blob).hexdigest()[:16]
