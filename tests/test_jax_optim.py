"""jax_impl.optim: schedule, DeepSpeed clipping, decay mask, and AdamW against a numpy reference."""
import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from parity.numerics import schedule  # noqa: E402
from parity.presets import preset  # noqa: E402
from parity.spec import ModelSpec, TrainSpec  # noqa: E402
from parity.weights import decays, init_params, param_shapes  # noqa: E402

from jax_impl import layout  # noqa: E402
from jax_impl import optim  # noqa: E402

SPEC = ModelSpec(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
LLAMA = ModelSpec(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=8, norm="rmsnorm",
                  mlp="swiglu", position="rope", bias=False, tie_embeddings=False)


@pytest.mark.parametrize("train", [
    preset("gpt2-small-cpu").train,
    preset("gpt2-tiny").train,
    TrainSpec(steps=50, warmup_steps=1, warmup_min_ratio=0.3, cos_min_ratio=0.0, lr=6e-4),
    TrainSpec(steps=5, warmup_steps=10, lr=1.0),  # warmup longer than the run
], ids=["small", "tiny", "warmup1", "long-warmup"])
def test_schedule_equals_parity_schedule_at_every_step(train):
  sched = jax.jit(jax.vmap(optim.warmup_cosine_schedule(train)))
  ks = np.arange(train.steps + 25, dtype=np.int32)
  got = np.asarray(sched(ks))
  want = np.array([schedule.train_lr(train, int(k)) for k in ks], dtype=np.float32)
  np.testing.assert_array_equal(got, want)  # bit-exact float32 of DeepSpeed's float64 lr
  assert got[0] == 0 and got[1] == np.float32(train.lr * train.warmup_min_ratio)  # DeepSpeed's first two steps


# ----------------------------------------------------------------------------- clipping


def _clip(grads, max_norm):
  tx = optim.clip_by_global_norm_deepspeed(max_norm)
  out, state = jax.jit(tx.update)(grads, tx.init(grads))
  return out, float(state.grad_norm)


def test_clip_scales_by_deepspeed_formula_above_the_threshold():
  rng = np.random.default_rng(0)
  grads = {"a": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
  norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
  out, reported = _clip(grads, 0.5)
  np.testing.assert_allclose(reported, norm, rtol=1e-6)
  factor = 1.0 / ((norm + 1e-6) / 0.5)
  for k in grads:
    np.testing.assert_allclose(np.asarray(out[k]), grads[k] * factor, rtol=1e-6)


def test_clip_leaves_small_gradients_untouched_and_zero_disables_it():
  grads = {"a": np.full((4,), 0.1, np.float32)}  # norm 0.2
  out, reported = _clip(grads, 1.0)
  np.testing.assert_array_equal(np.asarray(out["a"]), grads["a"])
  np.testing.assert_allclose(reported, 0.2, rtol=1e-6)
  big = {"a": np.full((4,), 100.0, np.float32)}
  out, reported = _clip(big, 0.0)
  np.testing.assert_array_equal(np.asarray(out["a"]), big["a"])
  assert reported == pytest.approx(200.0)
  with pytest.raises(ValueError, match=">= 0"):
    optim.clip_by_global_norm_deepspeed(-1.0)


def test_clip_epsilon_matters_right_at_the_threshold():
  # ||g|| == clip exactly: DeepSpeed still scales by clip / (clip + 1e-6) (optax would not).
  grads = {"a": np.array([3.0, 4.0], np.float32)}
  out, _ = _clip(grads, 5.0)
  np.testing.assert_allclose(np.asarray(out["a"]), grads["a"] * np.float32(5.0 / (5.0 + 1e-6)), rtol=1e-7)
  assert np.asarray(out["a"])[1] < 4.0


# ----------------------------------------------------------------------------- decay mask


@pytest.mark.parametrize("spec", [SPEC, LLAMA], ids=["gpt2", "llama"])
def test_decay_mask_follows_parity_weights(spec):
  mask = optim.decay_mask(spec)
  params = layout.to_flax(init_params(spec, 0), spec)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  for name in param_shapes(spec):
    path, _ = layout.flax_path(name)
    assert layout._get(mask, path) is decays(name), name
  assert mask["wte"]["embedding"] is False
  assert mask["ln_f"]["scale"] is False
  assert mask["h_0"]["ln_1"]["scale"] is False
  assert mask["h_0"]["attn"]["qkv"]["kernel"] is True
  assert mask["h_0"]["mlp"]["proj"]["kernel"] is True
  if spec.bias:
    assert mask["h_0"]["attn"]["qkv"]["bias"] is False and mask["wpe"]["embedding"] is False
  if not spec.tie_embeddings:
    assert mask["lm_head"]["kernel"] is True


# ----------------------------------------------------------------------------- AdamW vs numpy


def numpy_deepspeed_adamw(params, grads_per_step, train, names):
  """float64 DeepSpeedCPUAdam (adamw_mode) + ZeRO clip + WarmupCosineLR, canonical layout.

  Returns the params after each step and the (pre-clip norm, lr) of each step.
  """
  p = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  history, stats = [], []
  for step, grads in enumerate(grads_per_step):
    g = {k: x.astype(np.float64) for k, x in grads.items()}
    norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
    if train.grad_clip > 0:
      g = {k: x / max(1.0, (norm + 1e-6) / train.grad_clip) for k, x in g.items()}
    lr = schedule.train_lr(train, step)
    t = step + 1
    bc1, bc2 = 1 - train.beta1 ** t, 1 - train.beta2 ** t
    for k in p:
      m[k] = train.beta1 * m[k] + (1 - train.beta1) * g[k]
      v[k] = train.beta2 * v[k] + (1 - train.beta2) * g[k] ** 2
      if decays(k):
        p[k] = p[k] - lr * train.weight_decay * p[k]
      p[k] = p[k] - lr / bc1 * m[k] / (np.sqrt(v[k]) / np.sqrt(bc2) + train.eps)
    history.append({k: x.copy() for k, x in p.items()})
    stats.append((norm, lr))
  return history, stats


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_adamw_matches_numpy_deepspeed_reference(clip):
  spec = SPEC
  train = TrainSpec(steps=7, warmup_steps=2, lr=1e-2, weight_decay=0.1, grad_clip=clip, beta2=0.95)
  canonical = init_params(spec, 0)
  rng = np.random.default_rng(3)
  scales = [0.05, 3.0, 0.01, 2.0, 0.3, 5.0, 0.02]  # clipping active on some steps only
  grads = [{k: (s * rng.standard_normal(x.shape)).astype(np.float32) for k, x in canonical.items()} for s in scales]
  want, want_stats = numpy_deepspeed_adamw(canonical, grads, train, list(canonical))

  tx, sched = optim.make_optimizer(spec, train)
  params = layout.to_flax(canonical, spec)
  state = tx.init(params)

  @jax.jit
  def update(params, state, g):
    lr = sched(optim.step_count_of(state))
    upd, state = tx.update(g, state, params)
    return optax.apply_updates(params, upd), state, optim.grad_norm_of(state), lr

  for step, g in enumerate(grads):
    params, state, norm, lr = update(params, state, layout.to_flax(g, spec))
    np.testing.assert_allclose(float(norm), want_stats[step][0], rtol=1e-6)
    assert float(lr) == np.float32(want_stats[step][1])
    got = layout.from_flax(params, spec)
    for k in canonical:
      # fp32 vs float64: params ~0.02 hold ~2e-9 resolution; Adam steps are <= lr = 1e-2.
      np.testing.assert_allclose(got[k], want[step][k], rtol=0, atol=5e-7, err_msg=f"step {step} {k}")
  assert int(optim.step_count_of(state)) == len(grads)


def test_zero_lr_steps_leave_params_untouched():
  train = TrainSpec(steps=4, warmup_steps=2, weight_decay=0.5)
  tx, _ = optim.make_optimizer(SPEC, train)
  params = layout.to_flax(init_params(SPEC, 0), SPEC)
  state = tx.init(params)
  g = jax.tree.map(np.ones_like, params)
  update = jax.jit(tx.update)
  for _ in range(2):  # DeepSpeed's steps 0 and 1 run with lr 0
    upd, state = update(g, state, params)
    new = optax.apply_updates(params, upd)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(a), b)


def test_optimizer_state_is_float32():
  train = dataclasses.replace(preset("gpt2-tiny").train)
  tx, _ = optim.make_optimizer(LLAMA, train)
  state = tx.init(layout.to_flax(init_params(LLAMA, 0), LLAMA))
  dtypes = {str(x.dtype) for x in jax.tree.leaves(state)}
  assert dtypes <= {"float32", "int32"}, dtypes
  assert optim.grad_norm_of(state).dtype == jnp.float32


@pytest.mark.parametrize("kind", ["adamw", "adam", "lamb", "sgd"])
def test_port_verify_and_compare_share_one_factory_and_one_clip(kind):
  """`parity port --verify` builds its optimizer with jax_impl.optim (the one clip transform,
  which records the pre-clip norm, and optimizer_update); port_verify defines no clip or state class of its own,
  and its update equals the compare chain's (`make_optimizer`) bit for bit on the same spec."""
  import inspect
  from jax_impl import port_verify
  src = inspect.getsource(port_verify)
  assert "class " not in src and "GradientTransformation(" not in src
  t = dataclasses.replace(TrainSpec(steps=4, lr_schedule="Constant", grad_clip=0.5, weight_decay=0.0),
                          optimizer=kind, momentum=0.9 if kind == "sgd" else 0.0).validate()
  ported = {"optimizer": schedule.optimizer_of(t), "scheduler": {"type": "Constant", "params": {}},
            "clipping": {"max_global_norm": t.grad_clip, "epsilon": optim.DEEPSPEED_CLIP_EPS},
            "precision": {"skip_nonfinite_updates": False}}
  verify_tx = port_verify.build_optimizer(ported)
  compare_tx, _ = optim.make_optimizer(SPEC, t)
  params = layout.to_flax(init_params(SPEC, 0), SPEC)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), params)
  s1, s2 = verify_tx.init(params), compare_tx.init(params)
  u1, s1 = verify_tx.update(grads, s1, params)
  u2, s2 = compare_tx.update(grads, s2, params)
  assert float(optim.grad_norm_of(s1)) == float(optim.grad_norm_of(s2)) > 0.5  # the one clip, norm recorded
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
