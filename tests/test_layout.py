"""The package layout as docs/architecture.md draws it: no import cycles among the modules of parity/, harness/,
jax_impl/ and torch_impl/ (within a package or across them), counting function-local imports (a local import that
closes a circle only hides it), and every module of those packages imports only what its row of the import table
allows (RULES; the doc's table is checked against it)."""
from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[1]


def _graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
  """module -> the project's modules it imports anywhere in its body (top level or inside functions), over every
  package of OWN (or `sources`: dotted name -> module text). A top-level package face (`parity`, `torch_impl`) is no
  target: `from parity import spec` names parity.spec, and the face's own lazy imports are its business."""
  mods = sources if sources is not None else {m: p.read_text() for m, p in own_modules().items()}

  def owner(name: str) -> str:
    while name and name not in mods:
      name = name.rsplit(".", 1)[0] if "." in name else ""
    return name

  graph: dict[str, set[str]] = {m: set() for m in mods}
  for m, text in mods.items():
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for t in targets:
        o = owner(t) if t.split(".")[0] in OWN else ""
        if o and o not in (*OWN, m) and not m.startswith(o + "."):
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


def test_no_import_cycles_in_the_project():
  cycle = _cycle(_graph())
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  cycle = _cycle(graph)
  assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_cycle_check_sees_planted_circles_in_any_package():
  """Module texts through the same graph builder: a circle inside jax_impl closed by a function-local import, and one
  across packages (harness -> parity -> harness) are found; the same modules without the closing import are not."""
  texts = {"jax_impl.model": "from jax_impl.layers import Dense\n", "jax_impl.layers": "from jax_impl import layout\n",
           "jax_impl.layout": "import jax\ndef to_flax():\n  from jax_impl.model import GPT\n", "jax_impl": ""}
  cycle = _cycle(_graph(texts))
  assert cycle is not None and set(cycle) == {"jax_impl.model", "jax_impl.layers", "jax_impl.layout"}, cycle
  assert _cycle(_graph({**texts, "jax_impl.layout": "import jax\n"})) is None
  across = {"harness.env": "from parity.sizing import host_limits\n", "parity.sizing.host_limits": "import harness.env",
            "parity.sizing": "", "parity": "", "harness": ""}
  assert set(_cycle(_graph(across)) or ()) == {"harness.env", "parity.sizing.host_limits"}


def test_lower_layers_do_not_import_higher_ones():
  """errors < inputs < spec < weights/data < numerics/sizing/verdict < protocol < pipeline/report < cli: the
  shared basics never reach up into the pipeline, the report or the CLI."""
  graph = _graph()
  base = {"parity.errors", "parity.inputs", "parity.spec", "parity.weights", "parity.data"}
  upper = ("parity.pipeline", "parity.report", "parity.history", "parity.cli", "parity.diagnose")
  for m in base | {m for m in graph if m.startswith(("parity.numerics", "parity.verdict", "parity.sizing"))}:
    bad = sorted(t for t in graph[m] if t.startswith(upper))
    assert not bad, f"{m} imports {bad}"


# ----------------------------------------------------------------------------- the import table
OWN = ("parity", "harness", "jax_impl", "torch_impl")
"""The project's own top-level packages (benchmarks/ and tests/ are scripts over them, not layers)."""
FRAMEWORKS = frozenset({"jax", "jaxlib", "flax", "optax", "orbax", "torch", "deepspeed"})
JAX = frozenset({"jax", "jaxlib", "flax", "optax", "orbax"})
TORCH = frozenset({"torch", "deepspeed"})


@dataclasses.dataclass(frozen=True)
class Rule:
  """One row of docs/architecture.md's import table: the project's own units a package may import (`own`: a unit is
  'parity' for parity's top-level modules, 'parity.<sub>' for a subpackage, 'harness', 'jax_impl', 'torch_impl', or a
  single module such as 'parity.numerics.adam'), the other packages it may import (`third`; the standard library is
  always allowed), and what it must never import (`never`, own units or third-party names)."""
  own: frozenset[str]
  third: frozenset[str]
  never: frozenset[str] = frozenset()


