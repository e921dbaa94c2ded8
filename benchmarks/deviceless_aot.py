"""Deviceless AOT: the JAX train step compiled for an H100 by the CUDA plugin on a machine with no GPU.

  pip install -c constraints.txt jax==0.10.2 jaxlib==0.10.2 jax-cuda13-plugin==0.10.2   # + jax-cuda13-pjrt
  JAX_PLATFORMS=cpu python benchmarks/deviceless_aot.py --out tests/fixtures/hlo

No driver, no GPU and no nvidia-* wheels are needed (the plugin's `with-cuda` extra is not installed); XLA runs
`ptxas` and reads `libdevice.10.bc` from a CUDA toolkit (it found /usr/local/cuda, CUDA 13.0, on the machine the
fixtures came from). docs/deviceless-aot.md has the story, the errors met on the way, and what the fixtures show.

How it works, and why not plainly `jax.jit(f).lower(...).compile()` on a topology mesh:
  1. `jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=H100_SXM, topology="1x1x1")`
     gives compile-only H100 devices (no cuInit). Their memories are unimplemented in jaxlib 0.10.2
     (`default_memory()` raises UNIMPLEMENTED), so a NamedSharding on them silently drops
     `memory_kind="pinned_host"` (it reads None) and the step would compile with every buffer in device memory.
  2. So the step is traced and lowered on CPU devices, where the memory kinds hold, with
     `lower(lowering_platforms=("cuda",))`: JAX's GPU lowering rules, which keep in-jit `device_put`s as
     `annotate_device_placement` custom calls (CPU's own lowering drops them).
  3. That StableHLO module is compiled by the compile-only CUDA client with JAX's own compile options
     (`pxla.create_compile_options`), onto the H100 device: the optimised HLO is the GPU compiler's, with its
     latency-hiding schedule, host offloader and sm_90a kernels.

Writes OUT/<name>-h100.hlo.txt (the optimised HLO; over --max-kb cut by benchmarks/hlo_moves.py `trim`, which says
how in the JSON) and OUT/<name>-h100.json (versions, target config, command, memory_analysis, and every host<->device
move with its bytes, direction, computation, trip count and window: `hlo_moves.transfers`). Names: host-move and
remat-offload (two tiny functions), then the plans zero2-offload, scan-offload and act-offload (the project's train
step on a 2-layer GPT). Private JAX API used: `pxla.create_compile_options`, `pxla.get_prop_to_input_output`,
`compiler.backend_compile_and_load`, `Lowered._lowering` (jax 0.10.2).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA backend cannot start without a driver (cuInit fails)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import compiler  # noqa: E402
from jax._src.interpreters import pxla  # noqa: E402
from jax._src.lib import xla_client as xc  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from parity.sizing.plans import PLANS as PLAN_PAIRS, apply_plan  # noqa: E402
from parity.spec import ModelSpec, RunSpec, TrainSpec  # noqa: E402
from parity.weights import init_params  # noqa: E402
from jax_impl.offload import make_mesh  # noqa: E402
from jax_impl.step import Trainer  # noqa: E402
from benchmarks.hlo_moves import summary, transfers, trim  # noqa: E402

H100_SXM = """\
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  core_count: 132
  fpus_per_core: 128
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 2048
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 patch: 0 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
"""GpuTargetConfigProto (text) of an H100 SXM 80 GB. The device numbers are those of XLA's own H100 spec
(openxla/xla xla/backends/gpu/target_config/specs/h100_sxm.txtpb, which XLA made from a real H100's
CreateDeviceDescription), reduced to fields jaxlib 0.10.2's proto knows; cuDNN 9.12 and CUDA runtime 13.0 are the
versions jax-cuda13-plugin 0.10.2 was built against (`jax_cuda13_plugin._versions`)."""

MODEL = ModelSpec(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
TRAIN = TrainSpec(steps=1, micro_batch_size=2, grad_accum_steps=2, seq_len=8, warmup_steps=1, lr=1e-2, eval_every=0)
PLANS = ("zero2-offload", "scan-offload", "act-offload")


def cuda_devices(target_config: str = H100_SXM, topology: str = "1x1x1") -> list[Any]:
  """Compile-only CUDA devices of `topology` ("slices x hosts x devices per host") for `target_config`.

  Raises:
    jax.errors.JaxRuntimeError: FAILED_PRECONDITION when the text is no GpuTargetConfigProto of this jaxlib.
  """
  return list(topologies.get_topology_desc(platform="cuda", target_config=target_config, topology=topology).devices)


def compile_for(lowered: Any, devices: list[Any]) -> Any:
  """Compiles a `Lowered` (lowered for the cuda platform) onto compile-only `devices` with JAX's compile options.

  Returns the unloaded xla Executable (`hlo_modules()`, `get_compiled_memory_stats()`).
  """
  comp = lowered._lowering
  args = comp.compile_args
  allow_in, allow_out = pxla.get_prop_to_input_output(args["in_shardings"], args["out_shardings"],
                                                      len(args["ordered_effects"]))
  opts = pxla.create_compile_options(comp.stablehlo(), args["tuple_args"], allow_in, allow_out,
                                     devices[0].client, np.array(devices, dtype=object),
                                     dict(comp._compiler_options_kvs))
  return compiler.backend_compile_and_load(devices[0].client, comp.stablehlo(), xc.DeviceList(tuple(devices)),
                                           opts, [])


def _cpu_sharding(kind: str) -> NamedSharding:
  return NamedSharding(Mesh(np.array(jax.devices("cpu")[:1]), ("x",)), P(), memory_kind=kind)


def host_move_fn() -> tuple[Any, tuple[Any, ...]]:
  """x (1024, 1024) f32 in pinned_host -> moved to device, sin(x) * 2, returned to pinned_host."""
  host, dev = _cpu_sharding("pinned_host"), _cpu_sharding("device")

  def f(x):
    return jax.device_put(jnp.sin(jax.device_put(x, dev)) * 2.0, host)
  return jax.jit(f, out_shardings=host), (jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=host),)


