"""The environment block: what `parity doctor` prints and what every run records as <run>/environment.json.

`environment_block` merges three sources: `parity.environment` (host, OS, Python, CPU/NUMA, package versions,
git revision: read in this process, nothing imported or started), two short processes run here (`git status` for
the dirty flag, `nvidia-smi` for the GPUs and their topology, each only where the program exists), and the
framework probes (`python -m jax_impl.doctor`, `python -m torch_impl.doctor`, through `harness.launch.run_module`,
one after another so a bandwidth figure is not measured against the other probe, each with its own timeout),
whose JSON is merged under `frameworks`, and the thread settings every worker gets (`worker_threads`,
harness.env.thread_environ). A probe that fails, times out or prints no JSON is recorded as
{'error': ...}: the block is always written. Imports neither jax nor torch.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Mapping

from harness import launch
from harness.env import jax_pool_choice, pool_host_bytes, side_spec, thread_environ
from parity import environment as env
from parity import installed, sockets
from parity.errors import SpecError
from parity.numerics_flags import numerics_flags
from parity.sides import side_record
from parity.sizing import host_limits
from parity.spec import to_dict

__all__ = ["SCHEMA", "PROBE_TIMEOUT_S", "BUILD_TIMEOUT_S", "PROBES", "run_probe",
           "probe_frameworks", "git_state", "gpu_info", "environment_block", "run_environment", "host_limits_block"]

SCHEMA = "parity.environment/1"
PROBE_TIMEOUT_S = 180.0
"""Per probe process. Measured here: the jax probe 7-8 s, the torch probe 8-9 s, with a load of 8 on 2 cores
(importing the framework is most of it); a CUDA plugin's first initialization can add tens of seconds."""
BUILD_TIMEOUT_S = 1800.0
"""The torch probe with --build: the CPU Adam op took up to 177 s on a busy 2-core machine (torch_impl/ops.py)."""
PROBES = {"jax": "jax_impl.doctor", "torch": "torch_impl.doctor"}
"""framework -> the probe module (`python -m MODULE` prints one JSON object)."""
_TOOL_TIMEOUT_S = 20.0  # git status / nvidia-smi: well under a second when healthy; a hung driver must not hang us


def run_probe(module: str, args: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, object]:
  """Runs one probe module and returns its JSON object, or {'error': why, 'stderr_tail': ...} when it failed,
  timed out or printed no JSON (the last stdout line that parses as a JSON object is taken)."""
  try:
    done = launch.run_module(module, args, timeout_s=timeout_s)
  except launch.LaunchTimeout as exc:
    return {"error": f"{module} did not finish within {timeout_s:g} s", "stderr_tail": exc.stderr_tail[-1500:]}
  except OSError as exc:
    return {"error": f"{module} could not start: {exc}"}
  for line in reversed(done.stdout.strip().splitlines()):
    try:
      obj = json.loads(line)
    except ValueError:
      continue
    if isinstance(obj, dict):
      obj.setdefault("wall_s", round(done.wall_s, 2))
      return obj
  return {"error": f"{module} exited {done.returncode} without a JSON line", "stderr_tail": done.stderr[-1500:]}


def probe_frameworks(frameworks: tuple[str, ...] = ("jax", "torch"), *, bandwidth: bool = False,
                     build: bool = False, devices_only: bool = False,
                     timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, dict[str, object]]:
  """{framework: its probe's JSON} for each of `frameworks` (keys of PROBES), run one after another.

  Args:
    bandwidth: time the copies (jax: device <-> pinned_host; torch: pinned/pageable <-> CUDA device).
    build: let the torch probe build DeepSpeed's CPU Adam op when it is missing (timeout BUILD_TIMEOUT_S).
    devices_only: versions and devices only (the CPU-fallback check): no op check, no bandwidth.
  A framework that is not installed here is not probed: its entry is parity.installed.framework_record's
  ({'installed': False, 'missing', 'install', 'sides'}), not an error.
  """
  out = {}
  for fw in frameworks:
    missing = installed.framework_record(fw)  # not installed (a JAX-only install): no probe, said so
    if missing is not None:
      out[fw] = missing
      continue
    args = ["--devices-only"] if devices_only and fw == "torch" else []
    if bandwidth and not devices_only:
      args.append("--bandwidth")
    if build and fw == "torch" and not devices_only:
      args.append("--build")
    out[fw] = run_probe(PROBES[fw], args, max(timeout_s, BUILD_TIMEOUT_S) if "--build" in args else timeout_s)
  return out