def _rule(own: str, third: str = "", never: frozenset[str] | str = frozenset()) -> Rule:
  never = frozenset(never.split()) if isinstance(never, str) else never
  return Rule(frozenset(own.split()), frozenset(third.split()), never)


_PARITY = "parity parity.numerics"
FLOW = ("parity.cli", "parity.pipeline", "harness", "parity.verdict", "parity.report", "parity.history")
"""One run's flow, docs/architecture.md: cli -> pipeline -> harness -> (the sides) -> verdict -> report -> history.
The pipeline and the harness drive a run; the report and the history read what it left: neither reaches back up into
the ones that drive it, and the pipeline hands its caller's after-report step the report instead of importing the
history (parity.pipeline.compare.AfterStep). The verdict and the run protocol below them are shared by all."""
BACK_UP: dict[str, frozenset[str]] = {
  "parity.pipeline": frozenset({"parity.cli", "parity.history"}),
  "parity.report": frozenset({"parity.cli", "parity.pipeline", "harness", "parity.history"}),
  "parity.history": frozenset({"parity.cli", "parity.pipeline", "harness"}),
}
"""What each stage of FLOW never imports: the stages that drive it (and, for the pipeline, the history after it)."""
RULES: dict[str, Rule] = {
  # the package face composes the pipeline with the history's after-report step (parity.compare, run_comparison)
  "parity (package)": _rule("parity parity.history parity.pipeline", "", FRAMEWORKS | {"harness"}),
  # `python -m parity` is the CLI's entry point
  "parity (main)": _rule("parity.cli", "", FRAMEWORKS | {"harness"}),
  "parity": _rule(_PARITY, "numpy safetensors pydantic yaml hjson", FRAMEWORKS | {"harness"}),
  "parity.numerics": _rule("parity", "numpy", FRAMEWORKS | {"harness"}),
  # the placement check judges placement.json by the contract's own split of its host-compute ops
  "parity.verdict": _rule(f"{_PARITY} parity.protocol.placement", "numpy", FRAMEWORKS | {"harness"}),
  "parity.sizing": _rule(_PARITY, "numpy", FRAMEWORKS | {"harness"}),
  # the side's batch check computes the loss weights the NumPy reference does (framework-free)
  "parity.protocol": _rule(f"{_PARITY} parity.dataset.reference", "numpy safetensors", FRAMEWORKS | {"harness"}),
  "parity.hf": _rule(f"{_PARITY} parity.sizing harness", "numpy safetensors", FRAMEWORKS),
  "parity.migrate": _rule(f"{_PARITY} parity.protocol parity.sizing harness", "numpy pydantic yaml hjson", FRAMEWORKS),
  # dataset: a run's example inputs are built here; the after-report step (--baseline, --tracker) is the caller's
  "parity.pipeline": _rule(f"{_PARITY} parity.dataset parity.hf parity.migrate parity.protocol "
                           "parity.report parity.sizing parity.verdict harness", "numpy safetensors",
                           FRAMEWORKS | BACK_UP["parity.pipeline"]),
  "parity.diagnose": _rule(f"{_PARITY} parity.pipeline parity.protocol parity.sizing parity.verdict harness",
                           "numpy safetensors", FRAMEWORKS),
  "parity.report": _rule(f"{_PARITY} parity.hf parity.protocol parity.sizing parity.verdict",
                         "numpy matplotlib rich wandb mlflow tensorboard tensorboardX",
                         FRAMEWORKS | BACK_UP["parity.report"]),
  "parity.history": _rule(f"{_PARITY} parity.protocol parity.report parity.verdict", "numpy",
                          FRAMEWORKS | BACK_UP["parity.history"] | {"rich"}),
  "parity.dataset": _rule(_PARITY, "numpy tokenizers jinja2 pyarrow", FRAMEWORKS | {"harness"}),
  "parity.cli": _rule(f"{_PARITY} parity.diagnose parity.hf parity.history parity.migrate parity.pipeline "
                      "parity.report parity.sizing harness", "rich", FRAMEWORKS),
  # host_limits: the XLA pinned-host pool the workers' environment gets (env) and the doctor reports
  "harness": _rule(f"{_PARITY} parity.protocol parity.sizing.host_limits", "numpy",
                   FRAMEWORKS | {"parity.pipeline", "jax_impl", "torch_impl"}),
  # hf: the convert worker maps HF checkpoints to Flax params
  "jax_impl": _rule(f"{_PARITY} parity.hf parity.protocol parity.sizing.memory_jax",
                    "numpy safetensors ml_dtypes " + " ".join(sorted(JAX)), TORCH | {"torch_impl", "harness"}),
  "torch_impl": _rule(f"{_PARITY} parity.protocol", "numpy safetensors " + " ".join(sorted(TORCH)),
                      JAX | {"jax_impl", "harness"}),
}
"""docs/architecture.md, "Packages and what each may import", as data (the doc's table is checked against it)."""


