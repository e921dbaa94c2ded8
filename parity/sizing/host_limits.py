"""The host-memory limits a run meets on a GPU node, and what each side's host buffers cost against them (numpy only;
no jax, no torch).

Three limits, each read or derived here, used by the planner (parity.sizing.plans), the resource check
(parity.sizing.resources), the worker environments (harness.env) and `parity doctor`:

  * XLA's pinned-host pool. XLA's GPU client gives each local device one BFC allocator for the host memory space
    (`pinned_host` arrays, host buffers of the compiled step), limited to XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB GiB, 64 by
    default: openxla/xla xla/pjrt/gpu/gpu_helpers.cc `GetGpuHostAllocator` reads the variable with
    `tsl::ReadInt64FromEnvVar(..., 64, ...)` and multiplies it by 1 << 30; se_gpu_pjrt_client.cc builds one per
    addressable device. The allocator grows on demand (allow_growth) by regions that double in size, each at most
    what is left under the limit (tsl BFCAllocator::Extend), so what it pins can reach the limit, never more. A
    value XLA cannot parse is logged and the default used; parity refuses it instead (`xla_pool_setting`). On the
    CPU backend `pinned_host` is ordinary memory and the variable is not read.
  * The cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes; 'max' or the v1 'unlimited' value: none) less
    the cgroup's working set, and /proc/meminfo MemAvailable: a run may use the smaller (`host_memory`).
  * torch's pinned allocator: CachingHostAllocator rounds each pinned block up to a power of two (torch 2.13
    ATen/core/CachingHostAllocator.h: `c10::llvm::PowerOf2Ceil(size)` below pinned_max_round_threshold, whose
    default is SIZE_MAX), so a 1.2 GiB block pins 2 GiB; sgl-project/sglang PR #39021 measured 5 x 1.20 GiB
    requested = 10.01 GiB pinned (1.67x). `torch_pinned_bytes` gives that cost; `deepspeed_pinned_blocks` lists the
    host buffers DeepSpeed 0.19.8 pins when `pin_memory` is on.

The pool rule (`pool_gib_for`, `pool_decision`), shared by `parity plan`, the harness and benchmarks/gpu.py: a JAX
side whose pinned-host bytes per device (the memory model's peak host bytes, `jax_pinned_need_bytes`) times
POOL_HEADROOM exceed the pool gets XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB = that figure rounded up to a multiple of
POOL_STEP_GIB, unless the user set the variable (kept as set, both recorded). The pool must fit the host: a device's
pool at most the host memory per device (`pool_problem`), because a pool limit is what the allocator may pin, not what
the plan needs. So where the host memory per device is known and XLA's default pool is larger than it, parity sets
the pool to the rule's size too (`pool_decision`'s host_bytes): the pool then holds the need with its headroom and
cannot outgrow the host. Before, such a plan (1.4-21 GiB of pinned host on a 32 GiB host) was refused for the 64 GiB
default pool it would never have been given a reason to keep, while its own decision said the pool fitted.
Where the rule's 16 GiB step would pass the host, the pool is the whole GiB that holds need x POOL_HEADROOM.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Iterable, Mapping

from parity.errors import SpecError
from parity.inputs import ascii_number
from parity.numerics_flags import XLA_POOL_ENV  # XLA's pinned-host pool size per GPU, whole GiB: re-exported
from parity.sizing import memory
from parity.spec import RunSpec
from parity.weights import decays, param_shapes

__all__ = ["XLA_POOL_ENV", "XLA_POOL_DEFAULT_GIB", "POOL_HEADROOM", "POOL_STEP_GIB", "GiB", "xla_pool_setting",
           "pool_gib_for", "PoolDecision", "pool_decision", "jax_pinned_need_bytes", "jax_pool", "pool_problem",
           "host_bytes_per_device", "available_bytes", "HostMemory",
           "cgroup_memory", "mem_available", "host_memory", "next_pow2", "torch_pinned_bytes",
           "deepspeed_pinned_blocks", "PinnedCost", "deepspeed_pinned_cost"]

GiB = 2**30
XLA_POOL_DEFAULT_GIB = 64
"""The pool without the variable (openxla/xla gpu_helpers.cc)."""
XLA_POOL_MAX_GIB = (2**63 - 1) >> 30
"""The largest value XLA can hold: it multiplies the variable by 1 << 30 in an int64 (8,589,934,591 GiB)."""
POOL_HEADROOM = 1.05
"""The pool parity sets is at least 1.05x the predicted need: room for the BFC allocator's chunk rounding and
fragmentation and for host buffers the memory model does not list. An allowance, not measured."""
POOL_STEP_GIB = 16
"""The pool parity sets is a multiple of 16 GiB, so nearby sizes share one setting (a readable value, no more)."""

TPU_PREMAPPED_DEFAULT_BYTES = 4_294_967_296
"""A TPU runtime's premapped host region where TPU_PREMAPPED_BUFFER_SIZE is unset (the Cloud TPU performance guide,
"Memory management tuning"): a staging area pinned each time a process opens the chip, not where `pinned_host`
arrays live. On a v5e with a 1 GiB region, 14 GiB of pinned_host arrays grew the host's use by exactly their size
(benchmarks/results/2026-12-06-tpu-v5e-largest.md): a TPU has no pool like XLA's GPU one, its offloaded state is
host memory beside the region, and the region is host memory too."""
TPU_PROCESS_HOST_BYTES = 1_850_000_000
"""Host memory a JAX training process holds on a v5e beyond the memory model's state and the premapped region:
measured 1.82 GB at 103 layers of d_model 1600 (38.25 GiB peak use, less the model's 36.30 GiB of state and a 0.25
GiB region) and 1.81 GB at 98 layers (36.52, 34.59, 0.25), rounded up; the bare runtime is 1.13 GB of it."""
TPU_COMPILE_HOST_BYTES = 3_000_000_000
"""Host memory the train step's compile adds on a v5e: 2.9 GB (31.3 to 34.2 GB of the cgroup's use, sampled every
2 s) over four compiles of a 37-74 layer scan step, rounded up. Not held where a persistent compilation cache lets
the process load an executable compiled before."""


TPU_PREMAPPED_ENV = "TPU_PREMAPPED_BUFFER_SIZE"


def tpu_premapped_setting(environ: Mapping[str, str] = os.environ) -> int:
  """The premapped region's bytes a TPU process will pin: TPU_PREMAPPED_BUFFER_SIZE where set, else the runtime's
  default. Raises SpecError for a value that is not a whole number of bytes > 0 (the runtime would not take it)."""
  raw = environ.get(TPU_PREMAPPED_ENV, "").strip()
  if not raw:
    return TPU_PREMAPPED_DEFAULT_BYTES
  try:
    size = ascii_number(raw, sign=False)
  except ValueError:
    size = 0
  if size <= 0:
    raise SpecError(f"{TPU_PREMAPPED_ENV}={raw!r}: must be a whole number of bytes > 0 in ASCII digits (e.g. "
                    "268435456 for 256 MiB), or unset for the runtime's default (4 GiB)")
  return size


def tpu_process_overhead(premapped_bytes: int = TPU_PREMAPPED_DEFAULT_BYTES, compiles: bool = True) -> int:
  """Host bytes a JAX training process on a TPU holds besides its state: the premapped region, the process's own
  (TPU_PROCESS_HOST_BYTES) and, where it compiles its step, the compile's (TPU_COMPILE_HOST_BYTES)."""
  return premapped_bytes + TPU_PROCESS_HOST_BYTES + (TPU_COMPILE_HOST_BYTES if compiles else 0)


