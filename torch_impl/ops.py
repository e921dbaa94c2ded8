"""DeepSpeed's JIT-built C++ ops: stale build locks, progress while building, and building them up front.

torch builds an op in TORCH_EXTENSIONS_DIR/<op>/ under a `lock` file (torch.utils.file_baton.FileBaton:
created with O_CREAT|O_EXCL, held open by the builder for the whole build, removed when it ends). A
builder that dies (Ctrl-C, a side timeout, kill -9) leaves the file, and every later process waits on it
forever without a word. The rule here: a lock is live while some process has it open (the builder) or
works in its folder (ninja and the compilers it started, which may outlive a killed builder and finish
their file); otherwise it is stale, whatever its age, and is removed with a message saying so. Without
/proc (not Linux) nobody can be seen, so a lock counts as stale only after STALE_AGE_S.

`install_build_hooks` wraps DeepSpeed's `OpBuilder.jit_load`, the one place every op is built or loaded
from (whichever optimizer or comm backend asks), so that each build, in any worker: removes a stale lock
first (and again while waiting on a live one that dies); says "building DeepSpeed op X (first use, 1-4 min)"
in the harness's phase file (shown instead of `0/N steps`); and is kept off the side's clock (the
worker's own deadline moves by the build time; the harness stops its clock while the phase is shown).

`python -m torch_impl.ops [OP ...]` (what `parity build-ops` runs) builds the ops up front, once, with a
line per op. Never imports jax.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from parity import phase
from parity.buildenv import build_environ

__all__ = ["OPS", "STALE_AGE_S", "extensions_dir", "lock_path", "lock_holders", "lock_state", "clear_stale_lock",
           "needs_build", "install_build_hooks", "build_s", "build_ops", "main"]

OPS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder"}
"""The ops parity's DeepSpeed runs load on CPU (op name -> builder class of the accelerator): cpu_adam for
offload_optimizer (DeepSpeedCPUAdam), deepspeed_shm_comm for init_distributed on the CPU accelerator,
fused_adam for an `Adam`/`AdamW` optimizer section without offload (port --verify)."""
STALE_AGE_S = 1800.0
"""Where processes cannot be inspected (no /proc), a lock older than this is taken as stale: 10x the longest op
build measured here (cpu_adam, 177 s on a busy 2-core machine; FIRST_USE)."""
RECHECK_S = 5.0
"""While waiting on another process's build, how often the lock is checked again for a builder that died."""
FIRST_USE = {"cpu_adam": "1-4 min", "deepspeed_shm_comm": "1-3 min", "fused_adam": "1-3 min"}
"""Build times shown in the progress line, measured on this 2-core machine (README, 'DeepSpeed ops'): idle, cpu_adam
~60 s and deepspeed_shm_comm under 60 s; with other jobs running (load 5), 177 s, 125 s and fused_adam 146 s;
a newcomer's first run at load 3-5 (2026-12-01): deepspeed_shm_comm 130 s, cpu_adam about 100 s."""

_build_s = 0.0


def extensions_dir() -> Path:
  """TORCH_EXTENSIONS_DIR, as `parity.buildenv.build_environ` sets it for every process of this environment."""
  return Path(build_environ(dict(os.environ))["TORCH_EXTENSIONS_DIR"])


def lock_path(op: str) -> Path:
  return extensions_dir() / op / "lock"


def _proc_pids() -> list[int] | None:
  try:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]
  except OSError:
    return None


def lock_holders(op_dir: Path) -> list[tuple[int, str]] | None:
  """Live processes building in `op_dir`: (pid, why) for each that has its `lock` open or works in the folder.

  Returns None where processes cannot be inspected (no /proc). Processes this user may not inspect are skipped.
  """
  pids = _proc_pids()
  if pids is None:
    return None
  op_dir = Path(os.path.realpath(op_dir))
  lock = str(op_dir / "lock")
  found = []
  for pid in pids:
    try:
      if os.path.realpath(f"/proc/{pid}/cwd") == str(op_dir):
        found.append((pid, "works in the build folder"))
        continue
      for fd in os.listdir(f"/proc/{pid}/fd"):
        if os.readlink(f"/proc/{pid}/fd/{fd}") == lock:
          found.append((pid, "holds the lock"))
          break
    except OSError:
      continue
  return found


