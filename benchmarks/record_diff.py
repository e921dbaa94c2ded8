"""Record-for-record diff of two run folders' side outputs, timing fields aside.

    python benchmarks/record_diff.py RUN_A RUN_B [--ignore KEY ...] [--no-default-ignores]

For every side folder of RUN_A and RUN_B (the main run's and every rerun's: repeat/, resume/, noise/, ...: any
folder holding a steps.jsonl or summary.json), compares
  steps.jsonl       record by record, field by field (exact equality: the floats as JSON wrote them);
  summary.json      field by field, recursively (dicts by key, lists by position);
  final*.safetensors  tensor for tensor (names, dtypes, shapes, bytes) and their metadata (the file's bytes are
                    not compared: safetensors writes its metadata map in a per-process hash order).
Fields that are expected to differ between two runs of the same code are left out (VOLATILE: wall-clock timings,
process memory peaks, run ids, creation times; the machine's load when a torch side chose its threads:
VOLATILE_PATHS); each run folder's own path is replaced by `<run>` in every string,
so resumed_from / checkpoint.path compare. Every left-out field that did differ is counted in the last line, so
nothing is hidden silently. Prints one line per difference; exit 0 when the records are identical, 1 otherwise,
2 on bad input. Used to show that a refactor keeps the default compare's records.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

VOLATILE = frozenset({
    "step_time_s",  # steps.jsonl: wall seconds of the step
    "init_s", "compile_s", "train_s", "step_time_s_median", "tokens_per_s",  # summary: timings and throughput
    "compile_times_s", "save_s", "op_build_s", "created_unix_s",  # nested timings (jax compile, checkpoint, op builds)
    "peak_host_rss_bytes", "peak_rss_bytes", "peak_rss_bytes_wait4",  # resident-set peaks: allocator dependent
    "run_id", "pid",  # a fresh id per run folder, a process id per rank (multi-rank summaries)
    "loss_tokens_per_s", "cpu_adam_s", "host_rss_readings_bytes",  # throughput, CPU-Adam seconds, RSS samples
})
"""Field names (at any depth) that differ between two runs of the same code on the same machine."""
VOLATILE_PATHS = ("threads.inputs", "threads.reason")
"""Dotted field paths (ending a field's path) left out too: the load a torch side measured when it chose its thread
settings (harness.env), and the reason text that quotes it; the settings chosen are compared."""


def _load_steps(path: Path) -> list[dict[str, Any]]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tensor_diffs(pa: Path, pb: Path, where: str) -> list[str]:
  """Differences of two safetensors files: tensor names, dtypes, shapes, bytes, and the metadata."""
  from safetensors import safe_open  # the project's dependency; only this comparison needs it
  out = []
  with safe_open(str(pa), framework="numpy") as fa, safe_open(str(pb), framework="numpy") as fb:
    if (fa.metadata() or {}) != (fb.metadata() or {}):
      out.append(f"{where}: metadata {fa.metadata()} != {fb.metadata()}")
    ka, kb = set(fa.keys()), set(fb.keys())
    out += [f"{where}: tensor {k} only in {'A' if k in ka else 'B'}" for k in sorted(ka ^ kb)]
    for k in sorted(ka & kb):
      x, y = fa.get_tensor(k), fb.get_tensor(k)
      if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
        out.append(f"{where}: tensor {k} differs ({x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)})")
  return out


def _walk(a: Any, b: Any, where: str, ignore: frozenset[str], skipped: Counter, out: list[str],
          paths: tuple[str, ...] = VOLATILE_PATHS) -> None:
  """Appends 'where: a != b' for every difference of two JSON values; counts differing ignored keys (`ignore`: field
  names at any depth; `paths`: dotted path endings)."""
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(set(a) | set(b), key=str):
      if k in ignore or (paths and f"{where}.{k}".endswith(paths)):
        if a.get(k) != b.get(k):
          skipped[k] += 1
        continue
      if k not in a or k not in b:
        out.append(f"{where}.{k}: only in {'B' if k not in a else 'A'}")
      else:
        _walk(a[k], b[k], f"{where}.{k}", ignore, skipped, out, paths)
  elif isinstance(a, list) and isinstance(b, list):
    if len(a) != len(b):
      out.append(f"{where}: length {len(a)} != {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
      _walk(x, y, f"{where}[{i}]", ignore, skipped, out, paths)
  elif a != b or type(a) is not type(b):
    out.append(f"{where}: {a!r} != {b!r}")


def _relocated(value: Any, root: Path) -> Any:
  """`value` with the run folder's path replaced by '<run>' in every string."""
  text = json.dumps(value)
  return json.loads(text.replace(json.dumps(str(root.resolve()))[1:-1], "<run>").replace(
      json.dumps(str(root))[1:-1], "<run>"))


def side_folders(root: Path) -> list[Path]:
  """Folders under `root` (relative paths) holding a side's steps.jsonl or summary.json, sorted."""
  found = {p.parent.relative_to(root) for name in ("steps.jsonl", "summary.json") for p in root.rglob(name)}
  return sorted(found, key=str)


def diff_runs(a: Path, b: Path, ignore: frozenset[str] = VOLATILE,
              paths: tuple[str, ...] = VOLATILE_PATHS) -> tuple[list[str], Counter, int]:
  """(differences, differing ignored fields by name, side folders compared) of two run folders."""
  out: list[str] = []
  skipped: Counter = Counter()
  folders_a, folders_b = side_folders(a), side_folders(b)
  for only, where in ((set(folders_a) - set(folders_b), "A"), (set(folders_b) - set(folders_a), "B")):
    out += [f"{f}/: side folder only in {where}" for f in sorted(only, key=str)]
  common = [f for f in folders_a if f in set(folders_b)]
  for f in common:
    da, db = a / f, b / f
    if (da / "steps.jsonl").exists() or (db / "steps.jsonl").exists():
      sa = _load_steps(da / "steps.jsonl") if (da / "steps.jsonl").exists() else None
      sb = _load_steps(db / "steps.jsonl") if (db / "steps.jsonl").exists() else None
      _walk(_relocated(sa, a), _relocated(sb, b), f"{f}/steps.jsonl", ignore, skipped, out, paths)
    if (da / "summary.json").exists() or (db / "summary.json").exists():
      ja = json.loads((da / "summary.json").read_text()) if (da / "summary.json").exists() else None
      jb = json.loads((db / "summary.json").read_text()) if (db / "summary.json").exists() else None
      _walk(_relocated(ja, a), _relocated(jb, b), f"{f}/summary.json", ignore, skipped, out, paths)
    for name in sorted({p.name for d in (da, db) for p in d.glob("final*.safetensors")}):
      pa, pb = da / name, db / name
      if not (pa.exists() and pb.exists()):
        out.append(f"{f}/{name}: only in {'A' if pa.exists() else 'B'}")
      else:
        out += _tensor_diffs(pa, pb, f"{f}/{name}")
  return out, skipped, len(common)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("a", type=Path, help="run folder A (e.g. before a change)")
  ap.add_argument("b", type=Path, help="run folder B (e.g. after it)")
  ap.add_argument("--ignore", action="append", default=[], help="one more field name to leave out (repeatable)")
  ap.add_argument("--no-default-ignores", action="store_true", help="compare the VOLATILE fields and paths too")
  args = ap.parse_args(argv)
  for p in (args.a, args.b):
    if not p.is_dir():
      print(f"record_diff: {p}: not a folder (give two run folders of `parity compare`)", file=sys.stderr)
      return 2
  ignore = frozenset(args.ignore) | (frozenset() if args.no_default_ignores else VOLATILE)
  diffs, skipped, n = diff_runs(args.a, args.b, ignore, () if args.no_default_ignores else VOLATILE_PATHS)
  for line in diffs:
    print(line)
  left_out = ", ".join(f"{k} ({v})" for k, v in sorted(skipped.items())) or "none"
  print(f"{n} side folders compared; {len(diffs)} difference(s); left-out fields that differed: {left_out}")
  return 0 if not diffs else 1


if __name__ == "__main__":
  sys.exit(main())