def xla_pool_setting(environ: Mapping[str, str] = os.environ) -> int | None:
  """The user's XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB in GiB, None when unset (or empty).

  Raises:
    SpecError: a value that is not a whole number >= 1 (XLA would log an error and fall back to 64 GiB), naming
      the variable and the value.
  """
  raw = environ.get(XLA_POOL_ENV)
  if raw is None or not raw.strip():
    return None
  text = raw.strip()
  # ASCII digits only (str.isdigit also takes '²' or '１６０', which int() refuses or XLA's strtoll does not read),
  # and at most (2^63 - 1) / 2^30 GiB: XLA multiplies the value by 1 << 30 in an int64
  try:
    gib = ascii_number(text, sign=False)
  except ValueError:
    gib = 0
  if not 1 <= gib <= XLA_POOL_MAX_GIB:
    raise SpecError(f"{XLA_POOL_ENV}={raw!r}: must be a whole number of GiB from 1 to {XLA_POOL_MAX_GIB} in ASCII "
                    f"digits (XLA reads it as an int64 and, failing that, logs an error and uses "
                    f"{XLA_POOL_DEFAULT_GIB}); set e.g. {XLA_POOL_ENV}=160, or unset it")
  return gib


def pool_gib_for(need_bytes: int) -> int:
  """The pool (GiB) the rule gives a need of `need_bytes` pinned bytes per device: the smallest multiple of
  POOL_STEP_GIB >= need * POOL_HEADROOM (0 for no need). 147.7 GiB -> 160."""
  if need_bytes <= 0:
    return 0
  return POOL_STEP_GIB * math.ceil(need_bytes * POOL_HEADROOM / (POOL_STEP_GIB * GiB))


