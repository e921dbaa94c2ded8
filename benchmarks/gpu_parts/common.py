"""Helpers shared by the GPU benchmark's parts and its driver. Imports neither jax nor torch (numpy and parity only).

A part is `python -m benchmarks.gpu_parts.<name> --json OUT [...]`: it writes one JSON object to OUT and exits 0,
or exits non-zero with its error on stderr (the driver records the tail; `classify_failure` names an OOM).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from parity.protocol.memory_figures import compiled_memory  # noqa: E402
from parity.sizing.cost import flops_per_token as _flops_per_token  # noqa: E402
from parity.sizing import cost, memory, plans  # noqa: E402
from parity.weights import param_shapes  # noqa: E402
from parity.spec import RunSpec, from_dict, to_dict  # noqa: E402

GB = 10**9

def _tpu(bf16: float, int8: float) -> dict[str, float]:
  """A TPU's row of PEAK_FLOPS from its bf16 and int8 data-sheet peaks (fp32 and tf32 derived: the comment there)."""
  return {"bf16": bf16, "int8": int8, "tf32": bf16 / 3, "fp32": bf16 / 6}


# Dense (no sparsity) peak FLOP/s per device, from NVIDIA's data sheets: H100 (SXM5 / PCIe / NVL) and H200 (SXM /
# NVL) Tensor Core BF16 989.4 / 756 / 835 / 989.4 / 835 TFLOP/s, TF32 494.7 / 378 / 417.5 / 494.7 / 417.5, plain
# FP32 (CUDA cores) 66.9 / 51.2 / 60 / 66.9 / 60. The data sheets print twice these tensor figures "with sparsity".
# A100 (SXM/PCIe): BF16 312, TF32 156, FP32 19.5. Matched on the device name, most specific first.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H200", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    # Google Cloud TPU pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e), peak per chip: v5e bf16 197 TFLOP/s, int8
    # 394 TOP/s; v5p bf16 459, int8 918; v6e (Trillium) bf16 918, int8 1836 (the planner's presets,
    # parity.sizing.cost.HARDWARE, hold the same bf16 figures). The MXUs multiply bf16 only: an fp32 matmul at
    # precision 'highest' runs as 6 bf16 passes and 'high' (JAX's 'tensorfloat32') as 3 (XLA's BF16_BF16_F32_X6 /
    # _X3 dot algorithms), so 'fp32' and 'tf32' here are bf16 / 6 and bf16 / 3: derived, not printed in a data
    # sheet (a v5e measured 31 TFLOP/s at 'highest' and 164 in bf16, 8192^3). device_kind names: 'TPU v5 lite'
    # (v5e), 'TPU v5' / 'TPU v5p' (v5p), 'TPU v6 lite' / 'TPU v6e' (v6e); the lite names come first.
    ("TPU v5 lite", _tpu(197e12, 394e12)),
    ("TPU v5e", _tpu(197e12, 394e12)),
    ("TPU v6 lite", _tpu(918e12, 1836e12)),
    ("TPU v6e", _tpu(918e12, 1836e12)),
    ("TPU v5p", _tpu(459e12, 918e12)),
    ("TPU v5", _tpu(459e12, 918e12)),
]

OOM_PATTERNS = ("RESOURCE_EXHAUSTED", "Ran out of memory in memory space", "out of memory", "OutOfMemoryError",
                "Out of memory", "CUDA error: out of", "cudaErrorMemoryAllocation", "MemoryError",
                "Cannot allocate memory", "std::bad_alloc")
"""stderr text of an allocation failure: XLA (RESOURCE_EXHAUSTED; the TPU compiler's 'Ran out of memory in memory
space hbm'), torch/CUDA, numpy/Python, the C++ runtime."""

DEVICE_PEAK_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")


