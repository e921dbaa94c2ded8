# Sourced by benchmarks/tpu.sh: installs what a TPU VM's image lacks into a writable target and sets the environment.
# The VM's own package index (/opt/pypi/simple) and wheel folder (/opt/wheels) give flax, optax, orbax, safetensors,
# matplotlib, pyyaml, transformers and torch's CPU build; pydantic, rich, hjson, py-cpuinfo, psutil and deepspeed
# come as wheels carried in .whl-tpu/ (docs/install.md, "On a TPU VM"). PYTHONPATH is appended to, never replaced:
# the image puts jax and libtpu on it. TPU_SH_JAX_ONLY=1 leaves torch and deepspeed out (the JAX-only parts: a
# minute less to install, and less of a tmpfs /tmp held in memory).
SITE=${PARITY_TPU_SITE:-${TMPDIR:-/tmp}/parity-site}
t0=$(date +%s)
TORCH_PKG=torch==2.13.0
[ -n "${TPU_SH_JAX_ONLY:-}" ] && TORCH_PKG=
if [ ! -f "$SITE/.done" ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --find-links .whl-tpu --find-links /opt/wheels --target "$SITE" \
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
