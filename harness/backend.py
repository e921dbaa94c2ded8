"""The CPU-fallback check: on a machine with CUDA, refuse a run whose JAX or torch side would run on the CPU.

JAX without its CUDA plugin, or a CPU-only torch build, runs on the CPU without a word, so a GPU node's
comparison would quietly measure the wrong thing. `check_backends` runs before any side starts (from
parity.pipeline.compare): where no NVIDIA driver is visible (`cuda_present`: a few stat calls, no process) it
returns at once; otherwise it asks each framework the run needs (`probe_devices`: the doctor probes, devices
only, in their own processes) and, unless `allow_cpu`, refuses a side that would run on the CPU with the package
to install (`CpuFallbackError`, a bad-input error: exit 2). Imports neither jax nor torch.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping, Sequence

from harness import doctor
from parity import environment
from parity.installed import pip_install
from parity.sides import side_record
from parity.spec import SpecError

__all__ = ["ALLOW_CPU_ENV", "CpuFallbackError", "cuda_present", "frameworks_for", "probe_devices",
           "cpu_fallbacks", "check_backends"]

ALLOW_CPU_ENV = "PARITY_ALLOW_CPU"
"""PARITY_ALLOW_CPU=1 does what --allow-cpu does (for scripts and test runs on a GPU node)."""
GPU_BACKENDS = ("gpu", "cuda", "rocm")
"""jax.default_backend() names of a GPU backend (CUDA plugins report 'gpu')."""


class CpuFallbackError(SpecError):
  """CUDA is present but a side would run on the CPU; the message names the package to install (exit 2)."""


def cuda_present() -> str | None:
  """Evidence that this machine has an NVIDIA GPU ('/dev/nvidia0 exists', 'nvidia-smi lists 1 GPU'), or None.

  Device files first (parity.environment.cuda_evidence: stat calls only); `nvidia-smi -L` runs only when none
  exists and the program is on PATH, so a machine without a driver starts no process.
  """
  found = environment.cuda_evidence()
  if found or shutil.which("nvidia-smi") is None:
    return found
  try:
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  gpus = [ln for ln in done.stdout.splitlines() if ln.startswith("GPU ")]
  return f"nvidia-smi lists {len(gpus)} GPU(s)" if done.returncode == 0 and gpus else None


def frameworks_for(sides: Sequence[str]) -> tuple[str, ...]:
  """The frameworks (keys of harness.doctor.PROBES) the training workers of `sides` import: each side record's
  `framework` (parity.sides), in the sides' order, each once."""
  return tuple(dict.fromkeys(side_record(side).framework for side in sides))


def probe_devices(frameworks: Sequence[str]) -> dict[str, dict[str, object]]:
  """{framework: what it sees} from the doctor probes, devices only (seconds per framework: its import)."""
  return doctor.probe_frameworks(tuple(frameworks), devices_only=True)


def _jax_problem(p: Mapping[str, object], versions: Mapping[str, str | None]) -> str | None:
  if p.get("installed") is False:  # not installed: parity.installed refuses or leaves out its sides first
    return None
  if "error" in p:
    return f"the jax probe failed ({p['error']}); `parity doctor` shows more"
  if p.get("backend") in GPU_BACKENDS:
    return None
  jv = p.get("jax", "?")
  cuda = (p.get("platforms") or {}).get("cuda", "not tried")
  plugins = [f"{n} {v}" for n, v in versions.items() if n.startswith("jax-cuda") and v]
  if plugins:
    return (f"the jax side would run on the CPU: jax {jv} has {', '.join(plugins)} installed but its CUDA backend "
            f"does not start ({cuda}); the plugin must match jax {jv} exactly and the driver (nvidia-smi) the "
            f"plugin's CUDA: reinstall with `pip install \"jax[cuda13]=={jv}\"` (cuda12 for a CUDA 12 driver)")
  return (f"the jax side would run on the CPU: jax {jv} has no CUDA plugin ({cuda}); install it: "
          f"{pip_install('cuda', constrained=False)} (or `pip install \"jax[cuda13]=={jv}\"`; cuda12 for a CUDA 12 "
          "driver)")


def _torch_problem(p: Mapping[str, object]) -> str | None:
  if p.get("installed") is False:
    return None
  if "error" in p:
    return f"the torch probe failed ({p['error']}); `parity doctor` shows more"
  if p.get("cuda_available"):
    return None
  tv = p.get("torch", "?")
  if p.get("built_for_cuda") is None:
    return (f"the deepspeed/torch sides would run on the CPU: torch {tv} is a CPU-only build; install a CUDA "
            "build of torch for this node's CUDA, e.g. `pip install torch --index-url "
            "https://download.pytorch.org/whl/cu130` (cu126/cu128 for older drivers)")
  return (f"the deepspeed/torch sides would run on the CPU: torch {tv} (built for CUDA {p['built_for_cuda']}) "
          f"sees no GPU (CUDA_VISIBLE_DEVICES={p.get('CUDA_VISIBLE_DEVICES')!s}); check the driver with "
          "nvidia-smi: it must support that CUDA version")


def cpu_fallbacks(probes: Mapping[str, Mapping[str, object]],
                  versions: Mapping[str, str | None] | None = None) -> list[str]:
  """One sentence per framework in `probes` that would run on the CPU (or could not be probed), naming what to
  install; [] when every one sees a GPU. `versions`: installed distributions (default: read now)."""
  versions = environment.package_versions() if versions is None else versions
  out = []
  if "jax" in probes:
    out.append(_jax_problem(probes["jax"], versions))
  if "torch" in probes:
    out.append(_torch_problem(probes["torch"]))
  return [x for x in out if x]


def check_backends(sides: Sequence[str], allow_cpu: bool = False) -> dict[str, object] | None:
  """Refuses, before any side starts, a run on a CUDA machine whose sides would run on the CPU.

  Args:
    sides: the run's sides (their frameworks are probed).
    allow_cpu: run anyway (--allow-cpu, or PARITY_ALLOW_CPU=1 in the environment); the fallback is returned.
  Returns:
    None where no NVIDIA driver is visible (nothing probed); else {'cuda_driver': evidence, 'frameworks':
    {framework: probe JSON}, 'cpu_fallback': [sentences], 'allowed_cpu': bool}, for the environment block.
  Raises:
    CpuFallbackError: a side would run on the CPU and neither allow_cpu nor PARITY_ALLOW_CPU=1 is set; the
      message names each framework, the package to install, and --allow-cpu.
  """
  evidence = cuda_present()
  if evidence is None:
    return None
  probes = probe_devices(frameworks_for(sides))
  problems = cpu_fallbacks(probes)
  allowed = allow_cpu or os.environ.get(ALLOW_CPU_ENV, "") not in ("", "0")
  if problems and not allowed:
    raise CpuFallbackError(f"CUDA is present ({evidence}) but " + "; and ".join(problems) +
                           ". --allow-cpu (or PARITY_ALLOW_CPU=1) runs anyway on the CPU")
  return {"cuda_driver": evidence, "frameworks": probes, "cpu_fallback": problems, "allowed_cpu": bool(allowed)}
