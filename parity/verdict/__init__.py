"""The comparison: per-step and per-tensor checks between sides, and where each tolerance comes from.

  check.py       Check, what every check returns
  steps.py       scalar per-step checks (loss, grad norm, lr, val loss, fp16 scale/skips), completion,
                 determinism/resume
  params.py      the final-params rule (per-element Adam or per-tensor); its Adam kernels and AdamSensitivity,
                 which workers feed, are parity.numerics.adam
  envelope.py    the bf16/fp16 noise envelope: per-step windows and final params against each side's rerun
  gating.py      which checks are reported only (gating False): the one registry the reruns and the verifier use
  sides.py       compare_sides (every check of every pair) and the verdict
  reruns.py      what the noise-envelope, host-CPU, determinism and resume reruns find from their workers' files
                 (the run and the verifier call the same functions)
  equivalence.py the --equivalence check and its report section
  tolerances.py  every tolerance with its derivation or measurement
"""
