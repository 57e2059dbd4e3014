"""Every field the KV bytes depend on is in the fingerprint; the block count is not.

The configuration is a stand-in with the attributes ``kv_fingerprint`` reads
(the input); the KV tensors are real.
"""

import copy
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kvoffload_hal.tiers.identity import (
    FINGERPRINT_BYTES,
    block_hash_seed_is_random,
    kv_fingerprint,
    rank_in_replica,
    restart_warning,
)
from kvoffload_hal.tiers.weights_digest import local_weights_digest

NUM_BLOCKS = 6


@dataclass
class FullAttentionSpec:
    block_size: int = 16


@dataclass
class SlidingWindowSpec:
    block_size: int = 16


@dataclass
class Inputs:
    """What one worker passes to ``kv_fingerprint``."""

    vllm_config: SimpleNamespace
    tensors: list = field(default_factory=list)
    num_blocks: int = NUM_BLOCKS
    rank: int = 0
    kv_cache_config: SimpleNamespace | None = None

    def fingerprint(self) -> bytes:
        local_weights_digest.cache_clear()
        return kv_fingerprint(self.vllm_config, self.tensors, self.num_blocks, self.rank,
                              self.kv_cache_config)


def kv_tensor(num_blocks=NUM_BLOCKS, dtype=torch.float16, heads=2):
    return torch.zeros(2, num_blocks, 16, heads, 8, dtype=dtype)


@pytest.fixture
def model_dir(tmp_path):
    header = json.dumps({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                 + b"A" * 8)
    (tmp_path / "config.json").write_text("{}")
    os.utime(tmp_path / "model.safetensors", ns=(1_700_000_000 * 10**9,) * 2)
    return tmp_path


@pytest.fixture
def inputs(model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    groups = [SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=["l0", "l1"])]
    return Inputs(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(model=str(model_dir), model_weights="", revision=None,
                                         quantization=None, dtype=torch.float16),
            cache_config=SimpleNamespace(cache_dtype="auto", block_size=16,
                                         prefix_caching_hash_algo="sha256"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            load_config=SimpleNamespace(download_dir=None)),
        tensors=[kv_tensor(), kv_tensor()],
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups))


def rewrite_weights(i: Inputs) -> None:
    """Other bytes of the same size under the same path, with a newer time."""
    file = os.path.join(i.vllm_config.model_config.model, "model.safetensors")
    data = bytearray(open(file, "rb").read())
    data[-1] ^= 0xFF
    mtime = os.stat(file).st_mtime_ns
    with open(file, "wb") as f:
        f.write(data)
    os.utime(file, ns=(mtime + 10**9,) * 2)


def move_model(i: Inputs) -> None:
    """The same weights under another path (a link: the weights digest is the same)."""
    model = i.vllm_config.model_config.model
    os.symlink(model, model + "-link")
    i.vllm_config.model_config.model = model + "-link"


def setattrs(what: str, **values):
    def change(i: Inputs) -> None:
        for name, value in values.items():
            setattr(getattr(i.vllm_config, what), name, value)
    return change


def set_group(**values):
    def change(i: Inputs) -> None:
        for name, value in values.items():
            setattr(i.kv_cache_config.kv_cache_groups[0], name, value)
    return change


CHANGES = {
    "model": move_model,
    "revision": setattrs("model_config", revision="v2"),
    "weights": rewrite_weights,
    "quantization": setattrs("model_config", quantization="fp8"),
    "model dtype": setattrs("model_config", dtype=torch.bfloat16),
    "kv cache dtype": setattrs("cache_config", cache_dtype="fp8_e4m3"),
    "block size": setattrs("cache_config", block_size=32),
    "layout shape": lambda i: i.tensors.__setitem__(1, kv_tensor(heads=4)),
    "layout dtype": lambda i: i.tensors.__setitem__(1, kv_tensor(dtype=torch.bfloat16)),
    "layout stride order": lambda i: i.tensors.__setitem__(
        1, kv_tensor().permute(1, 0, 2, 3, 4).contiguous().permute(1, 0, 2, 3, 4)),
    "layout tensor count": lambda i: i.tensors.append(kv_tensor()),
    "group kind": set_group(kv_cache_spec=SlidingWindowSpec()),
    "group block size": set_group(kv_cache_spec=FullAttentionSpec(block_size=32)),
    "group layers": set_group(layer_names=["l0"]),
    "group count": lambda i: i.kv_cache_config.kv_cache_groups.append(
        SimpleNamespace(kv_cache_spec=SlidingWindowSpec(), layer_names=["l2"])),
    "tp size": setattrs("parallel_config", tensor_parallel_size=2),
    "pp size": setattrs("parallel_config", pipeline_parallel_size=2),
    "rank": lambda i: setattr(i, "rank", 1),
    "hash algorithm": setattrs("cache_config", prefix_caching_hash_algo="xxhash"),
    "hash seed": lambda i: os.environ.__setitem__("PYTHONHASHSEED", "1"),
    "hash seed unset": lambda i: os.environ.pop("PYTHONHASHSEED"),
}