@dataclasses.dataclass(frozen=True)
class PoolDecision:
  """The pinned-host pool one JAX worker runs with, per device.

  Attributes:
    need_bytes: pinned-host bytes per device the plan needs (`jax_pinned_need_bytes`).
    user_gib: the user's XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (None: unset); never overridden.
    parity_gib: what parity sets (None: nothing: the user set it, or the default pool holds the need with the
      headroom); the rule's value is `rule_gib` either way.
    rule_gib: `pool_gib_for(need_bytes)`.
    host_bytes: the host memory per device the pool must fit (None: not known, e.g. no GPU here to read it).
  """
  need_bytes: int
  user_gib: int | None
  parity_gib: int | None
  rule_gib: int
  default_gib: int = XLA_POOL_DEFAULT_GIB
  host_bytes: int | None = None

  @property
  def gib(self) -> int:
    """The pool the worker gets, GiB: the user's, else parity's, else XLA's default."""
    return self.user_gib if self.user_gib is not None else self.parity_gib or self.default_gib

  @property
  def pool_bytes(self) -> int:
    return self.gib * GiB

  @property
  def set_by(self) -> str:
    """'user', 'parity' or 'default' (XLA's 64 GiB: the variable is not set)."""
    return "user" if self.user_gib is not None else "parity" if self.parity_gib else "default"

  @property
  def fits(self) -> bool:
    """The pool works: it holds the need, and (host_bytes known) it fits the host memory per device; the same
    test as `pool_problem`, so a plan's row and its refusal never disagree."""
    return pool_problem(self, self.host_bytes) is None

  def env(self) -> dict[str, str]:
    """The variable parity puts into the JAX worker's environment ({} when it sets nothing)."""
    return {XLA_POOL_ENV: str(self.parity_gib)} if self.parity_gib else {}

  def statement(self) -> str:
    """One sentence: the need, the pool, and the setting (e.g. 'jax needs 75.3 GiB pinned host per device > XLA's
    64 GiB default pool: the JAX worker gets XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=80')."""
    need = f"jax needs {self.need_bytes / GiB:.1f} GiB pinned host per device"
    if self.set_by == "user":
      rel = "<=" if self.fits else ">"
      tail = "" if self.fits else f"; the rule would set {self.rule_gib}: raise it or unset it"
      return f"{need} {rel} the {self.gib} GiB pool {XLA_POOL_ENV}={self.gib} sets (the user's value, kept){tail}"
    if self.set_by == "parity" and self.host_bytes is not None and self.default_gib * GiB > self.host_bytes \
        and self.gib < self.default_gib:
      return (f"{need}; XLA's {self.default_gib} GiB default pool > {self.host_bytes / GiB:.1f} GiB host memory per "
              f"device, so the JAX worker gets {XLA_POOL_ENV}={self.gib} (the need x {POOL_HEADROOM:g}, within the "
              "host)")
    if self.set_by == "parity":
      return f"{need} > XLA's {self.default_gib} GiB default pool: the JAX worker gets {XLA_POOL_ENV}={self.gib}"
    return (f"{need} <= XLA's {self.default_gib} GiB default pool (with the {POOL_HEADROOM:g}x headroom): "
            f"{XLA_POOL_ENV} is not set")

  def to_json(self) -> dict[str, object]:
    return {"variable": XLA_POOL_ENV, "need_bytes": self.need_bytes, "default_gib": self.default_gib,
            "user_gib": self.user_gib, "parity_gib": self.parity_gib, "rule_gib": self.rule_gib, "gib": self.gib,
            "set_by": self.set_by, "fits": self.fits, "host_bytes": self.host_bytes, "statement": self.statement()}


