"""The run protocol between the harness and a side's worker process, split by its two ends.

  parity.protocol.layout   the run folder's files (request.json, batches, steps.jsonl, summary.json, final and moments
                           files, checkpoints, report.json, the lock, the rerun folders noise/ repeat/ resume/
                           backend/ equivalence/) and their readers: read_steps, read_summary, read_moments,
                           enclosing_run, ...
  parity.protocol.outputs  what a side left in its folder: SideRun (as the harness saw it), side_outputs (its files,
                           trusted only when whole and of this run), read by the pipeline and by the verifier
  parity.protocol.control  run control (stop_after_step, save_checkpoint_at_step, resume_from): derive_request (the
                           harness end) and parse_control / check_resume (the checks a worker runs)
  parity.protocol.side     the worker end: SideIO (inputs, records, summary, checkpoints), the batch-shape check,
                           main_guard
  parity.protocol.loop     the `Side` protocol a side's worker implements and the one training loop, run_train(io, side)
  parity.protocol.diagnose the diagnose worker's request and files, `DiagnoseSide` and run_diagnose(io, side)
  parity.protocol.ranks    multi-rank sides: the launch file, per-rank files, the global-batch rule, the refusals
  parity.protocol.workers  the worker modules by (side, job), read from the side records (parity.sides)

This package re-exports the public names of layout, control, side, loop and workers, so
`from parity.protocol import SideIO, read_steps` keeps working.
It imports neither jax nor torch.
"""
from parity.protocol.control import CONTROL_KEYS, ControlError, RunControl, check_resume, derive_request, parse_control
from parity.protocol.layout import (CHECKPOINT_DIR, CHECKPOINT_META, CHECKPOINT_SCHEMA, DEBUG_KEYS, FINAL_MOMENTS,
                                    LAUNCH_ENV, MOMENT_KINDS, REQUEST_SCHEMA, STEP_LIST_KEYS, SUMMARY_SCHEMA,
                                    parse_debug_value, read_checkpoint_meta, read_moments, read_steps, read_summary)
from parity.protocol.loop import Side, SideSummary, run_train
from parity.protocol.side import SideIO, check_batch_shapes, main_guard, peak_rss_bytes
from parity.protocol.workers import DIAGNOSE_WORKERS, SIDE_WORKERS, WORKERS, worker_module, workers_for

__all__ = ["SideIO", "Side", "SideSummary", "run_train", "SIDE_WORKERS", "DIAGNOSE_WORKERS", "WORKERS", "worker_module",
           "workers_for", "REQUEST_SCHEMA",
           "SUMMARY_SCHEMA", "LAUNCH_ENV", "DEBUG_KEYS", "STEP_LIST_KEYS", "parse_debug_value", "read_steps",
           "read_summary", "CONTROL_KEYS", "RunControl", "ControlError", "derive_request",
           "parse_control", "check_resume", "CHECKPOINT_DIR", "CHECKPOINT_META", "CHECKPOINT_SCHEMA",
           "read_checkpoint_meta", "FINAL_MOMENTS", "MOMENT_KINDS", "read_moments", "check_batch_shapes", "main_guard",
           "peak_rss_bytes"]
