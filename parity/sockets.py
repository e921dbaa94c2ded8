"""Whether this machine lets a process use sockets, and which sides cannot run without them.

Some machines refuse every socket (a sandboxed TPU VM: "Address family not supported by protocol" for TCP and
UDP, loopback included). On one host the sides that need sockets are the ones whose process group meets over
them: DeepSpeed (`deepspeed.init_distributed` builds a torch.distributed group, gloo on CPU, even with one rank),
FSDP2 (its device mesh needs a process group, even with one rank), and with several ranks every side (torchrun's
rendezvous and torch.distributed for deepspeed/torch/fsdp, jax.distributed's coordinator for JAX). The plain
torch side and JAX with one rank open no socket.

`loopback_refusal` is the one check (create a TCP socket, bind 127.0.0.1:0: microseconds), `sockets_record` its
record in the environment block (parity doctor, every run's environment.json), and `plan_sides` what `parity
compare` does about it before anything starts. Imports neither jax nor torch.
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Sequence

from parity.errors import SpecError
from parity.sides import all_sides, find_side

__all__ = ["PROBE", "loopback_refusal", "sockets_record", "meaning", "needs_sockets", "not_run_line",
           "SidePlan", "plan_sides"]

PROBE = "loopback TCP bind"
"""What `loopback_refusal` tries: a TCP socket bound to 127.0.0.1:0 (any free port)."""


def loopback_refusal() -> str | None:
  """None when this process can create a TCP socket and bind it to 127.0.0.1:0; else the OS's words for the
  refusal ('[Errno 97] Address family not supported by protocol')."""
  try:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(("127.0.0.1", 0))
  except OSError as exc:
    if exc.errno is not None and exc.strerror:
      return f"[Errno {exc.errno}] {exc.strerror}"
    return str(exc) or type(exc).__name__
  return None


def meaning(error: str | None) -> str:
  """What the check's outcome means for the sides, in one sentence (the doctor's line)."""
  if error is None:
    return (f"allowed ({PROBE} 127.0.0.1:0 works): DeepSpeed's init, torch.distributed (gloo, torchrun) and "
            "jax.distributed can start here")
  return (f"REFUSED ({PROBE}: {error}): DeepSpeed's init, FSDP2, torch.distributed (gloo, torchrun) and "
          "jax.distributed cannot start here, so `parity compare` runs jax and torch on one rank and records "
          "deepspeed/fsdp as not run; run those on a machine that allows sockets and join the folders with "
          "`parity join`")


def sockets_record() -> dict[str, object]:
  """{'allowed': bool, 'probe', 'error' (None when allowed), 'means'}: the environment block's 'sockets'."""
  error = loopback_refusal()
  return {"allowed": error is None, "probe": f"{PROBE} 127.0.0.1:0", "error": error, "means": meaning(error)}


def needs_sockets(side: str, world: int = 1) -> str | None:
  """What of `side` needs sockets with `world` ranks in all (words), or None when it opens none: its record's
  `sockets` (on any number of ranks), else with several ranks its framework's launcher and process group."""
  record = find_side(side)
  if record is not None and record.sockets:
    return record.sockets
  if world <= 1:
    return None
  return record.multi_rank_sockets if record is not None else "its process group"


def _short(side: str) -> str:
  """The side's socket need in a sentence ("DeepSpeed's init"): its record's `sockets_short`, else its name."""
  record = find_side(side)
  return (record.sockets_short if record is not None else "") or side


def not_run_line(side: str, error: str) -> str:
  """The one line said (and recorded) for a side left out because sockets are refused."""
  return (f"{side}: not run: this machine refuses sockets ({PROBE}: {error}), which {_short(side)} "
          "needs; the other sides run. Run it on a machine that allows them and join the folders with `parity join`")


@dataclasses.dataclass(frozen=True)
class SidePlan:
  """What a run does about refused sockets.

  Attributes:
    sides: the sides the run keeps (a dropped side is gone; a named one stays, to be recorded as not run).
    not_run: side -> the line (`not_run_line`) of every side that will not start.
    named: True when the user named the sides (a named side that cannot run fails the run, exit 1).
  """
  sides: tuple[str, ...]
  not_run: dict[str, str]
  named: bool


def plan_sides(sides: Sequence[str], *, world: int, named: bool, error: str | None,
               nproc_flag: str = "--nproc") -> SidePlan:
  """The sides to run when `error` (loopback_refusal's) says sockets are refused; all of them when it is None.

  Args:
    sides: the run's sides, in order; world: ranks per side in all; named: the user named the sides.
    error: loopback_refusal() (None: sockets allowed).
  Returns:
    SidePlan: sides the user did not name that need sockets are dropped; named ones are kept, to be not run.
  Raises:
    SpecError: several ranks (every side then meets its ranks over sockets), or no side left that can run.
  """
  sides = tuple(sides)
  if error is None:
    return SidePlan(sides, {}, named)
  if world > 1:
    raise SpecError(f"{nproc_flag} with {world} ranks per side: the ranks meet over sockets (jax.distributed's "
                    f"coordinator, torchrun's rendezvous and torch.distributed), and this machine refuses them "
                    f"({PROBE}: {error}); run with one rank here, or on a machine that allows sockets")
  out = {s: not_run_line(s, error) for s in sides if needs_sockets(s, 1)}
  if len(out) == len(sides):
    free = [r.name for r in all_sides() if not r.sockets]  # the sides that open none on one rank
    raise SpecError(f"sides {','.join(sides)}: none can run here: this machine refuses sockets ({PROBE}: {error}), "
                    f"which {' and '.join(_short(s) for s in sides)} need; add {' or '.join(free)} "
                    f"(--sides {','.join(free)}), or run on a machine that allows sockets")
  return SidePlan(sides if named else tuple(s for s in sides if s not in out), out, named)
