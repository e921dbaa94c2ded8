"""The model level of the `padded` and `packed` layouts, both frameworks, in process:
segment-id attention masks, positions restarting per example, per-target loss weights.

Arrays come from parity.dataset.layouts.build_batches on examples of varying lengths (prompt tokens without loss,
one example truncated); the reference reading is parity.dataset.reference. Checked: JAX logits and weighted loss
match torch's in fp32 (GPT-2 and LLaMA layers); each example of a packed row gives the logits it gives alone in a
row of its own (no leakage across documents); the ids in padding slots never change a real token's logits; the
weighted loss is the reference formula sum(token_weights * ce); packed equals padded under `tokens`; and each
planted bug of item 6 moves the loss by orders of magnitude more than the fp32 JAX~torch difference.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

from parity.dataset.examples import Example  # noqa: E402
from parity.dataset.layouts import build_batches  # noqa: E402
from parity.dataset.reference import attention_mask, token_weights  # noqa: E402
from parity.spec import ModelSpec  # noqa: E402
from parity.weights import param_shapes  # noqa: E402

from jax_impl import model as jm  # noqa: E402
from jax_impl import layout  # noqa: E402
from torch_impl import model as tm  # noqa: E402

pytestmark = [pytest.mark.requires_jax, pytest.mark.requires_torch]

jax.config.update("jax_default_matmul_precision", "highest")  # fp32 matmuls, as jax_impl.step sets them

V, T = 64, 16
GPT2 = ModelSpec(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
LLAMA = ModelSpec(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, norm="rmsnorm",
                  mlp="swiglu", position="rope", rope_theta=500.0, bias=False, tie_embeddings=False, d_ff=48,
                  norm_eps=1e-6)
SPECS = {"gpt2": GPT2, "llama": LLAMA}
LAYOUTS = ("padded", "packed")

# fp32 JAX vs torch, relative to max |logit|: the two fp32 implementations differ by ~1e-7..1e-6 of the logit
# scale on these 2-layer models (the same 1e-5 rule as tests/test_torch_model.py: 10x headroom, and a convention
# mismatch, e.g. a mask or position error, moves logits by >= 1e-2 here, see the plant tests).
LOGITS_RTOL = 1e-5
# Loss (nats, a weighted sum of O(1) per-token losses with weights summing to <= 1): fp32 rounding of the logits
# (~1e-6 relative) and of the sum over <= 64 targets stays below 1e-5 nats.
LOSS_ATOL = 1e-5
# A plant must move the loss by at least this many times the measured JAX~torch fp32 difference of the correct run,
# and by at least PLANT_MIN_NATS: what a verdict at today's loss tolerances (~1e-5 nats) can tell apart.
PLANT_FACTOR, PLANT_MIN_NATS = 100.0, 1e-3

# lengths (tokens) and prompt tokens (no loss) of the examples; 21 > T + 1 is truncated.
LENGTHS = (5, 9, 3, 12, 21, 7, 4, 11, 6, 14)
PROMPTS = (2, 4, 1, 5, 6, 0, 1, 3, 2, 7)


def _examples() -> list[Example]:
  rng = np.random.default_rng(7)
  out = []
  for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)):
    loss = np.arange(n) >= max(p, 1)
    out.append(Example(ids=rng.integers(1, V, n).astype(np.uint32), loss=loss, record=i + 1))
  return out


@functools.lru_cache(maxsize=None)
def _batches(layout: str, per_step: int | None = None, rows: int = 2):
  """One step, A = 2 micro batches of `rows` rows, T = 16, with provenance."""
  return build_batches(_examples(), steps=1, grad_accum_steps=2, micro_batch_size=rows, seq_len=T, seed=0,
                       vocab_size=V, layout=layout, examples_per_step=per_step, pad_id=0, provenance=True)


@functools.lru_cache(maxsize=None)
def _canonical(name: str) -> dict[str, np.ndarray]:
  """Canonical weights with every tensor non-trivial (random biases and norm gains too), as test_jax_model's."""
  rng = np.random.default_rng(3)
  out = {}
  for key, shape in param_shapes(SPECS[name]).items():
    base = 1.0 if (".ln_" in key or key.startswith("ln_f")) and key.endswith(".weight") else 0.0
    out[key] = (base + (0.1 if base else 0.3) * rng.standard_normal(shape)).astype(np.float32)
  return out


