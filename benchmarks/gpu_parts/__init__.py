"""Sub-measurements of benchmarks/gpu.py, each run as its own process (`python -m benchmarks.gpu_parts.<part>`), and
the driver's own modules.

Parts (processes):
  torch_raw    torch: pinned host<->device copy bandwidth, matmul throughput
  jax_raw      JAX: device_put to/from pinned_host, the same moves inside a jitted step, the donated in-jit round
               trip (the in-step rate), matmul throughput
  jax_device   JAX: what the accelerator is (a TPU's device_kind, bytes_limit, memory kinds), read where it opens
  jax_train    JAX side: jax_impl.step.Trainer on one RunSpec (step time, tokens/s, peaks, offload bytes), or at
               several gradient accumulations (--grad-accum: the grid)
  jax_largest  JAX: the largest model per plan and the grid's depth, found by compiling the train step (no weights)
  ds_train     DeepSpeed side: torch_impl.engine.DeepSpeedTrainer on one RunSpec (the same figures)
  fsdp_train   FSDP2 side: torch_impl.fsdp.FsdpTrainer on one RunSpec, one rank (the same figures)
Driver modules (import neither jax nor torch):
  common       helpers every part and the driver share: peaks, failure classes, the compiled device peak
  device       naming the device (nvidia-smi, a TPU VM's probe), the header's environment, what cannot run here
  suite        the driver's state, `run_part` (timeouts, the chip lock, partial results)
  sizing       the sizes (the memory model and planner: parity only), the largest-model search
  by_compile   compile probes, the fit-down search, the confirming run and how it ended
  fixed_flow   the GPU flow: each side (jax, deepspeed, fsdp) on a fixed size that needs offload, largest by
               training probes
  grid_flow    the TPU flow: raw, compile, the plan x accumulation grid, the confirming runs
  grid         the grid's offload figures (overlap, link bound, memory saved)
  report       the Markdown of the suite's JSON; report_grid its grid-flow sections
"""
