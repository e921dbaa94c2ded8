"""The package layout as docs/architecture.md draws it: no import cycles inside parity/, counting function-local
imports (a local import that closes a circle only hides it), and each package imports only what its layer may."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
  out = {}
  for p in (ROOT / "parity").rglob("*.py"):
    rel = p.relative_to(ROOT).with_suffix("")
    out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
  return out


def _graph() -> dict[str, set[str]]:
  """module -> the parity modules it imports anywhere in its body (top level or inside functions)."""
  mods = _modules()

  def owner(name: str) -> str:
    while name and name not in mods:
      name = name.rsplit(".", 1)[0] if "." in name else ""
    return name

  graph: dict[str, set[str]] = {m: set() for m in mods}
  for m, path in mods.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for t in targets:
        o = owner(t) if t.startswith("parity") else ""
        if o and o not in ("parity", m) and not m.startswith(o + "."):
          graph[m].add(o)
  return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle as a path [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
  state: dict[str, int] = {}
  for start in graph:
    if state.get(start):
      continue
    stack = [(start, iter(sorted(graph[start])))]
    path = [start]
    state[start] = 1
    while stack:
      node, it = stack[-1]
      nxt = next(it, None)
      if nxt is None:
        state[node] = 2
        stack.pop()
        path.pop()
      elif state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      elif not state.get(nxt):
        state[nxt] = 1
        stack.append((nxt, iter(sorted(graph[nxt]))))
        path.append(nxt)
  return None


def test_no_import_cycles_in_parity():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  cycle = _cycle(graph)
  assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_lower_layers_do_not_import_higher_ones():
  """errors < inputs < spec < weights/data < numerics/sizing/verdict < protocol < pipeline/report < cli: the
  shared basics never reach up into the pipeline, the report or the CLI."""
  graph = _graph()
  base = {"parity.errors", "parity.inputs", "parity.spec", "parity.weights", "parity.data"}
  upper = ("parity.pipeline", "parity.report", "parity.cli", "parity.diagnose")
  for m in base | {m for m in graph if m.startswith(("parity.numerics", "parity.verdict", "parity.sizing"))}:
    bad = sorted(t for t in graph[m] if t.startswith(upper))
    assert not bad, f"{m} imports {bad}"
