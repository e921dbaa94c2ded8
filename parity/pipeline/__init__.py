"""The run pipeline: resolve a run, claim its folder, run the sides, collect, compare, rerun, report.

  resolve.py   every source of a run's settings -> one frozen ResolvedRun (the one resolver)
  folder.py    per-side perturbations; the run folder's inputs (request, weights, batches), written once
  perturb.py   what each --perturb makes each side run (or why it is refused), the DeepSpeed side's config included
  claim.py     the run folder's lock: one run per folder, nothing a user had is overwritten
  compare.py   `compare()` / `run_comparison()`: the pipeline top to bottom (the after-report step, --baseline and
               --tracker, is its caller's: parity.history.after.PostRun.for_options; this package never imports the
               history)
  collect.py   reading back what each side wrote, only when it is whole and this run's own
               (parity.protocol.outputs.side_outputs)
  reruns.py    the noise-envelope, determinism and resume reruns, each returning its checks and report section
               (computed by parity.verdict.reruns, which the verifier calls too)
"""
