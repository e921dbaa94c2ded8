"""One record per side: everything the framework-free code knows of a side, registered once.

A side is a `SideRecord` passed to `register_side`; every place that needs to know something of a side reads it
from the record (`side_record(name)`), never by comparing the side's name with a string:

  which launcher starts its ranks    `framework` ('jax': the harness starts them for jax.distributed; 'torch':
                                     torchrun) and `hostfile_launcher` (harness.ranks); the framework also says
                                     which doctor probe sees its devices (harness.backend) and how the sizing
                                     model holds its batch (parity.sizing.batches)
  which worker runs it, per job      `workers` (parity.protocol.workers)
  what must be installed             `modules`, `extra`, `module_notes` (parity.installed)
  what its plan is and reads as      `plan` (the RunSpec section: RunSpec.reads_plan), `plan_label`, `plan_text`
                                     (parity.report.setup_table)
  what the sizing model predicts     `memory_rows` (parity.sizing.memory.estimate), `estimated` (`parity estimate`)
  what a checkpoint must share       `state_layout` (parity.protocol.control)
  what history compares              `records_threads` (parity.history.bands)
  whether it takes the TPU chip      `opens_chip` (harness.chip)
  whether one rank needs sockets     `sockets`, `sockets_short` (parity.sockets)

Code is named, not imported: a worker is a dotted module (run with `python -m`), `memory_rows` and `plan_text` are
'module:function' references (`load_ref`) that the one caller resolves, so this module imports nothing of the
project but its errors and every package may read it. The four sides of the repository are registered at the end
of this file; a side of its own (tests/fake_side.py registers the tests' numpy side) calls `register_side` in its
own module (docs/adding-a-side.md). Imports neither jax nor torch.
"""
from __future__ import annotations

import dataclasses
import importlib
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from parity.errors import SpecError

__all__ = ["SideRecord", "Framework", "FRAMEWORKS", "JOBS", "register_side", "unregister_side", "side_record",
           "find_side", "all_sides", "side_names", "reads_plan", "load_ref"]


@dataclasses.dataclass(frozen=True)
class Framework:
  """What a side's framework decides (a side names one: `SideRecord.framework`).

  Attributes:
    launcher: how the harness starts a side's ranks (harness.ranks): 'jax.distributed' (the harness starts the N
      processes, each given the coordinator) or 'torchrun' (torch.distributed.run starts them).
    modules: the top-level modules every side of it imports, as the doctor's probe of it needs them
      (parity.installed.framework_record).
    extra: the pip extra that installs them.
    multi_rank_sockets: what meets over sockets when a side of it has several ranks (parity.sockets).
  """
  launcher: str
  modules: tuple[str, ...]
  extra: str
  multi_rank_sockets: str


FRAMEWORKS = {
    "jax": Framework("jax.distributed", ("jax", "flax", "optax"), "jax", "jax.distributed's coordinator"),
    "torch": Framework("torchrun", ("torch",), "torch", "torchrun's rendezvous and torch.distributed"),
}
"""framework -> Framework: the two a side can be written in (the doctor probes each: harness.doctor.PROBES)."""
JOBS = ("train", "diagnose", "port_verify")
"""The jobs a worker module can run (parity.protocol.workers documents each)."""


def _frozen(mapping: Mapping[str, str]) -> Mapping[str, str]:
  return MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True, eq=False)
