"""The history of runs: one finished run held against others, standing on one run's report (parity.report reads a
run folder back and re-verifies it; parity.report never imports this package).

  comparison  `parity report A B C`: one page over several runs (comparison.md/.html/.json)
  gates       every regression gate and why it is that wide (GATES, STEP_TIME_BAND + STEP_TIME_SLACK_S, ...)
  bands       what two runs share (machine, versions, threads, configuration) and so each side's per-step band
  gate_rows   the gate's rows, one per metric and side
  gate        check_against (`parity compare --baseline`, `parity check`), gate.json/gate.md, read_gate
  snapshot    what the gate compares: a run folder or its card.json as a Snapshot (load_baseline)
  after       what a comparison does after its report: the gate and the tracker mirror (PostRun; its callers hand
              the pipeline PostRun.for_options, the pipeline never imports this package)

The gate never imports the comparison page; the page reads each run's gate (read_gate).
"""