@dataclasses.dataclass(frozen=True)
class Import:
  """One import statement's target: `name` the dotted module (for `from X import a`, X.a when that is a module of
  ours, else X), `line` its line, `local` True inside a function."""
  name: str
  line: int
  local: bool


def own_modules() -> dict[str, Path]:
  """Dotted name -> file, for every module of the project's own packages (a package is its __init__)."""
  out = {}
  for top in OWN:
    for p in (ROOT / top).rglob("*.py"):
      rel = p.relative_to(ROOT).with_suffix("")
      out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
  return out


def imports_of(source: str, module: str, modules: Iterable[str] = ()) -> list[Import]:
  """Every import in `source` (the text of `module`), module level or function-local, statements and calls naming
  the module (`_imported_by_call`); relative imports resolved against `module`; `from X import a` names X.a where
  X.a is in `modules`. Raises SyntaxError on bad source."""
  modules = set(modules)
  out: list[Import] = []

  def visit(node: ast.AST, local: bool) -> None:
    for child in ast.iter_child_nodes(node):
      inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
      if isinstance(child, ast.Import):
        out.extend(Import(a.name, child.lineno, local) for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = child.module or ""
        if child.level:
          pkg = module.split(".")[:len(module.split(".")) - child.level + (module in _PACKAGES)]
          base = ".".join(pkg + ([base] if base else []))
        for a in child.names:
          sub = f"{base}.{a.name}" if base else a.name
          out.append(Import(sub if sub in modules or not base else base, child.lineno, local))
      elif (named := _imported_by_call(child)) is not None:
        out.append(Import(named, child.lineno, local))
      visit(child, inner)

  visit(ast.parse(source), False)
  return out


_IMPORT_CALLS = {"import_module", "__import__"}
"""Calls that import the module named by their first argument (importlib.import_module, its bare name, __import__)."""


def _imported_by_call(node: ast.AST) -> str | None:
  """The module an `importlib.import_module('x')` / `import_module('x')` / `__import__('x')` call names, when written
  out as a string; None for any other node (a name held in a variable is data: its caller resolves it)."""
  if not isinstance(node, ast.Call) or not node.args:
    return None
  func = node.func
  name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
  first = node.args[0]
  if name in _IMPORT_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str):
    return first.value
  return None


_PACKAGES: set[str] = set()
"""Modules that are packages (an __init__.py): a relative import inside one is relative to itself."""


def unit_of(name: str) -> str:
  """The import-table unit a dotted module name belongs to ('parity.spec' -> 'parity', 'parity.verdict.params' ->
  'parity.verdict', 'torch_impl.ops' -> 'torch_impl'); a third-party name -> its top-level package."""
  parts = name.split(".")
  if parts[0] == "parity" and len(parts) > 2:
    return ".".join(parts[:2])
  if parts[0] == "parity" and len(parts) == 2:
    return name if (ROOT / "parity" / parts[1]).is_dir() else "parity"
  return parts[0]


def rule_key(module: str) -> str:
  """The RULES row that governs `module` (the package face `parity` and `python -m parity` have their own rows)."""
  return {"parity": "parity (package)", "parity.__main__": "parity (main)"}.get(module) or unit_of(module)


def _allows(u: str, name: str) -> bool:
  """Whether the own-unit `u` of a row covers the module `name`: a unit ('parity', 'parity.protocol', 'harness')
  covers exactly the modules of that unit (so 'parity' is parity's top-level modules, never a 'parity.<sub>'); a
  single module ('parity.sizing.memory_jax') covers itself and, were it a package, what lies under it."""
  if unit_of(u) == u:
    return unit_of(name) == u
  return name == u or name.startswith(u + ".")


