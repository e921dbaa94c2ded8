"""The example-data fields of TrainSpec (layout, loss_normalization, truncation, examples_per_step): their
defaults, validation, and the data they need (docs/data-examples.md). Re-exported by parity.spec."""
from __future__ import annotations

from typing import Any, Mapping

from parity.errors import SpecError

LAYOUT_DEFAULTS = {"layout": "stream", "loss_normalization": "tokens", "truncation": "truncate",
                   "examples_per_step": None}
"""The example-data fields of TrainSpec and their defaults; config_hash leaves a field out at its default, so runs
that do not use them keep the hash they had before the fields existed (gate baselines, checkpoints)."""


EXAMPLE_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".pq")
"""Data files read as examples (parity.dataset.records), for the padded and packed layouts."""
SFT_DEMO = "sft-demo"
"""`data` value of the built-in SFT examples (parity.dataset.demo.sft_demo)."""


def is_example_data(data: str) -> bool:
  """Whether `data` names example data (SFT_DEMO or a file with an EXAMPLE_SUFFIXES suffix), not a token stream."""
  return data == SFT_DEMO or str(data).lower().endswith(EXAMPLE_SUFFIXES)


def _check_example_data(data: str, layout: str) -> None:
  """SpecError when the layout and the data do not go together: padded/packed need examples, stream a stream."""
  if layout != "stream" and not is_example_data(data):
    raise SpecError(f"train.layout={layout!r} needs example data (--data FILE{'/'.join(EXAMPLE_SUFFIXES)} or "
                    f"--data {SFT_DEMO}); data is {data!r}, a token stream: use train.layout=stream for it")
  if layout == "stream" and is_example_data(data):
    raise SpecError(f"data {data!r} is example data (records of examples); set --set train.layout=padded (one "
                    "example per row) or --set train.layout=packed")


def without_layout_defaults(train: Mapping[str, Any], *, stream_only: bool = False) -> dict[str, Any]:
  """A to_dict() train section without the LAYOUT_DEFAULTS fields that hold their defaults (config_hash; with
  stream_only, only when the layout is 'stream', so a stream run's summary.json spec is the one it was before the
  fields existed, and a padded/packed run's names every field)."""
  out = dict(train)
  if stream_only and out.get("layout", "stream") != "stream":
    return out
  for key, default in LAYOUT_DEFAULTS.items():
    if key in out and out[key] == default:
      del out[key]
  return out


def validate_layout(self: Any) -> None:
  """SpecError naming train.layout / loss_normalization / truncation / examples_per_step on a bad value."""
  if self.layout not in ("stream", "padded", "packed"):
    raise SpecError(f"train.layout must be 'stream', 'padded' or 'packed'; got {self.layout!r}")
  if self.loss_normalization not in ("tokens", "micro_mean"):
    raise SpecError(f"train.loss_normalization must be 'tokens' or 'micro_mean'; got {self.loss_normalization!r}")
  if self.truncation not in ("truncate", "split"):
    raise SpecError(f"train.truncation must be 'truncate' or 'split'; got {self.truncation!r}")
  e = self.examples_per_step
  if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
    raise SpecError(f"train.examples_per_step must be null (the layout's default) or an integer >= 1; got {e!r}")
  if e is not None and self.layout == "stream":
    raise SpecError("train.examples_per_step applies to the padded and packed layouts only; train.layout is 'stream' "
                    "(set train.layout=padded or packed with example data, or leave examples_per_step null)")
