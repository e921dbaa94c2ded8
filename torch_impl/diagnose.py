"""Torch diagnose worker: `python -m torch_impl.diagnose run_dir/request.json --side torch`.

One step of the plain-torch side (`torch_impl.baseline.TorchTrainer.step`, unchanged) on the run's
initial weights and `batches.npy[step]` (see `parity.diagnose`), written to
`run_dir/torch/diagnose.safetensors`:
  * forward taps of the first micro batch: a `model.TapRecorder` attached to the model;
  * `grad/<param>`: each parameter's accumulated gradient, read by a post-accumulate-grad hook at the
    end of every backward (so the last read holds the sum over micro batches, before clipping);
  * `loss`: the step's loss (mean over micro batches), as the trainer reports it;
  * `update/<param>`: the params after the step: a fresh torch AdamW whose schedule position
    (`TorchTrainer.step_index`) is set to the request's `lr_step`.
bf16/fp16: the taps and gradients come from the trainer's compute-dtype module copy (fp16 gradients
divided by the loss scale the trainer unscaled with), `attn.scores`/`attn.probs` are SDPA's float32
internals (`_sdpa_internal_taps`), and the same step in fp32 from the trainer's rounded masters goes to
`diagnose.fp32.safetensors`.
Plants of this side (request `diagnose_plants`): `no_causal_mask` (Attention.causal=False),
`transpose` (canonical weights transposed before loading), `decay_all` (every param group decayed).
"""
from __future__ import annotations

import contextlib
import sys
from unittest import mock

import numpy as np
import torch

from parity.protocol import diagnose as dg
from parity.protocol.side import SideIO, main_guard
from torch_impl.baseline import TorchTrainer
from torch_impl.model import Attention, TapRecorder, to_canonical


def _sdpa_internal_taps(self, q, k, t: int, mask=None) -> None:
  """bf16/fp16 replacement of `Attention._attention_taps`: the scores and probs SDPA's kernel computes inside.

  The fused kernel (flash on CPU, likewise on CUDA) multiplies the bf16/fp16 q and k with float32
  accumulation and takes the softmax in float32; spelling it out in the compute dtype, as the fp32 taps
  do, would round the scores and probs where the forward never rounds them. Taps only: SDPA still makes
  the context. q, k: (B, nh, T, hd) in the compute dtype; mask: None (causal) or additive (B, 1, T, T), 0 = attend,
  -inf = not (torch_impl.layers.additive_mask of attention_mask or window_mask: padded/packed rows, sliding
  layers). Soft-capped attention (spec.attn_softcap) never calls it: its scores are the forward's own.
  """
  scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * self.spec.scale  # (B, nh, T, S) float32
  self._tap("scores", lambda: scores)
  if mask is not None:  # additive, in the compute dtype: 0 and -inf are exact in float32 too
    scores = scores + mask.float()
  elif self.causal:
    keep = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
  self._tap("probs", lambda: torch.softmax(scores, dim=-1))


