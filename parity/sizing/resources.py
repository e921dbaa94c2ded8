"""Will a run fit this machine? Bytes of memory and disk a RunSpec needs, checked before anything is allocated.

`check_resources` is what `parity compare` and `parity diagnose` call before claiming a run folder; it uses the
memory model (parity.sizing.memory) and the canonical parameter table (parity.weights).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Mapping

from parity.data import _CHUNK_TOKENS, batch_dtype
from parity.inputs import InputError
from parity.environment import cuda_evidence
from parity.sizing import host_limits, memory
from parity.sizing.batches import example_file_bytes, example_host_bytes
from parity.weights import param_shapes

__all__ = ["Resources", "estimate_resources", "check_resources", "available_memory_bytes", "tensor_count",
           "ALLOW_LARGE_ENV", "check_rank_count", "visible_gpus", "FRAMEWORK_FLOOR_BYTES", "check_host_pool"]


@dataclasses.dataclass(frozen=True)
class Resources:
  """What a run needs before it starts, bytes.

  Attributes:
    params: number of model parameters (closed form; no per-layer table is built).
    batches_bytes: size of batches.npy (steps x grad_accum x micro_batch x (seq_len + 1) tokens, 2 bytes each,
      4 when model.vocab_size > 65,536: parity.data.batch_dtype).
    memory_bytes: peak host RAM of the largest single process: the memory model's device + host bytes of the
      heavier side (on a CPU machine both kinds are RAM; the batch and mask rows of parity.sizing.batches among
      them) plus the batches, plus make_batches' sampling buffers, plus examples_bytes.
    disk_bytes: what the run folder will hold: batches.npy twice (run + noise rerun), init.safetensors and one
      final.safetensors per side and rerun.
    examples_bytes: a padded/packed run's example arrays at their peak in one process (parity.sizing.batches.
      example_host_bytes: loss mask, segment ids and positions of every step, and a side's float32 weights built
      through float64); 0 on stream. Counted in memory_bytes; their files (twice: run + noise rerun) in disk_bytes.
  """
  params: int
  batches_bytes: int
  memory_bytes: int
  disk_bytes: int
  examples_bytes: int = 0


def _per_layer(model, measure: Callable[[dict], int]) -> int:
  """measure(param_shapes) of the full model from a 1- and 2-layer copy of the spec: exact, cheap for any n_layers."""
  one = measure(param_shapes(dataclasses.replace(model, n_layers=1)))
  two = measure(param_shapes(dataclasses.replace(model, n_layers=2)))
  return one + (model.n_layers - 1) * (two - one)


def _param_count(model) -> int:
  return _per_layer(model, lambda shapes: sum(math.prod(s) for s in shapes.values()))


def tensor_count(model) -> int:
  """Number of canonical tensors of a ModelSpec, without building the per-layer table."""
  return _per_layer(model, len)


STATE_BYTES_PER_PARAM_FLOOR = 16
"""fp32 params + gradients + Adam's two moments: the least any side holds per parameter (4 + 4 + 8 bytes)."""
ALLOW_LARGE_ENV = "PARITY_ALLOW_LARGE"
"""Set to 1 to run past check_resources' refusal (the `--allow-large` flag sets it)."""
LARGE_MODEL_PARAMS = 2 * 10**9
"""Above this count the per-category memory model is skipped (it lists every tensor) and the floor is used."""


FRAMEWORK_FLOOR_BYTES = 435 * 10**6
"""A framework's own footprint per process: measured peak RSS of a 1-layer run (jax 435 MB, torch 328 MB, against
4 MB of model state and batches); the larger, since one side's ranks run at a time and either may be the one."""


