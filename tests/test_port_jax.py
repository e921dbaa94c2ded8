"""A port is a run spec plus what compare cannot run yet: the ported config's `jax:` section is
exactly parity.spec.JaxPlan's fields, `not_runnable_by_compare:` names the rest, and one DeepSpeed-JSON builder
(parity.numerics.ds_json) serves the DeepSpeed side and the reverse port."""
from __future__ import annotations

import dataclasses

import pytest

from parity.migrate import PortError, port_config
from parity.migrate._model import NOT_RUNNABLE_KEYS, NotRunnable
from parity.migrate._reverse import load_ported, to_deepspeed, to_run_spec
from parity.numerics.ds_json import deepspeed_json, zero_section
from parity.presets import preset
from parity.overrides import apply_overrides
from parity.spec import JaxPlan, SpecError
from test_migrate import REAL_FILES, flags_for, read_deepspeed_config

JAX_FIELDS = {f.name for f in dataclasses.fields(JaxPlan)}
BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
CRAFTED = [
    {**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu", "pin_memory": False}}},
    {**BASE, "zero_optimization": {"stage": 2}, "activation_checkpointing": {"cpu_checkpointing": True}},
    {**BASE, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
     "activation_checkpointing": {"partition_activations": False}},
    {**BASE, "zero_optimization": True},
    BASE,
    {**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
]


def _ported_docs():
  """(name, ported document) of every real config that ports (tests/data/realworld/ds_configs) and the crafted ones."""
  out = [(f"crafted{i}", port_config(c, source=f"crafted{i}")) for i, c in enumerate(CRAFTED)]
  for p in REAL_FILES:
    raw = read_deepspeed_config(p)
    out.append((p.name, port_config(raw, flags_for(raw), source=p.name)))
  return [(n, r.ported.to_dict()) for n, r in out if r.ported is not None]


def test_every_key_of_a_ports_jax_section_is_a_jaxplan_field():
  docs = _ported_docs()
  assert len(docs) >= len(CRAFTED)
  for name, doc in docs:
    assert set(doc["jax"]) == JAX_FIELDS, name
    assert JaxPlan(**doc["jax"]).validate() is not None, name  # a runnable JaxPlan as written
    assert set(doc.get("not_runnable_by_compare", {})) <= set(NOT_RUNNABLE_KEYS), name
    assert "sharding" not in doc and "remat" not in doc, name


def test_zero3_offload_maps_to_jaxplan_and_mixed_pinning_is_named_not_runnable():
  r = port_config(CRAFTED[0], source="t")
  j, nr = r.ported.jax, r.ported.not_runnable_by_compare
  assert (j.zero_stage, j.offload_opt_state, j.offload_params, j.host_memory_kind) == (3, True, True, "pinned_host")
  assert nr["params_host_memory_kind"].value == "unpinned_host"
  assert "one host memory kind" in nr["params_host_memory_kind"].why
  ds, _ = to_deepspeed(r.ported.to_dict())  # the reverse port writes each offload's own pinning back
  assert ds["zero_optimization"] == zero_section(3, "pinned_host", "unpinned_host")
  with pytest.raises(SpecError, match="params_host_memory_kind"):
    to_run_spec(r.ported, preset("gpt2-tiny"))


def test_cpu_checkpointing_is_remat_offload_names_and_runs_on_both_sides():
  r = port_config(CRAFTED[1], source="t")
  assert r.ported.jax.remat == "offload_names" and "cpu_checkpointing" not in r.ported.not_runnable_by_compare
  assert r.report.entries["activation_checkpointing.cpu_checkpointing"].target == "jax.remat"
  ds, _ = to_deepspeed(r.ported.to_dict())
  assert ds["activation_checkpointing"]["cpu_checkpointing"] is True
  run = to_run_spec(r.ported, preset("gpt2-tiny"))
  assert run.jax.remat == "offload_names" and run.deepspeed.activation_checkpointing
  assert run.deepspeed.cpu_checkpointing  # compare's DeepSpeed side keeps the checkpoints in host memory too
  old = r.ported.model_copy(update={"not_runnable_by_compare": {"cpu_checkpointing": NotRunnable(
      value=True, why="written by an older parity")}})  # a port from before compare ran it
  assert to_run_spec(old, preset("gpt2-tiny")).deepspeed.cpu_checkpointing


def test_a_runnable_port_runs_its_jax_section_as_written():
  r = port_config(CRAFTED[2], source="t")
  assert r.ported.not_runnable_by_compare == {}
  spec = to_run_spec(r.ported, preset("gpt2-tiny"))
  j = r.ported.jax
  assert (spec.jax.zero_stage, spec.jax.offload_opt_state, spec.jax.host_memory_kind, spec.jax.remat) == \
      (j.zero_stage, j.offload_opt_state, j.host_memory_kind, j.remat) == (1, True, "unpinned_host", "full")


def test_an_older_port_output_is_refused_with_the_fix():
  doc = port_config(BASE, source="t").ported.to_dict()
  old = {**{k: v for k, v in doc.items() if k not in ("jax", "not_runnable_by_compare")}, "schema": "parity.ported/1",
         "sharding": {"zero_stage": 0}, "remat": {"policy": "none"}}
  with pytest.raises(PortError, match="port the DeepSpeed config again"):
    load_ported(old, source="old.yaml")


def test_the_deepspeed_sides_config_comes_from_the_one_builder():
  run = apply_overrides(preset("gpt2-tiny"), {"deepspeed.zero_stage": 3, "deepspeed.offload_optimizer": "cpu",
                                              "deepspeed.offload_param": "cpu", "train.precision": "fp16"})
  cfg = deepspeed_json(run)
  assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                      "offload_param": {"device": "cpu", "pin_memory": False}}
  assert cfg["fp16"]["enabled"] and cfg["fp16"]["initial_scale_power"] == run.train.initial_scale_power
  torch = pytest.importorskip("torch")  # noqa: F841  the torch side builds the same dict through it
  from torch_impl import engine
  assert engine.ds_config(run) == cfg


def test_a_partial_optimizer_offload_at_stage_3_is_jax_offload_opt_ratio_both_ways():
  """offload_optimizer.ratio (ZeRO-Offload++) is jax.offload_opt_ratio: the port maps it, compare runs it, and
  --to-deepspeed writes it back where it was."""
  r = port_config(CRAFTED[-1], source="t")
  j = r.ported.jax
  assert (j.zero_stage, j.offload_opt_state, j.offload_opt_ratio) == (3, True, 0.3)
  row = r.report.entries["zero_optimization.offload_optimizer.ratio"]
  assert (row.fate, row.target) == ("mapped", "jax.offload_opt_ratio") and "30%" in row.reason
  assert to_run_spec(r.ported, preset("gpt2-tiny")).jax.offload_opt_ratio == 0.3
  ds, report = to_deepspeed(r.ported.to_dict())
  assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.3}
  assert report.entries["jax.offload_opt_ratio"].target == "zero_optimization.offload_optimizer.ratio"
  assert port_config(ds, source="back").ported.jax == j  # and back again
  full = port_config({**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, source="t")
  assert full.ported.jax.offload_opt_ratio == 1.0
  assert "ratio" not in to_deepspeed(full.ported.to_dict())[0]["zero_optimization"]["offload_optimizer"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_partial_optimizer_offload_below_stage_3_is_refused_as_deepspeed_refuses_it(stage):
  cfg = {**BASE, "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
  r = port_config(cfg, source="t")
  assert r.ported is None and r.exit_code == 2
  msg = r.report.deepspeed_refusals[0]  # DeepSpeed's own config asserts it (tests/test_port_acceptance.py asks it)
  assert "zero_optimization.offload_optimizer.ratio 0.5" in msg and "stage 3 only" in msg and f"stage is {stage}" in msg
  assert "Set zero_optimization.stage to 3, or remove ratio" in msg
  assert r.report.entries["zero_optimization.offload_optimizer.ratio"].fate == "unsupported"


def test_ratio_zero_keeps_the_optimizer_state_on_the_device_and_a_ratio_without_offload_is_not_needed():
  zero = port_config({**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0}}},
                     source="t")
  assert (zero.ported.jax.offload_opt_state, zero.ported.jax.offload_opt_ratio) == (False, 1.0)  # no sub-group on CPU
  assert zero.report.entries["zero_optimization.offload_optimizer.ratio"].target == "jax.offload_opt_state"
  none = port_config({**BASE, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "ratio": 0.5}}},
                     source="t")
  assert not none.ported.jax.offload_opt_state
  assert none.report.entries["zero_optimization.offload_optimizer.ratio"].fate == "not_needed"


def test_the_reverse_port_refuses_a_partial_offload_deepspeed_cannot_run():
  doc = port_config(CRAFTED[-1], source="t").ported.to_dict()
  doc["jax"]["zero_stage"] = 2  # edited by hand: DeepSpeed offloads part of the optimizer state at stage 3 only
  _, report = to_deepspeed(doc)
  assert any("jax.offload_opt_ratio 0.3 at jax.zero_stage 2" in e and "set jax.zero_stage to 3" in e
             for e in report.errors), report.errors
  bad = {**doc, "jax": {**doc["jax"], "zero_stage": 3, "offload_opt_state": False}}
  with pytest.raises(PortError, match="offload_opt_ratio"):
    load_ported(bad, source="ported.yaml")
