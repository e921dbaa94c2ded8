"""`parity build-ops [OP ...]`: builds DeepSpeed's JIT ops up front (harness.runner.build_ops)."""
from __future__ import annotations

import argparse
from harness.runner import build_ops  # harness depends on parity, not the reverse

from parity.cli._common import float_arg
from parity.errors import SpecError

__all__ = ["register"]


def register(sub) -> None:
  """Adds `build-ops` to the subparsers `sub`."""
  p = sub.add_parser("build-ops", help="build DeepSpeed's C++ ops once, up front (first use takes minutes)",
                     description="Builds (or loads, when built) DeepSpeed's JIT ops cpu_adam, deepspeed_shm_comm and "
                                 "fused_adam into this environment's torch_extensions folder, removing a stale build "
                                 "lock an interrupted build left, so no DeepSpeed side builds inside its timed run. "
                                 "Exit 0 built; 1 a build failed; 2 bad input; 130 interrupted.")
  p.add_argument("ops", nargs="*", help="ops to build (default: all three)")
  p.add_argument("--timeout", type=float_arg, default=None, help="seconds before the build is stopped (default 1800)")
  p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
  """Builds the ops. Raises SpecError on a --timeout that is not a positive number (main exits 2)."""
  if args.timeout is not None and not args.timeout > 0:
    raise SpecError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
  return build_ops(args.ops, **({"timeout_s": args.timeout} if args.timeout else {}))