@functools.lru_cache(maxsize=None)
def _jax_apply(name: str):
  spec = SPECS[name]
  params = layout.to_flax(_canonical(name), spec)
  return jax.jit(lambda x, s, p: jm.GPT(spec).apply({"params": params}, x, s, p)), params


@functools.lru_cache(maxsize=None)
def _jax_loss(name: str, shift: int = 1):
  spec, params = SPECS[name], _jax_apply(name)[1]
  return jax.jit(lambda tok, s, p, w: jm.loss_fn(params, tok, spec, segment_ids_bt=s, positions_bt=p, weights_bt=w,
                                                 label_shift=shift))


def jax_logits(name: str, inputs, seg=None, pos=None) -> np.ndarray:
  """float32 (B, T, V) from the JAX GPT; seg/pos None: the stream call."""
  fn, params = _jax_apply(name)
  if seg is None and pos is None:
    return np.asarray(jax.jit(lambda x: jm.GPT(SPECS[name]).apply({"params": params}, x))(inputs))
  return np.asarray(fn(inputs, seg, pos))


@functools.lru_cache(maxsize=None)
def _torch_model(name: str):
  return tm.build_model(SPECS[name], _canonical(name))


def torch_logits(name: str, inputs, seg=None, pos=None) -> np.ndarray:
  """float32 (B, T, V) from the torch GPT."""
  as_t = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.int64))
  with torch.no_grad():
    return _torch_model(name)(as_t(inputs), as_t(seg), as_t(pos)).numpy()


def _micro(b, a: int):
  """(inputs, targets, seg, pos) int32 of micro batch a of step 0."""
  tok = b.tokens[0, a].astype(np.int32)
  return tok[:, :-1], tok[:, 1:], b.segment_ids[0, a], b.positions[0, a]


def _ce(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """float64 per-target cross-entropy (B, T) from logits (B, T, V)."""
  z = logits.astype(np.float64)
  m = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - m).sum(-1)) + m[..., 0]
  return lse - np.take_along_axis(z, targets[..., None].astype(np.int64), -1)[..., 0]


def _step_loss_jax(name: str, b, weights: np.ndarray, *, seg=True, pos=True, shift=1) -> float:
  """The step's objective, sum over micro batches of loss_fn(weights=w[a]); seg/pos False drop them (plants);
  shift=2 scores every input against the token two ahead (labels shifted twice)."""
  total = 0.0
  for a in range(b.tokens.shape[1]):
    tok, w = b.tokens[0, a].astype(np.int32), weights[0, a].astype(np.float32)
    s, p = b.segment_ids[0, a] if seg else None, b.positions[0, a] if pos else None
    total += float(_jax_loss(name, shift)(tok, s, p, w))
  return total


def _step_loss_torch(name: str, b, weights: np.ndarray) -> float:
  total = 0.0
  for a in range(b.tokens.shape[1]):
    x, y, s, p = _micro(b, a)
    logits = torch.from_numpy(torch_logits(name, x, s, p))
    total += float(tm.lm_loss(logits, torch.from_numpy(y.astype(np.int64)), torch.from_numpy(weights[0, a]
                                                                                                .astype(np.float32))))
  return total


def _rtol_close(a: np.ndarray, b: np.ndarray, rtol: float = LOGITS_RTOL) -> None:
  scale = max(1.0, float(np.abs(b).max()))
  np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


