"""Models with several KV cache groups: offloading never changes a token.

Two tiny random-weight hybrids built offline (``kvoffload_hal.demo.tiny_hybrid``):

* **Gemma 3**: sliding-window layers (64-token window) and a global layer, four
  KV cache groups of 32-token blocks;
* **Qwen3-Next**: Gated DeltaNet layers (a Mamba-like state, vLLM's 'align' mode)
  and a full-attention layer, four groups of 160-token blocks (vLLM derives that
  size to fit the state). Its default mode switches to lazy stores by itself.

As in ``test_accuracy.py``: documents are read, evicted from the device, read
again; greedy tokens and logprobs must match a run without the connector, the
second pass must be served from our tiers (``num_cached_tokens`` equal to the
connector's own counters), and a corrupting backend must change the output.
"""

import pytest

from kvoffload_hal import vllm_compat
from kvoffload_hal.demo.inprocess import EngineSpec, close_llm, make_llm, scheduler_connector
from kvoffload_hal.demo.tiny_model import synthetic_text
from support.engines import drain_transfers

pytestmark = pytest.mark.e2e

NUM_DOCS = 10
CPU_BLOCKS_WITH_DISK = 32
MODELS = {
    # device blocks, words per document, max_model_len, dtype, the block size vLLM
    # uses and the KV bytes a block id covers (one layer per group: the largest page,
    # block x KV heads x head_dim x K+V x dtype bytes; Mamba pages are padded to it)
    "gemma3": dict(device_blocks=80, words=150, max_len=512, dtype="float32", block=32,
                   page=32 * 1 * 64 * 2 * 4),
    "qwen3_next": dict(device_blocks=40, words=500, max_len=1024, dtype="bfloat16", block=160,
                       page=160 * 1 * 64 * 2 * 2),
}


def _docs(model):
    return [synthetic_text(MODELS[model]["words"], seed=i) for i in range(NUM_DOCS)]


def _workload(model):
    return [d + f" question {rnd}" for rnd in range(2) for d in _docs(model)]


def _spec(model, model_dir, **kwargs):
    m = MODELS[model]
    return EngineSpec(model_dir, num_gpu_blocks=m["device_blocks"], dtype=m["dtype"],
                      max_model_len=m["max_len"], **kwargs)


def _run(spec, prompts):
    from vllm import SamplingParams

    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs = []
    try:
        for prompt in prompts:  # one at a time: identical batches with and without offloading
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            completion = out.outputs[0]
            logprobs = [lp[tok].logprob
                        for lp, tok in zip(completion.logprobs, completion.token_ids)]
            outputs.append((out.num_cached_tokens, list(completion.token_ids), logprobs))
        assert drain_transfers(llm)
        conn = scheduler_connector(llm)
        if conn is None:
            return outputs, None
        sched = conn.scheduler
        return outputs, dict(totals=dict(sched.totals.data), pinned=sched.num_pinned_cpu_blocks(),
                             pending=sched.has_pending_transfers(),
                             groups=len(sched.cpu.group_block_sizes),
                             cpu_blocks=sched.cpu.num_blocks)
    finally:
        close_llm(llm)


def _model_dir(request, model):
    if model == "qwen3_next" and not vllm_compat.REPORTS_FAILED_RECVING:
        pytest.skip("vLLM 0.23's CPU platform disables prefix caching for linear-attention "
                    "models (and then refuses --mamba-block-size): Qwen3-Next cannot run here")
    return request.getfixturevalue(f"tiny_{model}_dir")


@pytest.fixture(scope="module", params=sorted(MODELS))
def baseline(request):
    model = request.param
    model_dir = _model_dir(request, model)
    outputs, _ = _run(_spec(model, model_dir), _workload(model))
    # The workload must really evict: the second pass finds nothing on the device.
    assert all(cached == 0 for cached, _, _ in outputs[NUM_DOCS:])
    return model, model_dir, outputs


