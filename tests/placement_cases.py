"""The JAX plans whose compiled placement tests/test_placement_plans*.py assert, and the
assertions, shared by the two files (split so that pytest-xdist compiles the two halves in parallel).

One device: a plan's zero_stage shards nothing on a one-device mesh (Placement.sharded), so plans that differ only in
it compile to the same program and are compiled once. zero3-fsdp4 (4 devices) is asserted in
tests/test_jax_plans_mesh.py, whose spawned process has the 4 devices.
"""
from __future__ import annotations

import dataclasses

import jax

from parity.sizing.plans import PLANS
from parity.spec import JaxPlan, ModelSpec, RunSpec, TrainSpec
from parity.weights import init_params

from jax_impl.placement import placement_record
from jax_impl.step import Trainer

MODEL = ModelSpec(vocab_size=16, d_model=8, n_layers=1, n_heads=1, max_seq_len=4)
TRAIN = TrainSpec(steps=2, micro_batch_size=1, grad_accum_steps=1, seq_len=2, warmup_steps=1, lr=1e-2, eval_every=0)
FP16_EXAMPLES = "zero3-offload-all"
"""The plan compiled as an fp16 run on padded/packed inputs (same placement; adds the overflow_factor argument and the
batch's four arrays): no extra compile."""
EXTRA = {"remat-offload_names": JaxPlan(remat="offload_names")}
"""offload_names with the Adam moments in pinned_host too (zero3-act-offload keeps them on the device)."""
JAX_PLANS = {**{n: p.jax for n, p in PLANS.items() if p.jax.data_parallel == 1}, **EXTRA}
ON_MESH = {"zero3-fsdp4"}
"""Plans asserted in tests/test_jax_plans_mesh.py (several devices)."""

H, D = "host", "device"
EXPECT = {  # (params, opt_state, activations), written out: not derived from the code under test
    "zero0": (D, D, D), "zero1": (D, D, D), "zero2": (D, D, D), "zero3": (D, D, D),
    "zero2-offload": (D, H, D), "zero2-offload-remat": (D, H, "recomputed"),
    "zero3-offload-all": (H, H, D), "zero3-offload-all-remat": (H, H, "recomputed"),
    "scan-offload": (H, H, D), "scan-offload-remat": (H, H, "recomputed"), "zero2-offload-scan": (D, H, D),
    "act-offload": (D, H, H), "remat-offload_names": (D, H, H), "zero3-act-offload": (D, D, H),
}
GROUPS = ({"zero0", "zero1", "zero2", "zero3", "zero2-offload", "zero2-offload-remat", "zero3-offload-all",
           "zero3-offload-all-remat"},
          {"scan-offload", "scan-offload-remat", "zero2-offload-scan", "act-offload", "remat-offload_names",
           "zero3-act-offload"})
"""The plans of test_placement_plans.py and of test_placement_plans_scan.py (5 and 6 distinct programs)."""
OFFLOADED_PER_LAYER = {"act-offload": 3, "remat-offload_names": 5, "zero3-act-offload": 5}
"""device_puts to host the offload policy adds per block, measured with jax 0.10.2 (jax_remat3 false):
offload_dot_with_no_batch_dims moves 3 weight-matmul outputs of a block, save_and_offload_only_these_names the 5
RESIDUAL_NAMES. A JAX that moves another number has changed what the policy means."""


def compile_records(names) -> dict[str, dict]:
  """Plan name -> its placement record (run_id 'r1'); one compile per distinct one-device program."""
  compiled: dict[tuple[JaxPlan, bool], Trainer] = {}
  out = {}
  for name in sorted(names):
    plan = JAX_PLANS[name]
    fp16 = name == FP16_EXAMPLES
    key = (dataclasses.replace(plan, zero_stage=0), fp16)
    if key not in compiled:
      train = dataclasses.replace(TRAIN, precision="fp16") if fp16 else TRAIN
      t = Trainer.build(RunSpec(model=MODEL, train=train, jax=key[0]), init_params(MODEL, 0))
      t.compile((TRAIN.grad_accum_steps, TRAIN.micro_batch_size, TRAIN.seq_len + 1), None, examples=fp16)
      compiled[key] = t
    out[name] = placement_record(compiled[key], plan, run_id="r1")
  return out


def assert_placement(rec: dict, name: str) -> None:
  """The compiled placement of plan `name` is EXPECT's, the bytes add up, nothing mismatches."""
  params, opt_state, acts = EXPECT[name]
  spaces = {(r["class"], r["role"]): r["memory_space"] for r in rec["classes"]}
  fp16 = {("overflow_factor", "argument"): D} if name == FP16_EXAMPLES else {}
  assert spaces == {("params", "argument"): params, ("opt_state", "argument"): opt_state, ("batch", "argument"): D,
                    ("params", "result"): params, ("opt_state", "result"): opt_state, ("metrics", "result"): D,
                    **fp16}, name
  batch = next(r for r in rec["classes"] if r["class"] == "batch")
  assert batch["buffers"] == (4 if fp16 else 1)  # padded/packed: tokens, segment ids, positions, weights
  for r in rec["classes"]:  # every kept buffer of a host class is a host buffer, of a device class none
    assert r["host_bytes"] == (r["bytes"] if r["memory_space"] == H else 0) and r["bytes"] > 0, r
  assert rec["activations"]["expected"] == acts
  assert rec["mismatches"] == [], rec["mismatches"]
  assert rec["plan"] == dataclasses.asdict(JAX_PLANS[name])


def assert_residual_moves(rec: dict, name: str) -> None:
  """The offload policies move OFFLOADED_PER_LAYER residuals per block to host; no other plan's policy moves any
  (a scan plan's per-layer state moves are in its jaxpr, and are not counted as the policy's)."""
  a = rec["activations"]
  want = OFFLOADED_PER_LAYER.get(name, 0) * MODEL.n_layers
  assert a["jaxpr_to_host_by_policy"] == want, (f"{name}: jax {jax.__version__} moves {a['jaxpr_to_host_by_policy']}"
                                                 f" residuals to host, {want} measured with jax 0.10.2", a)
  if JAX_PLANS[name].scan_layers and (JAX_PLANS[name].offload_params or JAX_PLANS[name].offload_opt_state):
    assert a["jaxpr_to_host"] > a["jaxpr_to_host_by_policy"]
