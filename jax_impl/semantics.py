"""The JAX side's semantics card (parity.protocol.semantics): each item probed on the objects its step runs, after
`Trainer.build` and before step 1 (`jax_impl.side.JaxSide.semantics`).

  rotary.layout        `layers.apply_rope` on the basis vector e_0 with a constant angle: the rotated mass lands
                       on index H/2 (half-split, HF rotate_half) or 1 (interleaved)
  mlp.gelu_form        `layers.mlp_activation(spec)` at parity.semantics.GELU_PROBE_X (x = 1 and -3)
  norm.*               a `layers.Norm` of the run's spec (scale 1, bias 0) on known vectors: the form from
                       (1, 3, 1, 3, ...), eps from +-a at the amplitude whose output is nearest 0.5, the statistics'
                       dtype from a float16 input of +-300 (300^2 overflows float16 but not float32); norm.rounding:
                       the Norm in bfloat16 with the rounding probe's scale (parity.semantics.classify_norm_rounding);
                       norm.eps_all: every `layers.Norm` the model creates, each module's own eps (`layers.norm_eps`,
                       this process's family plants included), read while jax.eval_shape traces the model's init
                       (`norm_eps_by_name`)
  forward.probe_loss   `model.loss_fn` of parity.semantics.probe_spec in float32 on the host CPU device at
                       probe_params (the class the step traces, this process's family plants included)
  attention.*          the module's own scale (spec.scale, what its einsum multiplies by); the soft-caps:
                       `layers.softcap` at parity.semantics.CAP_PROBE with the Attention's / GPT's spec caps; the q/k
                       norm: present when the built params hold the Attention's `ln_q`, probed as a
                       `layers.Norm(heads=True)` of the spec over head_dim; the window of each layer:
                       `attention.window_ok` of the layer's kind (spec.layer_kinds, what GPT passes each block) and
                       the causal triangle at T = train.seq_len (parity.semantics.window_of)
  rotary.per_layer     `layers.rope_tables` of each layer's (theta, scaling) (`attention.kind_rope` of its kind, what
                       the Attention builds), row 1 (parity.semantics.rope_row)
  embedding.scale      `layers.embed_scale` on ones with spec.embed_scale (GPT applies it when the scale is not 1)
  loss.*               the loss's reduction (`model._mean_nll` on synthetic logits) and the label shift of its
                       wiring (`step.example_loss_kwargs` with this side's plants; stream: tokens[:, 1:])
  optimizer.*, lr, clip  the Trainer's own optax chain (`Trainer.tx`) on a tiny tree of the params' structure
                       (each leaf (1, ...), a scan-stacked leaf (L, 1, ...), expanded to per-layer canonical names):
                       zero gradients and params 1 at the first update count whose lr > 0 give the decay set (the
                       leaves that move); gradient eps and params 0 give eps placement and bias correction
                       (parity.numerics.adam.classify_adam); the clip's recorded norm gives the rule. The betas,
                       eps, weight decay and clip threshold: the values the chain's transforms were built with and
                       their updates close over (`jax_impl.optim.built_from`; beta1 at the state's count where a
                       schedule cycles it), not the spec's
  dtypes, matmul       the state's leaves; jax.config's default matmul precision; no dropout exists in the model.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_impl import accelerator_plants, attention, layers, layout, loss_scaling, optim
from jax_impl import model as model_lib
from jax_impl import step as step_lib
from parity.numerics import schedule as schedule_ref
from parity.numerics.adam import classify_adam
from parity import semantics as card_lib
from parity.protocol.layout import ACCELERATOR_PLANT_KEYS
from parity.semantics import sig
from parity.weights import param_shapes

__all__ = ["semantics_card", "gelu_form", "rotary_layout", "optimizer_probe", "loss_reduction", "family_items",
           "norm_rounding", "probe_loss", "norm_eps_by_name", "optimizer_items"]


def gelu_form(act: Any) -> str:
  """'tanh' | 'erf' | 'silu' | 'other': the form of a nonlinearity function of one array, probed at
  parity.semantics.GELU_PROBE_X in float32."""
  return card_lib.classify_gelu(np.asarray(act(jnp.asarray(card_lib.GELU_PROBE_X, jnp.float32)), np.float64))


def rotary_layout(apply_rope: Any, head_dim: int) -> str:
  """'half-split' | 'interleaved' | 'other': apply_rope(x (1, 1, 1, H), cos, sin (1, H)) on e_0 at angle 0.5."""
  x = jnp.zeros((1, 1, 1, head_dim), jnp.float32).at[..., 0].set(1.0)
  c, s = np.full((1, head_dim), np.cos(0.5), np.float32), np.full((1, head_dim), np.sin(0.5), np.float32)
  return card_lib.classify_rotary(np.asarray(apply_rope(x, c, s)).reshape(-1))


def _norm_apply(spec: Any, x: np.ndarray, heads: bool = False) -> np.ndarray:
  """A `layers.Norm` of `spec` (scale 1, bias 0, compute dtype the input's; `heads`: the q/k norm's) on one vector
  x (D,)."""
  norm = layers.Norm(spec, dtype=jnp.dtype(x.dtype), heads=heads)
  xin = jnp.asarray(x)[None, None]
  params = jax.tree.map(lambda p: jnp.ones_like(p) if p.ndim else p, norm.init(jax.random.PRNGKey(0), xin))
  params = {"params": {k: (jnp.zeros_like(v) if k == "bias" else v) for k, v in params["params"].items()}}
  return np.asarray(norm.apply(params, xin), np.float64).reshape(-1)


def norm_rounding(spec: Any, form: str) -> str:
  """norm.rounding (parity.semantics.classify_norm_rounding): a `layers.Norm` of `spec` in bfloat16, its scale the
  rounding probe's weight as a bfloat16 array (what `model.cast_params` hands the forward) and bias 0, on the
  probe's bfloat16 input; `form` is its norm.form."""
  x, w = card_lib.rounding_probe(spec.d_model, form == "rmsnorm(1+w)")
  norm = layers.Norm(spec, dtype=jnp.bfloat16)
  xin = jnp.asarray(x).astype(jnp.bfloat16)[None]
  params = norm.init(jax.random.PRNGKey(0), xin)["params"]
  params = {k: (jnp.zeros_like(v) if k == "bias" else jnp.asarray(w)).astype(jnp.bfloat16) for k, v in params.items()}
  y = np.asarray(norm.apply({"params": params}, xin).astype(jnp.float32))[0]
  return card_lib.classify_norm_rounding(x, w, y, form, spec.norm_eps)


