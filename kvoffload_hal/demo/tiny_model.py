"""Random-weight Llama models built offline, for tests, the demo and benchmarks.

No model hub is needed: a byte-level BPE tokenizer is trained on a small
synthetic corpus and a ``LlamaForCausalLM`` is initialised with a fixed seed.
``initializer_range=0.2`` (not the usual 0.02) keeps greedy output varied, so a
wrong KV block visibly changes the generated tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

_WORDS = (
    "the quick brown fox jumps over the lazy dog vllm kv cache block prefix "
    "connector offload save load scheduler worker token prompt hello world "
    "alpha beta gamma delta one two three four five six seven eight nine ten "
    "document question answer river mountain city ocean forest paper number"
).split()


STAMP = "kvoffload_spec.json"


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def build_tiny_llama(out_dir: str, spec: TinyModelSpec = TinyModelSpec()) -> str:
    """Write tokenizer + bf16 weights to ``out_dir`` (reused when already built)."""
    if is_built(out_dir, asdict(spec)):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = build_tokenizer(out_dir, spec.max_position_embeddings)
    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
        torch_dtype="bfloat16", initializer_range=0.2,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    write_stamp(out_dir, asdict(spec))
    return out_dir


def is_built(out_dir: str, spec: dict) -> bool:
    """``out_dir`` holds a model built from ``spec`` (it is then reused)."""
    stamp = os.path.join(out_dir, STAMP)
    if not os.path.exists(stamp):
        return False
    with open(stamp) as f:
        return json.load(f) == spec


def write_stamp(out_dir: str, spec: dict) -> None:
    with open(os.path.join(out_dir, STAMP), "w") as f:
        json.dump(spec, f)


def build_tokenizer(out_dir: str, max_length: int):
    """A byte-level BPE tokenizer trained on a synthetic corpus, saved in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    n = len(_WORDS)
    corpus = [" ".join(_WORDS[(i * 7 + j * 3) % n] for j in range(40)) for i in range(600)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", model_max_length=max_length)
    fast.save_pretrained(out_dir)
    return fast


def synthetic_text(num_words: int, seed: int) -> str:
    """Deterministic pseudo-text from the tokenizer's vocabulary."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))
