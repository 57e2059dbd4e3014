"""Random-weight hybrid models built offline: several KV cache groups in vLLM.

* **Gemma 3** (``Gemma3ForCausalLM``): sliding-window layers around one global
  layer, a 64-token window, so a document spans many windows: a sliding-window
  group next to a full-attention group.
* **Qwen3-Next** (``Qwen3NextForCausalLM``): Gated DeltaNet (linear attention,
  a Mamba-like state) layers around one full-attention layer, and a small MoE.
  vLLM's CPU Gated DeltaNet kernel needs key and value head dims of 128. The
  state decays slowly (``exp(A_log)`` = :data:`GDN_DECAY`, so it keeps about a
  hundred tokens): with transformers' initialisation (``exp(A_log)`` up to 16)
  it forgot a token within one or two more, and a wrong state left no trace in
  the output once a few tokens were recomputed after a hit.

Both share the Llama builder's tokenizer. Gemma 3 is float32, which keeps greedy
outputs free of bf16 rounding noise; vLLM's CPU Gated DeltaNet runs in bfloat16
only (Qwen3-Next then uses the block size vLLM derives to fit its state: 160).
"""

from __future__ import annotations

import math

from kvoffload_hal.demo.tiny_model import build_tokenizer, is_built, write_stamp

MAX_POSITIONS = 4096

GEMMA3 = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention"],
)

QWEN3_NEXT = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64,
    layer_types=["linear_attention", "linear_attention", "full_attention",
                 "linear_attention"],
    linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, decoder_sparse_step=1,
)


DTYPES = {"gemma3": "float32", "qwen3_next": "bfloat16"}
GDN_DECAY = 0.01  # Gated DeltaNet: exp(A_log), the scale of the per-token state decay


def _build(out_dir: str, kind: str, fields: dict, seed: int) -> str:
    spec = {"kind": kind, "seed": seed, "dtype": DTYPES[kind], **fields}
    if kind == "qwen3_next":
        spec["gdn_decay"] = GDN_DECAY
    if is_built(out_dir, spec):
        return out_dir
    import torch
    import transformers

    fast = build_tokenizer(out_dir, MAX_POSITIONS)
    config_cls, model_cls = {
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=len(fast), max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
        torch_dtype=DTYPES[kind], initializer_range=0.2, **fields)
    model = model_cls(config)
    with torch.no_grad():
        for layer, layer_type in zip(model.model.layers, config.layer_types):
            if layer_type == "linear_attention":  # Qwen3-Next's gated delta net
                layer.linear_attn.A_log.fill_(math.log(GDN_DECAY))
    model.to(getattr(torch, DTYPES[kind])).save_pretrained(out_dir)
    write_stamp(out_dir, spec)
    return out_dir


def build_tiny_gemma3(out_dir: str, seed: int = 0) -> str:
    """A tiny Gemma 3 text model in ``out_dir`` (reused when already built)."""
    return _build(out_dir, "gemma3", GEMMA3, seed)


def build_tiny_qwen3_next(out_dir: str, seed: int = 0) -> str:
    """A tiny Qwen3-Next in ``out_dir`` (reused when already built)."""
    return _build(out_dir, "qwen3_next", QWEN3_NEXT, seed)
