"""parity: PyTorch/DeepSpeed and JAX/Flax training side by side, with numerical parity checks.

This package is the shared contract and imports neither jax nor torch.
"""
from parity.presets import preset, PRESETS
from parity.spec import DeepSpeedPlan, JaxPlan, ModelSpec, RunSpec, SpecError, TrainSpec
from parity.data import DataError


def compare(preset: str | None = None, **keywords):
  """Runs a comparison and returns its Report: `parity.pipeline.compare.compare` (its keywords: resolve_run's
  parameters and RunOptions' fields; an unknown one raises TypeError naming it and the valid ones), with the
  history's after-report step (parity.history.after.PostRun: `baseline=`, `trackers=`).

  Imported on first use, like `run_comparison` and `RunOptions`: every worker imports parity.spec, and so this
  package, and must not load the pipeline, the harness and the report with it."""
  from parity.history.after import PostRun
  from parity.pipeline.compare import compare as _compare
  return _compare(preset, after=PostRun.for_options, **keywords)


def run_comparison(run, options):
  """Runs a resolved comparison (parity.pipeline.compare.run_comparison: `run` from resolve_run, `options` a
  RunOptions) with the history's after-report step (the `baseline` gate and the `trackers`), and returns its
  Report. Imported on first use (see `compare`)."""
  from parity.history.after import PostRun
  from parity.pipeline.compare import run_comparison as _run
  return _run(run, options, after=PostRun.for_options)


def __getattr__(name: str):
  """`parity.RunOptions` (parity.pipeline.compare), imported on first use (see `compare`)."""
  if name == "RunOptions":
    from parity.pipeline import compare as api
    return api.RunOptions
  raise AttributeError(f"module 'parity' has no attribute {name!r}")


__all__ = ["compare", "run_comparison", "RunOptions", "ModelSpec", "TrainSpec", "JaxPlan", "DeepSpeedPlan", "RunSpec",
           "SpecError", "DataError",
           "PRESETS", "preset"]
