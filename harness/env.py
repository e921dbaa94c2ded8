"""The one environment every worker, op build and `port --verify` process runs in.

torch JIT-builds DeepSpeed's C++ ops (cpu_adam, deepspeed_shm_comm, fused_adam) into
TORCH_EXTENSIONS_DIR/<op>/ with the first `ninja` on PATH, and rebuilds from scratch when the build
inputs differ from the last build: another ninja (the system one writes an older .ninja_log format,
so every alternation between it and the environment's ninja rebuilt every op), another compiler or
its flags (CC, CXX, CFLAGS, CXXFLAGS, LDFLAGS), another accelerator (DS_ACCELERATOR). The rule:
every process that can load an op gets its environment from `parity.buildenv.build_environ`, whichever path started
it (the harness, a test running a worker directly, `parity port --verify`, `parity build-ops`), so
one environment builds each op at most once.

The same environment carries the worker's thread settings (`thread_environ`, `choose_threads`): OpenMP's default
wait policy spins idle threads, which collapses when other processes share the cores (the torch side at a load of
~2x the cores and more ran 3-6x slower than with OMP_WAIT_POLICY=PASSIVE, benchmarks/results/torch_contention.md),
and OpenMP starts a thread per CPU of the affinity mask even where a cgroup quota allows fewer.
Imports neither jax nor torch.
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from parity.buildenv import build_environ
from parity.environment import cpu_quota, cuda_evidence, load_1min, runnable_now, usable_cpus
from parity.errors import SpecError
from parity.overrides import apply_overrides
from parity.protocol.layout import DEBUG_KEYS
from parity.sizing import host_limits
from parity.spec import RunSpec, from_dict

__all__ = ["ROOT", "RENDEZVOUS", "worker_env", "THREADS_SWITCH", "THREADS_CHOICE", "PARITY_SET", "choose_threads",
           "thread_environ", "HOST_POOL_CHOICE", "side_spec", "jax_pool_choice", "pool_host_bytes",
           "host_pool_environ"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: workers run `python -m <module>` with it first on PYTHONPATH."""


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
"""torch.distributed's rendezvous variables. A worker never inherits them from the harness's own environment: a
single-process side picks a free port of its own (torch_impl.distributed.setup_distributed) and a multi-rank side's
launcher sets them per rank (harness.ranks); inherited, a port some other process still holds (a torchrun shell, a
DeepSpeed engine built in this process) made every DeepSpeed side fail with EADDRINUSE."""


def worker_env(extra: dict[str, str] | None = None, python: str = sys.executable, ranks: int = 1) -> dict[str, str]:
  """The full environment of a worker process: os.environ without the RENDEZVOUS variables, then `extra`, then the
  op-build environment, the thread settings for `ranks` processes sharing this machine's CPUs (`thread_environ`),
  the repository first on PYTHONPATH, and unbuffered output (the harness tails stderr.log)."""
  inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
  env = build_environ({**inherited, **(extra or {})}, python)
  thread_environ(env, ranks)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
  env["PYTHONUNBUFFERED"] = "1"
  return env


# ----------------------------------------------------------------------------- thread settings

THREADS_SWITCH = "PARITY_THREADS"
"""'off' leaves every thread variable as it is (OpenMP's and torch's own defaults, what parity did before it chose
them); unset or 'auto': `choose_threads` decides."""
THREADS_CHOICE = "PARITY_THREADS_CHOICE"
"""The choice as JSON, set beside the variables it names: what a worker records in its summary (`threads`), and
how a second `thread_environ` over the same environment tells parity's values from a user's."""
PARITY_SET = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
"""The variables parity chooses (OMP_WAIT_POLICY only on a busy machine); each one a user set is kept. torch sizes
its intra-op pool (and MKL's, oneDNN's) from OMP_NUM_THREADS; libgomp reads OMP_WAIT_POLICY when torch loads it
(DeepSpeed's CPU Adam runs on that pool)."""
_USER_PREFIXES = ("OMP_", "MKL_", "GOMP_", "KMP_")
PASSIVE_REASON = ("waiting threads sleep instead of spinning: spinning threads hold the cores the working ones "
                  "need once other jobs share them (the torch side of gpt2-small-cpu ran 3-6x slower; "
                  "benchmarks/results/torch_contention.md)")
SPIN_REASON = ("OpenMP's default (spin a while, then sleep): with nothing else to run, a spinning thread starts the "
               "next parallel region sooner (PASSIVE lost 14-19% where nothing preempted the side)")
COUNT_REASON = ("the count follows the CPUs, never the load: it sets torch's float summation order, so runs on one "
                "machine (a side and its rerun) stay bitwise comparable; the wait policy changes no bit")
"""The reasons a choice records (docs/install.md, 'Threads'): why each wait policy, why the count ignores the load."""


