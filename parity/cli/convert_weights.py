"""`parity convert-weights SRC DST`: arguments and the one-line summary of parity.hf.convert.convert."""
from __future__ import annotations

import argparse
import json

from parity.cli._common import EXIT_OK, Failure
from parity.hf.convert import FORMATS, convert
from parity.hf.families import FAMILIES
from parity.inputs import load_json
from parity.spec import ModelSpec, from_dict, to_dict

__all__ = ["register"]


def register(sub) -> None:
  """Adds `convert-weights` to the subparsers `sub`."""
  p = sub.add_parser("convert-weights", help="convert weights: Hugging Face folder <-> canonical <-> orbax",
                     description="Converts model weights between a Hugging Face checkpoint folder ("
                                 f"{', '.join(f.hf_class for f in FAMILIES)}), canonical safetensors (with "
                                 "the ModelSpec as metadata) and an orbax checkpoint of the Flax params. Exit 0; 1 "
                                 "when the output could not be written (nothing replaced); 2 on bad input.")
  p.add_argument("src",
                 help="HF folder (config.json + safetensors or pytorch_model.bin), .safetensors, or orbax folder")
  p.add_argument("dst", help="output: a .safetensors file (canonical) or a folder (--to hf|orbax)")
  p.add_argument("--from", dest="src_format", choices=FORMATS, help="source format (default: inferred from SRC)")
  p.add_argument("--to", dest="dst_format", choices=FORMATS, help="output format (default: inferred from DST)")
  p.add_argument("--spec", help="ModelSpec JSON file, for a canonical source without spec metadata (default: the "
                                "file's metadata)")
  p.add_argument("--force", action="store_true", help="replace DST if it is a checkpoint of the output format "
                 "(never the source, never anything else); the old one goes only once the new one is complete "
                 "(default off)")
  p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
  """Runs `convert-weights` and prints what it wrote. Returns 0.

  Raises:
    SpecError / ValueError / FileNotFoundError / FileExistsError: bad input (main exits 2).
    Failure: the output could not be written (exit 1); the source and an old DST stay.
  """
  spec = from_dict(ModelSpec, load_json(args.spec, what="--spec file"), path="model") if args.spec else None
  try:
    done = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format, spec=spec,
                   force=args.force)
  except (FileNotFoundError, FileExistsError):
    raise
  except OSError as exc:  # disk full, read-only folder: the output was not written; the source and an old DST stay
    raise Failure(f"cannot write {exc.filename or args.dst} ({exc.strerror or exc}); nothing was replaced") from None
  print(f"{done.src_format} -> {done.dst_format}: {done.dst} ({done.n_tensors} tensors, {done.n_params:,} params)")
  print("model: " + json.dumps(to_dict(done.spec), sort_keys=True))
  for note in done.notes:
    print(f"note: {note}")
  return EXIT_OK
