"""JAX side of a comparison: `python -m jax_impl.worker run_dir/request.json --side jax`.

The loop is `parity.protocol.loop.run_train`; the side it drives is `jax_impl.side.JaxSide` (over
`jax_impl.step.Trainer`).
This module is the adapter: the environment jax reads at start-up (device count, no preallocation), then the loop.
It writes steps.jsonl, summary.json, final.safetensors and final_moments.safetensors (Adam's sqrt(v_hat)). Exit
codes: 0 ok, 3 non-finite loss or grad norm (status 'nan'), 1 crash (status 'crashed', written by `main_guard`).

Checkpoints: with resume_from the whole TrainState is restored from the checkpoint's orbax state (same shardings and
memory kinds) before compiling; save_checkpoint_at_step K saves the state after step K
(`jax_impl.checkpoint.save_train_state`). The steps run under `jax.transfer_guard("disallow")`.
"""
from __future__ import annotations

import json
import os
import sys

from jax_impl.side import JaxSide  # imports no jax at module level (jax_impl/side.py): the flags below come first
from parity.protocol.loop import run_train
from parity.protocol.side import main_guard

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported


_FORCE_COUNT = "--xla_force_host_platform_device_count"


def force_host_devices(argv: list[str], environ: dict = os.environ) -> int | None:
  """Before jax is imported: give the CPU backend `jax.data_parallel` devices when the plan needs > 1.

  Reads the request JSON named by the first positional argument; when its `run.jax.data_parallel`
  n > 1 and XLA_FLAGS sets no device count yet, appends `--xla_force_host_platform_device_count=n`.
  The flag only affects the host (CPU) platform, so a GPU run keeps its real devices. Errors in the
  request are left to `main_guard`, which reports them.

  Returns:
    The forced count, or None when nothing was set.
  """
  paths = [a for a in argv if not a.startswith("-") and a.endswith(".json")]
  try:
    n = int(json.loads(open(paths[0]).read())["run"]["jax"].get("data_parallel", 1)) if paths else 1
  except (OSError, ValueError, KeyError, TypeError):
    return None
  flags = environ.get("XLA_FLAGS", "")
  if n <= 1 or _FORCE_COUNT in flags:
    return None
  environ["XLA_FLAGS"] = f"{flags} {_FORCE_COUNT}={n}".strip()
  return n


def main(argv: list[str] | None = None) -> int:
  if "jax" not in sys.modules:  # the flag is read when jax initialises its backends
    force_host_devices(sys.argv[1:] if argv is None else argv)
  return main_guard(lambda io: run_train(io, JaxSide()), argv)


if __name__ == "__main__":
  sys.exit(main())
