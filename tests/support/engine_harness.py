"""vLLM's real scheduler and both connector roles, around a model that checks its KV.

No model weights run here. :class:`FakeModel` plays the model runner: each token it
"computes" gets bytes derived from its "weights" (a salt) and the whole prefix in its
KV slot, and before computing it verifies the KV of the prefix it attends to (served
by the device prefix cache or loaded back from a tier): a wrong block, a stale block
or a load that lands late fails the check. Everything else is real: vLLM's
``Scheduler`` and ``KVCacheManager``, both connector roles, the CPU copy backend (or
a test subclass), host memory and the KV tensors.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvoffload_hal.demo.inprocess import offload_transfer_config, set_inprocess_env

set_inprocess_env()

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvoffload_hal import vllm_compat  # noqa: E402
from kvoffload_hal.capabilities import loads_before_forward  # noqa: E402
from kvoffload_hal.connector import HALOffloadConnector  # noqa: E402
from kvoffload_hal.metadata import OffloadMetadata, OffloadWorkerMetadata  # noqa: E402

HEADS, HEAD_DIM = 1, 32  # one KV "page" per token: 2 (K, V) x 1 x 32 bf16 = 128 bytes
VOCAB = 97


def _kv_cache_tensor(page: int, num_blocks: int, layers: list[str]) -> KVCacheTensor:
    """One KV tensor shared by ``layers``, in the fields of this vLLM's ``KVCacheTensor``."""
    if "layers" in KVCacheTensor.__dataclass_fields__:  # vLLM >= 0.32: placement explicit
        return KVCacheTensor(size=page * num_blocks, layers=layers,
                             layer_stride=page * num_blocks, block_stride=page)
    return KVCacheTensor(size=page * num_blocks, shared_by=layers)


