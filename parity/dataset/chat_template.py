"""The jinja2 sandbox chat templates are compiled and rendered in, with limits: a template is code from a file the
user gave, and a hostile or broken one must be refused fast, naming the limit, rather than run for hours or fill the
memory before any side starts.

Limits, each per rendering (one call of `render`):
  MAX_STEPS   loop iterations plus calls (macros, methods, filters): nested `range()` loops meet it in well under a
              second; a real chat template takes one step per message and a few per call it makes.
  MAX_CHARS   characters (or items) of any text or list the template builds and of its whole output; sizes are
              checked before `*`, `+`, `%`, `~` and width arguments (center, indent, ...) build them, so
              `'x' * 10**9` is refused at once instead of being built (jinja2 would even fold it at compile time).
  MAX_INT_BITS  bits of an integer `*` or `**` may produce (`10**10**10` would run for hours).
  MAX_SECONDS wall time, checked at every step: the backstop for whatever the counts do not catch.
A syntax error is refused when the template is compiled, naming the line of the template.
"""
from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

from parity.data import DataError

__all__ = ["compile_template", "render", "TemplateSyntax", "GEN_OPEN", "GEN_CLOSE", "MAX_STEPS",
           "MAX_CHARS", "MAX_INT_BITS", "MAX_SECONDS"]

GEN_OPEN, GEN_CLOSE = "\ue000", "\ue001"
"""Private-use characters the `generation` tag wraps its text in while rendering; removed from the final text (a
message that holds one is refused)."""
MAX_STEPS = 1_000_000
"""Loop iterations plus calls in one rendering (a chat of 1,000 messages takes a few thousand)."""
MAX_CHARS = 16 * 2**20
"""Characters (or items) of any text or list one rendering builds, its output included (16 Mi; a 128k-token
sequence is about 0.5 Mi characters)."""
MAX_INT_BITS = 4096
"""Bits of an integer a template's `*` or `**` may produce."""
MAX_SECONDS = 30.0
"""Wall time of one rendering (s)."""
_FIX = "change the template so that it renders each chat in one pass over its messages"
_WIDTH_FILTERS = frozenset({"center", "indent", "wordwrap", "tojson", "batch", "slice"})
"""Filters whose integer arguments size what they build."""
_PERCENT_WIDTH = re.compile(r"%[-0 +" "#" r"]*(\d*)(?:\.(\d*))?")  # the flags: - 0 space + and the alternate form
_BRACE_FIELD = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")
"""A str.format field, one level of nested fields (a width taken from the arguments) included."""


class TemplateSyntax(DataError):
  """The chat template is not valid jinja2: a fault of the template, not of the record being rendered."""


class TemplateLimit(Exception):
  """A chat template went past one of this module's limits (the message names it and the fix)."""


class _Budget:
  """The steps and deadline of the rendering under way."""

  def __init__(self):
    self.steps, self.deadline = 0, time.monotonic() + MAX_SECONDS

  def step(self):
    self.steps += 1
    if self.steps > MAX_STEPS:
      raise TemplateLimit(f"ran past {MAX_STEPS:,} steps (loop iterations and calls) in one rendering, the limit a "
                          f"chat template has; remove the loop that does not end (e.g. nested range()), or {_FIX}")
    if not self.steps & 255 and time.monotonic() > self.deadline:
      raise TemplateLimit(f"ran past {MAX_SECONDS:g} s in one rendering, the limit a chat template has; {_FIX}")


def _too_big(n: int, what: str):
  raise TemplateLimit(f"would build {what} of {n:,} characters or items, over the {MAX_CHARS:,} one rendering of a "
                      "chat template may build; remove the repetition (e.g. 'x' * n, a width like center(n)) from "
                      "the template")


def _sized(value):
  """`value`, refused when it is a text or list over MAX_CHARS or an integer over MAX_INT_BITS."""
  if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_CHARS:
    _too_big(len(value), "a value")
  if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
    _big_int()
  return value


def _big_int():
  raise TemplateLimit(f"would build an integer of more than {MAX_INT_BITS:,} bits (e.g. 10 ** (10 ** 10)), the "
                      "limit a chat template has; remove that arithmetic from the template")


def _check_widths(numbers):
  for n in numbers:
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_CHARS:
      _too_big(n, "a text (a width or count argument)")


def _percent(fmt: str, args):
  """Refuses `fmt % args` whose widths (written, or `*` taken from args) exceed MAX_CHARS."""
  _check_widths(int(d) for m in _PERCENT_WIDTH.finditer(fmt) for d in m.groups() if d)
  if "*" in fmt:
    _check_widths(args if isinstance(args, tuple) else (args,))


def _binop(op: str, left, right):
  """Refuses `left op right` before it is computed when its result would exceed a limit."""
  seq = (str, bytes, list, tuple)
  ints = isinstance(left, int) and isinstance(right, int)
  if op == "*":
    if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
      _big_int()
    for a, b in ((left, right), (right, left)):
      if isinstance(a, seq) and isinstance(b, int) and len(a) * max(b, 0) > MAX_CHARS:
        _too_big(len(a) * b, "a repeated text or list")
  elif op == "**" and ints and right > 0 and abs(left) > 1 and right * (abs(left).bit_length() - 1) > MAX_INT_BITS:
    _big_int()
  elif op == "+" and isinstance(left, seq) and isinstance(right, seq) and len(left) + len(right) > MAX_CHARS:
    _too_big(len(left) + len(right), "a joined text or list")
  elif op == "%" and isinstance(left, str):
    _percent(left, right)