def _check(model, outputs, summary, base):
    for i, ((_, tokens, logprobs), (_, base_tokens, base_logprobs)) in enumerate(
            zip(outputs, base)):
        assert tokens == base_tokens, f"{model} request {i}: tokens differ"
        assert logprobs == pytest.approx(base_logprobs, abs=1e-4), f"{model} request {i}"
    second = [cached for cached, _, _ in outputs[NUM_DOCS:]]
    assert all(c >= MODELS[model]["block"] for c in second), second  # served from our tier
    totals = summary["totals"]
    assert summary["groups"] > 1
    assert totals["cpu_hit_tokens"] == sum(second)
    assert totals["blocks_loaded"] > 0
    assert summary["pinned"] == 0 and not summary["pending"]


@pytest.mark.parametrize("lazy", [False, True], ids=["default", "lazy"])
def test_outputs_identical_and_served_from_cpu(baseline, lazy):
    model, model_dir, base = baseline
    if lazy and model == "qwen3_next":
        pytest.skip("Qwen3-Next's default mode is lazy already (align-mode Mamba state)")
    outputs, summary = _run(_spec(model, model_dir, offload=True, lazy_offload=lazy),
                            _workload(model))
    _check(model, outputs, summary, base)


def test_outputs_identical_and_served_from_disk(baseline, tmp_path):
    model, model_dir, base = baseline
    page = MODELS[model]["page"]
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

    model, model_dir, base = baseline
    register_backend("corrupting-cpu", "corrupting_backend:CorruptingCpuBackend",
                     synchronous_compute=True)
    monkeypatch.setenv("KVOFFLOAD_HAL_BACKEND", "corrupting-cpu")
    monkeypatch.syspath_prepend(__file__.rsplit("/", 1)[0])
    outputs, _ = _run(_spec(model, model_dir, offload=True), _workload(model))
    assert all(c > 0 for c, _, _ in outputs[NUM_DOCS:])
    assert sum(tok != b for (_, tok, _), (_, b, _) in zip(outputs, base)) > 0


def _diverging_prompts():
    """Documents sharing their first ~200 tokens (one whole 160-token block) and then
    diverging, each asked after the device forgot it, whole and cut short."""
    shared = synthetic_text(200, seed=100)
    docs = [shared + " " + synthetic_text(300, seed=200 + k) for k in range(4)]
    fillers = [synthetic_text(500, seed=300 + k) for k in range(6)]
    again = [d + " question" for d in docs] + [d[:len(d) * 2 // 3] for d in docs]
    return docs + fillers + again, len(docs) + len(fillers)


def test_a_mamba_state_is_used_only_at_its_own_position(request):
    """A Gated DeltaNet state in the CPU tier is the state after every token up to
    its block's end, keyed by the hash of exactly those tokens. The four documents
    share their first block and then differ, and each is asked again whole and cut
    at two thirds (ending inside another block): only a state taken at the same
    position after the same tokens may be loaded. A state of another document or
    another position would start the recurrence from other values, and the tokens
    would differ from the run without the connector (the canary shows that damaged
    state changes them)."""
    model_dir = _model_dir(request, "qwen3_next")
    prompts, first_again = _diverging_prompts()
    base, _ = _run(_spec("qwen3_next", model_dir), prompts)
    outputs, summary = _run(_spec("qwen3_next", model_dir, offload=True), prompts)
    assert [t for _, t, _ in outputs] == [t for _, t, _ in base]
    for (_, _, lp), (_, _, base_lp) in zip(outputs, base):
        assert lp == pytest.approx(base_lp, abs=1e-4)
    # Asked again whole, each document finds more than the device still has (at
    # most the shared first block, brought back by the first of them), in whole
    # 160-token blocks: its own blocks, states included, came from the CPU tier.
    whole = slice(first_again, first_again + 4)
    device = [c for c, _, _ in base[whole]]
    hits = [c for c, _, _ in outputs[whole]]
    assert device[0] == 0 and all(d in (0, 160) for d in device), device
    assert all(h > d and h % 160 == 0 for h, d in zip(hits, device)), (hits, device)
    assert summary["totals"]["cpu_hit_tokens"] >= sum(h - d for h, d in zip(hits, device))
