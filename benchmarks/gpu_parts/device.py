"""The accelerator the benchmark runs on, named, and what may run there (imports neither jax nor torch).

  * GPU: `nvidia-smi` (name and memory.total of the first GPU), as before.
  * TPU: only where the machine looks like a TPU VM without starting anything (`tpu_evidence`: /dev/accel*,
    /dev/vfio/<n>, libtpu installed, or the TPU_* variables a TPU VM sets). Then one short process
    (`benchmarks.gpu_parts.jax_device`: jax_impl.doctor's probe, plus libtpu's version) reads the chip: its
    device_kind, count, memory_stats bytes_limit, memory kinds. The driver never opens the chip itself: one process at
    a time may hold it, and the parts need it.
  * CPU otherwise.
`device_from_jax_probe` turns that probe's JSON (the `frameworks.jax` block `parity doctor --json` records, the same
format) into the device record the suite sizes from. `not_run_reasons` says which torch, DeepSpeed and FSDP2 parts
cannot run here and why (no CUDA device, sockets refused: parity.sockets), so they are recorded as not run instead of
timing out.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

from parity import sockets

TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_WORKER_ID", "TPU_SKIP_MDS_QUERY", "TPU_CHIPS_PER_HOST_BOUNDS")
"""Variables a Cloud TPU VM's image sets; any of them counts as evidence of a TPU (none starts the runtime)."""
ENV_PREFIXES = ("XLA_", "LIBTPU", "TPU_", "JAX_", "TF_CPP_")
"""The environment the header records: XLA and libtpu flags, the TPU runtime's settings, JAX's configuration."""
ENV_KEYS = ("PYTHONUNBUFFERED", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "OMP_NUM_THREADS")