def compiled_device_peak(memory_analysis: dict | None) -> dict[str, Any]:
  """The compiled step's memory by memory space from its `memory_analysis()` fields
  (jax_impl.step.Trainer.memory_analysis; parity.protocol.memory_figures.compiled_memory):
  'device_bytes' = the device figure: XLA's `peak_memory_in_bytes` less the step's host-resident buffers (host
  argument + output - alias, which XLA's peak counts), the device fields' sum where XLA gives no peak;
  'device_from' = how; 'host_bytes' = the host_* argument + output + temp - alias (the step's pinned_host buffers:
  host memory, never device); 'xla_peak_bytes' = XLA's own peak as it reads (host buffers included); 'peak_bytes' =
  argument + output + temp - alias of the device fields, the compiler's sum, which on a TPU counts temporaries the
  runtime does not hold at once (17.04 GB for a step the 16.91 GB chip ran, holding 13.67 GB): not a device peak.
  None where a field is missing (no analysis)."""
  ma = memory_analysis or {}
  vals = [ma.get(k) for k in DEVICE_PEAK_FIELDS]
  host = [ma.get("host_" + k) for k in DEVICE_PEAK_FIELDS]
  arg, out, temp, alias = vals
  split = compiled_memory(ma)
  return {"device_bytes": split["device"], "device_from": split["device_from"],
          "peak_bytes": arg + out + temp - alias if None not in vals else None,
          "xla_peak_bytes": ma.get("peak_memory_in_bytes"),
          "host_bytes": host[0] + host[1] + host[2] - host[3] if None not in host else None}


def recorded_device_bytes(compiled: dict | None) -> int | None:
  """The compiled device figure of a probe or run record's `compiled_device_peak` fields: its 'device_bytes', or for
  a record written before that field, XLA's peak less its 'host_bytes' (exact where the step has no host
  temporaries, which XLA's peak leaves out; lower by them where it has some); None where neither is there."""
  c = compiled or {}
  if c.get("device_bytes") is not None:
    return c["device_bytes"]
  xla, host = c.get("xla_peak_bytes"), c.get("host_bytes")
  return xla - host if xla is not None and host is not None and xla - host > 0 else None


def peak_flops(device_name: str | None, dtype: str) -> float | None:
  """Peak FLOP/s of `device_name` (e.g. 'NVIDIA H200', 'TPU v5 lite') for dtype 'bf16', 'tf32', 'fp32' (TPUs also
  'int8'); None when unknown (CPU, a dtype the table lacks)."""
  for key, table in PEAK_FLOPS:
    if device_name and key.lower() in device_name.lower():
      return table.get(dtype)
  return None


def flops_per_token(model, seq_len: int) -> float:
  """Training FLOPs per token: 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, appendix B: 6N for the forward and
  backward matmuls of N params, 12·L·h·s for attention scores and values; Megatron's Narayanan et al. 2021 eq. 3
  without recomputation counts the same terms). It is the planner's cost model (parity.sizing.plans)."""
  return float(_flops_per_token(model, seq_len))


def mfu_fields(model, seq_len: int, tokens_per_s: float, peak: float | None, *,
               causal_skip: bool = False) -> dict[str, Any]:
  """Both MFU counts of one measured rate against `peak` (FLOP/s; None where unknown: both MFUs None). 'mfu': the 6N
  convention (`flops_per_token`: every param, the embedding gathers included, attention dense). 'mfu_strict': matmul
  work only (parity.sizing.cost.strict_flops_per_token: matmul params, attention as the kernel computes it: its
  causal half with `causal_skip`, else dense), with the FLOPs per token each counts and 'attention_counted'."""
  fpt = flops_per_token(model, seq_len)
  strict = float(cost.strict_flops_per_token(model, seq_len, causal_skip=causal_skip))
  return {"flops_per_token": fpt, "strict_flops_per_token": strict,
          "attention_counted": cost.attention_counted(causal_skip),
          "mfu": tokens_per_s * fpt / peak if peak else None,
          "mfu_strict": tokens_per_s * strict / peak if peak else None}


MFU_NOTE = ("MFU (6N) = tokens/s x (6N + 12·L·h·s) FLOPs per token (PaLM, Chowdhery et al. 2022, app. B: every param "
            "counted, an untied input embedding's gather included, attention dense); MFU (strict) counts matmul "
            "params only (no embedding gathers, biases or norms) and attention as the kernel computes it (dense "
            "for parity's exact kernel and torch's masked SDPA, the causal half for a kernel that skips masked "
            "blocks)")
"""The sentence a report prints under an MFU table (`mfu_fields`)."""


def sizing_modules():
  """(memory, plans): the project's memory model and planner (parity.sizing), imported when first needed."""
  return memory, plans


def reset_peak_rss() -> bool:
  """Resets this process's peak RSS (VmHWM) to its current RSS (Linux: write 5 to /proc/self/clear_refs)."""
  try:
    Path("/proc/self/clear_refs").write_text("5")
    return True
  except OSError:
    return False


