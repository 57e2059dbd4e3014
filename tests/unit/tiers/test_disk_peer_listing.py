"""``disk_shared``: the first listing of the peers' directories is waited for by every
IO thread (kvoffload_hal/tiers/disk/peers.py), so no read made meanwhile misses a block a
peer holds. The worker half alone: two DiskTiers on one ``disk_path``, real files."""

import os
import threading

import torch

from kvoffload_hal.tiers.disk.worker import DiskTier
from support.polling import collect_results

# How long the first listing waits for a second reader to give its answer before it
# ends: a reader that waits for the listing gives none until then.
ANSWER_WAIT_S = 3.0


def _tier(root, fill):
    views = [torch.full((4, 64), fill, dtype=torch.uint8)]
    return DiskTier(str(root), 0, views, fingerprint=bytes(32), shared=True)


def test_a_read_during_the_first_listing_of_peers_waits_for_it(tmp_path, monkeypatch):
    writer, reader = _tier(tmp_path, 7), _tier(tmp_path, 0)
    try:
        writer.views[0][1] = torch.arange(64, dtype=torch.uint8)
        writer.submit_store(0, [("ab01", 1), ("ab02", 1)])
        assert collect_results(writer.poll, 1)[0].ok
        answered = threading.Semaphore(0)  # a call of reader.peers.paths() returned
        paths = reader.peers.paths

        def counted_paths():
            try:
                return paths()
            finally:
                answered.release()

        monkeypatch.setattr(reader.peers, "paths", counted_paths)
        scandir = os.scandir

        def slow_listing(path=".", *args):
            # The first listing of disk_path ends once another read answered, or at
            # the latest after ANSWER_WAIT_S (then that read waited, as it must).
            if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(tmp_path):
                answered.acquire(timeout=ANSWER_WAIT_S)
            return scandir(path, *args)

        monkeypatch.setattr(os, "scandir", slow_listing)
        # One IO thread per block file: both reads ask for the peers' list at once.
        reader.submit_load(1, [("ab01", 2), ("ab02", 3)])
        (result,) = collect_results(reader.poll, 1, timeout_s=ANSWER_WAIT_S + 10)
        assert result.failed_keys == (), "a read missed before the first listing ended"
        for block in (2, 3):
            assert torch.equal(reader.views[0][block], writer.views[0][1])
    finally:
        for tier in (writer, reader):
            tier.shutdown()