def estimate_resources(spec, nproc: int = 1) -> Resources:
  """Bytes a run of `spec` (a RunSpec) needs; cheap for absurd sizes (nothing is allocated). See Resources.

  nproc: ranks per side on this host (`--nproc`); with more than one, memory_bytes counts every rank's model state
  (each rank holds the whole model) and its framework footprint (FRAMEWORK_FLOOR_BYTES), plus the batches once.
  """
  t, m = spec.train, spec.model
  n = _param_count(m)
  tok = batch_dtype(m.vocab_size).itemsize  # bytes per stored token id
  batches = (t.steps * t.grad_accum_steps * t.micro_batch_size * (t.seq_len + 1) * tok
             + max(t.eval_batches, 1) * t.micro_batch_size * (t.seq_len + 1) * tok + 128)
  state = n * STATE_BYTES_PER_PARAM_FLOOR
  if n <= LARGE_MODEL_PARAMS:
    rows = memory.estimate(spec, sides=("deepspeed", "jax"))
    state = max(state, *(sum(r.bytes for r in rows if r.side == s) for s in ("deepspeed", "jax")))
  examples = example_host_bytes(spec)
  disk = 2 * (batches + example_file_bytes(spec)) + n * 4 * (1 + 2 * len(spec.sides))
  # make_batches' peak besides the batches: int64 window starts, and one chunk's int64 indices + its gather (tok)
  # (measured with tracemalloc, 200,000 steps of gpt2-tiny: peak 102.1 MB; this formula: 101.1 MB + the model state)
  sampling = t.steps * t.grad_accum_steps * t.micro_batch_size * 8 + _CHUNK_TOKENS * (8 + tok)
  per_rank = state if nproc <= 1 else nproc * (state + FRAMEWORK_FLOOR_BYTES)
  return Resources(params=n, batches_bytes=batches, memory_bytes=per_rank + batches + sampling + examples,
                   disk_bytes=disk, examples_bytes=examples)


def visible_gpus(environ=os.environ) -> int:
  """GPUs a rank could get here: the CUDA_VISIBLE_DEVICES entries when it is set, else /dev/nvidia<k> files."""
  vis = environ.get("CUDA_VISIBLE_DEVICES")
  if vis is not None:
    return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
  try:
    return sum(1 for f in Path("/dev").iterdir() if f.name.startswith("nvidia") and f.name[6:].isdigit())
  except OSError:
    return 0


def check_rank_count(nproc: int, *, allow_large: bool = False, gpus: int | None = None,
                     cpus: int | None = None) -> None:
  """Refuses more ranks on this host than it has GPUs (on a GPU node) or CPU cores (elsewhere).

  Args:
    nproc: ranks per side on this host (`--nproc`). gpus, cpus: override the machine's counts (tests).
    allow_large: skip the refusal (also PARITY_ALLOW_LARGE=1, what `--allow-large` sets).
  Raises:
    InputError: naming --nproc, the count it exceeds and the fix.
  """
  if nproc <= 1 or allow_large or os.environ.get(ALLOW_LARGE_ENV) == "1":
    return
  gpus = visible_gpus() if gpus is None else gpus
  cpus = (os.cpu_count() or 1) if cpus is None else cpus
  limit, what = (gpus, "visible GPUs") if gpus > 0 else (cpus, "CPU cores (os.cpu_count())")
  if nproc > limit:
    raise InputError(f"--nproc {nproc}: more ranks than this host's {limit} {what}; each rank is a process of its "
                     f"own. Use --nproc {limit} or fewer, or pass --allow-large (PARITY_ALLOW_LARGE=1) to start "
                     f"{nproc} anyway")


def available_memory_bytes() -> int | None:
  """Host memory a run may use here: the smaller of /proc/meminfo MemAvailable and this process's cgroup memory limit
  less its working set (parity.sizing.host_limits.host_memory); where neither can be read, physical memory
  (sysconf), else None (parity.sizing.host_limits.available_bytes, what the JAX worker's pool is held to as well)."""
  return host_limits.available_bytes()


def check_host_pool(spec, *, available: int | None, gpu: bool | None = None,
                    environ: Mapping[str, str] = os.environ) -> host_limits.PoolDecision | None:
  """Refuses a JAX side whose pinned-host pool cannot work here; returns the pool decision (None: no JAX side, no
  GPU, or nothing pinned).

  Rule (docs/plans.md, 'Host limits'): only where XLA's GPU pool applies (`gpu`; None: a CUDA driver is visible,
  parity.environment.cuda_evidence). The JAX worker gets the pool of host_limits.pool_decision over `available` per
  device (the user's XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB kept, else the rule's where the default is short for the need
  or larger than the host). Refused: the user's pool below the need, or jax.data_parallel pools (one per device, each
  able to grow to its limit) above `available`.
  Raises:
    SpecError: a bad variable value (host_limits.xla_pool_setting). InputError: the pool does not work, naming the
      variable, the need, the pool and the fix.
  """
  if not spec.reads_plan("jax") or not (cuda_evidence() is not None if gpu is None else gpu):
    return None
  devices = max(1, spec.jax.data_parallel)
  per_device = available // devices if available is not None else None
  decision = host_limits.jax_pool(spec, environ, per_device)
  if not decision.need_bytes:
    return None
  why = host_limits.pool_problem(decision, per_device)
  if why:
    raise InputError(f"the JAX side's pinned host cannot be placed here: {why}. Change the plan (`parity plan`), "
                     "or pass --allow-large (PARITY_ALLOW_LARGE=1) to try anyway")
  return decision


