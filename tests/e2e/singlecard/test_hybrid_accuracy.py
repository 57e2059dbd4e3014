"""Models with several KV cache groups: offloading never changes a token.

Two tiny random-weight hybrids built offline (``kvoffload_hal.demo.tiny_hybrid``):

* **Gemma 3** (float32): sliding-window layers (64-token window) and a global
  layer, four KV cache groups of 32-token blocks;
* **Qwen3-Next** (bfloat16, the only dtype of vLLM's CPU Gated DeltaNet): Gated
  DeltaNet layers (a Mamba-like state, vLLM's 'align' mode) and a full-attention
  layer, four groups of 160-token blocks (vLLM raises the 32 asked for to the
  smallest multiple of 32 whose attention page holds the state, and pads the
  state page to it). Where the host has AVX512-BF16, vLLM keeps the states in
  float32 and the block is 288 tokens: the prompts are sized in blocks, from the
  block size the engine reports. Its default mode switches to lazy stores by itself.

As in ``test_accuracy.py``: documents are read, evicted from the device, read
again; greedy tokens and logprobs must match a run without the connector, the
second pass must be served from our tiers (``num_cached_tokens`` equal to the
connector's own counters), and a corrupting backend must change the output.
Qwen3-Next also answers documents that leave a shared text at different offsets
from the Mamba state at their own position (and a wrong state would show).

Where vLLM cannot run Qwen3-Next with prefix caching on CPU (0.23: see
:func:`_why_not_runnable`) its tests are skipped, found from the engine's start
or from the first run without the connector.
"""

import pytest

from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import drain_transfers
from support.hybrid_runs import why_vllm_cannot_run

pytestmark = pytest.mark.e2e

NUM_DOCS = 10
CPU_BLOCKS_WITH_DISK = 32
MODELS = {
    # device blocks, words per document at ``block``, max_model_len, dtype, the block
    # size vLLM uses on most hosts and the KV bytes a block id covers there (one layer
    # per group: the largest page, block x KV heads x head_dim x K+V x dtype bytes;
    # Mamba pages are padded to it). Words and pages scale with the block vLLM picks.
    "gemma3": dict(device_blocks=80, words=150, max_len=512, dtype="float32", block=32,
                   page=32 * 1 * 64 * 2 * 4),
    "qwen3_next": dict(device_blocks=40, words=500, max_len=2048, dtype="bfloat16", block=160,
                       page=160 * 1 * 64 * 2 * 2),
}
_CANNOT_RUN: dict[str, str] = {}  # model directory -> why this vLLM cannot run it


def _words(model, words, block):
    """``words`` at the usual block size, scaled to the block vLLM picked."""
    return words * block // MODELS[model]["block"]


def _page(model, block):
    return MODELS[model]["page"] * block // MODELS[model]["block"]


def _workload(model):
    """The prompts, for the block size the engine reports."""
    def prompts(block):
        docs = [synthetic_text(_words(model, MODELS[model]["words"], block), seed=i)
                for i in range(NUM_DOCS)]
        return [d + f" question {rnd}" for rnd in range(2) for d in docs]
    return prompts


def _spec(model, model_dir, **kwargs):
    m = MODELS[model]
    kwargs.setdefault("num_gpu_blocks", m["device_blocks"])
    return EngineSpec(model_dir, dtype=m["dtype"], max_model_len=m["max_len"], **kwargs)


def _start(spec):
    """The engine, or a skip where this vLLM cannot run Qwen3-Next with prefix
    caching on CPU (found once, from vLLM's behaviour, then remembered)."""
    if spec.model in _CANNOT_RUN:
        pytest.skip(_CANNOT_RUN[spec.model])
    try:
        llm = make_llm(spec)
    except Exception as exc:
        _skip_if_vllm_cannot(spec, exc)
        raise
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    return llm


def _skip_if_vllm_cannot(spec, exc: BaseException) -> None:
    """Skip (and remember why) where ``exc`` is vLLM's own failure; return otherwise.
    A run with the connector never skips: its failure is ours unless the run
    without it failed the same way first (the baselines run first)."""
    reason = why_vllm_cannot_run(exc)
    if reason is None or spec.offload:
        return
    _CANNOT_RUN[spec.model] = ("this vLLM cannot run Qwen3-Next with prefix caching "
                               f"on CPU: {reason}")
    pytest.skip(_CANNOT_RUN[spec.model])


def _generate(llm, spec, prompt, params):
    try:
        return llm.generate([prompt], params, use_tqdm=False)[0]
    except Exception as exc:
        _skip_if_vllm_cannot(spec, exc)
        raise


