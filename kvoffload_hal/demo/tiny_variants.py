"""Random-weight models for the deployment shapes, built offline.

* **Qwen3-MoE** (``Qwen3MoeForCausalLM``): two layers, each a mixture of 4
  experts (2 per token), float32; its attention is the tiny Llama's (2 KV heads
  of 64), so it also splits over TP = 2.
* **EAGLE** (``EagleLlamaForCausalLM``): a one-layer EAGLE-1 draft head for
  the tiny Llama (:func:`~kvoffload_hal.demo.tiny_model.build_tiny_llama`), with
  which it shares the vocabulary and the hidden size. vLLM builds it from the
  target's config plus ``fc`` (target hidden state and token embedding into
  one hidden state) and one decoder layer without its input norm; the target's
  LM head is shared. Its random weights propose tokens the target rarely
  accepts: it runs EAGLE's code path (its own KV cache layer, offloaded with
  the target's), not a good draft.

Both share the Llama builder's tokenizer.
"""

from __future__ import annotations

import json
import os

from kvoffload_hal.demo.tiny_model import TinyModelSpec, build_tokenizer, is_built, write_stamp

QWEN3_MOE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64, decoder_sparse_step=1,
)
MAX_POSITIONS = 4096


def build_tiny_qwen3_moe(out_dir: str, seed: int = 0) -> str:
    """A tiny Qwen3-MoE in ``out_dir`` (reused when already built)."""
    spec = {"kind": "qwen3_moe", "seed": seed, **QWEN3_MOE}
    if is_built(out_dir, spec):
        return out_dir
    import torch
    import transformers

    fast = build_tokenizer(out_dir, MAX_POSITIONS)
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(fast), max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32",
        initializer_range=0.2, **QWEN3_MOE)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out_dir)
    write_stamp(out_dir, spec)
    return out_dir


def build_tiny_eagle(out_dir: str, target: TinyModelSpec = TinyModelSpec(), seed: int = 1) -> str:
    """A one-layer EAGLE draft head for the tiny Llama of ``target`` in ``out_dir``."""
    spec = {"kind": "eagle", "seed": seed, "hidden_size": target.hidden_size}
    if is_built(out_dir, spec):
        return out_dir
    import torch
    import transformers
    from safetensors.torch import save_file

    fast = build_tokenizer(out_dir, MAX_POSITIONS)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32",
        initializer_range=0.2)
    layer = transformers.LlamaForCausalLM(config).model
    weights = {name: tensor.contiguous() for name, tensor in layer.state_dict().items()
               if not name.startswith("norm") and name != "layers.0.input_layernorm.weight"}
    weights["fc.weight"] = torch.randn(target.hidden_size, 2 * target.hidden_size) * 0.05
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**config.to_dict(), "architectures": ["EagleLlamaForCausalLM"]}, f)
    write_stamp(out_dir, spec)
    return out_dir
