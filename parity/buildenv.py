"""The one op-build environment of this virtualenv: every process that can load a DeepSpeed op (a worker, a test
running one directly, `parity port --verify`, `parity build-ops`) applies `build_environ`, so one environment builds
each op at most once (why it matters: harness.env's docstring). Here, not in the harness, because the torch side
applies it itself (torch_impl.ops, torch_impl.distributed) and a side never imports the harness.
Standard library only; imports neither jax nor torch.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

__all__ = ["extensions_dir", "env_bin", "build_environ", "deepspeed_ops", "missing_ops"]


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


def deepspeed_ops(spec, *, cuda: bool) -> tuple[str, ...]:
  """The JIT ops the DeepSpeed side of the run `spec` (a RunSpec) loads: deepspeed_shm_comm for init_distributed on
  the CPU accelerator (`cuda` False), and for an Adam/AdamW optimizer cpu_adam (DeepSpeedCPUAdam) under
  offload_optimizer 'cpu', else fused_adam (DeepSpeed's FusedAdam); torch_impl.ops.OPS names them."""
  ops = [] if cuda else ["deepspeed_shm_comm"]
  if spec.train.optimizer in ("adam", "adamw"):
    ops.append("cpu_adam" if spec.deepspeed.offload_optimizer == "cpu" else "fused_adam")
  return tuple(ops)


def missing_ops(ops: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
  """The ops among `ops` not built in this environment's extensions folder yet: no `<op>*.so` in
  TORCH_EXTENSIONS_DIR/<op>/ (torch_impl.ops.needs_build's rule), the folder `build_environ` gives every worker.
  Reads the folder only (environ: default os.environ)."""
  root = Path(build_environ(dict(os.environ if environ is None else environ))["TORCH_EXTENSIONS_DIR"])
  return [op for op in ops if not any((root / op).glob(f"{op}*.so"))]