def _run(spec, make_prompts):
    """Per request (cached tokens, tokens, logprobs, tokens loaded from our CPU
    tier), and the block size and the connector's state at the end.
    ``make_prompts(block)`` gives the prompts for the block size vLLM picked."""
    from vllm import SamplingParams

    llm = _start(spec)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompts = make_prompts(block)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    conn = scheduler_connector(llm)
    outputs = []
    try:
        for prompt in prompts:  # one at a time: identical batches with and without offloading
            before = _cpu_hits(conn)
            out = _generate(llm, spec, prompt, params)
            completion = out.outputs[0]
            logprobs = [lp[tok].logprob
                        for lp, tok in zip(completion.logprobs, completion.token_ids)]
            outputs.append((out.num_cached_tokens, list(completion.token_ids), logprobs,
                            _cpu_hits(conn) - before))
        assert drain_transfers(llm)
        if conn is None:
            return outputs, dict(block=block)
        sched = conn.scheduler
        return outputs, dict(block=block, totals=dict(sched.totals.data),
                             pinned=sched.num_pinned_cpu_blocks(),
                             pending=sched.has_pending_transfers(),
                             groups=len(sched.cpu.group_block_sizes),
                             cpu_blocks=sched.cpu.num_blocks, unstable=sched.cpu.unstable_groups,
                             policy=type(sched.policy).__name__)
    finally:
        close_llm(llm)


def _cpu_hits(conn) -> int:
    return 0 if conn is None else conn.scheduler.totals.data.get("cpu_hit_tokens", 0)


@pytest.fixture(scope="module", params=sorted(MODELS))
def baseline(request):
    model = request.param
    model_dir = request.getfixturevalue(f"tiny_{model}_dir")
    outputs, summary = _run(_spec(model, model_dir), _workload(model))
    # The workload must really evict: the second pass finds nothing on the device.
    assert all(out[0] == 0 for out in outputs[NUM_DOCS:])
    return model, model_dir, outputs, summary["block"]


def _check(model, outputs, summary, base):
    for i, (out, base_out) in enumerate(zip(outputs, base)):
        assert out[1] == base_out[1], f"{model} request {i}: tokens differ"
        assert out[2] == pytest.approx(base_out[2], abs=1e-4), f"{model} request {i}"
    second = [out[0] for out in outputs[NUM_DOCS:]]
    assert all(c >= summary["block"] for c in second), second  # served from our tier
    totals = summary["totals"]
    # All of it from the CPU tier (the counters say why not: a failed load, a wait).
    # On a mismatch, every counter and per request (cached, from the CPU tier): where
    # the hit came from.
    assert [out[3] for out in outputs[NUM_DOCS:]] == second, (
        f"{totals}; per request: {[(out[0], out[3]) for out in outputs]}")
    assert summary["groups"] > 1
    assert totals["cpu_hit_tokens"] == sum(second)
    assert totals["blocks_loaded"] >= summary["groups"] * len(second)
    assert summary["pinned"] == 0 and not summary["pending"]


@pytest.mark.parametrize("lazy", [False, True], ids=["default", "lazy"])
def test_outputs_identical_and_served_from_cpu(baseline, lazy):
    model, model_dir, base, _ = baseline
    if lazy and model == "qwen3_next":
        pytest.skip("Qwen3-Next's default mode is lazy already (align-mode Mamba state)")
    outputs, summary = _run(_spec(model, model_dir, offload=True, lazy_offload=lazy),
                            _workload(model))
    _check(model, outputs, summary, base)
    # Mamba state in 'align' mode: lazy stores without being asked; Gemma 3: as asked.
    mamba = model == "qwen3_next"
    assert bool(summary["unstable"]) == mamba
    assert summary["policy"] == ("LazyPolicy" if lazy or mamba else "EagerPolicy")


def test_outputs_identical_and_served_from_disk(baseline, tmp_path):
    model, model_dir, base, block = baseline
    page = _page(model, block)
    # Room for about two documents' blocks (every group's): the rest comes from disk.
    spec = _spec(model, model_dir, offload=True, cpu_bytes_to_use=CPU_BLOCKS_WITH_DISK * page,
                 extra_config={"disk_path": str(tmp_path / "kv"),
                               "disk_bytes_to_use": 400 * page})
    outputs, summary = _run(spec, _workload(model))
    assert summary["cpu_blocks"] == CPU_BLOCKS_WITH_DISK
    assert summary["totals"]["blocks_from_disk"] > 0
    _check(model, outputs, summary, base)