def probe_loss(spec: Any) -> float | None:
  """forward.probe_loss: `model.loss_fn` of parity.semantics.probe_spec(spec) (the model the step traces, with any
  planted family bug of this process) in float32 on the host CPU device at matmul precision 'highest', at
  probe_params on probe_tokens; None where probe_spec is None."""
  spec = card_lib.probe_spec(spec)
  if spec is None:
    return None
  try:  # this process's own CPU device: under jax.distributed, jax.devices() lists other processes' devices too
    cpu = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS without cpu): its first local device
    cpu = jax.local_devices()[0]
  params = jax.device_put(layout.to_flax(card_lib.probe_params(spec), spec), cpu)
  tokens = jax.device_put(jnp.asarray(card_lib.probe_tokens(spec)), cpu)
  with jax.default_device(cpu), jax.default_matmul_precision("highest"):
    return float(model_lib.loss_fn(params, tokens, spec, dtype=jnp.float32))


@contextlib.contextmanager
def _without_accelerator_plants() -> Iterator[None]:
  """This process's accelerator plants (jax_impl.accelerator_plants) held off: they stand for an accelerator's own
  compiler or runtime error, which no built module shows, so the card keeps the run's values under them."""
  held = {k: accelerator_plants.planted_value(k) for k in ACCELERATOR_PLANT_KEYS}
  held = {k: v for k, v in held.items() if v is not None}
  if not held:
    yield
    return
  accelerator_plants.set_accelerator_plants({}, "cpu")
  try:
    yield
  finally:
    accelerator_plants.set_accelerator_plants(held, "accelerator")


