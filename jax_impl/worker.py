"""JAX side of a comparison: `python -m jax_impl.worker run_dir/request.json --side jax`.

Reads the run through `parity.protocol.side.SideIO`, trains with `jax_impl.step.Trainer`, and
writes steps.jsonl, summary.json, final.safetensors and final_moments.safetensors (Adam's sqrt(v_hat)). Exit codes: 0 ok, 3 non-finite
loss or grad norm (status 'nan'), 1 crash (status 'crashed', written by `main_guard`).

Run control (`SideIO.control()`): with resume_from, the whole TrainState is restored from the
checkpoint's orbax state (same shardings and memory kinds) before compiling, and training
continues at the checkpoint's step + 1; with save_checkpoint_at_step K, the state after step K
is saved (`jax_impl.checkpoint.save_train_state`); stop_after_step S ends the loop after step S.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported

from parity.verdict.params import AdamSensitivity  # noqa: E402
from parity.protocol.side import SideIO, main_guard  # noqa: E402
from parity.spec import to_dict  # noqa: E402

EXIT_NAN = 3


def _versions() -> dict[str, str]:
  import flax
  import jax
  import jaxlib
  import optax
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__}


def _peak_device_bytes(device) -> int | None:
  stats = device.memory_stats()  # None on CPU
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


class _Ranks:
  """How this process takes its batches and reads the state: directly with one rank; with several
  (jax_impl.distributed) its rows of each batch into the global array, and the state gathered to read it."""

  def __init__(self, io: SideIO, trainer):
    from jax_impl import distributed
    self.io, self.trainer, self.dist = io, trainer, distributed
    self.gathered = distributed.Gathered(trainer) if io.world > 1 else None

  def batch(self, host):
    if self.gathered is None:
      return host
    sharding = self.trainer.placement.batch_sharding()
    return self.dist.global_batch(host, sharding, tuple(host.shape), self.io.rank, self.io.world)

  def read(self, fn):
    """fn() (canonical params or moments), on the replicated state with several ranks (a collective)."""
    return fn() if self.gathered is None else self.gathered.call(self.trainer, fn)


def _build(io: SideIO, control):
  """jax.distributed first (several ranks), then the Trainer on a mesh over every process's devices."""
  from jax_impl import distributed
  from jax_impl.step import Trainer
  distributed.initialize()  # (0, 1) and nothing done with one rank
  if io.world > 1 and (control.save_at is not None or control.resume_dir is not None):
    raise ValueError(f"save_checkpoint_at_step/resume_from with {io.world} ranks: checkpoints of multi-rank sides "
                     "are not supported yet; run --resume-at with --nproc 1")
  trainer = Trainer.build(io.run, io.init_params(), mesh=distributed.global_mesh() if io.world > 1 else None)
  return trainer, _Ranks(io, trainer)


def run_side(io: SideIO) -> int:
  """Trains one run; returns the process exit code."""
  import jax
  from jax_impl import checkpoint, offload

  control = io.control()  # refusals (bad keys, a checkpoint of another run) end here, as 'crashed'
  train = io.run.train
  batches, val = io.training_batches()  # shapes checked (parity.protocol.side.check_batch_shapes)
  trainer, ranks = _build(io, control)
  if control.resume_dir is not None:
    trainer.state = checkpoint.restore_train_state(control.resume_dir, trainer.state, trainer.shardings)
  io.ready()
  trainer.compile(batches.shape[1:], val.shape if train.eval_every > 0 else None, batches.dtype)
  io.compile_s = trainer.compile_s
  status, moments_error = "ok", None
  sens = AdamSensitivity(train.eps)  # per-element Adam sensitivity for the params rule (parity.verdict.params)
  with jax.transfer_guard("disallow"):  # every host<->device move below is explicit
    for step in control.steps():
      io.before_step(step, poison=trainer.poison)
      t0 = time.perf_counter()
      forced = {"force_overflow": True} if io.forced_overflow(step) else {}
      # loss, grad_norm, lr (+ loss_scale, skipped in fp16)
      metrics = trainer.step(ranks.batch(batches[step]), **forced)
      step_time_s = time.perf_counter() - t0
      val_loss = trainer.evaluate(ranks.batch(val)) if io.is_eval_step(step) else None
      if not io.record(step, step_time_s=step_time_s, val_loss=val_loss, **metrics):
        status = "nan"
        break
      if not metrics.get("skipped") and moments_error is None:
        try:  # the params rule falls back to its per-tensor form without them, and says so
          sens.add(ranks.read(trainer.canonical_moments), float(metrics["lr"]))
        except (ValueError, KeyError) as exc:
          moments_error = f"{type(exc).__name__}: {exc}"
      if step == control.save_at:
        with jax.transfer_guard("allow"):  # orbax reads the state to host memory
          io.save_checkpoint(step, lambda folder: checkpoint.save_train_state(folder, trainer.state), _versions())
  device = trainer.placement.mesh.devices.flat[0] if io.world == 1 else jax.local_devices()[0]
  extra = {"state_memory_kinds": offload.state_memory_kinds(trainer.state),
           "memory_analysis": trainer.memory_analysis,
           "offload_evidence": trainer.offload_evidence(),
           "state_bytes_all_devices": offload.bytes_by_memory_kind(trainer.state),
           "state_shardings": offload.state_sharding_specs(trainer.state),
           "mesh_devices": int(trainer.placement.mesh.size),
           "compile_times_s": trainer.compile_times_s,
           "plan": to_dict(io.run.jax)}
  moments = None
  if status == "ok" and moments_error is None:
    rms = ranks.read(trainer.canonical_moments)
    moments = {"grad_rms": rms, "sensitivity": sens.result(rms)}
  elif moments_error is not None:
    extra["moments_error"] = moments_error
  final = ranks.read(trainer.canonical_params) if status == "ok" else None
  io.finish(status, final_params=final, final_moments=moments,
            error="non-finite loss or grad_norm" if status == "nan" else None,
            versions=_versions(), device=str(device), peak_device_bytes=_peak_device_bytes(device),
            state_bytes_by_memory_kind=offload.bytes_by_memory_kind(trainer.state, device), extra=extra)
  return 0 if status == "ok" else EXIT_NAN


_FORCE_COUNT = "--xla_force_host_platform_device_count"


def force_host_devices(argv: list[str], environ: dict = os.environ) -> int | None:
  """Before jax is imported: give the CPU backend `jax.data_parallel` devices when the plan needs > 1.

  Reads the request JSON named by the first positional argument; when its `run.jax.data_parallel`
  n > 1 and XLA_FLAGS sets no device count yet, appends `--xla_force_host_platform_device_count=n`.
  The flag only affects the host (CPU) platform, so a GPU run keeps its real devices. Errors in the
  request are left to `main_guard`, which reports them.

  Returns:
    The forced count, or None when nothing was set.
  """
  paths = [a for a in argv if not a.startswith("-") and a.endswith(".json")]
  try:
    n = int(json.loads(open(paths[0]).read())["run"]["jax"].get("data_parallel", 1)) if paths else 1
  except (OSError, ValueError, KeyError, TypeError):
    return None
  flags = environ.get("XLA_FLAGS", "")
  if n <= 1 or _FORCE_COUNT in flags:
    return None
  environ["XLA_FLAGS"] = f"{flags} {_FORCE_COUNT}={n}".strip()
  return n


def main(argv: list[str] | None = None) -> int:
  if "jax" not in sys.modules:  # the flag is read when jax initialises its backends
    force_host_devices(sys.argv[1:] if argv is None else argv)
  return main_guard(run_side, argv)


if __name__ == "__main__":
  sys.exit(main())
