"""Worker of the FSDP2 side: `python -m torch_impl.fsdp_worker run_dir/request.json --side fsdp` (with several ranks,
under torchrun: harness.ranks).

The loop is `parity.protocol.loop.run_train`; the side it drives is `torch_impl.fsdp_side.FsdpSide` over
`torch_impl.fsdp.FsdpTrainer`. It writes what every worker writes (steps.jsonl, summary.json, final.safetensors,
final_moments.safetensors, semantics.json; rank 0 only). Exit codes: 0 ok, 1 crashed (summary carries the traceback),
3 non-finite loss or grad norm. Checkpoints: torch_impl.fsdp_side.save / restore (DCP).
"""
from __future__ import annotations

from parity.protocol.loop import run_train
from parity.protocol.side import exit_now, main_guard
from torch_impl.fsdp_side import FsdpSide


def main(argv: list[str] | None = None) -> int:
  return main_guard(lambda io: run_train(io, FsdpSide()), argv)


if __name__ == "__main__":
  exit_now(main())  # no interpreter teardown: the runtime's C++ threads can abort there (parity.protocol.side.exit_now)
