# Sourced by benchmarks/tpu.sh: installs what a TPU VM's image lacks into a writable target and sets the environment.
# Where the VM has its own package index (/opt/pypi/simple) and wheel folder (/opt/wheels), pip installs from them
# (flax, optax, orbax, safetensors, matplotlib, pyyaml, transformers, torch's CPU build) and from wheels carried in
# .whl-tpu/ (pydantic, rich, hjson, py-cpuinfo, psutil, deepspeed: docs/install.md, "On a TPU VM"); elsewhere from
# pip's default index. PYTHONPATH is appended to, never replaced: the image puts jax and libtpu on it.
# TPU_SH_JAX_ONLY=1 leaves torch and deepspeed out (the JAX-only parts: a minute less to install, and less of a
# tmpfs /tmp held in memory).
SITE=${PARITY_TPU_SITE:-${TMPDIR:-/tmp}/parity-site}
t0=$(date +%s)
TORCH_PKG=torch==2.13.0
[ -n "${TPU_SH_JAX_ONLY:-}" ] && TORCH_PKG=
if [ ! -f "$SITE/.done" ]; then
  SOURCES=()  # the image's own index and wheel folder where it has them, else pip's default index
  [ -d /opt/pypi/simple ] && SOURCES+=(--index-url file:///opt/pypi/simple)
  for d in .whl-tpu /opt/wheels; do [ -d "$d" ] && SOURCES+=(--find-links "$d"); done
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: "${SOURCES[@]}" --target "$SITE" \
    flax optax orbax-checkpoint safetensors matplotlib pyyaml pydantic rich psutil hjson py-cpuinfo tqdm \
    ninja msgpack einops packaging $TORCH_PKG 2>&1 | grep -v "^WARNING" | tail -5
  ok=${PIPESTATUS[0]}
  if [ -z "${TPU_SH_JAX_ONLY:-}" ] && compgen -G ".whl-tpu/deepspeed-*.whl" > /dev/null; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --target "$SITE" \
      .whl-tpu/deepspeed-*.whl 2>&1 | grep -v "^WARNING" | tail -3
    [ "${PIPESTATUS[0]}" = 0 ] || ok=1
  fi
  # marked done only when pip succeeded: a failed install is retried by the next run, not skipped
  if [ "$ok" = 0 ]; then touch "$SITE/.done"; else echo "[tpu.sh] install into $SITE failed (pip above)" >&2; fi
fi
echo "[tpu.sh] install: $(( $(date +%s) - t0 )) s into $SITE"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:$SITE" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/parity-torch-extensions}
export DS_ACCELERATOR=cpu