def _one_step(run, params, plants, batch, lr_step: int, arrays=None, data_plants: frozenset = frozenset()):
  """Taps, loss, gradients and first update of one `TorchTrainer.step` in `run.train.precision`.

  bf16/fp16: the trainer runs the forward and backward on its compute-dtype copy of the module
  (`TorchTrainer.half_model`, DeepSpeed's layout); the taps and gradients are read there, fp16 gradients
  divided by the loss scale the trainer unscaled them with.

  Args:
    run: the run spec (its train.precision is the one run).
    params: canonical float32 weights with this side's plants applied (the trainer rounds bf16/fp16 masters).
    plants: this side's plants (`parity.protocol.diagnose.read_request`).
    batch: token ids, uint16 or uint32 (parity.data.batch_dtype) (A, M, T + 1).
    lr_step: the schedule position of the update.
    arrays: padded/packed only, the step's ExampleArrays (A, M, T), given to `TorchTrainer.step` as training does;
      data_plants: this side's planted data bugs (the trainer's `plants`, `micro_loss`).
  Returns:
    (tensors, where, metrics): canonical tap name -> float32 numpy array, tap name -> torch module, the step's
    metrics.
  Raises:
    RuntimeError: a gradient was not recorded, or (fp16) the step overflowed and was skipped.
  """
  torch.manual_seed(run.train.seed)
  trainer = TorchTrainer(run, params, plants=data_plants)
  model = trainer.model
  compute = trainer.half_model if trainer.half_model is not None else model  # where forward and backward run
  _apply_plants(trainer, compute, plants, run.train.weight_decay)

  recorder = TapRecorder()
  compute.record_taps(recorder)
  grads: dict[str, torch.Tensor] = {}

  def keep_grad(name: str):
    return lambda p: grads.__setitem__(name, p.grad.detach().float().cpu().clone())

  hooks = [p.register_post_accumulate_grad_hook(keep_grad(n)) for n, p in compute.named_parameters()]
  trainer.step_index = lr_step
  reduced = run.train.precision != "fp32"
  try:
    with mock.patch.object(Attention, "_attention_taps", _sdpa_internal_taps) if reduced else contextlib.nullcontext():
      metrics = trainer.step(batch) if arrays is None else trainer.step(batch, arrays=arrays)
  finally:
    for h in hooks:
      h.remove()
    compute.record_taps(None)
  if metrics.get("skipped"):
    raise RuntimeError(f"fp16: the gradient overflowed at the initial loss scale {metrics['loss_scale']:g}, so the "
                       "update was skipped; diagnose another --step or lower train.initial_scale_power")
  divisor = trainer.loss_scaler.scale if trainer.loss_scaler is not None else 1.0  # fp16: DeepSpeed's unscale

  out, where = _outputs(run.model, recorder, grads, divisor, to_canonical(model), metrics)
  if reduced and run.model.attn_softcap is None:  # soft-capped attention is computed explicitly (its own taps)
    where.update({f"h.{i}.attn.{t}": f"h.{i}.attn (Attention) {t}: SDPA's float32 internals, recomputed"
                  for i in range(run.model.n_layers) for t in ("scores", "probs")})
  return out, where, metrics


def _apply_plants(trainer, compute, plants, weight_decay: float) -> None:
  """The torch side's plants: `no_causal_mask` (every Attention of both module copies unmasked) and `decay_all`
  (every param group decayed by train.weight_decay)."""
  if plants["no_causal_mask"]:
    for m in [*trainer.model.modules(), *compute.modules()]:
      if isinstance(m, Attention):
        m.causal = False
  if plants["decay_all"]:
    for group in trainer.optimizer.param_groups:
      group["weight_decay"] = float(weight_decay)


def _outputs(spec, recorder, grads, divisor: float, after, metrics) -> tuple[dict, dict[str, str]]:
  """(tensors, where) of one diagnosed step: forward taps, 'loss', 'grad/<param>' (divided by the fp16 loss scale
  `divisor`) and 'update/<param>' (`after`, the canonical params after the step), float32 numpy arrays.
  Raises RuntimeError when a parameter's gradient was not recorded."""
  names = dg.param_order(spec)
  missing = [n for n in names if n not in grads]
  if missing:
    raise RuntimeError(f"no gradient was recorded for {missing[:5]}: the backward pass did not reach them")
  out = {k: v.cpu().numpy() for k, v in recorder.values.items()}
  where = dict(recorder.where)
  out["loss"] = np.asarray(metrics["loss"], np.float32)
  where["loss"] = "baseline.TorchTrainer.step: mean over micro batches"
  for n in names:
    out[f"grad/{n}"] = grads[n].numpy() / np.float32(divisor) if divisor != 1.0 else grads[n].numpy()
    where[f"grad/{n}"] = f"{n}.grad (accumulated, before clip_like_deepspeed)"
    out[f"update/{n}"] = after[n]
    where[f"update/{n}"] = f"{n} after TorchTrainer.step (torch.optim.AdamW)"
  return out, where


class TorchDiagnose:
  """`parity.protocol.diagnose.DiagnoseSide` of the plain-torch side (DeepSpeed runs the same torch model)."""

  def check(self, io: SideIO) -> None:
    if io.side != "torch":
      raise ValueError(f"torch_impl.diagnose runs the 'torch' side; got --side {io.side} "
                       "(DeepSpeed runs the same torch model: diagnose it as 'torch')")

  def one_step(self, run, params, req, batch, arrays=None) -> dg.DiagnoseStep:
    """`_one_step`; the trainer rounds the bf16/fp16 masters itself (`TorchTrainer`)."""
    out, where, metrics = _one_step(run, params, req.plants, batch, req.lr_step, arrays, req.data_plants)
    return dg.DiagnoseStep(tensors=out, where=where, lr=float(metrics["lr"]), loss=float(metrics["loss"]))

  def versions(self) -> dict[str, str]:
    return {"torch": torch.__version__}

  def device(self) -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
  return main_guard(lambda io: dg.run_diagnose(io, TorchDiagnose()), argv)


if __name__ == "__main__":
  sys.exit(main())