class SideRecord:
  """What the framework-free code knows of one side. Only `name`, `framework`, `label` and `workers` are required;
  every other field's default is what a side without that property has (no plan, no memory model, no chip).

  Attributes:
    name: the side's name (`--sides`, run_dir/<name>/, the report's column).
    framework: 'jax' or 'torch' (FRAMEWORKS): the launcher of its ranks and which doctor probe sees its devices.
    label: its name in sentences ('DeepSpeed', 'FSDP2').
    workers: job (JOBS) -> the worker module (dotted, run with `python -m harness.boot`); 'train' is required.
    modules: the top-level modules its training worker imports, in the order `parity.installed` checks them.
    extra: the pip extra that installs them (`pip install 'parity[EXTRA]'`); None: the base install has them.
    module_notes: module -> what to add to its name in a refusal ({'torch': 'FSDP2 is part of it'}).
    plan: the RunSpec section holding its plan ('jax', 'deepspeed', 'fsdp'), or None (no plan of its own).
    plan_label: the setup table's row name for its plan (default '<label> plan').
    plan_text: 'module:function' taking the run (its report.json as a parity.report.run_record.RunRecord) and
      returning the plan row's text (the built-in sides: their plan's own `describe`), or None for no plan row.
    memory_rows: 'module:function' taking (run: RunSpec, ranks: int) and returning its predicted
      parity.sizing.memory.Row list (per rank, its batch rows included), or None: no memory model.
    estimated: `parity estimate` prints its column (needs memory_rows). `--plan auto` costs the sides with a `plan`,
      the sections the plan pairs of parity.sizing.plans set.
    state_layout: the plan fields a checkpoint must share with the run resuming it; None: the whole plan; ():
      none (parity.protocol.control.check_resume).
    records_threads: its worker records its thread settings in every summary (parity.history.bands).
    opens_chip: its worker opens JAX's default backend, so it takes the machine's TPU chip (harness.chip).
    sockets: what of it needs sockets on one rank (words), or None: none on one rank (parity.sockets).
    sockets_short: the short form of `sockets` in sentences.
    hostfile_launcher: the module that launches it with a hostfile (DeepSpeed's launcher), or None (harness.ranks).
  """
  name: str
  framework: str
  label: str
  workers: Mapping[str, str]
  modules: tuple[str, ...] = ()
  extra: str | None = None
  module_notes: Mapping[str, str] = dataclasses.field(default_factory=dict)
  plan: str | None = None
  plan_label: str = ""
  plan_text: str | None = None
  memory_rows: str | None = None
  estimated: bool = False
  state_layout: tuple[str, ...] | None = ()
  records_threads: bool = False
  opens_chip: bool = False
  sockets: str | None = None
  sockets_short: str = ""
  hostfile_launcher: str | None = None

  def __post_init__(self) -> None:
    """Refuses a record that cannot work (ValueError naming the field): an empty or odd name, an unknown framework
    or job, no train worker, a reference not 'module:function', `estimated` without `memory_rows`."""
    if not self.name or not self.name.replace("_", "").isalnum() or not self.name.islower():
      raise ValueError(f"side name {self.name!r}: use lower-case letters, digits and '_' (it names run_dir/<side>/)")
    if self.framework not in FRAMEWORKS:
      raise ValueError(f"side {self.name!r}: framework {self.framework!r}; expected one of {', '.join(FRAMEWORKS)}")
    bad = [j for j in self.workers if j not in JOBS]
    if bad or "train" not in self.workers:
      raise ValueError(f"side {self.name!r}: workers need a 'train' module and only the jobs {', '.join(JOBS)}; "
                       f"got {sorted(self.workers)}")
    for field in ("memory_rows", "plan_text"):
      ref = getattr(self, field)
      if ref is not None and ref.count(":") != 1:
        raise ValueError(f"side {self.name!r}: {field} {ref!r} is not 'module:function'")
    if self.estimated and self.memory_rows is None:
      raise ValueError(f"side {self.name!r}: estimated=True needs memory_rows (the rows the estimate costs)")
    object.__setattr__(self, "workers", _frozen(self.workers))
    object.__setattr__(self, "module_notes", _frozen(self.module_notes))
    object.__setattr__(self, "modules", tuple(self.modules))
    object.__setattr__(self, "plan_label", self.plan_label or f"{self.label} plan")

  @property
  def launcher(self) -> str:
    """How its ranks start: 'torchrun' or 'jax.distributed' (its framework's)."""
    return FRAMEWORKS[self.framework].launcher

  @property
  def multi_rank_sockets(self) -> str:
    """What of it meets over sockets with several ranks (its framework's launcher and process group)."""
    return FRAMEWORKS[self.framework].multi_rank_sockets

  def same_as(self, other: "SideRecord") -> bool:
    """Whether `other` records the same facts (a module imported twice registers the same record again)."""
    return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self))


_REGISTRY: dict[str, SideRecord] = {}


