"""The PyTorch sides of parity: the GPT model, the DeepSpeed engine, the plain-torch baseline and FSDP2.

Modules:
  model     GPT decoder named by the canonical weights; load_canonical / to_canonical; lm_loss.
  engine    DeepSpeed environment, ds_config(run), build_engine, torch_step (imports deepspeed lazily).
  baseline  torch.optim.AdamW with DeepSpeed's schedule, accumulation and clipping (no deepspeed).
  memory    byte accounting of training state by category and memory kind.
  worker    `python -m torch_impl.worker run_dir/request.json --side deepspeed|torch`.
  fsdp      the FSDP2 side: fully_shard per block and root, MixedPrecisionPolicy, CPUOffloadPolicy (FsdpTrainer);
            fsdp_side (its Side and DCP checkpoints), fsdp_worker (`... --side fsdp`).
Never imports jax, flax or optax.
"""
from torch_impl.model import GPT as GPT
from torch_impl.model import build_model as build_model
from torch_impl.model import decay_groups as decay_groups
from torch_impl.model import lm_loss as lm_loss
from torch_impl.model import load_canonical as load_canonical
from torch_impl.model import to_canonical as to_canonical
