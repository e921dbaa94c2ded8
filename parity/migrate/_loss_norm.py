"""Which loss normalisation a DeepSpeed job implies, as far as its config can tell.

A DeepSpeed JSON has no key for it. DeepSpeed divides the loss by gradient_accumulation_steps inside
`engine.backward` and averages gradients over ranks, so what the optimizer sees depends on the loss the training
script hands to `backward`:
  - a mean over each micro batch's loss tokens (the usual `loss = model(batch).loss; engine.backward(loss)` loop):
    the mean of micro-batch means, parity's `micro_mean`;
  - the micro batch's summed token losses over the step's loss tokens: parity's `tokens`. The HF Trainer does this
    since transformers 4.46 (Trainer.training_step / compute_loss, checked in transformers 5.24): it counts the
    step's label tokens (`num_items_in_batch`), passes the count to a model whose forward takes `**kwargs`
    (`model_accepts_loss_kwargs`) and sets DeepSpeed's `scale_wrt_gas=False`; over ranks only with
    `average_tokens_across_devices` (default true in 5.24). A Trainer before 4.46, or a subclass that sets
    `model_accepts_loss_kwargs = False` (LLaMA-Factory's SFT trainer does for multimodal processors), runs
    `micro_mean`.
What the config can tell: with one micro batch per step on one rank (gradient_accumulation_steps x world = 1) the
two are the same loss; "auto" values mean the HF integration (the Trainer, or Accelerate) fills the config, so the
Trainer's version and setup decide (or, under Accelerate with a loop of its own, the script). Otherwise the training
script decides, and the config says nothing.
"""
from __future__ import annotations

from typing import Any

from parity.migrate._report import leaf_paths

__all__ = ["loss_normalization", "DEFAULT", "DECIDED_BY"]

DEFAULT = "tokens"
"""parity's train.loss_normalization default (parity.spec.TrainSpec): what a port records when the config cannot
tell, the HF Trainer >= 4.46 convention."""
DECIDED_BY = ("config", "assumption", "hf_trainer", "script")
"""Who decides the normalisation: `config` (one micro batch per step on one rank: both are one loss),
`assumption` (the same, but the one rank is the port's assumption: no --world-size), `hf_trainer`
("auto" values: the HF Trainer's version and setup, or an Accelerate script), `script` (nothing in the config)."""

_FIX = ("to reproduce a job that averages micro-batch means, run it with --set train.loss_normalization=micro_mean "
        "(padded/packed data)")


def loss_normalization(raw: dict[str, Any], batch: dict[str, Any] | None, *, world_given: bool = True
                       ) -> dict[str, Any]:
  """The port's record of the loss normalisation a DeepSpeed job implies.

  Args:
    raw: the config as read (before "auto" is resolved).
    batch: the ported batch {micro, grad_accum, world, global_batch}, or None when it did not resolve.
    world_given: False when batch['world'] is the port's assumption (no --world-size): then one rank is an
      assumption about the job, not something the config states, and the record says so (decided_by 'assumption').
  Returns:
    {value: 'tokens' (what the port records for train.loss_normalization: parity's default, as the config never
    states it), decided_by: one of DECIDED_BY, same_loss: bool (grad_accum x world = 1: 'tokens' and 'micro_mean'
    are one loss), signals: [text: what in the config points where], why: one sentence}. JSON types only.
  """
  autos = sorted(k for k, v in leaf_paths(raw) if v == "auto")
  signals = []
  if autos:
    shown = ", ".join(autos[:4]) + (f" and {len(autos) - 4} more" if len(autos) > 4 else "")
    signals.append(f"\"auto\" values ({shown}): the HF integration fills them (the HF Trainer, or Accelerate's "
                   "DeepSpeed plugin)")
  if "optimizer" not in raw:
    signals.append("no optimizer section: a client optimizer (the HF Trainer's AdamW, or the script's own)")
  same = batch is not None and batch["grad_accum"] * batch["world"] == 1
  if batch is not None:
    signals.append(f"gradient_accumulation_steps {batch['grad_accum']} x world {batch['world']} = "
                   f"{batch['grad_accum'] * batch['world']} micro batch(es) per optimizer step")
  if same and not world_given:
    decided, why = "assumption", (
        "not stated by the config: gradient_accumulation_steps is 1, so 'tokens' and 'micro_mean' are the same loss "
        "if the job ran on one rank, which the port assumed (--world-size not given); on several ranks the training "
        f"script decides. parity's default 'tokens' (HF Trainer >= 4.46); give --world-size N to port the job as it "
        f"ran; {_FIX}")
  elif same:
    decided, why = "config", ("the config decides: one micro batch per optimizer step on one rank, so 'tokens' and "
                              "'micro_mean' are the same loss (each is the micro batch's mean over its loss tokens)")
  elif autos:
    decided, why = "hf_trainer", (
        "not stated by the config: its \"auto\" values say the HF Trainer (or Accelerate) runs it, and the Trainer's "
        "version decides: >= 4.46 normalises by the step's loss tokens ('tokens', over ranks with "
        "average_tokens_across_devices) for a model whose forward takes **kwargs; before 4.46, or with "
        "model_accepts_loss_kwargs false, the mean of micro-batch means ('micro_mean'); under Accelerate with its "
        f"own loop, the script decides. parity's default 'tokens' (HF Trainer >= 4.46); {_FIX}")
  else:
    decided, why = "script", (
        "not stated by the config: the training script decides (DeepSpeed divides the loss by "
        "gradient_accumulation_steps inside backward, so a script that backpropagates each micro batch's mean "
        f"loss runs 'micro_mean'); parity's default 'tokens' (HF Trainer >= 4.46); {_FIX}")
  return {"value": DEFAULT, "decided_by": decided, "same_loss": bool(same), "signals": signals, "why": why}