def _tool(cmd: list[str], cwd: str | None = None) -> tuple[int, str] | None:
  """(exit code, stdout) of a short command, or None when it is not installed or did not finish."""
  if shutil.which(cmd[0]) is None:
    return None
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, cwd=cwd)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return done.returncode, done.stdout


def git_state(root: str | Path = launch.ROOT) -> dict[str, object] | None:
  """The repository's revision ({'commit', 'branch'}, parity.environment.git_revision) plus 'dirty': True when a
  tracked file differs from the commit (`git status --porcelain --untracked-files=no`), None when git could not
  tell; None for the whole when `root` is not a checkout (an installed copy)."""
  rev = env.git_revision(root)
  if rev is None:
    return None
  res = _tool(["git", "status", "--porcelain", "--untracked-files=no"], cwd=str(root))
  changed = [ln for ln in res[1].splitlines() if ln.strip()] if res and res[0] == 0 else None
  return {**rev, "dirty": None if changed is None else bool(changed),
          "changed_files": None if changed is None else len(changed)}


def gpu_info(topology: bool = False) -> dict[str, object] | None:
  """NVIDIA GPUs as `nvidia-smi` lists them (index, name, driver, memory, PCIe link) and, with `topology`, the
  text of `nvidia-smi topo -m` (GPU/NIC links and CPU/NUMA affinity); None where nvidia-smi is not installed."""
  q = _tool(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,pcie.link.gen.current,"
             "pcie.link.width.current", "--format=csv,noheader"])
  if q is None:
    return None
  out: dict[str, object] = {"nvidia_smi_exit": q[0], "gpus": [ln.strip() for ln in q[1].splitlines() if ln.strip()],
                            "fields": "index, name, driver_version, memory.total, pcie gen, pcie width"}
  if topology:
    t = _tool(["nvidia-smi", "topo", "-m"])
    out["topology"] = t[1] if t and t[0] == 0 else "nvidia-smi topo -m failed"
  return out


def tpu_evidence() -> str | None:
  """Why this machine looks like a TPU VM ('/dev/accel0 present', 'libtpu installed'), or None. Read without
  starting the TPU runtime: opening the chip takes ~15 s and one process at a time may hold it."""
  accel = sorted(glob.glob("/dev/accel*")) + sorted(glob.glob("/dev/vfio/[0-9]*"))
  if accel:
    return f"{accel[0]} present"
  try:
    found = importlib.util.find_spec("libtpu") is not None
  except (ImportError, ValueError):
    found = False
  return "libtpu installed" if found else None


def _inferred_frameworks() -> dict[str, dict[str, object]]:
  """Quick mode on a machine with no NVIDIA driver: no CUDA backend can run, so torch runs on the CPU, and so does
  JAX unless the machine looks like a TPU VM (`tpu_evidence`), where its backend is left unnamed rather than guessed:
  the JAX side's summary.json names the device it ran on. Said as inferred (no process was started); `parity doctor`
  probes for real."""
  why = "inferred, not probed: no NVIDIA driver on this machine (parity doctor probes the frameworks)"
  tpu = tpu_evidence()
  jax = ({"backend": "cpu", "how": why} if tpu is None else
         {"backend": None, "how": f"not probed: {tpu}, so JAX may run on a TPU (starting it here would hold the chip "
                                  "~15 s); the JAX side's summary.json names the device it ran on"})
  torch = {"cuda_available": False, "how": why}
  return {"jax": installed.framework_record("jax") or jax, "torch": installed.framework_record("torch") or torch}


