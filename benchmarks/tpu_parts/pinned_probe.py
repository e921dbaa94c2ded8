"""Where a TPU's pinned_host arrays live: filled one by one (jit-made, GIB_EACH each) up to --total-gib, with the
host's memory use (cgroup, else MemTotal - MemAvailable) after each, and TPU_PREMAPPED_BUFFER_SIZE as set. If the
use grows by each array's size, the arrays are allocated beside the premapped region, not inside it; an error says
where the runtime refused. Writes --out (JSON)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.tpu_parts.memguard import used_and_limit  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--total-gib", type=float, default=24)
  ap.add_argument("--gib-each", type=float, default=2)
  ap.add_argument("--kind", default="pinned_host")
  a = ap.parse_args()
  rec = {"premapped": os.environ.get("TPU_PREMAPPED_BUFFER_SIZE"), "kind": a.kind, "steps": []}
  rec["before_open"] = used_and_limit()[0]
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  rec["after_open"] = used_and_limit()[0]
  sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind=a.kind)
  n = int(a.gib_each * 2**30 / 4)
  fill = jax.jit(lambda v: jnp.full((n,), v, jnp.float32), out_shardings=sharding)
  held = []
  t0 = time.perf_counter()
  while len(held) * a.gib_each < a.total_gib:
    try:
      x = fill(float(len(held)))
      x.block_until_ready()
      held.append(x)
      rec["steps"].append({"arrays": len(held), "used": used_and_limit()[0], "s": time.perf_counter() - t0})
    except Exception as exc:  # the refusal is the finding
      rec["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
      break
    Path(a.out).write_text(json.dumps(rec, indent=1))
  if held:
    rec["readback_ok"] = bool(float(held[-1][:4].sum()) == 4.0 * (len(held) - 1))
  Path(a.out).write_text(json.dumps(rec, indent=1))
  for s in rec["steps"]:
    print(f"{s['arrays'] * a.gib_each:5.1f} GiB {a.kind}: host use {s['used'] / 2**30:6.2f} GiB ({s['s']:.1f} s)")
  print({k: v for k, v in rec.items() if k != "steps"})
  return 0


if __name__ == "__main__":
  sys.exit(main())