def peak_rss_bytes() -> int | None:
  """This process's peak resident set (VmHWM), bytes; None where /proc is missing."""
  try:
    for line in Path("/proc/self/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def host_memory_bytes() -> dict[str, int]:
  """MemTotal and MemAvailable of this machine, bytes (empty where /proc/meminfo is missing)."""
  out = {}
  try:
    for line in Path("/proc/meminfo").read_text().splitlines():
      key, _, rest = line.partition(":")
      if key in ("MemTotal", "MemAvailable"):
        out[key] = int(rest.split()[0]) * 1024
  except OSError:
    pass
  return out


def fast_params(model) -> dict[str, np.ndarray]:
  """Canonical float32 weights of `model` filled with constants (norm scales 1, biases 0, matrices init_std):
  the same names, shapes and bytes as parity.weights.init_params without drawing billions of normals. For the
  largest-model probes only, where values change neither the memory nor the time of a step."""
  out = {}
  for name, shape in param_shapes(model).items():
    norm = ".ln_" in name or name.startswith("ln_f")
    out[name] = np.full(shape, fast_value(model, norm and name.endswith(".weight"), name.endswith(".bias")),
                        np.float32)
  return out


def fast_value(model, norm_scale: bool, bias: bool) -> float:
  """The constant of one fast-init tensor (`fast_params`; jax_train.filled_trainer fills the flax tree with it)."""
  return 1.0 if norm_scale else 0.0 if bias else model.init_std


def part_parser(doc: str, spec_required: bool = True) -> argparse.ArgumentParser:
  """The options every training part takes: --spec, --json, --steps, --warmup, --fast-init."""
  ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  ap.add_argument("--spec", required=spec_required, help="RunSpec JSON (parity.spec.to_dict)")
  ap.add_argument("--json", required=True)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--fast-init", action="store_true")
  return ap


def timed_steps(step, vocab_size: int, shape: tuple[int, ...], steps: int, warmup: int, sync=None,
                probe_first: bool = False) -> tuple[list[float], dict]:
  """`warmup` untimed then `steps` timed calls of `step(batch)` (with probe=True on the first where `probe_first`) on
  random token ids of `shape`, `sync()` around each (a CUDA device's synchronize; None: the step returns when done)."""
  rng = np.random.default_rng(0)
  sync = sync or (lambda: None)
  times, metrics = [], {}
  for i in range(warmup + steps):
    batch = rng.integers(0, vocab_size, shape).astype(np.uint16)
    sync()
    s0 = time.perf_counter()
    metrics = step(batch, probe=i == 0) if probe_first else step(batch)
    sync()
    if i >= warmup:
      times.append(time.perf_counter() - s0)
  return times, metrics


def timing(times: list[float]) -> dict[str, float]:
  """median, min, max of timed seconds."""
  return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "n": len(times)}


def read_spec(path: str):
  """The RunSpec a driver wrote with `write_spec`."""
  return from_dict(RunSpec, json.loads(Path(path).read_text()))


def write_spec(run, path: Path) -> Path:
  """Writes a RunSpec as JSON (parity.spec.to_dict) for a part to read."""
  path.write_text(json.dumps(to_dict(run), indent=1))
  return path


def write_json(path: str | Path, data: dict[str, Any]) -> None:
  """Writes a part's result (non-finite floats as null)."""
  def clean(x):
    if isinstance(x, float) and not math.isfinite(x):
      return None
    if isinstance(x, dict):
      return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v) for v in x]
    if isinstance(x, np.generic):
      return clean(x.item())
    return x
  Path(path).write_text(json.dumps(clean(data), indent=1, default=str))


def classify_failure(returncode: int | None, stderr: str, timed_out: bool) -> str:
  """'timeout', 'oom' (stderr names an allocation failure, or the kernel's OOM killer: SIGKILL) or 'error'."""
  if timed_out:
    return "timeout"
  if any(p in stderr for p in OOM_PATTERNS) or returncode in (-9, 137):
    return "oom"
  return "error"


def tail(text: str, lines: int = 15, chars: int = 2000) -> str:
  """The last lines of a process's output, without ANSI escapes, at most `chars` characters."""
  text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text or "")
  return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def raw_args(description: str, argv: list[str] | None) -> argparse.Namespace:
  """The command line of the raw probes (jax_raw, torch_raw): --json OUT, --mib copy size (MiB), --n matmul size,
  --reps repetitions."""
  ap = argparse.ArgumentParser(description=description)
  ap.add_argument("--json", required=True)
  ap.add_argument("--mib", type=int, default=1024, help="copy size, MiB")
  ap.add_argument("--n", type=int, default=8192, help="matmul size")
  ap.add_argument("--reps", type=int, default=5)
  return ap.parse_args(argv)

