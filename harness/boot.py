"""`python -m harness.boot MODULE ARGS...`: runs `python -m MODULE ARGS...` bound to the harness that started it.

Every process the harness starts goes through here (`harness.runner.run_side`, `parity build-ops`), so
binding a worker to its parent (`harness.lifetime.watch_parent`: it dies with the harness, kill -9
included, and by its own deadline) is not something each worker module has to remember: a new worker
module, a diagnose worker or a rerun gets it without a line of its own. Then the module runs exactly
as `python -m MODULE` would (`runpy`, as __main__, with sys.argv[0] its file). Imports neither jax nor torch.
"""
from __future__ import annotations

import runpy
import sys

from harness import lifetime


def main(argv: list[str]) -> None:
  if not argv or argv[0].startswith("-"):
    sys.stderr.write("usage: python -m harness.boot MODULE [ARGS...]\n")
    sys.exit(2)
  lifetime.watch_parent()
  sys.argv = list(argv)
  runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main(sys.argv[1:])
