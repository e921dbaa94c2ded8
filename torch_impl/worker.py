"""Worker of the PyTorch sides: `python -m torch_impl.worker run_dir/request.json --side deepspeed|torch`.

The loop is `parity.protocol.loop.run_train`; the side it drives is `torch_impl.side.TorchSide`, over the DeepSpeed
engine (`torch_impl.engine.DeepSpeedTrainer`, `--side deepspeed`) or the plain-torch baseline
(`torch_impl.baseline.TorchTrainer`, `--side torch`). It writes steps.jsonl, summary.json,
final.safetensors and final_moments.safetensors (Adam's sqrt(v_hat)). Exit codes: 0 ok, 1 crashed (summary carries
the traceback), 3 non-finite loss or grad norm.

Checkpoints: with resume_from the trainer is built from the initial weights and then restored
(`torch_impl.checkpoint.restore`); save_checkpoint_at_step K saves the complete state after step K
(`torch_impl.checkpoint.save`).
"""
from __future__ import annotations

from parity.protocol.loop import run_train
from parity.protocol.side import exit_now, main_guard
from torch_impl.side import TorchSide


def main(argv: list[str] | None = None) -> int:
  return main_guard(lambda io: run_train(io, TorchSide()), argv)


if __name__ == "__main__":
  exit_now(main())  # no interpreter teardown: the runtime's C++ threads can abort there (parity.protocol.side.exit_now)
