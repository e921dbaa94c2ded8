"""`parity diagnose`: the first tensor where two sides differ, for one step on identical inputs.

Both sides get the same canonical initial weights and the same batch (`batches.npy[step]`, all micro
batches). Each side's diagnose worker (`jax_impl.diagnose`, `torch_impl.diagnose`) writes
`run_dir/<side>/diagnose.safetensors`: float32 tensors keyed by canonical tap names (`tap_order`):

  forward (first micro batch)  embed, h.{i}.ln_1, h.{i}.attn.{q,k,v,scores,probs,context,out},
                               h.{i}.resid_mid, h.{i}.ln_2, h.{i}.mlp.{fc | gate,up}, h.{i}.mlp.{act,out},
                               h.{i}.out, ln_f, logits
  loss                         the step's loss (mean over its micro batches), shape ()
  grad/<param>                 the accumulated pre-clip gradient (DeepSpeed style: sum of grad(loss_i / A))
  update/<param>               the param after one step of the side's real optimizer

Gradients and updates are in backward order (the reverse of parity.weights.param_shapes: the head and
ln_f first, embeddings last). This module compares the files in that order and names the first tensor
that breaks its rule (`RULES`). It imports neither jax nor torch.

The update. A step's optimizer state is fresh on both sides (Adam moments zero, bias correction of a
first step), so any step is diagnosed on identical state; `step` picks the batch and the learning-rate
position. The lr is DeepSpeed's schedule at that position (`parity.numerics.schedule.train_lr`); when it is 0
there (WarmupCosineLR gives 0 at steps 0 and 1) the position moves to the first later step with lr > 0,
recorded as `lr_step` (gpt2-tiny: step 2, lr 3.3e-4). An lr of 0 would make every update the identity
and hide optimizer bugs such as a wrong decay mask.

bf16/fp16 (train.precision): each worker also writes `<side>/diagnose.fp32.safetensors`, the same step
in fp32 from the same rounded master weights. The two fp32 runs are compared with `RULES` first (a bug of
any precision); then each side's reduced-precision error against its own fp32 run (`compare_precision`)
names the first tensor where one side rounds differently (`PRECISION_RULE`); updates are checked against
a first AdamW step from the side's own gradient. docs/diagnose.md has the measurements.

Planted bugs for testing the tool (`--plant SIDE:KIND`, request key `diagnose_plants`): `no_causal_mask`,
`transpose=<canonical square weight>` (transposed when that side loads it), `decay_all` (weight decay
on every tensor, norms and biases included). Numeric settings go through `--perturb` as in compare.

Layout: `parity.diagnose.inputs` (the `--plant` items, the lr position), `parity.diagnose.compare` (the per-kind rules
and the tensor comparison), `parity.diagnose.driver` (the driver `diagnose` and its DiagnoseResult); the request and
files a worker reads and writes, and the workers' loop, are `parity.protocol.diagnose`. This package only re-exports
them.
"""
from parity.diagnose.compare import (PRECISION_RULE, RULES, UNIT_ROUNDOFF, PrecisionDiff, PrecisionRule, Rule,
                                     TensorDiff, compare_outputs, compare_precision, compare_tensor, precision_errors)
from parity.diagnose.driver import DiagnoseResult, diagnose
from parity.diagnose.inputs import PLANT_KINDS, lr_position, parse_plants
from parity.protocol.diagnose import (INPUTS_METADATA_KEY, OUTPUT_FILE, PLANTS_KEY, REFERENCE_FILE, REQUEST_KEY,
                                      WHERE_METADATA_KEY, WorkerRequest, apply_weight_plants, check_plan, forward_taps,
                                      param_order, read_request, side_inputs, tap_order, write_outputs)
from parity.protocol.workers import DIAGNOSE_WORKERS

__all__ = ["Rule", "RULES", "UNIT_ROUNDOFF", "TensorDiff", "PrecisionRule", "PRECISION_RULE", "PrecisionDiff",
           "compare_precision", "precision_errors", "REFERENCE_FILE", "DiagnoseResult", "diagnose", "tap_order",
           "forward_taps", "param_order", "parse_plants", "apply_weight_plants", "lr_position", "compare_tensor",
           "compare_outputs", "check_plan", "side_inputs", "DIAGNOSE_WORKERS", "PLANTS_KEY", "REQUEST_KEY",
           "OUTPUT_FILE", "INPUTS_METADATA_KEY", "WHERE_METADATA_KEY", "WorkerRequest", "PLANT_KINDS", "read_request",
           "write_outputs"]