def _cmd(pid: int) -> str:
  try:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
  except OSError:
    return "?"


def lock_state(op_dir: str | Path) -> tuple[str, str]:
  """('free' | 'live' | 'stale', what was seen) for the build lock of `op_dir` (TORCH_EXTENSIONS_DIR/<op>)."""
  op_dir = Path(op_dir)
  lock = op_dir / "lock"
  try:
    age = time.time() - lock.stat().st_mtime
  except FileNotFoundError:
    return "free", "no lock"
  holders = lock_holders(op_dir)
  if holders is None:
    if age > STALE_AGE_S:
      return "stale", f"{age / 60:.0f} min old (over {STALE_AGE_S / 60:.0f} min; processes cannot be inspected here)"
    return "live", f"{age:.0f} s old (processes cannot be inspected here; stale after {STALE_AGE_S / 60:.0f} min)"
  if holders:
    return "live", "; ".join(f"pid {p} {why} ({_cmd(p)})" for p, why in holders[:3])
  return "stale", f"{age:.0f} s old, held by no live process, no build in its folder: an interrupted build left it"


def clear_stale_lock(op_dir: str | Path, say: Callable[[str], None] = print) -> bool:
  """Removes the build lock of `op_dir` when it is stale (see the module docstring), saying what was removed.

  Returns True when a lock was removed. A live lock, or none, is left alone (False).
  """
  state, detail = lock_state(op_dir)
  if state != "stale":
    return False
  try:
    (Path(op_dir) / "lock").unlink()
  except FileNotFoundError:
    return False
  say(f"removed stale DeepSpeed op build lock {Path(op_dir) / 'lock'}: {detail}")
  return True


def needs_build(op: str) -> bool:
  """True when `op` has no built library in TORCH_EXTENSIONS_DIR/<op>/ yet (torch may still relink an existing
  one whose sources or flags changed; that is the rarer case, and it is not announced)."""
  d = extensions_dir() / op
  return not any(d.glob(f"{op}*.so"))


def build_s() -> float:
  """Seconds this process has spent inside DeepSpeed op builds and loads through the hook."""
  return _build_s


def _wait_guard(op_dir: Path, done: threading.Event, removed: threading.Event, say: Callable[[str], None]) -> None:
  """While torch waits on another process's lock, remove it if that builder dies (torch would wait forever)."""
  while not done.wait(RECHECK_S):
    if clear_stale_lock(op_dir, say):
      removed.set()


def install_build_hooks(say: Callable[[str], None] | None = None, cls: type | None = None) -> None:
  """Wraps deepspeed's OpBuilder.jit_load (idempotent): stale locks cleared, builds announced, off the clock.

  Args:
    say: where messages go (default: stderr, which the harness keeps in the side's stderr.log).
    cls: the class whose `jit_load(self, verbose)` to wrap (its instances have `.name`, the op); default
      deepspeed.ops.op_builder.builder.OpBuilder, the base of every accelerator's op builders.
  """
  if cls is None:
    # deepspeed: when the hooks are installed, after the worker set DS_ACCELERATOR
    from deepspeed.ops.op_builder import builder as ds_builder
    cls = ds_builder.OpBuilder
  if getattr(cls.jit_load, "_parity_hooked", False):
    return
  original = cls.jit_load
  say = say or (lambda msg: print(f"[parity] {msg}", file=sys.stderr, flush=True))

  def jit_load(self, verbose=True):
    global _build_s
    op_dir = extensions_dir() / self.name
    clear_stale_lock(op_dir, say)
    building = needs_build(self.name)
    state, detail = lock_state(op_dir)
    if state == "live":
      msg = f"waiting for DeepSpeed op {self.name}: another process is building it ({detail})"
    else:
      msg = f"building DeepSpeed op {self.name} (first use, {FIRST_USE.get(self.name, '~1 min')})" if building else ""
    if msg:
      say(msg)
      phase.set_phase(msg)
    phase.extend_deadline(phase.BUILD_LIMIT_S)
    done, removed = threading.Event(), threading.Event()
    threading.Thread(target=_wait_guard, args=(op_dir, done, removed, say), daemon=True).start()
    t0 = time.time()
    try:
      try:
        return original(self, verbose)
      except (ImportError, OSError):
        if not (removed.is_set() and needs_build(self.name)):
          raise
        # we waited on a builder that died, and removed its lock: nothing was built, so build it here (torch
        # skips the build of a name it has seen in this process; forget it)
        from torch.utils import cpp_extension
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(self.name, None)
        phase.set_phase(f"building DeepSpeed op {self.name} (first use, {FIRST_USE.get(self.name, '~1 min')})")
        return original(self, verbose)
    finally:
      done.set()
      dt = time.time() - t0
      _build_s += dt
      phase.extend_deadline(dt - phase.BUILD_LIMIT_S)
      phase.set_phase(None)
      if building:
        say(f"DeepSpeed op {self.name} ready after {dt:.0f} s")
  jit_load._parity_hooked = True  # type: ignore[attr-defined]
  cls.jit_load = jit_load