def violations(module: str, imports: Iterable[Import], rules: dict[str, Rule] = RULES) -> list[str]:
  """Each import of `module` its row of `rules` does not allow, as 'module:line (local) imports X: why'."""
  rule = rules[rule_key(module)]
  home = unit_of(module)
  out = []
  for imp in imports:
    top = imp.name.split(".")[0]
    if not top or top in sys.stdlib_module_names or top == "__future__":
      continue
    unit = unit_of(imp.name)
    where = f"{module}:{imp.line}{' (function-local)' if imp.local else ''} imports {imp.name}"
    banned = sorted(n for n in rule.never if imp.name == n or imp.name.startswith(n + ".") or top == n)
    if banned:
      out.append(f"{where}: never {banned[0]}")
    elif top in OWN:
      if unit != home and not any(_allows(u, imp.name) for u in rule.own):
        out.append(f"{where}: {rule_key(module)} may import {sorted(rule.own)} of the project")
    elif top not in rule.third:
      out.append(f"{where}: {rule_key(module)} may import {sorted(rule.third)} besides the standard library")
  return out


def table_violations() -> list[str]:
  """Every import in the project's own packages that breaks RULES."""
  mods = own_modules()
  _PACKAGES.update(m for m, p in mods.items() if p.name == "__init__.py")
  out = []
  for m, p in sorted(mods.items()):
    out += violations(m, imports_of(p.read_text(), m, mods))
  return out


def local_own_imports(root: Path = ROOT) -> list[str]:
  """Every function-local import of the project's own modules (parity, harness, jax_impl, torch_impl) in those
  packages and benchmarks/, one per statement, as 'path:line name': the figure to count before and
  after a change."""
  out: dict[str, str] = {}
  for top in (*OWN, "benchmarks"):
    for p in sorted((root / top).rglob("*.py")):
      rel = p.relative_to(root).with_suffix("")
      module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
      for imp in imports_of(p.read_text(), module):
        if imp.local and imp.name.split(".")[0] in OWN:
          out.setdefault(f"{p.relative_to(root)}:{imp.line}", imp.name)
  return [f"{k} {v}" for k, v in out.items()]


def test_every_import_keeps_to_the_table():
  bad = table_violations()
  assert not bad, "imports the table does not allow:\n  " + "\n  ".join(bad)


def test_every_package_has_a_row():
  keys = {rule_key(m) for m in own_modules()}
  assert keys <= set(RULES), f"packages without a row in RULES: {sorted(keys - set(RULES))}"
  assert set(RULES) <= keys, f"rows for packages that do not exist: {sorted(set(RULES) - keys)}"


def test_the_checker_catches_planted_wrong_imports():
  """Module texts parsed by the same checker: a side importing the launcher, a framework imported inside a function
  of the contract, the launcher reaching into the pipeline, a package the row does not list, a relative import of
  the other side; and the allowed imports beside them pass."""
  mods = {"torch_impl.ops", "harness.lifetime", "parity.pipeline.folder", "parity.verdict.params", "jax_impl.model",
          "torch_impl", "parity.protocol.side"}
  planted = {
    "torch_impl.ops": "from parity.protocol import side\nfrom harness import lifetime\n",
    "parity.verdict.params": "import numpy as np\ndef f():\n  import torch\n  return torch\n",
    "harness.doctor": "from parity import environment\ndef g():\n  from parity.pipeline.folder import write_new\n",
    "parity.protocol.side": "import json\nimport pandas\n",
    "jax_impl.step": "from . import model\nfrom .. import torch_impl\n",
  }
  found = {m: violations(m, imports_of(text, m, mods)) for m, text in planted.items()}
  assert {m: len(v) for m, v in found.items()} == dict.fromkeys(planted, 1), found
  assert "torch_impl.ops:2 imports harness.lifetime: never harness" in found["torch_impl.ops"][0]
  assert "parity.verdict.params:3 (function-local) imports torch: never torch" in found["parity.verdict.params"][0]
  assert "harness.doctor:3 (function-local) imports parity.pipeline.folder" in found["harness.doctor"][0]
  assert "imports pandas" in found["parity.protocol.side"][0]
  assert "jax_impl.step:2 imports torch_impl: never torch_impl" in found["jax_impl.step"][0]