def register_side(record: SideRecord) -> SideRecord:
  """Adds `record` to the registry and returns it (registering the same facts again is a no-op: the record
  registered first is returned).

  Raises:
    ValueError: another record under the same name (unregister_side it first).
  """
  old = _REGISTRY.get(record.name)
  if old is not None:
    if not old.same_as(record):
      raise ValueError(f"side {record.name!r} is registered already with other facts; unregister_side it first")
    return old
  _REGISTRY[record.name] = record
  return record


def unregister_side(name: str) -> SideRecord | None:
  """Removes side `name` from the registry (a test's side, when the test ends); returns its record or None."""
  return _REGISTRY.pop(name, None)


def find_side(name: str) -> SideRecord | None:
  """The record of side `name`, or None when no side of that name is registered."""
  return _REGISTRY.get(name)


def side_record(name: str) -> SideRecord:
  """The record of side `name`.

  Raises:
    SpecError: no side of that name (the message lists the registered ones).
  """
  record = _REGISTRY.get(name)
  if record is None:
    raise SpecError(f"unknown side {name!r}; the sides are {', '.join(_REGISTRY)}")
  return record


def all_sides() -> tuple[SideRecord, ...]:
  """Every registered record, in registration order."""
  return tuple(_REGISTRY.values())


def side_names() -> tuple[str, ...]:
  """Every registered side's name, in registration order."""
  return tuple(_REGISTRY)


def reads_plan(sides: Iterable[str], section: str) -> bool:
  """Whether one of `sides` runs the plan in RunSpec section `section` (its record's `plan`; a name no side is
  registered under reads none)."""
  return any(getattr(find_side(s), "plan", None) == section for s in sides)


def load_ref(ref: str) -> Any:
  """The object a 'module:function' reference names (the module imported on first use)."""
  module, _, attr = ref.partition(":")
  return getattr(importlib.import_module(module), attr)


# ----------------------------------------------------------------------------- the repository's sides
# Registration order is the order of every listing built from the registry: the setup table's plan rows and
# `parity estimate`'s sides (deepspeed, jax, fsdp) as they were before the record existed.

register_side(SideRecord(
    name="deepspeed", framework="torch", label="DeepSpeed",
    workers={"train": "torch_impl.worker", "port_verify": "torch_impl.port_verify"},
    modules=("torch", "deepspeed"), extra="deepspeed",
    plan="deepspeed", plan_text="parity.report.setup_table:deepspeed_plan_text",
    memory_rows="parity.sizing.memory:deepspeed_rows", estimated=True,
    state_layout=None,  # a ZeRO-partitioned checkpoint: the whole deepspeed plan must match
    records_threads=True,
    sockets="DeepSpeed's init (deepspeed.init_distributed: a torch.distributed group, even on one rank)",
    sockets_short="DeepSpeed's init", hostfile_launcher="deepspeed.launcher.runner"))
register_side(SideRecord(
    name="jax", framework="jax", label="JAX",
    workers={"train": "jax_impl.worker", "diagnose": "jax_impl.diagnose", "port_verify": "jax_impl.port_verify"},
    modules=("jax", "flax", "optax"), extra="jax",
    plan="jax", plan_text="parity.report.setup_table:jax_plan_text",
    memory_rows="parity.sizing.memory:jax_rows", estimated=True,
    state_layout=("scan_layers",),  # restored into this run's shardings: only the params layout must match
    opens_chip=True))  # XLA's CPU pool follows the CPU count, which the machine identity compares: no thread record
register_side(SideRecord(
    name="torch", framework="torch", label="PyTorch",
    workers={"train": "torch_impl.worker", "diagnose": "torch_impl.diagnose"},  # DeepSpeed is diagnosed as 'torch'
    modules=("torch",), extra="torch",
    memory_rows="parity.sizing.memory:torch_rows", records_threads=True))
register_side(SideRecord(
    name="fsdp", framework="torch", label="FSDP2",
    workers={"train": "torch_impl.fsdp_worker"},
    modules=("torch",), extra="torch", module_notes={"torch": "FSDP2 is part of it"},
    plan="fsdp", plan_text="parity.report.setup_table:fsdp_plan_text",
    memory_rows="parity.sizing.memory:fsdp_rows", estimated=True,
    state_layout=(),  # DCP reshards on load: none of the fsdp plan must match
    records_threads=True,
    sockets="FSDP2's process group (torch.distributed, even on one rank)", sockets_short="FSDP2's process group"))