def norm_eps_by_name(spec: Any, scan: bool) -> dict[str, float]:
  """{canonical norm module name ('h.0.ln_1', 'h.0.attn.ln_q', 'ln_f'): its eps} of every `layers.Norm` the model
  (`model_lib.GPT` of `spec`, its blocks scanned as the step's when `scan`) creates, each read from the module itself
  (`layers.norm_eps`: this process's family plants included) while jax.eval_shape traces the model's init on one
  token (nothing is computed). A scanned block's norms are every layer's (one module runs them all)."""
  found: dict[tuple[str, ...], float] = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, layers.Norm) and context.method_name == "__call__":
      found.setdefault(tuple(context.module.path), float(layers.norm_eps(context.module)))
    return next_fun(*args, **kwargs)

  with _without_accelerator_plants(), nn.intercept_methods(record):
    jax.eval_shape(model_lib.GPT(spec, scan_layers=scan).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
  out = {}
  for path, eps in found.items():
    head, rest = path[0], ".".join(path[1:])
    if head == layout.LAYERS and scan:
      out.update({f"h.{i}.{rest}": eps for i in range(spec.n_layers)})
    elif head.startswith("h_") and head[2:].isdigit():
      out[f"h.{head[2:]}.{rest}"] = eps
    else:
      out[".".join(path)] = eps
  return out


def optimizer_items(tx: Any, count: int, decay_set: list[str] | None, n_params: int) -> dict[str, Any]:
  """optimizer.betas, optimizer.eps, optimizer.weight_decay_groups and the clip threshold of the chain `tx`, from
  the values its transforms were built with (`optim.built_from`): beta1 at update `count` where a schedule cycles
  it; the decay groups: the built weight decay where `decay_set` (the probe's decayed names) holds any of the
  `n_params` params, 0.0 where it leaves any out. 'clip_max_norm': None when the chain records no clip."""
  built = optim.built_from(tx)
  b1, b2, eps = built.get("beta1"), built.get("beta2"), built.get("eps")
  if callable(b1):
    b1 = float(np.asarray(b1(jnp.asarray(count, jnp.int32))))
  betas = None if b1 is None or b2 is None else [float(b1), float(b2)]
  wd = built.get("weight_decay")
  groups = None
  if decay_set is not None and wd is not None:
    groups = sorted(({sig(float(wd), 6)} if decay_set else set()) | ({0.0} if len(decay_set) < n_params else set()))
  clip = built.get("clip_max_norm")
  return {"optimizer.betas": betas, "optimizer.eps": None if eps is None else float(eps),
          "optimizer.weight_decay_groups": groups, "clip_max_norm": None if clip is None else float(clip)}


def family_items(spec: Any, params: Any, seq_len: int) -> dict[str, Any]:
  """The model-family items of the module docstring: rotary.per_layer, attention.qk_norm(_eps),
  attention.softcap, attention.window, embedding.scale, logits.final_softcap. params: the state's Flax params (only
  their paths are read); seq_len: the rows' T (the window probe's)."""
  kinds = spec.layer_kinds
  rope = None
  if spec.position == "rope":
    rope = []
    for kind in kinds:
      cos, sin = layers.rope_tables(2, spec.head_dim, *attention.kind_rope(spec, kind == "sliding"))
      rope.append(card_lib.rope_row(cos[1], sin[1]))
  causal = np.tril(np.ones((seq_len, seq_len), bool))
  window = [card_lib.window_of(causal & np.asarray(attention.window_ok(seq_len, spec.sliding_window or seq_len,
                                                                       kind == "sliding"))) for kind in kinds]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  qk = (card_lib.norm_probe(lambda x: _norm_apply(spec, x, heads=True), spec.head_dim)
        if any("'ln_q'" in p for p in paths) else None)
  cap = lambda c: None if c is None else sig(float(layers.softcap(
      jnp.full((1,), card_lib.CAP_PROBE, jnp.float32), c)[0]), 6)
  scale = 1.0 if spec.embed_scale == 1.0 else float(layers.embed_scale(jnp.ones((1, 1, 1), jnp.float32),
                                                                       spec.embed_scale)[0, 0, 0])
  return {"rotary.per_layer": rope, "attention.qk_norm": qk["form"] if qk else None,
          "attention.qk_norm_eps": qk["eps"] if qk else None, "attention.softcap": cap(spec.attn_softcap),
          "attention.window": window, "embedding.scale": sig(scale, 6),
          "logits.final_softcap": cap(spec.final_softcap)}


def loss_reduction(nll_fn: Any) -> str:
  """'mean' | 'sum' | 'other' of a loss nll_fn(logits (B, T, V), targets (B, T)) on logits 0 (each term log V)."""
  v, n = card_lib.REDUCTION_PROBE
  return card_lib.classify_reduction(float(nll_fn(jnp.zeros((1, n, v), jnp.float32), jnp.zeros((1, n), jnp.int32))))


def _tiny(params: Any) -> Any:
  """The params tree with every leaf (1, ...) (a scan-stacked leaf under layout.LAYERS: (L, 1, ...)), float32."""
  out = {}
  for k, v in params.items():
    if isinstance(v, dict):
      out[k] = _tiny(v) if k != layout.LAYERS else jax.tree.map(
          lambda x: jnp.zeros((x.shape[0],) + (1,) * (x.ndim - 1), x.dtype), v)
    else:
      out[k] = jnp.zeros((1,) * v.ndim, v.dtype)
  return out


def _at_count(opt_state: Any, count: int) -> Any:
  """The optimizer state with every update count (DeepSpeedOptState, optax's ScaleByAdamState and
  ScaleByScheduleState: each state tuple with a `count`) set to `count`."""
  is_opt = lambda x: "count" in getattr(x, "_fields", ())
  return jax.tree.map(lambda x: x._replace(count=jnp.asarray(count, x.count.dtype)) if is_opt(x) else x,
                      opt_state, is_leaf=is_opt)


def _canonical_values(tree: Any, spec: Any, scan: bool) -> dict[str, float]:
  """{canonical name: the leaf's first element} of a tiny tree (`_tiny`'s layout)."""
  if scan:
    tree = layout.unstack_layers(tree, spec.n_layers)
  out = {}
  for name in param_shapes(spec):
    path, _ = layout.flax_path(name)
    leaf = tree
    for k in path:
      leaf = leaf[k]
    out[name] = float(np.asarray(leaf, np.float64).reshape(-1)[0])
  return out


def optimizer_probe(tx: Any, schedule: Any, params: Any, spec: Any, train: Any, scan: bool) -> dict[str, Any]:
  """Decay set, weight decay, eps placement, bias correction and clip rule of the optax chain `tx`, from two updates
  of a tiny tree of `params`' structure at the first update count whose lr > 0.

  Args:
    tx, schedule: the Trainer's chain and its schedule (update count -> lr, float32).
    params: the Flax params tree (float32; only its structure and leaf ranks are used); scan: stacked layers.
    spec, train: the run's ModelSpec and TrainSpec (train.eps is the probe gradient; its betas are the hypotheses').
  Returns:
    {decay_set: sorted canonical names | None, weight_decay: float (-delta / lr of a decayed param 1) | None,
    eps_placement, bias_correction (parity.numerics.adam.classify_adam), clip_rule: 'global-l2' | 'other' (the
    chain's recorded norm against the tree's L2 norm), probe_count, probe_leaves}; every value None (and a 'note')
    when the lr is 0 for the first 64 updates."""
  tiny = _tiny(params)
  count = next((k for k in range(64) if float(schedule(k)) > 0.0), None)
  if count is None:
    return {"decay_set": None, "weight_decay": None, "eps_placement": None, "bias_correction": None,
            "clip_rule": None, "note": "the learning rate is 0 for the first 64 updates: nothing moves"}
  lr = float(schedule(count))
  state = _at_count(tx.init(tiny), count)
  scale = _loss_scale(state)
  ones = jax.tree.map(jnp.ones_like, tiny)
  upd, _ = tx.update(jax.tree.map(jnp.zeros_like, tiny), state, ones)
  moved = {n: -v / lr for n, v in _canonical_values(upd, spec, scan).items()}
  decayed = sorted(n for n, v in moved.items() if v != 0.0)
  g = float(train.eps)
  upd, after = tx.update(jax.tree.map(lambda x: jnp.full_like(x, g * scale), tiny), state, tiny)
  u = -_canonical_values(upd, spec, scan)[next(iter(param_shapes(spec)))] / lr
  b1, b2 = schedule_ref.train_betas(train, count)
  placement, bc = classify_adam(u, g, float(train.eps), b1, b2, count + 1)
  n_leaves = len(jax.tree.leaves(tiny, is_leaf=lambda x: isinstance(x, jax.Array)))
  n_el = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tiny))
  try:
    norm = float(optim.grad_norm_of(after))
  except ValueError:  # a chain without parity's clip (no recorded norm): not a rule this card knows
    norm = float("nan")
  rule = "global-l2" if abs(norm - g * np.sqrt(n_el)) <= 1e-3 * g * np.sqrt(n_el) else "other"
  return {"decay_set": decayed, "weight_decay": sig(moved[decayed[0]], 6) if decayed else None,
          "eps_placement": placement, "bias_correction": bc, "clip_rule": rule, "probe_count": count,
          "probe_leaves": n_leaves}


