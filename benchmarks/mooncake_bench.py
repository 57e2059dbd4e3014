"""Mooncake Store client: plain put/get against batched zero-copy calls, on a real master.

Starts ``mooncake_master`` on a free loopback port, sets one client up over
TCP and moves ``--blocks`` blocks of ``--block-bytes`` each way:

* ``put``/``get``: one call per block, the value copied in and out of Python
  ``bytes``;
* ``batch_put_from``/``batch_get_into``: one call per ``--batch`` blocks,
  straight from and into a host buffer registered once with
  ``register_buffer`` (what the Mooncake tier does, with
  ``batch_*_multi_buffers`` for its header and host regions).

Every read is checked byte for byte. Prints a table of GB/s and writes
``docs/benchmarks/mooncake_bench.md``.

    python benchmarks/mooncake_bench.py [--blocks 512] [--block-bytes 262144]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kvoffload_hal.selfcheck.environment import cpu_model  # noqa: E402
from support.mooncake_master import MooncakeMaster  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "mooncake_bench.md")


def plain(client, keys, src, dst, block):
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        assert client.put(key, src[i * block:(i + 1) * block].tobytes()) == 0
    t1 = time.perf_counter()
    for i, key in enumerate(keys):
        dst[i * block:(i + 1) * block] = np.frombuffer(client.get(key), dtype=np.uint8)
    return t1 - t0, time.perf_counter() - t1


def batched(client, keys, src, dst, block, batch):
    t0 = time.perf_counter()
    for s in range(0, len(keys), batch):
        chunk = keys[s:s + batch]
        codes = client.batch_put_from(chunk, [src.ctypes.data + (s + i) * block
                                              for i in range(len(chunk))], [block] * len(chunk))
        assert all(c == 0 for c in codes), codes
    t1 = time.perf_counter()
    for s in range(0, len(keys), batch):
        chunk = keys[s:s + batch]
        codes = client.batch_get_into(chunk, [dst.ctypes.data + (s + i) * block
                                              for i in range(len(chunk))], [block] * len(chunk))
        assert all(c == block for c in codes), codes
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-bytes", type=int, default=256 << 10)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    from mooncake.store import MooncakeDistributedStore

    n, block = args.blocks, args.block_bytes
    total = n * block
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    rows = []
    with MooncakeMaster() as master:
        client = MooncakeDistributedStore()
        # Room for every pass (warm-up included): no eviction during the runs.
        assert client.setup("127.0.0.1", "P2PHANDSHAKE", 10 * total, 64 << 20, "tcp", "",
                            master.address) == 0
        dst = np.zeros(total, dtype=np.uint8)
        for buf in (src, dst):
            assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        variants = [("put / get (bytes, one call per block)",
                     lambda keys: plain(client, keys, src, dst, block))]
        variants += [(f"batch_put_from / batch_get_into ({b} per call, registered)",
                      lambda keys, b=b: batched(client, keys, src, dst, block, b))
                     for b in (1, args.batch)]
        for v, (name, run) in enumerate(variants):
            for attempt in ("warm-up", "measured"):  # the first pass maps the segment
                dst[:] = 0
                put_s, get_s = run([f"bench/{v}/{attempt}/{i}" for i in range(n)])
                assert np.array_equal(src, dst), name
            rows.append((name, total / put_s / 1e9, total / get_s / 1e9))
        client.close()
    lines = [f"{n} blocks of {block >> 10} KiB, one client, TCP on loopback, "
             f"CPU: {cpu_model()}", "",
             "| calls | put GB/s | get GB/s |", "|---|---|---|"]
    lines += [f"| {name} | {put:.2f} | {get:.2f} |" for name, put, get in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    png = OUT.replace(".md", ".png")
    with open(OUT, "w") as f:
        f.write(f"{text}\n![plot]({os.path.basename(png)})\n")
    write_plot(rows, png, lines[0])
    print(f"wrote {OUT} and {png}")


def write_plot(rows: list[tuple[str, float, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.38
    for i, (label, column) in enumerate((("put", 1), ("get", 2))):
        xs = [k + (i - 0.5) * width for k in range(len(rows))]
        ax.bar(xs, [r[column] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0].replace(" (", "\n(") for r in rows], fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
