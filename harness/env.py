"""The one environment every worker, op build and `port --verify` process runs in.

torch JIT-builds DeepSpeed's C++ ops (cpu_adam, deepspeed_shm_comm, fused_adam) into
TORCH_EXTENSIONS_DIR/<op>/ with the first `ninja` on PATH, and rebuilds from scratch when the build
inputs differ from the last build: another ninja (the system one writes an older .ninja_log format,
so every alternation between it and the environment's ninja rebuilt every op), another compiler or
its flags (CC, CXX, CFLAGS, CXXFLAGS, LDFLAGS), another accelerator (DS_ACCELERATOR). The rule:
every process that can load an op gets its environment from `build_environ`, whichever path started
it (the harness, a test running a worker directly, `parity port --verify`, `parity build-ops`), so
one environment builds each op at most once. Imports neither jax nor torch.
"""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["ROOT", "extensions_dir", "env_bin", "build_environ", "worker_env"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: workers run `python -m <module>` with it first on PYTHONPATH."""


def extensions_dir(prefix: str = sys.prefix) -> str:
  """TORCH_EXTENSIONS_DIR of this environment: <prefix>/torch_extensions, one per virtualenv, so two
  environments on one machine never rebuild (or lock) each other's ops."""
  return os.path.join(prefix, "torch_extensions")


def env_bin(python: str = sys.executable) -> str:
  """The bin folder of the interpreter `python` (a virtualenv's bin holds the `ninja` pip installed with it)."""
  return os.path.dirname(os.path.abspath(python))


def build_environ(environ: MutableMapping[str, str], python: str = sys.executable) -> MutableMapping[str, str]:
  """Makes `environ` the op-build environment, in place, and returns it.

  Sets TORCH_EXTENSIONS_DIR (where absent: a user's explicit folder is kept) to this environment's
  folder, and puts the interpreter's bin first on PATH when it holds a `ninja` (so the build never
  uses a system ninja). Idempotent: applying it twice, or to an environment it already produced,
  changes nothing, so a worker started by the harness and one started by hand build identically.

  Args:
    environ: os.environ or a copy of it (str -> str).
    python: the interpreter that will run the build; default this one.
  Returns:
    `environ`.
  """
  environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
  bin_dir = env_bin(python)
  if os.path.exists(os.path.join(bin_dir, "ninja")):
    rest = [p for p in environ.get("PATH", "").split(os.pathsep) if p and os.path.normpath(p) != bin_dir]
    environ["PATH"] = os.pathsep.join([bin_dir, *rest])
  return environ


def worker_env(extra: dict[str, str] | None = None, python: str = sys.executable) -> dict[str, str]:
  """The full environment of a worker process: os.environ, then `extra`, then the op-build environment,
  the repository first on PYTHONPATH, and unbuffered output (the harness tails stderr.log)."""
  env = build_environ({**os.environ, **(extra or {})}, python)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
  env["PYTHONUNBUFFERED"] = "1"
  return env