def test_the_checker_sees_imports_by_name_in_a_call():
  """importlib.import_module('x') and __import__('x') with the module written out are imports as much as an import
  statement (a reference held in data, as parity.sides.load_ref resolves, is not: its callers are checked)."""
  text = ("import importlib\nfrom importlib import import_module\nA = importlib.import_module('parity.pipeline')\n"
          "def f(name):\n  __import__('torch')\n  import_module('parity.cli.report')\n"
          "  return importlib.import_module(name)\n")
  found = violations("parity.report.card", imports_of(text, "parity.report.card"))
  assert len(found) == 3, found
  assert "parity.report.card:3 imports parity.pipeline: never parity.pipeline" in found[0]
  assert "parity.report.card:5 (function-local) imports torch: never torch" in found[1]
  assert "parity.report.card:6 (function-local) imports parity.cli.report: never parity.cli" in found[2]

def flow_violations(graph: dict[str, set[str]]) -> list[str]:
  """Each edge of an import graph (`_graph`) that runs back up the FLOW: 'module -> module' where the importer's
  stage never imports the target's (BACK_UP)."""
  return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                if unit_of(t) in BACK_UP.get(unit_of(m), frozenset()))


def test_the_flow_runs_one_way():
  """cli -> pipeline -> harness -> verdict -> report -> history, never back: no module of the report or the history
  imports the pipeline, the harness or the CLI, and the pipeline does not import the history, function-local
  imports included (the pipeline takes the history's after-report step from its caller)."""
  back = flow_violations(_graph())
  assert not back, "imports back up the flow:\n  " + "\n  ".join(back)


def test_the_checker_refuses_planted_imports_back_up():
  """Planted module texts (under real module names) that import back up the flow, at module level or inside a
  function, fail both the table (their row's `never`) and the flow check; the same modules importing the homes those
  names moved to (the run folder's names in parity.protocol.layout, the rerun outcomes in parity.verdict.reruns)
  pass both."""
  mods = {"parity.pipeline.reruns", "parity.pipeline.claim", "parity.history.after", "harness.self_runs",
          "harness.runner", "parity.cli.compare", "parity.protocol.layout", "parity.verdict.reruns"}
  planted = {
    "parity.report.page": "from parity.pipeline.reruns import envelope_result\n",
    "parity.report.card": "def f():\n  from harness.self_runs import NOISE_DIR\n  return NOISE_DIR\n",
    "parity.history.comparison": "from parity.pipeline.claim import enclosing_run\n",
    "parity.history.gate": "def g():\n  from parity.cli.compare import print_summary\n",
    "parity.pipeline.compare": "def h():\n  from parity.history.after import PostRun\n",
  }
  found = {m: violations(m, imports_of(text, m, mods)) for m, text in planted.items()}
  assert {m: len(v) for m, v in found.items()} == dict.fromkeys(planted, 1), found
  first = {m: v[0] for m, v in found.items()}
  assert "parity.report.page:1 imports parity.pipeline.reruns: never parity.pipeline" in first["parity.report.page"]
  assert "parity.report.card:2 (function-local) imports harness.self_runs: never harness" in first["parity.report.card"]
  assert "never parity.pipeline" in found["parity.history.comparison"][0]
  assert "never parity.cli" in found["parity.history.gate"][0]
  assert "parity.pipeline.compare:2 (function-local) imports parity.history.after: never parity.history" in \
      found["parity.pipeline.compare"][0]
  texts = {**{m: "" for m in mods}, **planted, "parity": "", "parity.report": "", "parity.history": "",
           "parity.pipeline": "", "harness": "", "parity.cli": "", "parity.protocol": "", "parity.verdict": ""}
  assert flow_violations(_graph(texts)) == sorted([
      "parity.report.page -> parity.pipeline.reruns", "parity.report.card -> harness.self_runs",
      "parity.history.comparison -> parity.pipeline.claim", "parity.history.gate -> parity.cli.compare",
      "parity.pipeline.compare -> parity.history.after"])
  moved = {"parity.report.page": "from parity.verdict.reruns import envelope_result\n",
           "parity.report.card": "def f():\n  from parity.protocol.layout import NOISE_DIR\n  return NOISE_DIR\n",
           "parity.history.comparison": "from parity.protocol.layout import enclosing_run\n"}
  assert all(violations(m, imports_of(text, m, mods)) == [] for m, text in moved.items())
  assert flow_violations(_graph({**texts, **moved, "parity.history.gate": "", "parity.pipeline.compare": ""})) == []