# ----------------------------------------------------------------------------- JAX ~ torch


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SPECS)
def test_jax_and_torch_agree_on_logits_and_weighted_loss(name, layout):
  b = _batches(layout)
  assert len(set(b.loss_tokens_per_micro[0])) == 2, "the micro batches must carry different loss-token counts"
  for a in range(2):
    x, _, s, p = _micro(b, a)
    _rtol_close(jax_logits(name, x, s, p), torch_logits(name, x, s, p))
  w = token_weights(b.loss_mask, "tokens")
  assert abs(_step_loss_jax(name, b, w) - _step_loss_torch(name, b, w)) <= LOSS_ATOL


@pytest.mark.parametrize("name", SPECS)
def test_stream_call_is_the_call_without_arguments(name):
  """Positions 0..T-1 and a single segment per row are the stream layout: the same logits as no arguments
  (the per-token gather of wpe / rope rows reads the very table values)."""
  x = np.random.default_rng(0).integers(0, V, (2, T)).astype(np.int32)
  seg, pos = np.ones((2, T), np.int32), np.tile(np.arange(T, dtype=np.int32), (2, 1))
  for fn in (jax_logits, torch_logits):
    np.testing.assert_allclose(fn(name, x, seg, pos), fn(name, x), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- no leakage, padding, positions


def _alone(b, a: int, r: int, seg_id: int):
  """The slots of example `seg_id` in row r of micro batch a, and that example alone in a padded row of T."""
  x, _, s, p = _micro(b, a)
  slots = np.flatnonzero(s[r] == seg_id)
  n = slots.size
  xa, sa, pa = np.zeros((1, T), np.int32), np.zeros((1, T), np.int32), np.zeros((1, T), np.int32)
  xa[0, :n], sa[0, :n], pa[0, :n] = x[r, slots], 1, np.arange(n)
  return slots, xa, sa, pa


@pytest.mark.parametrize("name", SPECS)
def test_each_example_of_a_packed_row_gives_its_logits_alone(name):
  b = _batches("packed")
  checked = 0
  for fn in (jax_logits, torch_logits):
    for a in range(2):
      x, _, s, p = _micro(b, a)
      packed = fn(name, x, s, p)
      for r in range(s.shape[0]):
        for seg_id in range(1, int(s[r].max()) + 1):
          slots, xa, sa, pa = _alone(b, a, r, seg_id)
          _rtol_close(packed[r, slots], fn(name, xa, sa, pa)[0, :slots.size])
          checked += int(slots[0] > 0)
  assert checked >= 4, "some examples must sit after another one in their row"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SPECS)
