"""Whether each side's framework is installed here, and which sides a run keeps when one is not.

The base install (`pip install parity`) is framework-free; each side's framework comes with an extra
(pyproject.toml): `parity[jax]` (jax, flax, optax, orbax-checkpoint), `parity[torch]` (torch: the torch and fsdp
sides, FSDP2 being part of torch), `parity[deepspeed]` (deepspeed and torch), `parity[all]`. A JAX-only machine (a
TPU VM) installs `parity[jax]` and has no torch.

`pip_install` is the one install command every hint gives: in a source checkout (an editable install of a clone)
`pip install -c constraints.txt -e '.[torch]'` from the checkout's root, the measured versions (a plain
`pip install '.[torch]'` there resolves to the newest torch and its CUDA wheels); for a wheel install
`pip install 'parity[torch]'`.

`missing_module` is the one check (importlib.util.find_spec of each module a side's worker imports: nothing is
imported), `refusal` the words for a side the user named (`parity compare` exits 2 with them before anything
starts), `not_installed_line` the one line for a default side left out, and `plan_sides` what `parity compare` does
about it, the way parity.sockets.plan_sides does for refused sockets. Imports neither jax nor torch.
"""
from __future__ import annotations

import importlib.util
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from parity.errors import SpecError
from parity.sides import FRAMEWORKS, all_sides, find_side
from parity.sockets import SidePlan

__all__ = ["NAMES", "installed", "missing_module", "checkout_root", "pip_install", "install_line", "refusal",
           "not_installed_line", "plan_sides", "framework_record"]

NAMES = {"jax": "JAX", "flax": "Flax", "optax": "Optax", "torch": "PyTorch", "deepspeed": "DeepSpeed"}
"""module -> the framework's name in messages. Which modules a side's training worker imports, and the extra that
installs them, are its record's `modules` and `extra` (parity.sides)."""


def installed(module: str) -> bool:
  """True when `module` (a top-level name) can be imported here: importlib.util.find_spec, nothing imported."""
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a broken package, or a module whose __spec__ is None
    return False


def missing_module(side: str, have: Callable[[str], bool] | None = None) -> str | None:
  """The first module `side` needs that is not installed (its record's `modules`, in order), or None (also for a
  side not registered). have: module -> installed? (None: `installed`, looked up at the call, so a test may replace
  it)."""
  record = find_side(side)
  return _first_missing(record.modules if record is not None else (), have)


def _first_missing(modules: Sequence[str], have: Callable[[str], bool] | None) -> str | None:
  have = have or installed
  return next((m for m in modules if not have(m)), None)


def checkout_root() -> Path | None:
  """The source checkout this package runs from, or None for a wheel install: the folder holding `parity/` when
  `pyproject.toml` and `constraints.txt` lie beside it (an editable install of a clone, or a clone on the path)."""
  root = Path(__file__).resolve().parent.parent
  return root if (root / "pyproject.toml").is_file() and (root / "constraints.txt").is_file() else None


def pip_install(extra: str | None, *, constrained: bool = True) -> str:
  """The command that installs parity with `extra` here: the one every install hint gives.

  Args:
    extra: a pyproject.toml extra ('torch', 'jax', 'cuda', ...), or None for the base install.
    constrained: in a checkout, pin the measured versions with `-c constraints.txt` (False: a GPU node keeps its own
      CUDA builds, docs/install.md "On a GPU node").
  Returns:
    Through this interpreter's pip (`<python> -m pip`: the venv parity runs in, whether or not it is activated).
    In a source checkout (`checkout_root`): "cd /path/to/clone && <python> -m pip install -c constraints.txt -e
    '.[torch]'",
    run from the checkout's root (a plain `pip install '.[torch]'` there resolves to the newest torch and its CUDA
    wheels, not the CPU build the constraints pin); for a wheel install "pip install 'parity[torch]'".
  """
  pip = f"{shlex.quote(sys.executable)} -m pip"  # this interpreter's pip: a bare `pip` may be another Python's
  root = checkout_root()
  if root is None:
    return f"{pip} install 'parity[{extra}]'" if extra else f"{pip} install parity"
  pins = "-c constraints.txt " if constrained else ""
  return f"cd {shlex.quote(str(root))} && {pip} install {pins}-e " + (f"'.[{extra}]'" if extra else ".")


def install_line(side: str) -> str:
  """`pip_install` of the framework of `side` (its record's `extra`; 'all' for a side not registered): "pip install
  'parity[torch]'" for a wheel install."""
  record = find_side(side)
  return pip_install(record.extra if record is not None else "all")


def refusal(side: str, module: str) -> str:
  """The words for a named side whose framework is missing: "side 'torch' needs PyTorch, which is not installed
  here: pip install 'parity[torch]'" (`install_line`; with the record's note on the module: "PyTorch (FSDP2 is
  part of it)")."""
  what = NAMES.get(module, module)
  record = find_side(side)
  note = record.module_notes.get(module) if record is not None else None
  if note:
    what = f"{what} ({note})"
  return f"side '{side}' needs {what}, which is not installed here: {install_line(side)}"


def not_installed_line(side: str, module: str) -> str:
  """The one line said (and recorded) for a side the user did not name, left out because its framework is missing
  (parity.sockets.not_run_line's form)."""
  return (f"{side}: not run: {NAMES.get(module, module)} is not installed here, which the {side} side needs; the "
          f"other sides run. Install it with {install_line(side)}")


def plan_sides(sides: Sequence[str], *, named: bool, have: Callable[[str], bool] | None = None) -> SidePlan:
  """The sides to run given the frameworks installed here.

  Args:
    sides: the run's sides, in order; named: the user named them (`--sides`, an override, a config).
    have: module -> installed? (None: `installed`).
  Returns:
    SidePlan (parity.sockets'): the sides whose frameworks are installed; `not_run` the line of each side left out.
  Raises:
    SpecError: a named side whose framework is missing (`refusal`, each such side), or no side left (none named).
  """
  sides = tuple(sides)
  missing = {s: m for s in sides if (m := missing_module(s, have)) is not None}
  if not missing:
    return SidePlan(sides, {}, named)
  if named:
    raise SpecError("; ".join(refusal(s, m) for s, m in missing.items()))
  if len(missing) == len(sides):
    raise SpecError(f"sides {','.join(sides)}: none can run here: "
                    + "; ".join(f"{s} needs {NAMES.get(m, m)}" for s, m in missing.items())
                    + f" and none is installed; install one side's framework: {pip_install('jax')} (or the extra "
                      "torch, deepspeed or all in place of jax)")
  return SidePlan(tuple(s for s in sides if s not in missing),
                  {s: not_installed_line(s, m) for s, m in missing.items()}, named)


def framework_record(framework: str, have: Callable[[str], bool] | None = None) -> dict[str, object] | None:
  """None when `framework` ('jax' or 'torch', harness.doctor.PROBES' keys) is installed; else the record the
  environment block keeps for it instead of a probe: {'installed': False, 'missing', 'install', 'sides'}: the
  framework's modules and extra are parity.sides.FRAMEWORKS', `sides` every registered side needing the module."""
  fw = FRAMEWORKS[framework]
  module = _first_missing(fw.modules, have)
  if module is None:
    return None
  needing = [r for r in all_sides() if module in r.modules]  # those needing nothing more first (torch, then deepspeed)
  sides = [r.name for r in sorted(needing, key=lambda r: len(r.modules))]
  return {"installed": False, "missing": module, "install": pip_install(fw.extra), "sides": sides}