def pool_decision(need_bytes: int, user_gib: int | None, host_bytes: int | None = None) -> PoolDecision:
  """The pool of a JAX worker needing `need_bytes` pinned bytes per device, the user's setting `user_gib` (GiB,
  None: unset; `xla_pool_setting`) and the host memory per device `host_bytes` (None: unknown): when the user set
  nothing and the plan pins something, parity sets the rule's pool (`pool_gib_for`) where XLA's default is too small
  for the need or too large for the host; where the rule's 16 GiB step would pass the host, the smallest whole GiB
  holding need x POOL_HEADROOM (when that fits)."""
  rule = pool_gib_for(need_bytes)
  parity = None
  too_big = host_bytes is not None and XLA_POOL_DEFAULT_GIB * GiB > host_bytes
  if user_gib is None and need_bytes > 0 and (rule > XLA_POOL_DEFAULT_GIB or too_big):
    parity = rule
    whole = math.ceil(need_bytes * POOL_HEADROOM / GiB)
    if host_bytes is not None and rule * GiB > host_bytes and whole * GiB <= host_bytes:
      parity = whole
  return PoolDecision(need_bytes=int(need_bytes), user_gib=user_gib, parity_gib=parity, rule_gib=rule,
                      host_bytes=None if host_bytes is None else int(host_bytes))


def jax_pinned_need_bytes(run: RunSpec) -> int:
  """Pinned-host bytes per device of the run's JAX side: the memory model's peak host bytes (offloaded params and
  optimizer state, the streamed update's new layer stacks, activations an offload remat policy keeps on the host:
  parity.sizing.memory.peak_host_bytes), when jax.host_memory_kind is 'pinned_host'; 0 for 'unpinned_host' (not
  served by this pool in the source read; not measured)."""
  if run.jax.host_memory_kind != "pinned_host":
    return 0
  return memory.peak_host_bytes(memory.estimate(run, sides=("jax",)), "jax")


def jax_pool(run: RunSpec, environ: Mapping[str, str] = os.environ, host_bytes: int | None = None) -> PoolDecision:
  """The pool rule for one run's JAX side, the one function every caller uses (`parity plan` through the planner's
  pieces, harness.env for the JAX worker, the resource check, benchmarks/gpu.py for its probes): `pool_decision` of
  the run's `jax_pinned_need_bytes`, the user's `xla_pool_setting(environ)` and the host memory per device
  `host_bytes` (None: unknown). Raises SpecError for a bad variable value."""
  return pool_decision(jax_pinned_need_bytes(run), xla_pool_setting(environ), host_bytes)


def host_bytes_per_device(run: RunSpec) -> int | None:
  """This machine's host memory for each of the run's JAX devices (`available_bytes` over jax.data_parallel), what
  the resource check and the JAX worker's environment hold the pool to; None where it cannot be read."""
  avail = available_bytes()
  return None if avail is None else avail // max(1, run.jax.data_parallel)


def pool_problem(decision: PoolDecision, host_bytes_per_device: int | None) -> str | None:
  """Why a JAX plan's pool does not work on a host with `host_bytes_per_device` (None when it does): the user's pool
  is smaller than the need, or the pool the worker gets (default pools only when needed) exceeds the host memory
  per device (each device's pool can grow to its limit)."""
  if decision.need_bytes > decision.pool_bytes:
    return (f"jax needs {decision.need_bytes / GiB:.1f} GiB pinned host per device > the {decision.gib} GiB pool "
            f"{XLA_POOL_ENV}={decision.gib} sets (the user's value is kept: raise it to {decision.rule_gib} or unset "
            "it)")
  if decision.need_bytes and host_bytes_per_device is not None and decision.pool_bytes > host_bytes_per_device:
    return (f"jax's pinned-host pool of {decision.gib} GiB per device ({XLA_POOL_ENV}={decision.gib}, "
            f"{decision.set_by}, for {decision.need_bytes / GiB:.1f} GiB pinned host) > "
            f"{host_bytes_per_device / GiB:.1f} GiB host memory per device: the pool can grow to its limit")
  return None


# ----------------------------------------------------------------------------- cgroup and MemAvailable

_V1_UNLIMITED = 2**60
"""cgroup v1 writes 'no limit' as PAGE_COUNTER_MAX pages (9223372036854771712 with 4 KiB pages): anything this large
is no limit."""


def _read(path: Path) -> str | None:
  try:
    return path.read_text().strip()
  except OSError:
    return None


def _int(text: str | None) -> int | None:
  return int(text) if text is not None and re.fullmatch(r"[0-9]+", text) else None


def _inactive_file(stat: str | None, key: str) -> int:
  for line in (stat or "").splitlines():
    parts = line.split()
    if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
      return int(parts[1])
  return 0


