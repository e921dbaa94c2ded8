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