def token_kv(prefix_digest: bytes) -> torch.Tensor:
    """The bytes a token's K and V hold: a function of the whole prefix up to it."""
    raw = (prefix_digest * (2 * HEADS * HEAD_DIM * 2 // len(prefix_digest) + 1))
    return torch.frombuffer(bytearray(raw[: 2 * HEADS * HEAD_DIM * 2]), dtype=torch.uint8)


@dataclass
class FakeModel:
    """Writes and checks per-token KV in the real KV tensors, group by group."""

    kv: dict[int, torch.Tensor]  # group -> uint8 view [num_blocks, block_size, bytes per token]
    block_sizes: list[int]
    windows: list[int | None]
    digests: dict[str, list[bytes]] = field(default_factory=dict)  # req -> per-token prefix digest
    checked_tokens: int = 0
    weights: bytes = b""  # new weights: every token's KV changes

    def load_weights(self, weights: bytes) -> None:
        self.weights = weights
        self.digests.clear()

    def _digests(self, req: Request) -> list[bytes]:
        have = self.digests.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        while len(have) < len(tokens):
            prev = have[-1] if have else self.weights
            have.append(hashlib.blake2b(prev + tokens[len(have)].to_bytes(4, "little"),
                                        digest_size=16).digest())
        return have

    def run(self, req: Request, block_ids: tuple[list[int], ...], start: int, end: int,
            wrong_reads: list[tuple[str, int]]) -> None:
        """Check what attention reads, write what the step computes.

        A wrong read goes into ``wrong_reads`` (request, block); the engine then
        requires every one to be a block reported as a failed load in this step,
        whose output vLLM drops and recomputes.
        """
        digests = self._digests(req)
        for g, kv in self.kv.items():
            bs, window = self.block_sizes[g], self.windows[g]
            lo = 0 if window is None else max(0, start - window + 1)
            for pos in range(lo, start):  # what attention reads
                block = block_ids[g][pos // bs]
                got = kv[block, pos % bs]
                if not torch.equal(got, token_kv(digests[pos])):
                    wrong_reads.append((req.request_id, block))
                self.checked_tokens += 1
            for pos in range(start, end):  # what this step writes
                kv[block_ids[g][pos // bs], pos % bs] = token_kv(digests[pos])

    def next_token(self, req: Request) -> int:
        return self._digests(req)[-1][0] % VOCAB


class Engine:
    """One scheduler + one worker connector + the fake model, stepped by hand."""

    def __init__(self, model_dir: str, *, num_gpu_blocks: int, cpu_blocks: int,
                 block_size: int = 16, lazy: bool = False, sliding_window: int | None = None,
                 full_groups: int = 1, sliding_groups: int = 1,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 32,
                 ranks: int = 1, extra_config: dict | None = None,
                 kv_events: bool = False, scheduling_policy: str = "fcfs",
                 peer_layers: tuple[int, ...] = (), parallel: dict | None = None,
                 handshake: bool = True) -> None:
        """``ranks`` > 1: the one worker here plays rank 0 and a test reports for the
        others. ``peer_layers``: real workers for the other ranks instead, one per
        entry with that many layers (pipeline stages hold different layers; the
        scheduler, as in vLLM, is given rank 0's config); each gets every step's
        metadata, runs its copies and reports. KV cache groups: ``full_groups`` full
        attention, then ``sliding_groups`` sliding-window. ``parallel``: ``ParallelConfig``
        fields set after the config is built. ``handshake``: the workers' start-up metadata
        to the scheduler, as vLLM's engine core gives it."""
        self.block_size = block_size
        layout = dict(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_DIM,
                      dtype=torch.bfloat16)
        groups = [FullAttentionSpec(**layout)] * full_groups
        if sliding_window is not None:
            groups += [SlidingWindowSpec(**layout, sliding_window=sliding_window)] * sliding_groups
        page = groups[0].page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[_kv_cache_tensor(page, num_gpu_blocks,
                                               [f"layer.{g}" for g in range(len(groups))])],
            kv_cache_groups=[KVCacheGroupSpec([f"layer.{g}"], spec)
                             for g, spec in enumerate(groups)],
        )
        ranks = max(ranks, 1 + len(peer_layers))
        cpu_bytes = cpu_blocks * page * ranks  # split evenly across ranks
        args = EngineArgs(
            kv_events_config=(KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                              if kv_events else None),
            model=model_dir, block_size=block_size, enable_prefix_caching=True,
            max_model_len=2048, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, enforce_eager=True, scheduling_policy=scheduling_policy,
            kv_transfer_config=offload_transfer_config(
                cpu_bytes_to_use=cpu_bytes, lazy_offload=lazy, **(extra_config or {})),
        )
        self.vllm_config = args.create_engine_config()
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks  # set by profiling in vLLM
        # With ranks > 1 the one worker here plays rank 0; a test reports for the others.
        self.vllm_config.parallel_config.world_size = ranks
        for key, value in (parallel or {}).items():
            setattr(self.vllm_config.parallel_config, key, value)
        self.scheduler = Scheduler(self.vllm_config, self.kv_cache_config,
                                   StructuredOutputManager(self.vllm_config),
                                   block_size=block_size, log_stats=True)
        self.connector: HALOffloadConnector = self.scheduler.connector
        self.offload = self.connector.scheduler
        # One KV tensor shared by the groups' layers, as vLLM's HMA allocates it.
        self.kv_storage = torch.zeros(num_gpu_blocks, block_size, 2 * HEADS * HEAD_DIM,
                                      dtype=torch.bfloat16)
        self.worker = HALOffloadConnector(self.vllm_config, KVConnectorRole.WORKER,
                                          self.kv_cache_config)
        self.worker.register_kv_caches({f"layer.{g}": self.kv_storage for g in range(len(groups))})
        self.peers = [_peer_worker(self.vllm_config, groups[0], num_gpu_blocks, n)
                      for n in peer_layers]
        if handshake:  # vLLM's engine core, once the workers registered their KV caches:
            # each rank's CPU blocks, and the blocks a restarted tier kept (in the index
            # before the first request)
            self.connector.set_xfer_handshake_metadata_pp_aware({
                (rank, 0): w.get_handshake_metadata()
                for rank, w in enumerate([self.worker, *self.peers])})
        as_bytes = self.kv_storage.view(torch.uint8).view(num_gpu_blocks, block_size, -1)
        windows = [None] * full_groups + [sliding_window] * (len(groups) - full_groups)
        self.model = FakeModel({g: as_bytes for g in range(len(groups))},
                               [block_size] * len(groups), windows)
        init_none_hash(get_hash_fn_by_name("sha256"))
        self._hasher = get_request_block_hasher(block_size, get_hash_fn_by_name("sha256"))
        self.outputs: dict[str, list[int]] = {}
        self.cached_tokens: dict[str, int] = {}  # prompt tokens not computed, per request
        self.finished: set[str] = set()
        self.steps = 0
        self.preemptions = 0  # requests vLLM's scheduler preempted
        self.computed_tokens = 0  # tokens the model was given to compute
        self._released_kv: list = []  # KV memory left behind by move_kv
        self.sent: list[OffloadMetadata] = []  # each step's metadata, as the workers got it
        self.reported: list[OffloadWorkerMetadata] = []  # this rank's reports
        self.published: Counter[str] = Counter()  # connector stats as vLLM published them
        self._recving: Counter[str] = Counter()  # finished loads: how many ranks reported each
        self._sending: Counter[str] = Counter()  # released requests, likewise

    # ------------------------------------------------------------ requests
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4,
            priority: int = 0) -> Request:
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     temperature=0.0), None,
                      block_hasher=self._hasher, priority=priority)
        self.scheduler.add_request(req)
        self.outputs[req_id] = []
        return req

    def abort(self, req_ids: list[str]) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        self.finished.update(req_ids)

    # --------------------------------------------------------------- steps
    def step(self) -> None:
        so = self.scheduler.schedule()
        self.preemptions += len(so.preempted_req_ids or ())
        self.computed_tokens += so.total_num_scheduled_tokens
        meta = so.kv_connector_metadata
        self.sent.append(meta)
        workers = [self.worker, *self.peers]
        for w in workers:
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
        # As vLLM's model runner: synchronous loads before the forward pass.
        load_first = loads_before_forward(so)
        if load_first:
            for w in workers:
                w.start_load_kv(None)
        req_ids, sampled, wrong_reads = self._forward(so)
        vllm_compat.end_forward(workers)
        if not load_first:
            for w in workers:
                w.start_load_kv(None)
        sending, recving, failed, errors, worker_meta = self._collect(so.finished_req_ids)
        stray = [(r, b) for r, b in wrong_reads if b not in errors]
        assert not stray, f"wrong KV read, not reported as a failed load: {stray[:5]}"
        output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=vllm_compat.connector_output(
                failed, finished_sending=sending, finished_recving=recving,
                kv_connector_worker_meta=worker_meta,
                invalid_block_ids=errors, kv_connector_stats=self.worker.get_kv_connector_stats()),
        )
        engine_outputs = self.scheduler.update_from_output(so, output)
        for eco in engine_outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.published.update(stats.kv_connector_stats)
            for o in eco.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        self.steps += 1
        if not so.num_scheduled_tokens:
            time.sleep(0.001)  # an idle engine step is short: let the copy thread run

    def _forward(self, so) -> tuple[list[str], list[list[int]], list[tuple[str, int]]]:
        """The fake model's pass over the scheduled tokens: (requests, sampled, wrong reads)."""
        req_ids, sampled, wrong_reads = [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            self.model.run(req, block_ids, end - n, end, wrong_reads)
            self.cached_tokens.setdefault(req_id, end - n)  # where its first pass starts
            req_ids.append(req_id)
            done_prefill = end >= req.num_tokens
            sampled.append([self.model.next_token(req)] if done_prefill else [])
        return req_ids, sampled, wrong_reads

    def _collect(self, finished: set[str]):
        """Every rank's results of this step, summed as vLLM sums ranks: a load is
        finished (a request's blocks released) once every rank reported it; failures
        and reports are merged."""
        recving, failed, errors, worker_meta = set(), set(), set(), None
        for rank, w in enumerate([self.worker, *self.peers]):
            released, done, bad = _transfer_results(w, finished)
            self._sending.update(released)
            self._recving.update(done)
            failed |= bad
            errors |= w.get_block_ids_with_load_errors()
            report = w.build_connector_worker_meta()
            if rank == 0 and report is not None:
                self.reported.append(report)
            if report is not None:
                worker_meta = report if worker_meta is None else worker_meta.aggregate(report)
            w.clear_connector_metadata()
        ranks = 1 + len(self.peers)
        sending, recving = ({r for r, n in c.items() if n >= ranks}
                            for c in (self._sending, self._recving))
        for r in sending:
            del self._sending[r]
        for r in recving:
            del self._recving[r]
        return sending, recving, failed, errors, worker_meta

    def run_until_done(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():  # the engine core's own test
                return
            self.step()
        raise AssertionError(
            f"not done after {max_steps} steps: requests "
            f"{ {r: q.status.name for r, q in self.scheduler.requests.items()} }, loads "
            f"{self.offload.num_jobs_in_flight()} jobs in flight, backend pending "
            f"{self.worker.worker.backend.num_pending}")

    def drain(self, max_steps: int = 200) -> None:
        """Idle steps until every copy in flight has been reported."""
        for _ in range(max_steps):
            if not self.offload.has_pending_transfers():
                return
            time.sleep(0.002)  # idle steps are short: give the copy thread the GIL
            self.step()
        raise AssertionError("transfers still pending")

    def assert_idle(self) -> None:
        assert not self.offload.has_pending_transfers()
        assert self.worker.worker.tiers.nearest.num_pending == 0
        assert self.offload.num_pinned_cpu_blocks() == 0
        assert self.worker.worker.backend.num_pending == 0
        gpu_pool = self.scheduler.kv_cache_manager.block_pool
        # Only the null block stays in use once every request is gone.
        assert gpu_pool.get_num_free_blocks() == gpu_pool.num_gpu_blocks - 1

    # --------------------------------------------------------- sleep mode
    def sleep(self) -> None:
        """As vLLM's engine core process sleeps (level 1): requests aborted, steps
        until the scheduler has no work (the connector's copies included), every
        cache reset (the connector's too), the worker's KV caches unregistered,
        then the KV cache memory released (here: overwritten, as new memory would
        hold)."""
        self.abort([r for r in self.scheduler.requests])
        for _ in range(200):
            if not self.scheduler.has_requests():
                break
            self.step()
        assert self.scheduler.reset_prefix_cache(reset_running_requests=True,
                                                 reset_connector=True)
        self.worker.unregister_kv_caches()
        self.kv_storage.view(torch.uint8).fill_(0xA5)

    def move_kv(self) -> None:
        """The KV cache at other (zeroed) addresses, the tensor object unchanged (as
        vLLM keeps it); the old memory stays allocated, so a copy there is not read."""
        self._released_kv.append(self.kv_storage.untyped_storage())
        moved = torch.zeros_like(self.kv_storage)
        self.kv_storage.set_(moved.untyped_storage(), 0, moved.shape, moved.stride())
        as_bytes = self.kv_storage.view(torch.uint8).view(*self.kv_storage.shape[:2], -1)
        self.model.kv = {g: as_bytes for g in self.model.kv}

    def wake(self, weights: bytes | None = None, move_kv: bool = False) -> None:
        """Wake-up: new ``weights`` loaded meanwhile (an RL update); ``move_kv``: the KV
        cache comes back elsewhere."""
        if move_kv:
            self.move_kv()
        if weights is not None:
            self.model.load_weights(weights)
        self.worker.restore_kv_caches()

    def close(self) -> None:
        for w in [self.worker, *self.peers]:
            w.shutdown()


def _transfer_results(worker, finished: set[str]) -> tuple[set[str], set[str], set[str]]:
    """As the model runner of this vLLM asks a worker for them: requests whose blocks
    the connector releases, and (finished, failed) loads."""
    return vllm_compat.ask_transfer_results(worker, finished)


def _peer_worker(vllm_config, spec, num_gpu_blocks: int, num_layers: int) -> HALOffloadConnector:
    """The worker of another rank, holding ``num_layers`` layers of ``spec`` (its own
    KV cache config, as each pipeline stage has)."""
    layers = [f"peer.{i}" for i in range(num_layers)]
    tensors = [_kv_cache_tensor(spec.page_size_bytes, num_gpu_blocks, [n]) for n in layers]
    config = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=tensors,
                           kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    worker = HALOffloadConnector(vllm_config, KVConnectorRole.WORKER, config)
    worker.register_kv_caches({
        name: torch.zeros(num_gpu_blocks, spec.block_size, 2 * HEADS * HEAD_DIM,
                          dtype=torch.bfloat16) for name in layers})
    return worker