def test_canary_corrupted_loads_change_outputs(baseline, monkeypatch):
    """The comparison above can fail: damaged KV from the CPU tier changes tokens."""
    from kvoffload_hal.hal import register_backend

    model, model_dir, base, _ = baseline
    register_backend("corrupting-cpu", "corrupting_backend:CorruptingCpuBackend",
                     synchronous_compute=True)
    monkeypatch.setenv("KVOFFLOAD_HAL_BACKEND", "corrupting-cpu")
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    outputs, _ = _run(_spec(model, model_dir, offload=True), _workload(model))
    assert all(out[3] > 0 for out in outputs[NUM_DOCS:])
    assert sum(out[1] != b[1] for out, b in zip(outputs, base)) > 0


# In words at a 160-token block (one token a word), scaled to the block vLLM picks.
SHARED_WORDS = 560  # three and a half blocks
CUTS = (520, 500, 360, 200)  # where each document leaves the shared text
DOC_WORDS, FILLER_WORDS = 640, 600
PROBE_TAIL = 20  # tokens a probe computes after its hit


def _diverging_prompts(block):
    """Documents leaving a shared text at different offsets, fillers that evict
    them from the device, then probes (the shared text cut 20 tokens past a
    block end) and the documents again; and the index of the first probe."""
    def words(n):
        return _words("qwen3_next", n, block)

    shared = synthetic_text(words(SHARED_WORDS), seed=100).split()
    docs = [" ".join(shared[:words(cut)]) + " "
            + synthetic_text(words(DOC_WORDS) - words(cut), seed=200 + k)
            for k, cut in enumerate(CUTS)]
    fillers = [synthetic_text(words(FILLER_WORDS), seed=300 + k) for k in range(8)]
    probes = [" ".join(shared[:end + PROBE_TAIL]) for end in (block, 2 * block, 3 * block)]
    return docs + fillers + probes + [d + " question" for d in docs], len(docs) + len(fillers)


@pytest.fixture(scope="module")
def position_reference(request):
    """The same prompts without the connector, on a device that keeps everything."""
    model_dir = request.getfixturevalue("tiny_qwen3_next_dir")
    reference, summary = _run(_spec("qwen3_next", model_dir, num_gpu_blocks=400),
                              lambda block: _diverging_prompts(block)[0])
    block = summary["block"]
    prompts, first = _diverging_prompts(block)
    # Reading each document after one that shares more of the text stopped at the
    # block end before they part: Mamba states at 1, 2 and 3 blocks along the
    # shared text, and every document's own at 4.
    assert [out[0] for out in reference[first:]] == (
        [block, 2 * block, 3 * block] + [4 * block] * len(CUTS))
    return model_dir, prompts, first, reference, block


def test_a_mamba_state_is_used_only_at_its_own_position(position_reference):
    """Our CPU tier holds several Gated DeltaNet states along one shared text
    (each the state after exactly the tokens its block hash covers) and each
    document's own; every probe and document, asked after the device evicted
    them, must find the state at its own position.

    A state from another position would show: the model's state keeps about a
    hundred tokens (``GDN_DECAY``) and a probe computes only 20 tokens and 8
    outputs after its hit, so it starts from a state that summarises 160 tokens
    more or fewer, or another document, and its tokens change (the control
    below loads another state in place of the right one: every probe changes).

    The reference is vLLM's own prefix cache on a device large enough to keep
    everything: it hits at the same positions (asserted), so outputs must be
    identical (they are, to the bit). An evicting run without the connector is no
    reference here: it computes some states again from other split points, and
    this long-memory model carries that bf16 rounding into its logprobs (up to
    0.8 apart, some tokens flipped)."""
    model_dir, prompts, first, reference, block = position_reference
    outputs, summary = _run(_spec("qwen3_next", model_dir, offload=True), lambda _: prompts)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out[1] == ref[1], f"request {i}: tokens differ"
        assert out[2] == pytest.approx(ref[2], abs=1e-4), f"request {i}"
    again = outputs[first:]
    assert [out[0] for out in again] == [ref[0] for ref in reference[first:]]
    # Each found at least its last block (its state included) in our CPU tier.
    assert all(out[3] >= block for out in again), again
    assert summary["pinned"] == 0 and not summary["pending"]


def test_control_a_state_from_elsewhere_changes_the_probes(position_reference, monkeypatch):
    """The test above can fail: loading another state the CPU tier holds, with
    the right attention blocks, changes every probe's tokens."""
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    from misplaced_state import misplace_state_loads

    model_dir, prompts, first, reference, _ = position_reference
    swapped = misplace_state_loads(monkeypatch)
    outputs, _ = _run(_spec("qwen3_next", model_dir, offload=True), lambda _: prompts)
    assert swapped
    probes = range(first, first + 3)
    assert all(outputs[i][0] == reference[i][0] for i in probes)
    assert all(outputs[i][1] != reference[i][1] for i in probes)
