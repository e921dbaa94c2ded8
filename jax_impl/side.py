"""The JAX side of the one loop: `JaxSide`, `parity.protocol.loop.Side` over `jax_impl.step.Trainer`.

`jax_impl.worker` runs it (`run_train(io, JaxSide())`) after setting the environment jax reads when it starts (XLA
device count, no preallocation); this module imports jax and jax_impl only inside the methods, so importing it sets
nothing up and the worker keeps the order: environment first, then the framework.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from parity.protocol.layout import ACCELERATOR_PLANT_KEYS
from parity.protocol.loop import Side, SideSummary
from parity.protocol.memory_figures import device_memory_fields, host_rss_fields, vm_rss_bytes
from parity.protocol.placement import PLACEMENT_FILE, write_placement
from parity.protocol.side import SideIO
from parity.spec import to_dict

__all__ = ["JaxSide"]


class JaxSide(Side):
  """`parity.protocol.loop.Side` over `jax_impl.step.Trainer`. With several ranks (jax_impl.distributed) each
  process puts its rows of each batch into the global array, and the state is gathered to read it.

  jax and jax_impl are imported inside the methods: `main` must set XLA_FLAGS (`force_host_devices`) first.
  No op builds, no synchronize (`Trainer.step` blocks until its state and metrics are ready): Side's defaults.
  """

  def build(self, io: SideIO) -> None:
    """jax.distributed first (several ranks), then the backend's start between two VmRSS readings
    (`_open_backend`), then the Trainer on a mesh over every process's devices."""
    from jax_impl import distributed  # after force_host_devices (module docstring)
    from jax_impl.accelerator_plants import set_accelerator_plants
    from jax_impl.layers import set_model_plants
    from jax_impl.step import Trainer
    self.io = io
    set_model_plants(io.plants)  # before the step is traced: a planted family porting bug, if any
    distributed.initialize()  # (0, 1) and nothing done with one rank
    self._open_backend()
    applied = set_accelerator_plants(io.debug, self.platform)  # before the step is traced; none on the CPU
    for key in (k for k in ACCELERATOR_PLANT_KEYS if k in io.debug and k not in applied):
      io.debug[key] = None  # recorded as not applied: summary.json 'perturbed' (parity.report.build `applied`)
    self.trainer = Trainer.build(io.run, io.init_params(), mesh=distributed.global_mesh() if io.world > 1 else None,
                                 plants=io.plants)
    self.gathered = distributed.Gathered(self.trainer) if io.world > 1 else None

  def _open_backend(self) -> None:
    """Opens jax's backend (`jax.devices()`, which the Trainer's build would call first) between two VmRSS
    readings: jax, flax, optax and jax_impl are imported by then and nothing has touched a device, so the jump is
    the runtime's start (on a TPU, the mapping it makes when it opens the chip: parity.protocol.memory_figures)."""
    import jax  # after force_host_devices
    self.rss_readings = {"before_backend": vm_rss_bytes()}
    self.platform = jax.devices()[0].platform
    self.rss_readings["backend_opened"] = vm_rss_bytes()

  def semantics(self, io: SideIO) -> dict[str, Any]:
    """The semantics card of the built Trainer (jax_impl.semantics: each item probed on its own objects)."""
    from jax_impl.semantics import semantics_card  # after force_host_devices
    return semantics_card(self.trainer, io.plants)

  def restore(self, folder: Path, meta: dict[str, Any]) -> None:
    from jax_impl import checkpoint  # after force_host_devices
    t = self.trainer
    t.state = checkpoint.restore_train_state(folder, t.state, t.shardings)

  def compile(self, batch_shape, val_shape, dtype, examples: bool = False) -> float:
    """Compiles the step (and eval), then writes <side>/placement.json from the compiled step (`_write_placement`);
    the seconds returned are the compile's only."""
    self.trainer.compile(batch_shape, val_shape, dtype, examples=examples)
    self._write_placement()
    return self.trainer.compile_s

  def _write_placement(self) -> None:
    """Rank 0 writes placement.json (jax_impl.placement: the compiled step against the request's plan), a new file.
    A record that cannot be built or written stops nothing: summary.json's `placement_error` says why, and the
    'placement' check reports itself not run."""
    from jax_impl.placement import placement_record  # after force_host_devices
    self.placement_error = None
    if self.io.rank != 0:
      return
    try:
      record = placement_record(self.trainer, self.io.run.jax, side=self.io.side, run_id=self.io.request.get("run_id"))
      write_placement(self.io.out / PLACEMENT_FILE, record)
    except Exception as exc:  # a report of the step, not the step: training goes on, the error is recorded
      self.placement_error = f"{type(exc).__name__}: {exc}"

  def loss_weight_factor(self) -> float:
    """A: the step is one program over the whole global micro batch; accumulate_grads divides by A (W = 1 in the
    factor even on a data-parallel mesh: docs/data-examples.md "The model level")."""
    return float(self.io.run.train.grad_accum_steps)

  def training(self):
    import jax  # after force_host_devices
    return jax.transfer_guard("disallow")  # every host<->device move in the steps is explicit

  def _global(self, host: np.ndarray):
    """A host batch as this rank's part of the global array (several ranks), else itself."""
    if self.gathered is None:
      return host
    from jax_impl import distributed  # after force_host_devices
    sharding = self.trainer.placement.batch_sharding()
    return distributed.global_batch(host, sharding, tuple(host.shape), self.io.rank, self.io.world)

  def rank_batch(self, batches: np.ndarray, step: int):
    return self._global(batches[step])

  def rank_arrays(self, arrays):
    """Each array as the global array (several ranks: this process puts its rows in, as `rank_batch`), else as is."""
    return type(arrays)(*(self._global(np.asarray(getattr(arrays, f)))
                          for f in ("segment_ids", "positions", "weights")))

  def step(self, batch, *, probe: bool, force_overflow: bool, arrays=None) -> dict[str, float | bool]:
    from jax_impl.step import example_batch  # after force_host_devices
    if arrays is not None:
      batch = example_batch(batch, arrays)
    return self.trainer.step(batch, force_overflow=force_overflow)  # probe unused: state sizes are the compiled ones

  def eval_loss(self, val: np.ndarray, arrays=None) -> float:
    from jax_impl.step import example_batch  # after force_host_devices
    if arrays is None:
      return self.trainer.eval_loss(self._global(val))
    return self.trainer.eval_loss(example_batch(self._global(val), self.rank_arrays(arrays)))

  def _read(self, fn):
    """fn() (canonical params or moments), on the replicated state with several ranks (a collective)."""
    return fn() if self.gathered is None else self.gathered.call(self.trainer, fn)

  def canonical_params(self) -> dict[str, np.ndarray]:
    return self._read(self.trainer.canonical_params)

  def canonical_moments(self) -> dict[str, np.ndarray]:
    return self._read(self.trainer.canonical_moments)

  def poison(self) -> None:
    self.trainer.poison()

  def save(self, folder: Path, step: int) -> dict[str, Any]:
    import jax  # after force_host_devices
    from jax_impl import checkpoint
    with jax.transfer_guard("allow"):  # orbax reads the state to host memory
      self.trainer.settle()  # a deferred update still pending is part of the steps taken
      return checkpoint.save_train_state(folder, self.trainer.state)

  def versions(self) -> dict[str, str]:
    import flax  # after force_host_devices
    import jax
    import jaxlib
    import optax
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__}

  def summary(self) -> SideSummary:
    """The first device's name and peak bytes (one rank: the mesh's; several: this process's): the runtime's hold
    (bytes in use + the program's reserved region) where memory_stats gives it, else the larger of the allocator's
    peak and the compiled step's device figure, the step's host buffers apart
    (parity.protocol.memory_figures.device_memory_fields, every reading kept; on the CPU none), the VmRSS readings
    and the runtime's mapping (`host_rss_fields`), the state's bytes by memory kind, and the plan's evidence (memory
    kinds, shardings, compiled memory and offload, compile times)."""
    import jax  # after force_host_devices
    from jax_impl import offload
    t = self.trainer
    device = t.placement.mesh.devices.flat[0] if self.io.world == 1 else jax.local_devices()[0]
    stats = device.memory_stats()  # None on CPU
    allocator = int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
    memory = device_memory_fields(allocator, t.memory_analysis, device.platform, stats)
    rss = {**getattr(self, "rss_readings", {}), "end": vm_rss_bytes()}
    extra = {**{k: v for k, v in memory.items() if k != "peak_device_bytes"},
             **host_rss_fields(rss, getattr(self, "platform", device.platform)),
             "state_memory_kinds": offload.state_memory_kinds(t.state), "memory_analysis": t.memory_analysis,
             "offload_evidence": t.offload_evidence(), "state_bytes_all_devices": offload.bytes_by_memory_kind(t.state),
             "state_shardings": offload.state_sharding_specs(t.state), "mesh_devices": int(t.placement.mesh.size),
             "compile_times_s": t.compile_times_s, "plan": to_dict(self.io.run.jax),
             "device_kind": str(device.device_kind)}
    if getattr(self, "placement_error", None):
      extra["placement_error"] = self.placement_error
    return SideSummary(versions=self.versions(), device=str(device),
                       peak_device_bytes=memory["peak_device_bytes"],
                       state_bytes_by_memory_kind=offload.bytes_by_memory_kind(t.state, device), extra=extra)
