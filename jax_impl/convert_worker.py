"""Canonical safetensors <-> orbax checkpoint, run as a subprocess by `parity convert-weights`.

  python -m jax_impl.convert_worker to-orbax   CANONICAL.safetensors ORBAX_DIR [--force]
  python -m jax_impl.convert_worker from-orbax ORBAX_DIR CANONICAL.safetensors

The canonical file must carry its spec (parity.hf.canonical_metadata). `from-orbax` writes
with the same metadata, so canonical -> orbax -> canonical reproduces the file byte for byte.
Exit codes: 0 ok, 2 bad input (message on stderr).
"""
from __future__ import annotations

import argparse
import sys

from parity import hf
from jax_impl import checkpoint
from jax_impl.layout import from_flax, to_flax


def main(argv: list[str] | None = None) -> int:
  """`python -m jax_impl.convert_worker to-orbax|from-orbax SRC DST [--force]`: converts canonical safetensors
  to an Orbax checkpoint or back, in a JAX process started by harness.launch. Returns 0, or 2 with the reason on
  stderr (bad or missing input, an existing destination without --force)."""
  ap = argparse.ArgumentParser(prog="python -m jax_impl.convert_worker")
  sub = ap.add_subparsers(dest="op", required=True)
  p = sub.add_parser("to-orbax")
  p.add_argument("src")
  p.add_argument("dst")
  p.add_argument("--force", action="store_true")
  p = sub.add_parser("from-orbax")
  p.add_argument("src")
  p.add_argument("dst")
  args = ap.parse_args(argv)
  try:
    if args.op == "to-orbax":
      params, spec = hf.load_canonical(args.src)
      checkpoint.save(args.dst, to_flax(params, spec), spec, force=args.force)
    else:
      tree, spec = checkpoint.load(args.src)
      hf.save_canonical(args.dst, from_flax(tree, spec), spec)
  except (ValueError, FileNotFoundError, FileExistsError) as exc:
    print(f"convert_worker {args.op}: {exc}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
