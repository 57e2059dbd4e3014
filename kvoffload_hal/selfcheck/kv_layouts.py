"""The KV cache layouts the self-check copies, built as views of flat byte buffers.

Each layout is what vLLM or vllm-ascend hands the connector for one layer: one
tensor, or a tuple of tensors. Every tensor is a view of its own flat ``uint8``
buffer, filled with random bytes, so a check can compare the whole buffer byte
for byte (blocks that were copied, blocks that were not, and padding between
blocks) without knowing where the block axis is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "KvBuild", "build_layout"]

# Small attention shapes: the checks are about addressing, not about size.
KV_HEADS = 2
HEAD_SIZE = 32
# MLA: the latent ("nope") and rotary ("rope") parts differ in their last dimension
# (DeepSeek: 512 and 64).
MLA_NOPE, MLA_ROPE = 128, 16
DTYPE = torch.float16
# Bytes between blocks left unused, as in vllm-ascend's K/V tensors aligned to 2 MiB.
PAD_BYTES = 256
NUM_LAYERS = 2


@dataclass
class KvBuild:
    """The per-layer KV entries of one layout and the flat buffers they view."""

    kv_caches: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]
    buffers: list[torch.Tensor]


class _Buffers:
    """Allocates random flat buffers on ``device`` and views them as KV tensors."""

    def __init__(self, device: torch.device, generator: torch.Generator) -> None:
        self.device, self.generator = device, generator
        self.buffers: list[torch.Tensor] = []

    def view(self, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> torch.Tensor:
        """A ``DTYPE`` tensor of ``shape`` (contiguous, or ``strides`` in elements)."""
        elt = torch.empty((), dtype=DTYPE).element_size()
        if strides is None:
            numel = 1
            for n in shape:
                numel *= n
        else:
            numel = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        data = torch.randint(0, 256, (numel * elt,), dtype=torch.uint8, generator=self.generator)
        flat = data.to(self.device)
        self.buffers.append(flat)
        typed = flat.view(DTYPE)
        return typed.view(shape) if strides is None else typed.as_strided(shape, strides)


def _flash_attn(b: _Buffers, blocks: int, block_size: int):
    return b.view((2, blocks, block_size, KV_HEADS, HEAD_SIZE))


def _flashinfer(b: _Buffers, blocks: int, block_size: int):
    return b.view((blocks, 2, block_size, KV_HEADS, HEAD_SIZE))


def _dense_kv(b: _Buffers, blocks: int, block_size: int):
    shape = (blocks, block_size, KV_HEADS, HEAD_SIZE)
    return b.view(shape), b.view(shape)


def _dense_kv_padded(b: _Buffers, blocks: int, block_size: int):
    elt = torch.empty((), dtype=DTYPE).element_size()
    block_elems = block_size * KV_HEADS * HEAD_SIZE
    shape = (blocks, block_size, KV_HEADS, HEAD_SIZE)
    strides = (block_elems + PAD_BYTES // elt, KV_HEADS * HEAD_SIZE, HEAD_SIZE, 1)
    return b.view(shape, strides), b.view(shape, strides)


def _mla(b: _Buffers, blocks: int, block_size: int):
    return b.view((blocks, block_size, 1, MLA_NOPE)), b.view((blocks, block_size, 1, MLA_ROPE))


#: Layout name -> builder of one layer's entry.
LAYOUTS: dict[str, Callable[[_Buffers, int, int], object]] = {
    "vllm (2, blocks, block, heads, head)": _flash_attn,
    "vllm (blocks, 2, block, heads, head)": _flashinfer,
    "dense tuple (k, v)": _dense_kv,
    "dense tuple (k, v), padded blocks": _dense_kv_padded,
    "mla tuple (nope, rope)": _mla,
}


def build_layout(name: str, num_blocks: int, block_size: int, device: torch.device | str,
                 generator: torch.Generator) -> KvBuild:
    """``NUM_LAYERS`` layers of layout ``name``, ``num_blocks`` blocks of ``block_size``
    tokens each, on ``device``, filled with random bytes."""
    try:
        builder = LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout {name!r} is unknown; expected one of {sorted(LAYOUTS)}") from None
    buffers = _Buffers(torch.device(device), generator)
    kv_caches = {f"layers.{i}": builder(buffers, num_blocks, block_size)
                 for i in range(NUM_LAYERS)}
    return KvBuild(kv_caches, buffers.buffers)
