"""The DeepSpeed side's `transfers` block (torch_impl.transfers): host<->device bytes per optimizer step, counted at
DeepSpeed's own copy calls, against an independent count from the spec (parameter counts x 4 bytes (fp32) x passes
per step), and CPU Adam's own time per step.

One in-process engine per case (module-scoped), gpt2-tiny, 3 optimizer steps of 2 micro steps each. N is the spec's
parameter count (parity.weights.param_shapes); every tensor of it is a multiple of DeepSpeed's 2-element alignment, so
the one-rank partitions carry no padding.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from parity import weights
from parity.presets import preset
from parity.sizing import plans

pytestmark = [pytest.mark.requires_deepspeed, pytest.mark.process]  # deepspeed.initialize starts op-build probes
STEPS, GAS = 3, 2
FP32 = 4


def _run(plan: str, zero: dict | None = None, stage: int | None = None):
  """A DeepSpeedTrainer of `plan` on gpt2-tiny (grad_accum_steps GAS) after STEPS steps; `zero` is merged into the
  config's zero_optimization, `stage` overrides the ZeRO stage (spec and config)."""
  from torch_impl.engine import DeepSpeedTrainer, ds_config
  run = preset("gpt2-tiny")
  run = plans.apply_plan(dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum_steps=GAS,
                                                                             steps=STEPS)), plan)
  if stage is not None:
    run = dataclasses.replace(run, deepspeed=dataclasses.replace(run.deepspeed, zero_stage=stage))
  config = ds_config(run)
  config["zero_optimization"].update(zero or {}, **({"stage": stage} if stage is not None else {}))
  trainer = DeepSpeedTrainer(run, weights.init_params(run.model, 0), config)
  rng = np.random.default_rng(0)
  for _ in range(STEPS):
    trainer.step(rng.integers(0, run.model.vocab_size, size=(GAS, run.train.micro_batch_size,
                                                             run.train.seq_len + 1)).astype(np.uint16))
  return run, trainer


def _numel(run, prefix: str = "") -> int:
  return sum(int(np.prod(s)) for n, s in weights.param_shapes(run.model).items() if n.startswith(prefix))


def _items(block: dict) -> dict[tuple[str, str], dict]:
  return {(i["tensor"], i["direction"]): i for i in block["items"]}


def _check_adam(block: dict) -> None:
  adam = block["cpu_adam_s"]
  assert adam["n"] == STEPS and 0 < adam["min"] <= adam["median"] <= adam["max"], adam


@pytest.fixture(scope="module")
def zero2_offload():
  return _run("zero2-offload")


@pytest.fixture(scope="module")
def zero3_offload_all():
  # No persistent params and no reuse window: every param is fetched from its host partition per micro step.
  return _run("zero3-offload-all", {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0})


def test_zero2_offload_counts_the_gradient_and_param_passes(zero2_offload):
  """ZeRO-2, offload_optimizer cpu, 2 micro steps: each micro step's gradients (whole params, fp32) to the host
  accumulation buffers (2 x N x 4 d2h), the first back for the second to add to (1 x N x 4 h2d), the accumulated
  partition into the fp32 master grads (N x 4 d2h), the updated partition back (N x 4 h2d)."""
  run, trainer = zero2_offload
  block = trainer.transfers()
  n = _numel(run) * FP32
  assert block["zero_stage"] == 2 and block["offload_optimizer"] == "cpu" and block["offload_param"] == "none"
  assert block["bytes_per_step"] == {"d2h": 3 * n, "h2d": 2 * n}
  got = {k: (i["bytes"], i["times_per_step"]) for k, i in _items(block).items()}
  assert got == {("gradient accumulation buffers (fp32, whole params)", "d2h"): (n, GAS),
                 ("gradient accumulation buffers (fp32, whole params)", "h2d"): (n, GAS - 1),
                 ("gradients (fp32 partition)", "d2h"): (n, 1),
                 ("updated params (fp32 partition)", "h2d"): (n, 1)}, got
  assert all(i["from"].startswith("engine.optimizer.") for i in block["items"])
  _check_adam(block)
  json.dumps(block)


