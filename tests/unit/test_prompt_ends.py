"""Blocks that end a prompt exactly go first from the CPU tier (``adaptive``).

On vLLM's real scheduler with the model that checks every KV read
(``engine_harness.py``): documents that fill their last block are read twice, one
at a time, through a device that keeps about two of them and a CPU tier that holds
every block a second read can use but not every block stored. vLLM computes a
prompt's last token whatever is cached, so a document's last block is never read
by the document again: ``adaptive`` evicts those first and the second pass finds
every readable block; ``lru`` (vLLM's order) evicts the first documents instead.
"""

import random

import pytest

from support import backend_doubles  # noqa: F401 (registers the doubles)

BS = 16
DOC_BLOCKS = 4
NUM_DOCS = 6
# 6 documents of 4 blocks: 18 blocks a second read can use, 24 stored, a CPU tier of 20.
ENGINE = dict(num_gpu_blocks=10, cpu_blocks=21, max_num_batched_tokens=2 * BS)


def _docs(n, seed=0):
    rng = random.Random(seed)
    # Exactly DOC_BLOCKS full blocks: the last one ends the prompt.
    return [[rng.randrange(1, 90) for _ in range(DOC_BLOCKS * BS)] for _ in range(n)]


def _read(engine, docs, tag):
    for i, d in enumerate(docs):
        engine.add(f"{tag}{i}", d, max_tokens=2)
        engine.run_until_done()
        engine.drain()
    return [engine.cached_tokens[f"{tag}{i}"] // BS for i in range(len(docs))]


@pytest.mark.parametrize("eviction", ["adaptive", "lru"])
def test_the_blocks_that_end_a_prompt_are_evicted_first(make_engine, eviction):
    engine = make_engine(**ENGINE, extra_config={"eviction": eviction})
    docs = _docs(NUM_DOCS)
    _read(engine, docs, "a")
    hits = _read(engine, docs, "b")
    readable = DOC_BLOCKS - 1  # the last block is computed again whatever is cached
    if eviction == "adaptive":
        assert hits == [readable] * NUM_DOCS
        assert engine.offload.totals.data["cpu_hit_tokens"] > 0  # not all from the device
    else:
        assert min(hits) < readable
    assert engine.model.checked_tokens > 0
    engine.assert_idle()