def remat_offload_fn() -> tuple[Any, tuple[Any, ...]]:
  """grad of sum(tanh(tanh(x @ w) @ w)) with the inner activation `h` (512, 512) f32 offloaded to pinned_host."""
  policy = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device", offload_dst="pinned_host")

  def layer(w, x):
    return jnp.tanh(checkpoint_name(jnp.tanh(x @ w), "h") @ w)
  loss = lambda w, x: jax.checkpoint(layer, policy=policy)(w, x).sum()
  s = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=_cpu_sharding("device"))
  return jax.jit(jax.grad(loss)), (s, s)


def plan_step(plan: str) -> tuple[Any, tuple[Any, ...], RunSpec]:
  """The project's train step of `plan` on the tiny MODEL/TRAIN, built on one CPU device (`Trainer.build`), and its
  abstract arguments as `Trainer.compile` makes them (state with the plan's shardings, uint16 batch (A, M, T + 1))."""
  run = apply_plan(RunSpec(model=MODEL, train=TRAIN), plan)
  t = Trainer.build(run, init_params(MODEL, 0), mesh=make_mesh(jax.devices("cpu")[:1]))  # memory kinds hold on CPU
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  state = jax.tree.map(sds, t.state, t.shardings)
  batch = jax.ShapeDtypeStruct((TRAIN.grad_accum_steps, TRAIN.micro_batch_size, TRAIN.seq_len + 1), np.uint16,
                               sharding=t.placement.batch_sharding())
  return t.jit_step, (state, batch), run


def compile_one(name: str, jitted: Any, args: tuple[Any, ...], devices: list[Any]) -> dict[str, Any]:
  """Trace and lower `jitted` for cuda on CPU shardings, compile for `devices`; the HLO text and figures."""
  t0 = time.perf_counter()
  lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
  exe = compile_for(lowered, devices)
  hlo = exe.hlo_modules()[0].to_string()
  stats = exe.get_compiled_memory_stats()
  mem = {k: int(getattr(stats, k)) for k in dir(stats) if k.endswith("_in_bytes")}
  moves = transfers(hlo)
  return {"name": name, "hlo": hlo, "hlo_sha256": hashlib.sha256(hlo.encode()).hexdigest(),
          "memory_analysis": mem, "summary": summary(moves), "transfers": moves,
          "entry_layout_host_buffers": hlo.split("\n", 1)[0].count("S(5)"),
          "lower_compile_s": round(time.perf_counter() - t0, 2)}


def versions() -> dict[str, Any]:
  """Versions of jax, jaxlib, the CUDA plugin and pjrt, flax, optax and numpy, the ptxas XLA runs, JAX's remat and
  offload flags, and XLA_FLAGS."""
  out: dict[str, Any] = {}
  for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "optax", "numpy"):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = "not installed"
  ptxas = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ptxas"
  ptxas = str(ptxas) if ptxas.exists() else shutil.which("ptxas")
  run = subprocess.run([ptxas, "--version"], capture_output=True, text=True) if ptxas else None
  release = [ln for ln in (run.stdout if run else "").splitlines() if "release" in ln]
  out["ptxas"] = f"{ptxas}: {release[0]}" if release else "not found"
  out["jax_flags"] = {k: v for k, v in jax.config.values.items() if "remat" in k or "offload" in k}
  out["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
  out["python"] = sys.version.split()[0]
  return out


def main(argv: list[str] | None = None) -> int:
  """CLI (see the module docstring). Exit 0 when every function compiled; 1 otherwise (errors in the JSON)."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "hlo")
  ap.add_argument("--only", nargs="*", default=None, help="names to compile (default: all)")
  ap.add_argument("--max-kb", type=int, default=300, help="trim an HLO text over this many KB")
  a = ap.parse_args(argv)
  a.out.mkdir(parents=True, exist_ok=True)
  devices = cuda_devices()
  jobs = {"host-move": host_move_fn, "remat-offload": remat_offload_fn}
  jobs.update({p: (lambda p=p: plan_step(p)[:2]) for p in PLANS})
  rc = 0
  for name, make in jobs.items():
    if a.only and name not in a.only:
      continue
    meta = {"versions": versions(), "target_config": H100_SXM, "device_kind": devices[0].device_kind,
            "topology": "1x1x1", "command": "JAX_PLATFORMS=cpu python " + " ".join(
                ["benchmarks/deviceless_aot.py", *(sys.argv[1:] if argv is None else argv)])}
    if name in PLANS:
      meta.update(plan=name, jax_plan=dataclasses.asdict(PLAN_PAIRS[name].jax), model=dataclasses.asdict(MODEL),
                  train=dataclasses.asdict(TRAIN))
    try:
      res = compile_one(name, *make(), devices)
    except Exception as exc:  # recorded, the others still run
      rc = 1
      (a.out / f"{name}-h100.json").write_text(json.dumps({**meta, "error": f"{type(exc).__name__}: {exc}"}, indent=1))
      print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
      continue
    text, note = trim(res.pop("hlo"), a.max_kb * 1024)
    (a.out / f"{name}-h100.hlo.txt").write_text(text)
    (a.out / f"{name}-h100.json").write_text(json.dumps({**meta, **res, "hlo_text": note}, indent=1))
    print(f"{name}: {json.dumps(res['summary'])} memory={res['memory_analysis']} ({res['lower_compile_s']} s)")
  return rc


if __name__ == "__main__":
  sys.exit(main())
