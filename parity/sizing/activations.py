"""Activation bytes per rank: what each block and the logits keep for the backward pass (integer arithmetic, no numpy).

Per block, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1
(34·s·b·h + 5·a·s²·b bytes for 2-byte activations with dropout), rewritten for this model: no dropout, element
size e, grouped-query K/V (repeated to every head on the torch sides), a head_dim of its own, GELU, SwiGLU or GeGLU
MLP, the model-family norms and soft-caps (`block_activation_bytes`); the (B, T, V) logits, their float32 upcast
and gradient (`logits_bytes`), which dominate at vocabularies of 128k-262k; the whole model (`activation_bytes`).
parity.sizing.memory builds its rows from these.
"""
from __future__ import annotations

from parity.spec import REMAT_POLICIES, ModelSpec

__all__ = ["FP32", "block_activation_bytes", "logits_bytes", "activation_bytes"]

FP32 = 4
"""Bytes per float32 element."""


def block_activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, elem: int,
                           policy: str = "none", *, kv_repeated: bool = False) -> tuple[int, int]:
  """Bytes one block keeps for its backward pass: (device, host), per rank.

  With s = seq_len, b = micro_batch, h = d_model, f = ffn_dim, a = n_heads, q = n_heads·head_dim (= h unless
  d_head is decoupled: Qwen3, Gemma), k = kv_heads·head_dim and e = elem bytes, a block without remat saves
  (Korthikanti et al. 2022, sec. 4.1, without dropout):
    2·e·sbh (the two norm inputs) + e·sbh (qkv input) + e·sb(q + 2k) (Q, K, V) + e·a·s²·b (softmax
    probabilities) + e·sbq (attention output, the proj input) + MLP: GELU e·sb(h + 2f), SwiGLU/GeGLU e·sb(h + 4f).
  With e = 2, q = k = h, f = 4h: 32·sbh + 2·as²b; their 34·sbh + 5·as²b adds the dropout masks and outputs.
  The model-family fields add what their backward needs (the models' code: jax_impl/model.py, torch_impl/model.py):
  qk_norm the q/k norm inputs e·sb(q + k); post_norms the two post-norm inputs 2·e·sbh; attn_softcap the tanh of
  the scores e·a·s²·b (d/dx cap·tanh(x/cap) = 1 - tanh²). `kv_repeated` (the torch sides: torch_impl repeats K
  and V to n_heads before scaled_dot_product_attention, HF repeat_kv) saves K and V q wide, not k; the JAX side
  contracts grouped heads without repeating. A sliding window changes nothing: both sides mask dense s×s scores.
  Biases save nothing (their gradient is a sum of the output gradient).
  Policies (jax_impl/offload.py names): 'full' keeps the block input e·sbh; 'save_dots' keeps it plus every
  matmul output, 'save_dots_no_batch' only the weight matmuls (no batch dimension: not QK^T or PV);
  'offload_dots_no_batch' / 'offload_names' keep the input on the device and those outputs on the host.
  """
  if policy not in REMAT_POLICIES:
    raise ValueError(f"remat policy must be one of {', '.join(REMAT_POLICIES)}; got {policy!r}")
  sb, h, f = seq_len * micro_batch, model.d_model, model.ffn_dim
  q, k = model.n_heads * model.head_dim, model.kv_heads * model.head_dim
  kv_saved = q if kv_repeated else k
  probs = model.n_heads * seq_len * seq_len * micro_batch * (2 if model.attn_softcap is not None else 1)
  mlp_in, mlp_dots = (h + 2 * f, f) if model.mlp == "gelu" else (h + 4 * f, 2 * f)
  weight_dots = sb * ((q + 2 * k) + h + mlp_dots + h)  # qkv, attention proj, fc (gate+up), mlp proj outputs
  family = (q + k if model.qk_norm else 0) + (2 * h if model.post_norms else 0)  # q/k norm, post-norm inputs
  if policy == "none":
    return elem * (sb * (2 * h + h + (q + 2 * kv_saved) + q + mlp_in + family) + probs), 0
  if policy == "full":
    return elem * sb * h, 0
  if policy == "save_dots":
    return elem * (sb * h + weight_dots + probs + sb * q), 0
  if policy == "save_dots_no_batch":
    return elem * (sb * h + weight_dots), 0
  return elem * sb * h, elem * weight_dots  # offload_dots_no_batch, offload_names


def logits_bytes(model: ModelSpec, micro_batch: int, seq_len: int, elem: int) -> tuple[int, int]:
  """(saved, gradient) bytes of the (B, T, V) logits, per rank.

  Saved for the backward: the logits in the compute dtype e·sbV, their float32 upcast that log_softmax reads
  4·sbV when e != 4 (both sides upcast before the loss: jax_impl/model.py _nll, torch_impl/model.py F.cross_entropy
  of logits.float()), and with final_softcap the tanh of the logits e·sbV. Gradient: the loss's float32 gradient
  w.r.t. the logits 4·sbV, which exists at the start of the backward pass while every saved activation still does
  (the peak of the forward/backward phase). At V = 262,208 (Gemma 3) and b·s = 2048, sbV is 0.5 Gi elements:
  3 GiB saved under bf16 (6 bytes per element) and 2 GiB of gradient.
  """
  sbv = seq_len * micro_batch * model.vocab_size
  saved = elem * sbv + (FP32 * sbv if elem != FP32 else 0) + (elem * sbv if model.final_softcap is not None else 0)
  return saved, FP32 * sbv


def activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, elem: int,
                     policy: str = "none", *, kv_repeated: bool = False,
                     host_checkpoints: bool = False) -> tuple[int, int]:
  """Activation bytes at the end of the forward pass: (device, host), per rank.

  n_layers × `block_activation_bytes`, plus the recompute working set of one block under any remat policy
  (the block being recomputed holds its full activations), plus the embedding output and final norm input
  (2·e·sbh) and the saved logits (`logits_bytes`: e·sbV, another 4·sbV when the loss upcasts them to fp32, e·sbV
  more with a final soft-cap). `host_checkpoints` (DeepSpeed's cpu_checkpointing) counts each block's
  checkpointed bytes on the host instead of the device.
  """
  dev, host = block_activation_bytes(model, micro_batch, seq_len, elem, policy, kv_repeated=kv_repeated)
  if host_checkpoints:
    dev, host = 0, host + dev
  sb = seq_len * micro_batch
  extra = 2 * elem * sb * model.d_model + logits_bytes(model, micro_batch, seq_len, elem)[0]
  if policy != "none":
    extra += block_activation_bytes(model, micro_batch, seq_len, elem, "none", kv_repeated=kv_repeated)[0]
  return model.n_layers * dev + extra, model.n_layers * host
