"""pytorch_model.bin -> safetensors, run as a subprocess by `parity convert-weights`.

  python -m torch_impl.convert_worker bin-to-safetensors OUT.safetensors IN.bin [IN2.bin ...]

Each pickle is read with `torch.load(weights_only=True)` (no code execution), on the CPU,
memory-mapped. Floating tensors are written as float32 (bf16/fp16 widen exactly); others
(e.g. the bool causal-mask buffers of old GPT-2 checkpoints) keep their dtype. Tied tensors
are written once per name. Names are kept as stored; `parity.hf` maps them.
Exit codes: 0 ok, 2 bad input (message on stderr).
"""
from __future__ import annotations

import sys
from pathlib import Path


def bin_to_safetensors(out: str | Path, files: list[str | Path]) -> int:
  """Converts the state dicts in `files` to one safetensors file; returns the tensor count.

  Raises:
    ValueError: a file is not a state dict of tensors, or two files hold the same name.
  """
  import torch  # torch: in the worker process only, after its environment is set
  from safetensors.torch import save_file
  tensors: dict[str, torch.Tensor] = {}
  for f in files:
    state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict):
      raise ValueError(f"{f}: expected a state dict, got {type(state).__name__}")
    for k, v in state.items():
      if not isinstance(v, torch.Tensor):
        raise ValueError(f"{f}: entry {k!r} is a {type(v).__name__}, not a tensor")
      if k in tensors:
        raise ValueError(f"{f}: tensor {k!r} also appears in an earlier file")
      v = v.float() if v.is_floating_point() else v
      tensors[k] = v.contiguous().clone()
  save_file(tensors, str(out))
  return len(tensors)


def main(argv: list[str] | None = None) -> int:
  """`python -m torch_impl.convert_worker bin-to-safetensors SRC DST`: converts a pytorch_model.bin to
  safetensors in a torch process. Returns the exit code (2 with usage on bad arguments)."""
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) < 3 or argv[0] != "bin-to-safetensors":
    print(__doc__, file=sys.stderr)
    return 2
  try:
    bin_to_safetensors(argv[1], argv[2:])
  except (ValueError, FileNotFoundError, RuntimeError) as exc:
    print(f"convert_worker bin-to-safetensors: {exc}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