def test_padding_ids_never_change_real_logits(name, layout):
  b = _batches(layout)
  assert (b.segment_ids == 0).any()
  for a in range(2):
    x, _, s, p = _micro(b, a)
    noisy = np.where(s == 0, np.random.default_rng(1).integers(1, V, x.shape), x).astype(np.int32)
    real = s > 0
    for fn in (jax_logits, torch_logits):
      np.testing.assert_allclose(fn(name, noisy, s, p)[real], fn(name, x, s, p)[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", SPECS)
def test_positions_restart_in_each_example(name):
  """An example later in a packed row reads positions from 0. Learned positions (GPT-2): its positions shifted
  by its offset in the row (a model without restart) change its logits far beyond the fp32 tolerance, in both
  frameworks. Rotary (LLaMA): q.k depends on position differences only, so within a correct segment mask the
  shift changes nothing beyond fp32 rounding: the restart cannot be seen there, and need not be."""
  b = _batches("packed")
  x, _, s, p = _micro(b, 0)
  r = int(np.argmax(s.max(axis=1)))
  assert p[r][s[r] == 2][0] == 0 and np.flatnonzero(s[r] == 2)[0] > 0
  later = s[r] >= 2
  for fn in (jax_logits, torch_logits):
    moved = fn(name, x, s, np.tile(np.arange(T, dtype=np.int32), (x.shape[0], 1)))
    right = fn(name, x, s, p)
    delta = np.abs(moved[r, later] - right[r, later]).max()
    if SPECS[name].position == "learned":
      assert delta > 100 * LOGITS_RTOL * np.abs(right).max()
    else:
      _rtol_close(moved, right)
    np.testing.assert_array_equal(moved[r, s[r] == 1], right[r, s[r] == 1])  # the first example: the same positions


# ----------------------------------------------------------------------------- the loss weights


@pytest.mark.parametrize("normalization", ("tokens", "micro_mean"))
@pytest.mark.parametrize("name", SPECS)
def test_weighted_loss_is_the_reference_formula(name, normalization):
  """sum over micro batches of loss_fn / lm_loss with weights = token_weights is sum(w * ce) of the model's own
  logits in float64; under `tokens` that is the mean over the step's loss tokens."""
  b = _batches("packed")
  w = token_weights(b.loss_mask, normalization)
  want = 0.0
  for a in range(2):
    x, y, s, p = _micro(b, a)
    want += float(np.sum(w[0, a] * _ce(jax_logits(name, x, s, p), y)))
  assert abs(_step_loss_jax(name, b, w) - want) <= LOSS_ATOL
  assert abs(_step_loss_torch(name, b, w) - want) <= LOSS_ATOL
  if normalization == "tokens":
    ce = []
    for a in range(2):
      x, y, s, p = _micro(b, a)
      ce.append(_ce(jax_logits(name, x, s, p), y)[b.loss_mask[0, a]])
    ce = np.concatenate(ce)
    assert ce.size == b.loss_tokens_per_step[0] and abs(want - ce.mean()) <= 1e-9


@pytest.mark.parametrize("name", SPECS)
def test_packed_equals_padded_under_tokens(name):
  """`--equivalence packing` at model level: the same examples packed into 4 rows and padded one per row give
  the same `tokens` objective to fp32 rounding, on both frameworks."""
  packed = _batches("packed")
  e = packed.examples_per_step
  padded = _batches("padded", per_step=e, rows=(e + 1) // 2)
  assert sorted(packed.step_pieces[0]) == sorted(padded.step_pieces[0])
  for loss in (_step_loss_jax, _step_loss_torch):
    got = [loss(name, bb, token_weights(bb.loss_mask, "tokens")) for bb in (packed, padded)]
    assert abs(got[0] - got[1]) <= LOSS_ATOL


# ----------------------------------------------------------------------------- planted bugs


def _plants(name: str, layout: str) -> dict[str, float]:
  """|objective(plant) - objective(correct)|, nats, JAX side, one step; and 'fp32' = |JAX - torch| correct."""
  b = _batches(layout)
  w = token_weights(b.loss_mask, "tokens")
  right = _step_loss_jax(name, b, w)
  real = np.zeros_like(b.loss_mask)
  real[..., :-1] = (b.segment_ids[..., :-1] > 0) & (b.segment_ids[..., :-1] == b.segment_ids[..., 1:])
  by_hand = 0.0  # labels shifted twice, from the logits: input t against token t + 2
  for a in range(2):
    x, _, s, p = _micro(b, a)
    by_hand += float(np.sum(w[0, a, :, :-1] * _ce(jax_logits(name, x, s, p)[:, :-1], b.tokens[0, a, :, 2:])))
  out = {
      "shifted_by_hand": abs(by_hand - right),
      "fp32": abs(right - _step_loss_torch(name, b, w)),
      "mask_dropped": abs(_step_loss_jax(name, b, w, seg=False) - right),
      "positions_not_restarted": abs(_step_loss_jax(name, b, w, pos=False) - right),
      "labels_shifted_twice": abs(_step_loss_jax(name, b, w, shift=2) - right),
      "loss_on_prompt": abs(_step_loss_jax(name, b, token_weights(real, "tokens")) - right),
      "mean_of_means": abs(_step_loss_jax(name, b, token_weights(b.loss_mask, "micro_mean")) - right),
  }
  return out


PLANTS = ("mask_dropped", "positions_not_restarted", "labels_shifted_twice", "loss_on_prompt", "mean_of_means")


def _invisible(name: str, layout: str) -> set[str]:
  """Plants that change nothing beyond fp32 rounding, by construction: on the padded layout (right padding, one
  example per row from slot 0) the segment mask is causality and the positions are 0..T-1 already; with rotary
  positions (LLaMA) a shift of every position of an example cancels in q.k (test_positions_restart...)."""
  if layout == "padded":
    return {"mask_dropped", "positions_not_restarted"}
  return {"positions_not_restarted"} if SPECS[name].position == "rope" else set()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SPECS)
def test_planted_bugs_move_the_loss_far_beyond_fp32(name, layout):
  got = _plants(name, layout)
  floor = max(PLANT_MIN_NATS, PLANT_FACTOR * got["fp32"])
  seen = [k for k in PLANTS if k not in _invisible(name, layout)]
  weak = {k: got[k] for k in seen if not got[k] > floor}
  assert not weak, f"plants within {floor:.2e} nats of the correct loss: {weak} (fp32 JAX~torch {got['fp32']:.2e})"
  assert got["labels_shifted_twice"] == pytest.approx(got["shifted_by_hand"], abs=LOSS_ATOL)
  for k in _invisible(name, layout):  # the rounding of another code path at most
    assert got[k] <= LOSS_ATOL, (k, got[k])


def test_reference_mask_is_the_one_the_models_build():
  b = _batches("packed")
  seg = b.segment_ids[0, 0]
  np.testing.assert_array_equal(np.asarray(jm.attention_mask(seg)), attention_mask(seg))
  np.testing.assert_array_equal(tm.attention_mask(torch.from_numpy(seg))[:, 0].numpy(), attention_mask(seg))


@pytest.mark.parametrize("name", SPECS)
def test_scanned_remat_and_checkpointed_paths_read_the_arrays_alike(name):
  """The plan's layer scan + remat (JAX) and activation checkpointing (torch) pass the mask and positions to
  every block: the same weighted loss and gradients as the plain path (recomputation repeats the same fp32 ops;
  1e-6 covers the scan's different fusion of the same sums)."""
  spec, b = SPECS[name], _batches("packed")
  tok, s, p = b.tokens[0, 0].astype(np.int32), b.segment_ids[0, 0], b.positions[0, 0]
  w = token_weights(b.loss_mask, "tokens")[0, 0].astype(np.float32)
  grads = {}
  for scan in (False, True):
    params = layout.to_flax(_canonical(name), spec, scan_layers=scan)
    fn = jax.value_and_grad(lambda q: jm.loss_fn(q, tok, spec, scan_layers=scan, remat="full" if scan else "none",
                                                 segment_ids_bt=s, positions_bt=p, weights_bt=w))
    loss, g = jax.jit(fn)(params)
    grads[scan] = (float(loss), layout.from_flax(jax.tree.map(np.asarray, g), spec, scan_layers=scan))
  assert abs(grads[True][0] - grads[False][0]) <= 1e-6
  for k, g in grads[False][1].items():
    np.testing.assert_allclose(grads[True][1][k], g, rtol=0, atol=1e-6, err_msg=k)
  model = tm.build_model(spec, _canonical(name))
  as_t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))
  out = {}
  for ckpt in (None, lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=True)):
    model.checkpoint = ckpt
    model.zero_grad(set_to_none=True)
    loss = tm.lm_loss(model(as_t(tok[:, :-1]), as_t(s), as_t(p)), as_t(tok[:, 1:]), torch.from_numpy(w))
    loss.backward()
    out[ckpt is None] = (float(loss.detach()), {k: v.grad.clone() for k, v in model.named_parameters()})
  assert out[True][0] == out[False][0]
  for k, g in out[True][1].items():
    torch.testing.assert_close(out[False][1][k], g, rtol=0, atol=0, msg=k)
  np.testing.assert_allclose(out[True][0], grads[False][0], rtol=0, atol=LOSS_ATOL)