def gpu_info() -> dict[str, Any]:
  """nvidia-smi's text and the first GPU's name and memory ({'nvidia_smi': ''} where there is none)."""
  out: dict[str, Any] = {"nvidia_smi": ""}
  try:
    out["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    if q:
      name, mib = (s.strip() for s in q[0].rsplit(",", 1))
      out.update(kind="gpu", name=name, count=len(q), memory_total_bytes=int(float(mib)) * 2**20,
                 memory_source="nvidia-smi memory.total")
  except (OSError, subprocess.SubprocessError, ValueError):
    pass
  return out


def tpu_evidence(environ: Mapping[str, str] = os.environ) -> str | None:
  """Why this machine looks like a TPU VM, or None; nothing is started (harness.doctor.tpu_evidence, plus the
  image's TPU_* variables)."""
  from harness.doctor import tpu_evidence as files
  why = files()
  if why:
    return why
  named = [k for k in TPU_ENV if environ.get(k)]
  return f"{named[0]} set" if named else None


def package_version(*names: str) -> str | None:
  """The installed version of the first of `names` that is installed (None: none is)."""
  for name in names:
    try:
      return md.version(name)
    except md.PackageNotFoundError:
      continue
  return None


def device_from_jax_probe(probe: Mapping[str, Any]) -> dict[str, Any]:
  """The device record from the jax probe's JSON (jax_impl.doctor.probe's fields; `benchmarks.gpu_parts.jax_device`
  adds 'libtpu'): kind 'tpu' (or the backend JAX opened: 'cpu' when the TPU runtime did not start), the chip's name
  (device_kind), count, device memory (memory_stats bytes_limit), memory kinds and versions."""
  acc = probe.get("accelerator") or {}
  kinds = (probe.get("memory_kinds") or {}).get("addressable") or []
  backend = probe.get("backend")
  limit = acc.get("bytes_limit")
  return {"kind": backend if backend in ("tpu", "gpu") else "cpu",
          "name": acc.get("kind") if backend in ("tpu", "gpu") else None,
          "count": acc.get("count"), "memory_total_bytes": int(limit) if isinstance(limit, (int, float)) else None,
          "memory_source": "memory_stats bytes_limit" if limit else None, "memory_kinds": list(kinds),
          "versions": {"jax": probe.get("jax"), "jaxlib": probe.get("jaxlib"), "libtpu": probe.get("libtpu")},
          "runtime_settings": acc.get("settings") or {}}


def host_facts(host_gib: float | None = None) -> dict[str, Any]:
  """Host memory (MemTotal; available: --host-gib, else parity's reading, the smaller of MemAvailable and this
  process's cgroup limit less its working set) and CPU cores (all, and those this process may use). MemAvailable
  alone is the VM's: a sandbox's cgroup may allow less (a TPU VM's 45 GiB under a 40 GiB cgroup killed a probe
  sized by MemAvailable)."""
  from benchmarks.gpu_parts.common import host_memory_bytes
  from parity.sizing import host_limits
  mem = host_memory_bytes()
  reading = host_limits.host_memory()
  try:
    usable = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    usable = os.cpu_count()
  return {"host_total_bytes": mem.get("MemTotal"),
          "host_available_bytes": int(host_gib * 2**30) if host_gib else (reading.available_bytes or 0),
          "host_memory": reading.to_json(),
          "cpu_count": os.cpu_count(), "cpu_usable": usable}


def recorded_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
  """The variables the header records (ENV_PREFIXES, ENV_KEYS) that are set, sorted by name."""
  return {k: environ[k] for k in sorted(environ) if environ[k] and (k.startswith(ENV_PREFIXES) or k in ENV_KEYS)}


def not_run_reasons(device: Mapping[str, Any], tiny: bool, socket_error: str | None) -> dict[str, str]:
  """Parts that cannot run here -> why: 'torch' (torch_raw) without a CUDA GPU outside the tiny CPU check (torch's
  figures would be the host CPU's: on a TPU VM a CPU build); 'deepspeed' (ds_train, the op build) and 'fsdp'
  (fsdp_train) when sockets are refused (each builds a torch.distributed group, even with one rank: parity.sockets)
  or, outside the tiny check, without a CUDA GPU. `socket_error`: parity.sockets.loopback_refusal()."""
  out = {}
  if not tiny and device.get("kind") != "gpu":
    torch = package_version("torch")
    build = f"torch {torch}" + (": a CPU build" if torch and "+cpu" in torch else "") if torch else "torch absent"
    out["torch"] = f"not run: torch has no device here ({build}; no CUDA GPU), its figures would be the host CPU's"
    for family, label in (("deepspeed", "DeepSpeed"), ("fsdp", "FSDP2")):
      out[family] = (f"not run: no CUDA GPU here, so {label} would train on the host CPU; the JAX side runs on the "
                     f"{device.get('name') or 'CPU'}")
  if socket_error:
    for family in ("deepspeed", "fsdp"):
      out[family] = sockets.not_run_line(family, socket_error)
  return out


def writable_dir(path: str | None) -> bool:
  """Whether `path` is (or can be made) a folder this process may write into."""
  if not path:
    return False
  try:
    Path(path).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path):
      pass
    return True
  except OSError:
    return False


def extensions_dir(environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
  """(TORCH_EXTENSIONS_DIR for DeepSpeed's op build, a note or None): the one set when writable, else the
  environment's own folder (parity.buildenv.extensions_dir) when writable, else ${TMPDIR:-/tmp}/parity-torch-
  extensions (a TPU VM's interpreter prefix is read-only, where the build failed)."""
  from parity.buildenv import extensions_dir as env_default
  given = environ.get("TORCH_EXTENSIONS_DIR")
  if given and writable_dir(given):
    return given, None
  for path in (env_default(), os.path.join(environ.get("TMPDIR") or tempfile.gettempdir(),
                                           "parity-torch-extensions")):
    if path != given and writable_dir(path):
      why = f"TORCH_EXTENSIONS_DIR={given} is not writable" if given else "TORCH_EXTENSIONS_DIR unset"
      return path, f"{why}: DeepSpeed's op build uses {path}"
  return given or env_default(), "no writable folder for DeepSpeed's op build was found"