def test_zero1_offload_moves_each_partition_once_per_step():
  """ZeRO-1 reduces once, at the boundary: no accumulation buffers cross, N x 4 each way."""
  run, trainer = _run("zero2-offload", stage=1)
  block = trainer.transfers()
  n = _numel(run) * FP32
  assert block["zero_stage"] == 1 and block["bytes_per_step"] == {"d2h": n, "h2d": n}
  assert sorted(_items(block)) == [("gradients (fp32 partition)", "d2h"), ("updated params (fp32 partition)", "h2d")]
  _check_adam(block)


def test_zero3_offload_param_fetches_each_layer_per_micro_step(zero3_offload_all):
  """ZeRO-3, offload_param + offload_optimizer: each layer's params fetched from the host once per micro step
  (GAS x its numel x 4 h2d; the first step, which records DeepSpeed's trace, fetches more, said in the notes); the
  gradient partitions to the host (once: on the CPU accelerator later micro steps add in place) and into the fp32
  master grads (once): 2 x N x 4 d2h. The updates stay on the host (both partitions offloaded)."""
  run, trainer = zero3_offload_all
  block = trainer.transfers()
  n = _numel(run) * FP32
  assert block["zero_stage"] == 3 and block["offload_optimizer"] == "cpu" and block["offload_param"] == "cpu"
  assert block["bytes_per_step"] == {"h2d": GAS * n, "d2h": 2 * n}
  items = _items(block)
  fetches = {t: i for (t, d), i in items.items() if "fetch" in t}
  layers = {t.split()[1] for t in fetches}
  assert layers == {"wte", "wpe", "h.0", "h.1", "ln_f"}, layers
  for layer in layers:
    item = fetches[f"params {layer} (fp32 host partitions, forward fetch)"]
    assert (item["bytes"], item["times_per_step"], item["direction"]) == (
        _numel(run, layer + ".") * FP32, GAS, "h2d"), item
  grads = {k: (i["bytes"], i["times_per_step"]) for k, i in items.items() if "fetch" not in k[0]}
  assert grads == {("gradient partitions (fp32, grad_partitions_flat_buffer)", "d2h"): (n, 1),
                   ("gradients (fp32 partition)", "d2h"): (n, 1)}, grads
  assert any("varied between steps" in note for note in block["notes"])
  assert any("host-to-host" in note for note in block["notes"])
  _check_adam(block)


def test_no_offload_moves_nothing_and_times_no_cpu_adam():
  run, trainer = _run("zero2")
  block = trainer.transfers()
  assert block["zero_stage"] == 2 and block["offload_optimizer"] == block["offload_param"] == "none"
  assert block["bytes_per_step"] == {"h2d": 0, "d2h": 0} and block["items"] == []
  assert block["cpu_adam_s"] is None
  assert any("cpu_adam_s is null: the optimizer is FusedAdam" in note for note in block["notes"])


def test_the_torch_side_writes_the_deepspeed_block_and_plain_torch_zero(zero2_offload):
  """TorchSide's summary field: the engine's probe on the deepspeed side, zero bytes on the plain-torch side."""
  from torch_impl.baseline import TorchTrainer
  from torch_impl.side import TorchSide
  run, trainer = zero2_offload
  side = TorchSide()
  side.trainer = trainer
  assert side._transfers()["bytes_per_step"] == trainer.transfers()["bytes_per_step"] != {"h2d": 0, "d2h": 0}
  side.trainer = TorchTrainer(run, weights.init_params(run.model, 0))
  plain = side._transfers()
  assert plain["bytes_per_step"] == {"h2d": 0, "d2h": 0} and plain["items"] == [] and plain["cpu_adam_s"] is None
  assert plain["source"].startswith("plain torch") and plain["zero_stage"] is None