def choose_threads(environ: Mapping[str, str], *, cpus: int, quota: float | None, load: float | None,
                   runnable: float | None = None, ranks: int = 1, parity_set: tuple[str, ...] = ()) -> dict:
  """The thread settings of a worker, from the CPUs it may use and what else runs (pure: no system call).

  OMP_NUM_THREADS = max(1, min(cpus, floor(quota)) // ranks): every CPU the process may use, shared by the side's
  ranks; it never depends on the load (COUNT_REASON). OMP_WAIT_POLICY=PASSIVE when other jobs fill at least one
  CPU beyond what the side's threads leave free (others >= usable - threads + 1; PASSIVE_REASON), or the side's
  ranks alone have more threads than CPUs, else left unset (SPIN_REASON). others = the larger of `runnable` and
  `load` less the side's own threads (a side that just ended is still in the load average: at most that many);
  in doubt PASSIVE, the cheaper mistake (14-19% on a quiet machine, against 3-6x on a busy one). A variable of
  PARITY_SET already in `environ` is the user's and kept, unless it is named in `parity_set` (an earlier choice of
  parity's, chosen again).

  Args:
    environ: the environment the worker will get (str -> str); not modified.
    cpus: CPUs in the affinity mask (>= 1); quota: the cgroup limit in CPUs, None: none; load: the 1-minute load
      average; runnable: tasks runnable now (parity.environment.runnable_now); either may be None (unknown).
    ranks: processes of one side sharing these CPUs (>= 1).
    parity_set: variables present in `environ` that parity set before (THREADS_CHOICE's 'env').
  Returns:
    {'env': {var: value} parity sets, 'values': {var: value} the worker runs with (parity's and the user's),
    'set_by': {var: 'parity' | 'user'}, 'user': {other OMP_/MKL_/GOMP_/KMP_ variables the user set}, 'inputs':
    {'cpus_affinity', 'cpu_quota', 'load_1min', 'runnable_now', 'ranks'}, 'reason': str}.
  """
  usable = max(1, min(cpus, math.floor(quota))) if quota is not None else cpus
  ranks = max(1, ranks)
  per_rank = max(1, usable // ranks)
  total = per_rank * ranks  # more than `usable` when there are more ranks than CPUs: the side alone oversubscribes
  known = [x for x in (runnable, None if load is None else max(0.0, load - total)) if x is not None]
  others = round(max(known), 2) if known else None
  busy = total > usable or (others is not None and others >= usable - total + 1)
  wanted = {"OMP_NUM_THREADS": str(per_rank), **({"OMP_WAIT_POLICY": "PASSIVE"} if busy else {})}
  user = {k: environ[k] for k in PARITY_SET if k in environ and k not in parity_set}
  env = {k: v for k, v in wanted.items() if k not in user}
  limit = f"cgroup quota {quota:g} CPUs" if quota is not None else "no cgroup CPU quota"
  why = [f"{per_rank} thread(s): {cpus} CPU(s) in the affinity mask, {limit}, {ranks} rank(s) sharing them",
         f"other jobs {others if others is not None else '?'} (the larger of {runnable} runnable now and the 1-min "
         f"load {load} less the side's own {total} thread(s))",
         ("OMP_WAIT_POLICY=PASSIVE: " + PASSIVE_REASON) if busy else ("OMP_WAIT_POLICY unset: " + SPIN_REASON),
         COUNT_REASON]
  if user:
    why.insert(0, "kept as the user set them: " + ", ".join(f"{k}={v}" for k, v in user.items()))
  return {"env": env, "values": {**env, **user}, "set_by": {**{k: "parity" for k in env}, **{k: "user" for k in user}},
          "user": {k: v for k, v in environ.items() if k.startswith(_USER_PREFIXES) and k not in PARITY_SET},
          "inputs": {"cpus_affinity": cpus, "cpu_quota": quota, "load_1min": load, "runnable_now": runnable,
                     "ranks": ranks}, "reason": "; ".join(why)}


def thread_environ(environ: MutableMapping[str, str], ranks: int = 1) -> dict[str, object]:
  """Puts the thread settings into `environ` in place (`choose_threads` over this machine's CPUs and load) and
  records the choice as JSON in THREADS_CHOICE; returns the choice. Idempotent: values parity set earlier
  (named in an existing THREADS_CHOICE with the same value) are chosen again, a user's are kept.
  With PARITY_THREADS=off nothing is set (the choice says so, reason included)."""
  try:
    before = json.loads(environ.get(THREADS_CHOICE) or "{}").get("env", {})
  except (ValueError, AttributeError):
    before = {}
  ours = tuple(k for k, v in before.items() if environ.get(k) == v)
  choice = choose_threads(environ, cpus=usable_cpus(), quota=cpu_quota(), load=load_1min(), runnable=runnable_now(),
                          ranks=ranks, parity_set=ours)
  for k in ours:  # an earlier choice's values are chosen again (or, with 'off', go: OpenMP's own defaults)
    environ.pop(k)
  if environ.get(THREADS_SWITCH, "auto").strip().lower() == "off":
    kept = {k: environ[k] for k in PARITY_SET if k in environ}
    choice.update(env={}, values=kept, set_by={k: "user" for k in kept},
                  reason=f"{THREADS_SWITCH}=off: thread variables left as they are (OpenMP's and torch's defaults "
                         "where the user set none)")
  environ.update(choice["env"])
  environ[THREADS_CHOICE] = json.dumps(choice, sort_keys=True)
  return choice


# ----------------------------------------------------------------------------- the JAX worker's pinned-host pool

HOST_POOL_CHOICE = "PARITY_HOST_POOL_CHOICE"
"""The JAX worker's pool choice as JSON (`jax_pool_choice`), set beside the variable: how a second
`host_pool_environ` over the same environment tells parity's value from a user's."""


def side_spec(request: Mapping[str, object], side: str) -> RunSpec:
  """The RunSpec a side of request.json runs: the run with the side's --perturb overrides (not its fault
  injections, DEBUG_KEYS), as parity.protocol.side.SideIO builds it. Raises SpecError for a request that is not one."""
  base = from_dict(RunSpec, request["run"])
  perturb = {k: v for k, v in dict((request.get("perturb") or {}).get(side) or {}).items() if k not in DEBUG_KEYS}
  return apply_overrides(base, perturb) if perturb else base


def jax_pool_choice(environ: Mapping[str, str], spec: RunSpec, host_bytes: int | None = None) -> dict[str, object]:
  """The pinned-host pool a JAX worker started with `environ` gets (pure: nothing is set).

  The rule is parity.sizing.host_limits.pool_decision over the memory model's pinned-host bytes per device and
  `host_bytes`, the host memory per device the pool must fit (None: unknown); a value of
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB in `environ` is the user's and kept. Returns the decision's JSON
  (need_bytes, user_gib, parity_gib, rule_gib, gib, set_by, fits, statement) plus 'env' ({variable: value} parity
  sets; {} for none), 'user_value' (the user's text or None) and 'value' (what the worker runs with; None: unset,
  XLA's 64 GiB default). A user's value XLA cannot read gives 'error' (what the run's resource check refuses on a GPU
  machine) and sets nothing.
  """
  raw = environ.get(host_limits.XLA_POOL_ENV)
  try:
    decision = host_limits.jax_pool(spec, environ, host_bytes)
  except SpecError as exc:
    return {"variable": host_limits.XLA_POOL_ENV, "env": {}, "user_value": raw, "value": raw, "set_by": "user",
            "error": str(exc)}
  env = decision.env()
  return {**decision.to_json(), "env": env, "user_value": raw,
          "value": raw if raw is not None else env.get(host_limits.XLA_POOL_ENV)}


def pool_host_bytes(spec: RunSpec, gpu: bool | None = None) -> int | None:
  """The host memory per device a JAX worker's pool must fit: this machine's (host_limits.host_bytes_per_device)
  where a GPU reads the pool (`gpu`; None: a CUDA driver is visible), else None (on the CPU backend the variable is
  not read: nothing to fit)."""
  on_gpu = cuda_evidence() is not None if gpu is None else gpu
  return host_limits.host_bytes_per_device(spec) if on_gpu else None


def host_pool_environ(environ: MutableMapping[str, str], spec: RunSpec, gpu: bool | None = None) -> dict[str, object]:
  """Puts the JAX worker's pool into `environ` in place (`jax_pool_choice`: only when the plan needs more pinned host
  than XLA's default pool, or, where a GPU reads the pool (`gpu`; None: a CUDA driver is visible), when the default
  pool is larger than this host's memory per device (host_limits.host_bytes_per_device, what the resource check holds
  it to); a user's value is never replaced) and records the choice as JSON in HOST_POOL_CHOICE; returns the choice.
  Idempotent: a value parity set earlier (named in an existing HOST_POOL_CHOICE, same value) is chosen again."""
  try:
    before = json.loads(environ.get(HOST_POOL_CHOICE) or "{}").get("env", {})
  except (ValueError, AttributeError):
    before = {}
  var = host_limits.XLA_POOL_ENV
  ours = var in before and environ.get(var) == before[var]
  if ours:
    environ.pop(var)
  choice = jax_pool_choice(environ, spec, pool_host_bytes(spec, gpu))
  environ.update(choice["env"])
  environ[HOST_POOL_CHOICE] = json.dumps(choice, sort_keys=True)
  return choice
