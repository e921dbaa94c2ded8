"""Sub-measurements of benchmarks/gpu.py, each run as its own process (`python -m benchmarks.gpu_parts.<part>`).

  common     helpers every part and the driver share (imports neither jax nor torch)
  torch_raw  torch: pinned host<->device copy bandwidth, matmul throughput
  jax_raw    JAX: device_put to/from pinned_host, the same moves inside a jitted step, matmul throughput
  jax_train  JAX side: jax_impl.step.Trainer on one RunSpec (step time, tokens/s, peaks, offload bytes)
  ds_train   DeepSpeed side: torch_impl.engine.DeepSpeedTrainer on one RunSpec (the same figures)
  sizing     the fixed GPT size that needs offload, the offload-cost batch, the largest-model start (parity only)
  report     the Markdown of the suite's JSON
"""
