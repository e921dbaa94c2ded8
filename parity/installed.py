"""Whether each side's framework is installed here, and which sides a run keeps when one is not.

The base install (`pip install parity`) is framework-free; each side's framework comes with an extra
(pyproject.toml): `parity[jax]` (jax, flax, optax, orbax-checkpoint), `parity[torch]` (torch: the torch and fsdp
sides, FSDP2 being part of torch), `parity[deepspeed]` (deepspeed and torch), `parity[all]`. A JAX-only machine (a
TPU VM) installs `parity[jax]` and has no torch.

`missing_module` is the one check (importlib.util.find_spec of each module a side's worker imports: nothing is
imported), `refusal` the words for a side the user named (`parity compare` exits 2 with them before anything
starts), `not_installed_line` the one line for a default side left out, and `plan_sides` what `parity compare` does
about it, the way parity.sockets.plan_sides does for refused sockets. Imports neither jax nor torch.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

from parity.errors import SpecError
from parity.sockets import SidePlan

__all__ = ["MODULES", "NAMES", "EXTRAS", "installed", "missing_module", "install_line", "refusal",
           "not_installed_line", "plan_sides", "framework_record"]

MODULES = {"jax": ("jax", "flax", "optax"), "torch": ("torch",), "fsdp": ("torch",),
           "deepspeed": ("torch", "deepspeed")}
"""side -> the top-level modules its training worker imports (jax_impl/, torch_impl/), in the order checked."""
NAMES = {"jax": "JAX", "flax": "Flax", "optax": "Optax", "torch": "PyTorch", "deepspeed": "DeepSpeed"}
"""module -> the framework's name in messages."""
EXTRAS = {"jax": "jax", "torch": "torch", "fsdp": "torch", "deepspeed": "deepspeed"}
"""side -> the extra that installs its framework (`pip install 'parity[EXTRA]'`)."""


def installed(module: str) -> bool:
  """True when `module` (a top-level name) can be imported here: importlib.util.find_spec, nothing imported."""
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a broken package, or a module whose __spec__ is None
    return False


def missing_module(side: str, have: Callable[[str], bool] | None = None) -> str | None:
  """The first module `side` needs that is not installed (MODULES), or None (also for a side not in MODULES).
  have: module -> installed? (None: `installed`, looked up at the call, so a test may replace it)."""
  have = have or installed
  return next((m for m in MODULES.get(side, ()) if not have(m)), None)


def install_line(side: str) -> str:
  """"pip install 'parity[torch]'": what installs the framework of `side`."""
  return f"pip install 'parity[{EXTRAS.get(side, 'all')}]'"


def refusal(side: str, module: str) -> str:
  """The words for a named side whose framework is missing: "side 'torch' needs PyTorch, which is not installed
  here: pip install 'parity[torch]'"."""
  what = NAMES.get(module, module)
  if side == "fsdp" and module == "torch":
    what = "PyTorch (FSDP2 is part of it)"
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
                    + " and none is installed; install one side's framework (pip install 'parity[jax]', "
                      "'parity[torch]', 'parity[deepspeed]', or 'parity[all]')")
  return SidePlan(tuple(s for s in sides if s not in missing),
                  {s: not_installed_line(s, m) for s, m in missing.items()}, named)


def framework_record(framework: str, have: Callable[[str], bool] | None = None) -> dict[str, object] | None:
  """None when `framework` ('jax' or 'torch', harness.doctor.PROBES' keys) is installed; else the record the
  environment block keeps for it instead of a probe: {'installed': False, 'missing', 'install', 'sides'}."""
  module = missing_module(framework, have)
  if module is None:
    return None
  sides = [s for s in MODULES if module in MODULES[s]]
  return {"installed": False, "missing": module, "install": install_line(framework), "sides": sides}
