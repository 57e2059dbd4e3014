"""The three review hazards of the first vllm-ascend offload worker, on the NPU backend.

Each test fails on an implementation without the matching fix in
:class:`~kvoffload_hal.hal.threaded.ThreadedCopyBackend`:

(a) ``get_finished`` running twice on the same bound metadata re-submitted the
    same transfer: double DMA and a second store racing the first. Fix:
    submission is idempotent by job id.
(b) the job -> request mapping was per step, so a load finishing two steps
    later found no request ids and its request hung. Fix: the tag travels on
    the job into its result.
(c) flush iterated a list shared with the copy thread and missed jobs still
    queued and not launched. Fix: two queues and a flush barrier.
"""

from __future__ import annotations

import numpy as np
from ascend_kv import NUM_HOST_BLOCKS, bind_rig

from kvoffload_hal.hal.backend import Direction, TransferJob
from support.polling import collect_results, wait_until


def test_a_same_job_submitted_twice_launches_once(npu_env, kv):
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    load = TransferJob(0, Direction.LOAD, [1, 2], [3, 4], tag={"req-a"})
    store = TransferJob(0, Direction.STORE, [5], [6], tag=None)
    for _ in range(2):  # get_finished twice on the same metadata
        backend.submit(load)
        backend.submit(store)
    backend.submit(TransferJob(0, Direction.LOAD, [7], [8]))  # an older id, other blocks
    results = backend.flush()
    assert sorted((r.direction.value, r.job_id) for r in results) == [("load", 0), ("store", 0)]
    assert npu_env.acl.v2_calls() == 2  # one batch per job, not four
    # One compute fence per launched job (load + store), none for the re-submissions.
    assert len([e for e in npu_env.npu.events if e.recorded_on is npu_env.npu.compute_stream]) == 2
    assert backend.num_pending == 0


def test_b_tag_survives_until_completion_two_steps_later(npu_env, kv):
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    npu_env.npu.hold_completion = True  # the DMA takes longer than a step

    # Step N: the load of requests a and b is submitted.
    backend.submit(TransferJob(7, Direction.LOAD, [0, 1], [10, 11], tag=("req-a", "req-b")))
    wait_until(lambda: npu_env.acl.v2_calls() >= 1, what="the load's batch call")
    assert npu_env.acl.v2_calls() == 1  # launched, not finished

    # Step N+1: a new store is submitted; nothing has completed yet.
    backend.submit(TransferJob(3, Direction.STORE, [4], [5], tag=("req-c",)))
    assert backend.poll() == []

    # Step N+2: the DMA ends; both results come back with their own request ids.
    npu_env.npu.release()
    results = {r.direction: r for r in collect_results(backend.poll, 2)}
    assert results[Direction.LOAD].ok and results[Direction.LOAD].tag == ("req-a", "req-b")
    assert results[Direction.STORE].tag == ("req-c",)


def test_c_flush_waits_for_jobs_not_yet_launched(npu_env, kv):
    backend = npu_env.backend("full")
    rig = bind_rig(backend, kv)
    npu_env.acl.set_delay_us(60_000)  # each batch call takes 60 ms in the copy thread
    for j in range(3):
        backend.submit(TransferJob(j, Direction.STORE, [j], [20 + j], tag=j))
    launched_before_flush = npu_env.acl.total_calls()
    results = backend.flush()
    assert launched_before_flush < 3  # some jobs were still queued when flush began
    assert sorted(r.job_id for r in results) == [0, 1, 2] and all(r.ok for r in results)
    assert npu_env.acl.v2_calls() == 3
    rig.assert_stored(range(3), range(20, 23))
    assert backend.num_pending == 0 and backend.poll() == []


def test_stress_copy_thread_appends_while_engine_polls(npu_env, kv):
    backend = npu_env.backend("full")
    rig = bind_rig(backend, kv)
    npu_env.acl.set_delay_us(200)  # the copy thread keeps launching for ~60 ms
    num_jobs = 300
    for j in range(num_jobs):
        backend.submit(TransferJob(j, Direction.STORE, [j % kv.num_blocks],
                                   [j % NUM_HOST_BLOCKS]))
    per_poll: list[int] = []

    def poll() -> list:
        results = backend.poll()
        per_poll.append(len(results))
        return results

    results = collect_results(poll, num_jobs)
    # Results were drained while the copy thread still appended.
    assert sum(1 for n in per_poll if n) > 1
    assert all(r.ok for r in results)
    assert sorted(r.job_id for r in results) == list(range(num_jobs))  # each exactly once
    assert backend.flush() == [] and backend.num_pending == 0
    last = {j % NUM_HOST_BLOCKS: j % kv.num_blocks for j in range(num_jobs)}
    rig.assert_stored(list(last.values()), list(last))


def test_stress_polling_interleaved_with_submission(npu_env, kv):
    backend = npu_env.backend("full")
    bind_rig(backend, kv)
    npu_env.acl.set_delay_us(100)
    rng = np.random.default_rng(7)
    seen: list[tuple[str, int]] = []
    for step in range(200):  # one store and maybe one load per step, polled every step
        backend.submit(TransferJob(step, Direction.STORE, [step % kv.num_blocks], [step % 16]))
        if rng.random() < 0.5:
            backend.submit(TransferJob(step, Direction.LOAD, [16 + step % 16],
                                       [step % kv.num_blocks]))
        seen += [(r.direction.value, r.job_id) for r in backend.poll()]
    seen += [(r.direction.value, r.job_id) for r in backend.flush()]
    assert len(seen) == len(set(seen)) and sum(d == "store" for d, _ in seen) == 200
    assert backend.num_pending == 0