def test_a_row_allowing_parity_allows_only_its_top_level_modules():
  """The unit `parity` is parity's top-level modules, never every `parity.<sub>` under it; a subpackage unit allows
  its whole subpackage, a single-module entry that module only. Planted texts through imports_of and violations."""
  mods = {"parity.spec", "parity.pipeline.compare", "parity.sizing.plans", "parity.sizing.host_limits",
          "parity.numerics.schedule", "harness.runner", "parity.protocol.side"}
  planted = {
    "parity.report.write": ("import os\nfrom parity import spec\nfrom parity.numerics import schedule\n", 0),
    "parity.spec": ("from parity.pipeline import compare\nfrom harness import runner\n", 2),
    "parity.weights": ("import numpy\ndef f():\n  import jax\n", 1),
    "parity.verdict.sides": ("from parity.sizing import plans\nfrom parity.protocol import side\n", 2),
    "harness.env": ("from parity.sizing import host_limits\nfrom parity.sizing import plans\n", 1),
    "parity.numerics.schedule": ("from parity import spec\nfrom parity.protocol import side\n", 1),
  }
  found = {m: violations(m, imports_of(text, m, mods)) for m, (text, _) in planted.items()}
  assert {m: len(v) for m, v in found.items()} == {m: n for m, (_, n) in planted.items()}, found
  assert "parity.spec:1 imports parity.pipeline.compare: parity may import" in found["parity.spec"][0]
  assert "parity.spec:2 imports harness.runner: never harness" in found["parity.spec"][1]
  assert "parity.weights:3 (function-local) imports jax: never jax" in found["parity.weights"][0]
  assert "imports parity.sizing.plans" in found["harness.env"][0]
  assert violations("parity.__main__", imports_of("from parity.cli import main\n", "parity.__main__")) == []


def _doc_table() -> dict[str, tuple[set[str], set[str]]]:
  """docs/architecture.md's import table: row key -> (the backticked names of 'may import' before 'never', after)."""
  text = (ROOT / "docs" / "architecture.md").read_text()
  section = text.split("## Packages and what each may import", 1)[1].split("\n## ", 1)[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or not cells[0].startswith("`"):
      continue
    key = cells[0].strip("`").rstrip("/").replace("/", ".")
    top_rows = {"__init__.py": "parity (package)", "__main__.py": "parity (main)", "*.py": "parity"}
    key = top_rows.get(key.removeprefix("parity."), key) if key.startswith("parity.") else key
    may, _, never = cells[2].partition("never")
    rows[key] = (set(re.findall(r"`([^`]+)`", may)), set(re.findall(r"`([^`]+)`", never)))
  return rows


def test_the_documented_table_is_the_enforced_one():
  """Each row of the doc names exactly its RULES row: the project's units and other packages it may import (before
  'never') and what it never imports (after)."""
  doc = _doc_table()
  assert set(doc) == set(RULES), f"doc rows {sorted(doc)} vs RULES {sorted(RULES)}"
  for key, rule in RULES.items():
    may, never = doc[key]
    enforced = set(rule.own) | set(rule.third)
    assert may == enforced, f"{key}: doc says may import {sorted(may)}, RULES {sorted(enforced)}"
    assert never == set(rule.never), f"{key}: doc says never {sorted(never)}, RULES {sorted(rule.never)}"


def test_local_imports_of_our_modules_are_counted():
  """The counter finds a planted function-local import of ours and skips module-level and third-party ones."""
  text = "import os\nfrom parity import spec\ndef f():\n  from harness import env\n  import torch\n"
  assert [i.name for i in imports_of(text, "x", {"harness.env"}) if i.local] == ["harness.env", "torch"]
  assert all(" " in line for line in local_own_imports())