def _loss_scale(state: Any) -> float:
  """The fp16 loss scale of a loss-scaled state (the update divides the gradient by it), else 1."""
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, loss_scaling.LossScaleState))
           if isinstance(x, loss_scaling.LossScaleState)]
  return float(found[0].scale) if found else 1.0


def _host(x: Any) -> np.ndarray:
  """A (replicated) array's value on this process: with several ranks a global array is not fully addressable."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return np.asarray(x)


def semantics_card(trainer: Any, plants: frozenset) -> dict[str, Any]:
  """{'items', 'info'} of a built `jax_impl.step.Trainer` (parity.semantics.DIFFED)."""
  run = trainer.run
  spec, train, scan = run.model, run.train, run.jax.scan_layers
  leaves = jax.tree.leaves(trainer.state.params)
  master = str(leaves[0].dtype)
  norm = card_lib.norm_probe(lambda x: _norm_apply(spec, x), spec.d_model)
  opt = optimizer_probe(trainer.tx, trainer.schedule, trainer.state.params, spec, train, scan)
  has_nu = lambda x: "nu" in getattr(x, "_fields", ())  # (DeepSpeedOptState, ScaleByAdamState)
  moments = [x for x in jax.tree.leaves(trainer.state.opt_state, is_leaf=has_nu) if has_nu(x)]
  mu = [str(x.dtype) for m in moments for x in jax.tree.leaves(getattr(m, "mu", None))]
  nu = [str(x.dtype) for m in moments for x in jax.tree.leaves(m.nu)]
  shift = step_lib.example_loss_kwargs({"segment_ids": None, "positions": None, "weights": None}, plants)
  precision = jax.config.jax_default_matmul_precision
  count = int(_host(optim.step_count_of(trainer.state.opt_state)))
  hyper = optimizer_items(trainer.tx, count, opt["decay_set"], len(param_shapes(spec)))
  clip = hyper.pop("clip_max_norm")
  items = {
      "rotary.layout": rotary_layout(layers.apply_rope, spec.head_dim) if spec.position == "rope" else None,
      "rotary.import_permutation": card_lib.IMPORT_PERMUTATION,
      "mlp.gelu_form": gelu_form(layers.mlp_activation(spec)),
      "norm.form": norm["form"], "norm.eps": norm["eps"], "norm.stats_dtype": norm["stats_dtype"],
      "norm.eps_all": card_lib.norm_eps_item(norm_eps_by_name(spec, scan)),
      "norm.rounding": norm_rounding(spec, norm["form"]), "forward.probe_loss": probe_loss(spec),
      "attention.scale": sig(spec.scale, 6), **family_items(spec, trainer.state.params, train.seq_len),
      "loss.label_shift": 1 if train.layout == "stream" else int(shift["label_shift"]),
      "loss.reduction": loss_reduction(model_lib._mean_nll),
      "optimizer.decay_set": opt["decay_set"],
      "optimizer.weight_decay": opt["weight_decay"] if train.optimizer == "adamw" else None,
      **hyper, "optimizer.eps_placement": opt["eps_placement"], "optimizer.bias_correction": opt["bias_correction"],
      "clip.rule": "none" if clip == 0.0 else opt["clip_rule"],
      "clip.max_norm": clip if clip else None,
      "lr.step0": sig(float(_host(trainer.schedule(count))), 6),
      "dtypes.params": str(jnp.dtype(model_lib.compute_dtype(train.precision))), "dtypes.master": master,
      "dtypes.moments": card_lib.moments_dtype(mu, nu), "dtypes.grads": master,
      "matmul.precision": {"highest": "highest", "float32": "highest", "high": "high", "tensorfloat32": "high",
                           "bfloat16_3x": "high", "default": "medium", "bfloat16": "medium"}.get(
                               str(precision).lower(), f"default ({precision})"),
      "dropout": 0.0}
  states = jax.tree.leaves(trainer.state.opt_state, is_leaf=lambda x: hasattr(x, "_fields"))
  info = {"optimizer": "optax chain of " + ", ".join(dict.fromkeys(type(x).__name__ for x in states
                                                                   if hasattr(x, "_fields"))),
          "clip.max_norm_source": "the clip transform's built_from (jax_impl.optim.clip_by_global_norm_deepspeed)",
          "optimizer.hyper_source": "the optax transforms' built_from (jax_impl.optim.BuiltTransformation): the betas, "
                                    "eps and weight decay their updates close over",
          "norm.eps_all_source": "each layers.Norm the model creates (its layers.norm_eps, traced by jax.eval_shape)",
          "attention.scale_source": "the Attention module's spec.scale (its einsum factor)",
          "loss.label_shift_source": "step.example_loss_kwargs (stream: tokens[:, 1:])",
          "rotary.import_permutation_source": "parity.hf maps tensors by name and transposes only (HF rotate-half "
                                              "layout, both models use it)",
          "optimizer_probe": {k: v for k, v in opt.items() if k.startswith("probe") or k == "note"},
          "scan_layers": bool(scan),
          "precision_settings": card_lib.precision_settings(
              os.environ, jax.default_backend(), str(jax.devices()[0].device_kind), str(precision))}
  return {"items": items, "info": info}
