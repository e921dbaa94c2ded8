# Sourced by benchmarks/tpu.sh recon: a first look at a TPU VM: doctor, the numerics probe (with the process's memory
# fields after it used the chip), and short compares whose run folders' JSON files (placement.json, semantics cards,
# steps, summaries) and XLA's optimised HLO of one train step come back in recon.tgz.
R=$OUT/recon
mkdir -p "$R"
deadline=$(( $(date +%s) + ${BUDGET_S:-480} ))
left() { echo $(( deadline - $(date +%s) )); }
python3 -m parity doctor --json "$R/doctor.json" > "$R/doctor.txt" 2>&1 || echo "doctor rc $?" >> "$R/doctor.txt"
python3 benchmarks/tpu_parts/probe_numerics.py "$R/numerics.json" > "$R/numerics.txt" 2>&1
run() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  [ "$(left)" -lt 30 ] && { echo "skip $name: out of time" >> "$R/log.txt"; return; }
  [ "$secs" -gt "$(left)" ] && secs=$(left)
  local t0=$(date +%s)
  XLA_FLAGS="--xla_dump_to=$R/$name-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*" \
    timeout "$secs" python3 -m parity compare --out "$R/$name" --no-progress --determinism-steps 0 "$@" \
    > "$R/$name.txt" 2>&1
  echo "$name rc $? $(( $(date +%s) - t0 )) s" >> "$R/log.txt"
}
common=(--sides jax,torch --steps 4 --no-noise-envelope --train-anyway-on-card-diff)
run gpt2-fp32 60 --preset gpt2-tiny "${common[@]}"
run llama3-bf16-scan 60 --preset llama3-tiny --set train.precision=bf16 --plan scan-offload "${common[@]}"
run qwen3-fp32-act 60 --preset qwen3-tiny --plan act-offload "${common[@]}"
run gemma3-fp32 60 --preset gemma3-tiny "${common[@]}"
run mistral-ds 40 --preset mistral-tiny --sides jax,deepspeed --steps 2 --no-noise-envelope
(cd "$R" && find . -path "*-hlo/*" ! -name "*after_optimizations.txt" -delete 2>/dev/null
 find . \( -name "*.npz" -o -name "*.npy" -o -name "*.safetensors" -o -name "*.png" -o -name "*.html" \) -delete)
tar czf "$OUT/recon.tgz" -C "$OUT" recon
ls -la "$OUT"