def _v2(root: Path, cgroup: str) -> dict[str, object] | None:
  """cgroup v2: the tightest memory.max from the process's cgroup up to `root`; usage from its memory.current."""
  leaf = root / cgroup.lstrip("/")
  if not leaf.is_dir():
    leaf = root
  limit, d, where = None, leaf, None
  while True:
    v = _int(_read(d / "memory.max"))  # 'max': no limit
    if v is not None and (limit is None or v < limit):
      limit, where = v, d
    if d == root or root not in d.parents:
      break
    d = d.parent
  if limit is None and not (leaf / "memory.current").exists():
    return None
  usage = _int(_read(leaf / "memory.current"))
  return {"version": 2, "path": str(where or leaf), "limit_bytes": limit, "usage_bytes": usage,
          "inactive_file_bytes": _inactive_file(_read(leaf / "memory.stat"), "inactive_file")}


def _v1(root: Path, cgroup: str) -> dict[str, object] | None:
  """cgroup v1: memory.limit_in_bytes of the process's memory cgroup (or the mount root, inside a container)."""
  base = root / "memory"
  for d in (base / cgroup.lstrip("/"), base):
    raw = _int(_read(d / "memory.limit_in_bytes"))
    if raw is None:
      continue
    limit = None if raw >= _V1_UNLIMITED else raw
    return {"version": 1, "path": str(d), "limit_bytes": limit, "usage_bytes": _int(_read(d / "memory.usage_in_bytes")),
            "inactive_file_bytes": _inactive_file(_read(d / "memory.stat"), "total_inactive_file")}
  return None


