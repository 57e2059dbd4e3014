"""The weights digest sees weights replaced in place, and reads no more than headers."""

import json
import os
import struct
from types import SimpleNamespace

import pytest

from kvoffload_hal.tiers.weights_digest import local_weights_digest, weights_digest


def write_safetensors(path, header: dict, payload: bytes) -> None:
    encoded = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded + payload)


def set_mtime_ns(path, mtime_ns: int) -> None:
    os.utime(path, ns=(mtime_ns, mtime_ns))


HEADER = {"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}


@pytest.fixture
def model_dir(tmp_path):
    local_weights_digest.cache_clear()
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    (tmp_path / "tokenizer.json").write_text("{}")
    write_safetensors(tmp_path / "model-1.safetensors", HEADER, b"A" * 8)
    write_safetensors(tmp_path / "model-2.safetensors", HEADER, b"B" * 8)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-1"}}')
    for i, name in enumerate(sorted(os.listdir(tmp_path))):
        set_mtime_ns(tmp_path / name, 1_700_000_000_000_000_000 + i)
    yield tmp_path
    local_weights_digest.cache_clear()


def digest(path) -> str:
    local_weights_digest.cache_clear()
    return weights_digest(SimpleNamespace(model=str(path), model_weights="", revision=None))


def test_untouched_weights_give_the_same_digest(model_dir):
    assert digest(model_dir) == digest(model_dir)


def test_a_weight_file_rewritten_in_place_changes_it(model_dir):
    before = digest(model_dir)
    file = model_dir / "model-1.safetensors"
    mtime = os.stat(file).st_mtime_ns
    write_safetensors(file, HEADER, b"C" * 8)  # same size, other bytes
    set_mtime_ns(file, mtime + 1)
    assert digest(model_dir) != before


def test_a_new_header_of_the_same_length_changes_it_even_at_the_same_mtime(model_dir):
    before = digest(model_dir)
    file = model_dir / "model-2.safetensors"
    mtime = os.stat(file).st_mtime_ns
    write_safetensors(file, {"v": HEADER["w"]}, b"B" * 8)
    set_mtime_ns(file, mtime)
    assert os.path.getsize(file) == os.path.getsize(model_dir / "model-1.safetensors")
    assert digest(model_dir) != before


def test_index_and_config_bytes_are_hashed(model_dir):
    before = digest(model_dir)
    for name, text in (("model.safetensors.index.json", '{"weight_map": {"w": "model-2"}}'),
                       ("config.json", '{"hidden_size": 8}')):
        mtime = os.stat(model_dir / name).st_mtime_ns
        (model_dir / name).write_text(text)
        set_mtime_ns(model_dir / name, mtime)
        assert digest(model_dir) != before
        before = digest(model_dir)


def test_same_size_header_and_mtime_is_not_seen_as_documented(model_dir):
    """Only the payload changed, with the old time restored (as cp -p would): the
    digest reads no payload, so it cannot see this; the README says what to do."""
    before = digest(model_dir)
    file = model_dir / "model-1.safetensors"
    mtime = os.stat(file).st_mtime_ns
    write_safetensors(file, HEADER, b"Z" * 8)
    set_mtime_ns(file, mtime)
    assert digest(model_dir) == before


def test_other_files_are_ignored(model_dir):
    before = digest(model_dir)
    (model_dir / "tokenizer.json").write_text('{"changed": 1}')
    (model_dir / "README.md").write_text("notes")
    assert digest(model_dir) == before


def test_weight_files_are_added_or_removed(model_dir):
    before = digest(model_dir)
    (model_dir / "extra.bin").write_bytes(b"x")
    with_bin = digest(model_dir)
    os.remove(model_dir / "extra.bin")
    assert with_bin != before and digest(model_dir) == before


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "model.gguf"])
@pytest.mark.parametrize("alone", [False, True], ids=["in-a-folder", "the-model-path"])
def test_a_weight_file_of_another_size_changes_it_even_at_the_same_mtime(model_dir, name, alone):
    """Files other than safetensors have no header to read: their size and time name them."""
    file = model_dir / name
    file.write_bytes(b"W" * 64)
    set_mtime_ns(file, 1_700_000_000_000_000_000)
    path = file if alone else model_dir
    before = digest(path)
    file.write_bytes(b"W" * 65)  # one more byte, the old time restored (cp -p, rsync -t)
    set_mtime_ns(file, 1_700_000_000_000_000_000)
    assert digest(path) != before
    file.write_bytes(b"W" * 64)
    set_mtime_ns(file, 1_700_000_000_000_000_000)
    assert digest(path) == before


def test_computed_once_per_folder(model_dir):
    first = digest(model_dir)
    (model_dir / "extra.pt").write_bytes(b"x")
    again = SimpleNamespace(model=str(model_dir), model_weights="", revision=None)
    assert weights_digest(again) == first  # cached
    assert digest(model_dir) != first


@pytest.mark.parametrize("content", [b"", b"\x01\x02", struct.pack("<Q", 2**40) + b"{}",
                                     struct.pack("<Q", 100) + b"{}"])
def test_a_damaged_header_falls_back_to_size_and_time(model_dir, content):
    (model_dir / "model-1.safetensors").write_bytes(content)
    assert len(digest(model_dir)) == 64


def test_model_weights_is_preferred_and_a_single_gguf_file_is_hashed(model_dir, tmp_path_factory):
    gguf = tmp_path_factory.mktemp("gguf") / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    config = SimpleNamespace(model=str(gguf), model_weights="", revision=None)
    local_weights_digest.cache_clear()
    alone = weights_digest(config)
    config.model_weights = str(model_dir)
    assert weights_digest(config) == digest(model_dir) != alone
    gguf.write_bytes(b"GGUF" + bytes(61))
    config.model_weights = ""
    assert digest(gguf) != alone


def test_a_hub_name_uses_its_local_snapshot_or_else_its_revision(tmp_path):
    """vLLM keeps a hub model in the Hugging Face cache: ``models--org--name/snapshots/
    <commit>/`` with ``refs/<revision>`` naming the commit."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text("{}")
    write_safetensors(snapshot / "model.safetensors", HEADER, b"A" * 8)
    hub = SimpleNamespace(model="org/tiny", model_weights="", revision=None)
    local_weights_digest.cache_clear()
    assert weights_digest(hub, str(tmp_path)) == digest(snapshot)
    assert weights_digest(hub, str(tmp_path / "empty")) == "revision:None"
    assert weights_digest(SimpleNamespace(model="org/tiny", model_weights="", revision="v2"),
                          str(tmp_path)) == "revision:v2"
