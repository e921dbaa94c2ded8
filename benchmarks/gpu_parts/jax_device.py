"""JAX part: what the accelerator is, read by the process that opens it (the driver never opens the chip).

  python -m benchmarks.gpu_parts.jax_device --json OUT

Writes jax_impl.doctor's probe (jax/jaxlib versions, backend, devices, memory kinds, the chip's kind, count,
memory_stats bytes_limit and the runtime's host-buffer settings) plus libtpu's version, and the seconds from the
process start to the devices being up (`open_s`: on a TPU the runtime's start). Never imports torch.
"""
from __future__ import annotations

import argparse
import sys
import time

T0 = time.time()

from benchmarks.gpu_parts.common import write_json  # noqa: E402
from benchmarks.gpu_parts.device import package_version  # noqa: E402


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", required=True)
  args = ap.parse_args(argv)
  import jax  # the chip opens here
  jax.devices()
  opened = time.time() - T0
  from jax_impl.doctor import probe
  res = {**probe(bandwidth=False), "libtpu": package_version("libtpu", "libtpu-nightly"), "open_s": opened,
         "part": "jax_device"}
  write_json(args.json, {**res, "complete": True})
  return 0


if __name__ == "__main__":
  sys.exit(main())
