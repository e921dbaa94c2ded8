#!/usr/bin/env bash
# TPU VM measurements in one command (docs/benchmarks.md, "On a TPU VM"): installs what the VM image lacks
# (benchmarks/tpu_parts/env.sh), then runs one part and tars its folder into $OUT (default
# benchmarks/results/tpu-<date>). Parts: recon (doctor, numerics probe, a few compares with their run folders), matrix
# (benchmarks/tpu_parts/matrix.py: the family x precision x plan grid of `parity compare --sides jax,torch`, the
# plants, and a JAX run folder for a cross-machine join; `matrix --part fp32 --part join`, `--part bf16`,
# `--part plants`), bench (benchmarks/tpu_parts/bench.py: benchmarks/gpu.py's suite on the chip, bench.tgz; BUDGET_S
# 420 by default there, options after the part go to it and to gpu.py), kernels (benchmarks/tpu_parts/kernels.py:
# whether a host copy runs under compute in one program, and the step's tokens/s and MFU with each attention kernel;
# `kernels --only overlap` or `--only mfu`), offload (benchmarks/tpu_parts/offload.py: the in-step copy rates, offload
# on/off equality, and each offload layout's step time and device memory). Each part ends within BUDGET_S seconds
# (default 480) of this script's start, install included.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-matrix}
shift || true
export OUT=${OUT:-benchmarks/results/tpu-$(date -u +%Y-%m-%d)}
mkdir -p "$OUT"
export TPU_SH_T0=${TPU_SH_T0:-$(date +%s)}
source benchmarks/tpu_parts/env.sh
case "$PART" in
  recon) source benchmarks/tpu_parts/recon.sh ;;
  verdict) source benchmarks/tpu_parts/verdict.sh ;;
  *) python3 benchmarks/tpu_parts/"$PART".py --out "$OUT" "$@" ;;
esac