def environment_block(quick: bool = True, frameworks: Mapping[str, Mapping] | None = None, *,
                      bandwidth: bool = False, build: bool = False,
                      timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, object]:
  """The environment block (module docstring) as a JSON-able dict.

  Args:
    quick: no bandwidth, no topology, and on a machine without an NVIDIA driver no framework probe (the backend is
      recorded as inferred): a few stat calls and `git status` (~0.1 s), what every run pays. With a driver the
      frameworks are probed (devices only) unless `frameworks` is given.
    frameworks: probe results already in hand ({framework: JSON}, e.g. from the CPU-fallback check), used as is.
    bandwidth, build: passed to the probes when not quick (see probe_frameworks).
    timeout_s: per probe, seconds.
  Returns:
    {'schema', 'quick', 'host', 'packages', 'git', 'cuda_driver', 'gpus', 'worker_threads', 'frameworks',
    'host_limits' (`host_limits_block`), 'numerics_flags' (parity.numerics_flags.numerics_flags), 'sockets'
    (parity.sockets.sockets_record: whether a loopback TCP socket can be bound, what that means for the sides)};
    worker_threads: the thread settings a one-rank worker started now gets (harness.env.thread_environ: the
    variables, who set each, the inputs, the reason); torch's own view is frameworks.torch.thread_settings where
    torch was probed, and every torch side's summary.json `threads`.
  """
  evidence = env.cuda_evidence()
  if frameworks is None:
    if quick and evidence is None:
      frameworks = _inferred_frameworks()
    else:
      frameworks = probe_frameworks(bandwidth=bandwidth and not quick, build=build and not quick,
                                    devices_only=quick, timeout_s=timeout_s)
  return {"schema": SCHEMA, "quick": quick, "host": env.host_info(), "packages": env.package_versions(),
          "git": git_state(), "cuda_driver": evidence, "gpus": gpu_info(topology=not quick),
          "worker_threads": thread_environ(dict(os.environ)), "frameworks": dict(frameworks),
          "host_limits": host_limits_block(os.environ), "numerics_flags": numerics_flags(os.environ),
          "sockets": sockets.sockets_record()}


def host_limits_block(environ: Mapping[str, str], **paths: str) -> dict[str, object]:
  """The host limits a run meets here (parity.sizing.host_limits): {'xla_pool': {'variable', 'value' (its text or
  None), 'gib' (None for a bad value), 'source' ('default' | 'env' | 'invalid'), 'error' (a bad value), 'applies'},
  'mem_available_bytes', 'cgroup', 'cgroup_headroom_bytes', 'available_bytes'}. paths: host_memory's (tests)."""
  raw = environ.get(host_limits.XLA_POOL_ENV)
  pool: dict[str, object] = {"variable": host_limits.XLA_POOL_ENV, "value": raw,
                             "applies": "per GPU, XLA's GPU client only: on the CPU backend pinned_host is ordinary "
                                        "memory and on a TPU host memory beside the runtime's premapped "
                                        "region (TPU_PREMAPPED_BUFFER_SIZE); there the variable is not read"}
  try:
    gib = host_limits.xla_pool_setting(environ)
    pool.update(gib=gib or host_limits.XLA_POOL_DEFAULT_GIB, source="env" if gib else "default")
  except SpecError as exc:
    pool.update(gib=None, source="invalid", error=str(exc))
  return {"xla_pool": pool, **host_limits.host_memory(**paths).to_json()}


def run_environment(devices: Mapping[str, object] | None, spec=None,
                    perturb: Mapping[str, Mapping] | None = None) -> dict[str, object]:
  """The quick block a run records, from the CPU-fallback check's result (harness.backend.check_backends: None
  where no driver is visible): its probes as `frameworks`, and `cpu_fallback` (the sentences; [] when every side
  sees a GPU) and `allowed_cpu` (--allow-cpu) at the top level. With the run's `spec` (a RunSpec) and its
  --perturb plan, a JAX side's pinned-host pool (`host_pool`: harness.env.jax_pool_choice, what the runner puts in
  that worker's environment) and the value in numerics_flags."""
  block = environment_block(quick=True) if devices is None else environment_block(quick=True,
                                                                                  frameworks=devices["frameworks"])
  if devices is not None:
    block.update(cpu_fallback=devices["cpu_fallback"], allowed_cpu=devices["allowed_cpu"])
  jax_side = next((s for s in spec.sides if side_record(s).framework == "jax"), None) if spec is not None else None
  if jax_side is not None:
    jax_spec = side_spec({"run": to_dict(spec), "perturb": dict(perturb or {})}, jax_side)
    choice = jax_pool_choice(os.environ, jax_spec, pool_host_bytes(jax_spec))
    block["host_pool"] = {jax_side: choice}
    block["numerics_flags"] = numerics_flags(os.environ, pool=choice)
  return block