def cgroup_memory(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> dict[str, object] | None:
  """This process's cgroup memory limit: {'version' (1 | 2), 'path', 'limit_bytes' (None: no limit), 'usage_bytes',
  'inactive_file_bytes'}; None where no memory controller can be read (not Linux, no cgroup mount)."""
  lines = (_read(Path(self_cgroup)) or "").splitlines()
  v2 = next((ln.split("::", 1)[1] for ln in lines if ln.startswith("0::")), None)
  v1 = next((ln.split(":", 2)[2] for ln in lines if len(ln.split(":", 2)) == 3
             and "memory" in ln.split(":", 2)[1].split(",")), None)
  base = Path(root)
  if v1 is not None:
    found = _v1(base, v1)
    if found is not None:
      return found
  return _v2(base, v2) if v2 is not None else None


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
  """MemAvailable of /proc/meminfo in bytes (the kernel's estimate of what can be allocated without swapping),
  None where it cannot be read."""
  for line in (_read(Path(meminfo)) or "").splitlines():
    parts = line.split()
    if len(parts) >= 2 and parts[0] == "MemAvailable:" and parts[1].isdigit():
      return int(parts[1]) * 1024
  return None


@dataclasses.dataclass(frozen=True)
class HostMemory:
  """What host memory a run may use here. mem_available_bytes: MemAvailable (None: unknown); cgroup: see
  `cgroup_memory` (None: none readable)."""
  mem_available_bytes: int | None
  cgroup: dict[str, object] | None

  @property
  def cgroup_headroom_bytes(self) -> int | None:
    """The cgroup limit less its working set (usage less inactive file pages: reclaimable page cache); None: no
    limit."""
    cg = self.cgroup or {}
    limit = cg.get("limit_bytes")
    if limit is None:
      return None
    used = max(0, int(cg.get("usage_bytes") or 0) - int(cg.get("inactive_file_bytes") or 0))
    return max(0, int(limit) - used)

  @property
  def available_bytes(self) -> int | None:
    """The smaller of MemAvailable and the cgroup headroom (None when neither is known)."""
    known = [v for v in (self.mem_available_bytes, self.cgroup_headroom_bytes) if v is not None]
    return min(known) if known else None

  def to_json(self) -> dict[str, object]:
    return {"mem_available_bytes": self.mem_available_bytes, "cgroup": self.cgroup,
            "cgroup_headroom_bytes": self.cgroup_headroom_bytes, "available_bytes": self.available_bytes}


def host_memory(root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup",
                meminfo: str = "/proc/meminfo") -> HostMemory:
  """MemAvailable and the cgroup memory limit of this process (paths injectable for tests)."""
  return HostMemory(mem_available(meminfo), cgroup_memory(root, self_cgroup))


def available_bytes() -> int | None:
  """Host memory a run may use here: the smaller of /proc/meminfo MemAvailable and this process's cgroup memory limit
  less its working set (`host_memory`); where neither can be read, physical memory (sysconf), else None."""
  avail = host_memory().available_bytes
  if avail is not None:
    return avail
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


# ----------------------------------------------------------------------------- torch's pinned rounding

def next_pow2(n: int) -> int:
  """The smallest power of two >= n (c10::llvm::PowerOf2Ceil; 0 -> 0)."""
  return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def torch_pinned_bytes(sizes: Iterable[int], round_threshold: int | None = None) -> int:
  """Bytes torch's CachingHostAllocator pins for host buffers of `sizes` bytes, each allocated on its own
  (`tensor.pin_memory()`, `torch.empty(..., pin_memory=True)`): each rounded up to a power of two, unless above
  `round_threshold` (the allocator's pinned_max_round_threshold; None: its default, no threshold). Reuse of a freed
  block is not modelled: every buffer is live at once."""
  return sum(s if round_threshold is not None and s > round_threshold else next_pow2(s) for s in sizes)


def _groups(run: RunSpec) -> list[int]:
  """Parameter counts of the DeepSpeed side's optimizer groups (torch_impl.semantics.decay_groups_of under
  train.decay_mask: decayed, then the rest; empty groups dropped)."""
  shapes = param_shapes(run.model)
  dec = sum(math.prod(s) for n, s in shapes.items() if decays(n, run.train.decay_mask))
  rest = sum(math.prod(s) for n, s in shapes.items() if not decays(n, run.train.decay_mask))
  return [g for g in (dec, rest) if g]


def deepspeed_pinned_blocks(run: RunSpec, ranks: int = 1) -> list[tuple[str, int]]:
  """(buffer, bytes) of every host buffer DeepSpeed 0.19.8 pins per rank when its offload `pin_memory` is on, each
  allocated on its own (e = 2 bytes under bf16/fp16, else 4; partitions over `ranks`):

  stages 1-2, offload_optimizer (stage_1_and_2.py): per param group the fp32 master partition, the compute-dtype
  staging buffer of the updated params and the fp32 gradient partition; one buffer of the largest param's gradient;
  with gradient accumulation one buffer per parameter (its whole numel; approximated as 1/ranks of the params when
  ranks > 1). Stage 3 (stage3.py): with offload_optimizer the flat fp32 gradient partition; with offload_param
  the compute-dtype param partition of each group. Adam's moments (CPU Adam's zeros_like) and stage 3's fp32 master
  (a clone) are not pinned. Stage 3's per-sub-group gradient buffers are not in the memory model and not listed.
  """
  p, t = run.deepspeed, run.train
  e = 4 if t.precision == "fp32" else 2
  part = lambda n: math.ceil(n / ranks)
  groups, out = _groups(run), []
  if p.zero_stage in (1, 2) and p.offload_optimizer == "cpu":
    for i, g in enumerate(groups):
      out += [(f"group {i} fp32 master partition", 4 * part(g)), (f"group {i} updated-param staging", e * part(g)),
              (f"group {i} fp32 gradient partition", 4 * part(g))]
    out.append(("largest param's gradient staging", e * memory.largest_param(run.model)))
    if t.grad_accum_steps > 1:
      sizes = [math.prod(s) for s in param_shapes(run.model).values()]
      keep = sizes if ranks <= 1 else sizes[: max(1, len(sizes) // ranks)]
      out += [(f"accumulation buffer {k}", e * n) for k, n in enumerate(keep)]
  elif p.zero_stage == 3:
    if p.offload_optimizer == "cpu":
      out.append(("fp32 gradient partition", 4 * part(sum(groups))))
    if p.offload_param == "cpu":
      out += [(f"group {i} param partition", e * part(g)) for i, g in enumerate(groups)]
  return out


@dataclasses.dataclass(frozen=True)
class PinnedCost:
  """Host buffers one side pins: requested_bytes (what they hold) and pinned_bytes (what torch pins for them)."""
  requested_bytes: int
  pinned_bytes: int

  @property
  def extra_bytes(self) -> int:
    return self.pinned_bytes - self.requested_bytes

  @property
  def ratio(self) -> float:
    return self.pinned_bytes / self.requested_bytes if self.requested_bytes else 1.0


def deepspeed_pinned_cost(run: RunSpec, ranks: int = 1) -> PinnedCost:
  """The pinned cost of `deepspeed_pinned_blocks` per rank (`torch_pinned_bytes`)."""
  sizes = [b for _, b in deepspeed_pinned_blocks(run, ranks)]
  return PinnedCost(sum(sizes), torch_pinned_bytes(sizes))
