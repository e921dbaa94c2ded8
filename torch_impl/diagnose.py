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
Plants of this side (request `diagnose_plants`): `no_causal_mask` (Attention.causal=False),
`transpose` (canonical weights transposed before loading), `decay_all` (every param group decayed).
"""
from __future__ import annotations

import sys

from parity import diagnose as dg
from parity.protocol import SideIO, main_guard


def side_main(io: SideIO) -> int:
  """Writes this side's diagnose tensors; returns the exit code (0)."""
  import numpy as np
  import torch
  from torch_impl.baseline import TorchTrainer
  from torch_impl.model import Attention, TapRecorder, to_canonical

  if io.side != "torch":
    raise ValueError(f"torch_impl.diagnose runs the 'torch' side; got --side {io.side} "
                     "(DeepSpeed runs the same torch model: diagnose it as 'torch')")
  req = dg.read_request(io.request, io.side)
  run = io.run
  torch.manual_seed(run.train.seed)
  plants = req.plants
  trainer = TorchTrainer(run, dg.apply_weight_plants(io.init_params(), plants))
  model = trainer.model
  if plants["no_causal_mask"]:
    for m in model.modules():
      if isinstance(m, Attention):
        m.causal = False
  if plants["decay_all"]:
    for group in trainer.optimizer.param_groups:
      group["weight_decay"] = float(run.train.weight_decay)
  batch = np.asarray(io.batches()[req.step])  # (A, M, T + 1)
  io.ready()

  recorder = TapRecorder()
  model.record_taps(recorder)
  grads: dict[str, torch.Tensor] = {}

  def keep_grad(name: str):
    return lambda p: grads.__setitem__(name, p.grad.detach().float().cpu().clone())

  hooks = [p.register_post_accumulate_grad_hook(keep_grad(n)) for n, p in model.named_parameters()]
  trainer.step_index = req.lr_step
  try:
    metrics = trainer.step(batch)
  finally:
    for h in hooks:
      h.remove()
    model.record_taps(None)

  names = dg.param_order(run.model)
  missing = [n for n in names if n not in grads]
  if missing:
    raise RuntimeError(f"no gradient was recorded for {missing[:5]}: the backward pass did not reach them")
  after = to_canonical(model)
  out = {k: v.cpu().numpy() for k, v in recorder.values.items()}
  where = dict(recorder.where)
  out["loss"] = np.asarray(metrics["loss"], np.float32)
  where["loss"] = "baseline.TorchTrainer.step: mean over micro batches"
  for n in names:
    out[f"grad/{n}"] = grads[n].numpy()
    where[f"grad/{n}"] = f"{n}.grad (accumulated, before clip_like_deepspeed)"
    out[f"update/{n}"] = after[n]
    where[f"update/{n}"] = f"{n} after TorchTrainer.step (torch.optim.AdamW)"
  dg.write_outputs(io.out, out, where, dg.side_inputs(io.request, io.side))
  io.finish("ok", versions={"torch": torch.__version__}, device=str(trainer.device),
            extra={"diagnose": {"step": req.step, "lr_step": req.lr_step, "lr": float(metrics["lr"]),
                                "loss": float(metrics["loss"]), "plants": plants, "tensors": len(out)}})
  return 0


def main(argv: list[str] | None = None) -> int:
  return main_guard(side_main, argv)


if __name__ == "__main__":
  sys.exit(main())
