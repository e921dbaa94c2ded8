# Sourced by benchmarks/tpu.sh verdict: the verdict with JAX on the chip and PyTorch on the host CPU. Correct runs
# (every model family, the three offload plans, fp32 and bf16), planted bugs (GELU form, LayerNorm eps, a wrong
# placement), and a JAX folder made from a carried request for `parity join` (runs/join-A, when carried). Each
# compare gets a share of BUDGET_S; what does not fit is skipped and said so in log.txt. The JSON of every run folder
# comes back in verdict.tgz (the join folder whole).
R=$OUT/verdict
mkdir -p "$R"
deadline=$(( $(date +%s) + ${BUDGET_S:-480} ))
left() { echo $(( deadline - $(date +%s) )); }
run() {  # name, seconds, args...
  local name=$1 secs=$2; shift 2
  [ "$(left)" -lt 25 ] && { echo "$name skipped: out of time" >> "$R/log.txt"; return; }
  [ "$secs" -gt "$(left)" ] && secs=$(left)
  local t0=$(date +%s)
  timeout "$secs" python3 -m parity compare --out "$R/$name" --no-progress --determinism-steps 0 "$@" \
    > "$R/$name.txt" 2>&1
  echo "$name rc $? $(( $(date +%s) - t0 )) s: $(grep -E '^(PASS|FAIL)' "$R/$name.txt" | head -1 | cut -c1-300)" \
    >> "$R/log.txt"
}
jt=(--sides jax,torch)
run gpt2-fp32-z2off 90 --preset gpt2-tiny "${jt[@]}" --steps 30
run gemma3-fp32-scan 70 --preset gemma3-tiny "${jt[@]}" --plan scan-offload --steps 8
run plant-gelu 75 --preset gpt2-tiny "${jt[@]}" --steps 3 --perturb jax:model.gelu_approximate=false
run plant-placement 75 --preset gpt2-tiny "${jt[@]}" --steps 3 --perturb jax:placement_device=true
if [ -f runs/join-A/request.json ]; then
  run join-B-jax 60 --request runs/join-A/request.json --sides jax
fi
run plant-norm-eps 80 --preset gpt2-tiny "${jt[@]}" --steps 4 --perturb jax:model.norm_eps=1e-3
run qwen3-fp32-act 70 --preset qwen3-tiny "${jt[@]}" --plan act-offload --steps 8
run llama3-bf16-z2off 90 --preset llama3-tiny "${jt[@]}" --set train.precision=bf16
run mistral-fp32-default-sides 70 --preset mistral-tiny --steps 8
(cd "$R" && find . \( -name "*.png" -o -name "*.html" -o -name "*.log" -o -name pid \) -delete
 find . -path ./join-B-jax -prune -o \( -name "*.npz" -o -name "*.npy" -o -name "*.safetensors" \) -exec rm -f {} +)
tar czf "$OUT/verdict.tgz" -C "$OUT" verdict
cp "$R/log.txt" "$OUT/log.txt"
ls -la "$OUT"