def _environment():
  """A jinja2 ImmutableSandboxedEnvironment as transformers renders chat templates in (trim_blocks, lstrip_blocks,
  loopcontrols, the `generation` tag, raise_exception, tojson without ASCII escaping), with this module's limits."""
  try:  # optional: only chat data needs it
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
  except ImportError:
    raise DataError("chat data (messages / conversations) needs jinja2 to render the tokenizer's chat template: "
                    "pip install jinja2") from None

  class Generation(Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_wrap"), [], [], body).set_lineno(lineno)

    def _wrap(self, caller):
      return GEN_OPEN + caller() + GEN_CLOSE

  class Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    budget = _Budget()

    def call_binop(self, context, operator, left, right):
      _binop(operator, left, right)
      return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):
      __self.budget.step()
      if isinstance(getattr(__obj, "__self__", None), str):  # 'x'.center(n), 'x'.ljust(n)
        _check_widths((*args, *kwargs.values()))
      return _sized(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
      """jinja2's sandboxed str.format, its widths checked first ('{:>9999999999}'.format(1))."""
      wrapped = super().wrap_str_format(value)
      if wrapped is None:
        return None

      def checked(*args, **kwargs):
        fields = _BRACE_FIELD.findall(value.__self__)
        _check_widths(int(d) for f in fields for d in re.findall(r"\d+", f))
        if any(f.count("{") > 1 for f in fields):  # a width taken from the arguments: '{:>{}}'
          _check_widths((*args, *kwargs.values()))
        return wrapped(*args, **kwargs)
      return checked

    def parity_iter(self, iterable):
      """Every `for` loop's iterable, counted item by item (`compile_template` puts it there)."""
      for item in iterable:
        self.budget.step()
        yield item

    def parity_concat(self, *parts):
      """The `~` operator (jinja2's str_join), its size checked before it is built."""
      texts = [str(p) for p in parts]
      if sum(map(len, texts)) > MAX_CHARS:
        _too_big(sum(map(len, texts)), "a joined text")
      return "".join(texts)

  def concat(chunks):  # the output of a macro, a call block or a {% set %} block
    chunks = list(chunks)
    if sum(map(len, chunks)) > MAX_CHARS:
      _too_big(sum(map(len, chunks)), "a block's output")
    return "".join(chunks)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"])
  env.concat = concat
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
  for name, f in list(env.filters.items()):
    env.filters[name] = _guarded(env, name, f)
  env.globals["raise_exception"] = raise_exception
  return env


def _guarded(env, name: str, f):
  """Filter `f` counted as a step, its width arguments and its result checked against MAX_CHARS."""
  @functools.wraps(f)  # keeps jinja2's pass_context / pass_environment marks
  def filtered(*args, **kwargs):
    env.budget.step()
    if name in _WIDTH_FILTERS:
      _check_widths((*args[1:], *kwargs.values()))
    elif name == "format" and args and isinstance(args[0], str):
      _percent(args[0], tuple(args[1:]))
    return _sized(f(*args, **kwargs))
  return filtered


def _where(source: Path | str, lineno: int | None) -> str:
  if lineno is None:
    return str(source)
  if Path(source).suffix == ".json":
    return f"{source}: its chat_template, line {lineno}"
  return f"{source} line {lineno}"


def compile_template(text: str, source: Path | str):
  """The jinja2 Template of chat template `text` (read from `source`), its loops and `~` routed through the
  sandbox's counters.

  Raises:
    DataError: jinja2 is missing, or the template is not valid jinja2 (the message names `source` and the line).
  """
  env = _environment()
  import jinja2
  from jinja2 import nodes
  from jinja2.visitor import NodeTransformer

  class Counted(NodeTransformer):
    def visit_For(self, node):
      node = self.generic_visit(node)
      node.iter = nodes.Call(nodes.EnvironmentAttribute("parity_iter"), [node.iter], [], None, None)
      return node

    def visit_Concat(self, node):
      node = self.generic_visit(node)
      return nodes.Call(nodes.EnvironmentAttribute("parity_concat"), node.nodes, [], None, None)

  try:
    tree = Counted().visit(env.parse(text))
    return env.from_string(tree)
  except jinja2.TemplateSyntaxError as exc:  # TemplateAssertionError too (an unknown filter or test)
    raise TemplateSyntax(f"{_where(source, exc.lineno)}: the chat template is not valid jinja2 ({exc.message}); "
                         "fix the template there") from None
  except (jinja2.TemplateError, RecursionError, MemoryError) as exc:
    raise TemplateSyntax(f"{source}: the chat template cannot be compiled ({type(exc).__name__}: {exc}); fix "
                         "the template") from None


def render(template, source: Path | str, **variables) -> str:
  """`template` (compile_template's) rendered with `variables`, within this module's limits.

  Raises:
    DataError: a limit was passed (named, with the fix), or the template raised (its message given).
  """
  env = template.environment
  env.budget = _Budget()
  out, size = [], 0
  try:
    for chunk in template.generate(**variables):
      size += len(chunk)
      if size > MAX_CHARS:
        _too_big(size, "an output")
      out.append(chunk)
  except TemplateLimit as exc:
    raise DataError(f"{source}: the chat template {exc}") from None
  except Exception as exc:  # jinja2 TemplateError, or an error inside the template's own logic
    raise DataError(f"{source}: the chat template failed on these messages: {exc}") from None
  return "".join(out)