def build_ops(names: list[str], say: Callable[[str], None] = print) -> dict[str, float]:
  """Builds (or loads, when already built) each op in `names` in this process, one line per op.

  Args:
    names: keys of OPS.
    say: where the lines go.
  Returns:
    op -> seconds it took.
  Raises:
    ValueError: an unknown op name (the message lists the known ones), or TORCH_EXTENSIONS_DIR is not a writable
      folder (the message names it and the fix).
    RuntimeError: a build failed (DeepSpeed's message; the compiler output is above it).
  """
  unknown = [n for n in names if n not in OPS]
  if unknown:
    raise ValueError(f"unknown DeepSpeed op(s) {', '.join(unknown)}; known: {', '.join(OPS)}")
  build_environ(os.environ)
  where = extensions_dir()
  fix = "point TORCH_EXTENSIONS_DIR at a writable folder, or unset it (default: <virtualenv>/torch_extensions)"
  if where.exists() and not where.is_dir():
    raise ValueError(f"TORCH_EXTENSIONS_DIR={where} is not a folder; {fix}")
  try:
    where.mkdir(parents=True, exist_ok=True)
    if not os.access(where, os.W_OK | os.X_OK):
      raise PermissionError(f"no write permission on {where}")
  except OSError as exc:
    raise ValueError(f"TORCH_EXTENSIONS_DIR={where} cannot hold the builds ({exc.strerror or exc}); {fix}") from None
  import torch  # torch: only to build ops up front
  if not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"  # as torch_impl.engine.setup_distributed; before deepspeed is imported
  from deepspeed.accelerator import get_accelerator
  install_build_hooks(say)
  took = {}
  for name in names:
    t0 = time.time()
    if not needs_build(name):
      say(f"DeepSpeed op {name}: built already, loading")
    get_accelerator().create_op_builder(OPS[name]).load(verbose=False)
    took[name] = time.time() - t0
  return took


def main(argv: list[str] | None = None) -> int:
  """`python -m torch_impl.ops [OPS...]`: builds DeepSpeed's ops once, up front (default all of OPS), printing
  progress. Returns 0 when built, 2 for bad input (an unknown op), 1 when a build failed (reason on stderr)."""
  ap = argparse.ArgumentParser(prog="python -m torch_impl.ops", description="build DeepSpeed's ops once, up front")
  ap.add_argument("ops", nargs="*", help=f"ops to build (default all: {', '.join(OPS)})")
  args = ap.parse_args(argv)
  try:
    took = build_ops(args.ops or list(OPS), say=lambda m: print(m, flush=True))
  except ValueError as exc:
    print(f"parity build-ops: error: {exc}", file=sys.stderr)
    return 2
  except Exception as exc:  # a compiler error: its output is above; one line here
    print(f"parity build-ops: error: building DeepSpeed ops failed: {type(exc).__name__}: {str(exc).strip()[:500]}",
          file=sys.stderr)
    return 1
  print("DeepSpeed ops ready in " + str(extensions_dir()) + ": " +
        ", ".join(f"{k} {v:.1f} s" for k, v in took.items()), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