def _free_disk_bytes(folder: Path) -> int | None:
  p = folder.absolute()
  while not p.exists() and p != p.parent:
    p = p.parent
  try:
    return shutil.disk_usage(p).free
  except OSError:
    return None


def _gb(n: int) -> str:
  for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
    if n >= size / 10 or unit == "MB":
      return f"{n / size:,.3g} {unit}"


def check_resources(spec, run_dir: str | Path, *, allow_large: bool = False, nproc: int = 1) -> Resources:
  """Refuses a run whose estimated memory or disk exceeds what this machine has, before anything is allocated.

  Rule: refuse when Resources.memory_bytes > available memory (`available_memory_bytes`: the smaller of MemAvailable
  and the cgroup limit less its working set), when the JAX side's pinned-host pool cannot work on a GPU machine
  (`check_host_pool`), or when Resources.disk_bytes > free disk under `run_dir`. The memory figure is a floor: it
  leaves out each framework's own footprint (measured peak RSS of a 1-layer run: jax 435 MB, torch 328 MB, against
  4 MB of model state and batches; with nproc > 1 every rank's footprint and model state are counted), so the memory
  rule never refuses a run that would fit and catches sizes that are off by orders of magnitude (--steps 2e9: 0.53 TB of
  batches). The pool rule is stricter on purpose: each device's pool can grow to its limit, not just to the need.
  `allow_large`, or PARITY_ALLOW_LARGE=1 (what `--allow-large` sets), skips the refusals (e.g. memory that will be
  freed, swap).
  Returns:
    The estimate.
  Raises:
    InputError: naming the sizes behind the estimate, the estimate, what is available and the fix.
    SpecError: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB is no whole number of GiB (on a GPU machine with a JAX side).
  """
  r = estimate_resources(spec, nproc)
  if allow_large or os.environ.get(ALLOW_LARGE_ENV) == "1":
    return r
  t, m = spec.train, spec.model
  tok = batch_dtype(m.vocab_size)
  ranks = f"--nproc {nproc} ranks x (model state + {_gb(FRAMEWORK_FLOOR_BYTES)} framework floor); " \
      if nproc > 1 else ""
  why = (f"{ranks}{r.params:,} params (model.n_layers={m.n_layers}, d_model={m.d_model}, vocab_size={m.vocab_size}); "
         f"batches.npy {_gb(r.batches_bytes)} (train.steps={t.steps} x grad_accum_steps={t.grad_accum_steps} x "
         f"micro_batch_size={t.micro_batch_size} x (seq_len+1)={t.seq_len + 1} x {tok.itemsize} bytes, "
         f"{tok.name} ids of model.vocab_size={m.vocab_size})"
         + (f"; the {t.layout} layout's mask arrays {_gb(r.examples_bytes)}" if r.examples_bytes else ""))
  mem = available_memory_bytes()
  if mem is not None and r.memory_bytes > mem:
    raise InputError(f"the run needs ~{_gb(r.memory_bytes)} of memory, more than the {_gb(mem)} available (the "
                     f"smaller of MemAvailable and the cgroup limit): {why}. Reduce these sizes, or pass --allow-large "
                     "(PARITY_ALLOW_LARGE=1) to try anyway")
  check_host_pool(spec, available=mem)
  disk = _free_disk_bytes(Path(run_dir))
  if disk == 0:  # a pseudo or read-only file system (/proc, a full disk): no size fits, so no size is the fix
    raise InputError(f"no space can be written under {Path(run_dir).absolute()} (0 bytes free: a full disk, or a "
                     "pseudo/read-only file system such as /proc); choose another --out")
  if disk is not None and r.disk_bytes > disk:
    raise InputError(f"the run folder would hold ~{_gb(r.disk_bytes)}, more than the {_gb(disk)} free under "
                     f"{Path(run_dir).absolute()}: {why}. Reduce these sizes, free disk, or pass --allow-large "
                     "(PARITY_ALLOW_LARGE=1)")
  return r