def test_identical_inputs_give_an_identical_fingerprint(inputs):
    first = inputs.fingerprint()
    assert len(first) == FINGERPRINT_BYTES
    assert copy.deepcopy(inputs).fingerprint() == first == inputs.fingerprint()


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_field_changes_the_fingerprint(inputs, name):
    before = inputs.fingerprint()
    changed = copy.deepcopy(inputs)
    CHANGES[name](changed)
    assert changed.fingerprint() != before, f"{name} is not in the fingerprint"


def test_the_block_count_does_not_change_it(inputs):
    before = inputs.fingerprint()
    inputs.num_blocks = 9
    inputs.tensors = [kv_tensor(num_blocks=9), kv_tensor(num_blocks=9)]
    assert inputs.fingerprint() == before


# ------------------------------------------------------------ PYTHONHASHSEED
def vllm_seeds_at_random(monkeypatch, hash_algo: str) -> bool:
    """Whether vLLM itself derives another first-block hash in each process: its
    ``init_none_hash`` run twice (as two processes would) gives two values."""
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils

    if hashing._xxhash is None:  # the optional package is absent: any 128-bit digest will do
        monkeypatch.setattr(hashing, "_xxhash", SimpleNamespace(
            xxh3_128_digest=lambda data: hashlib.blake2b(data, digest_size=16).digest()))

    # init_none_hash sets the module's globals, whichever this release has: all of
    # them are put back as they were after.
    state = vars(kv_cache_utils)
    saved = dict(state)
    try:
        hash_fn = hashing.get_hash_fn_by_name(hash_algo)
        kv_cache_utils.init_none_hash(hash_fn)
        first = kv_cache_utils.NONE_HASH
        kv_cache_utils.init_none_hash(hash_fn)
        return kv_cache_utils.NONE_HASH != first
    finally:
        for name in set(state) - set(saved):
            del state[name]
        state.update(saved)


@pytest.mark.parametrize("hash_algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("seed", [None, "0"])
def test_random_seed_detection_agrees_with_vllm(monkeypatch, hash_algo, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    random = vllm_seeds_at_random(monkeypatch, hash_algo)
    assert block_hash_seed_is_random(hash_algo) == random
    warning = restart_warning(True, "/data/kv/rank0.x", hash_algo)
    assert (warning is not None) == random
    if random:
        assert "/data/kv/rank0.x" in warning and "set PYTHONHASHSEED" in warning
        assert "\n" not in warning


def test_no_warning_when_the_blocks_are_not_kept_or_the_seed_is_set(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert restart_warning(False, "/data/kv", "xxhash") is None
    assert restart_warning(True, "/data/kv", "xxhash") is not None
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert restart_warning(True, "/data/kv", "xxhash") is None


def test_workers_of_two_data_parallel_replicas_share_a_fingerprint_per_tp_rank(inputs):
    """vLLM numbers the workers of replicas in lockstep (MoE) across replicas:
    with TP=2, replica 1's workers are ranks 2 and 3. The same TP rank of either
    replica holds the same shard: one fingerprint; another TP rank: another."""
    inputs.vllm_config.parallel_config.tensor_parallel_size = 2
    prints = []
    for world_rank in range(4):
        inputs.rank = rank_in_replica(world_rank, 2)
        prints.append(inputs.fingerprint())
    assert prints[0] == prints[2] and prints[1] == prints[3]
    assert prints[0] != prints[1]
