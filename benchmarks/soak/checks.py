"""The soak's verdicts: tokens, errors and hangs, leak slopes, counter balance, faults
seen, and the cost of the connector's scheduler hooks."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from soak.config import (
    BLOCK_BYTES,
    MOONCAKE_SEGMENT_BYTES,
    SoakConfig,
    tier_names,
    uses_disk,
    uses_mooncake,
)
from soak.reference_load import rss_at

# Leak bounds, as a least-squares slope per 1000 requests after warm-up.
SLOPE_BOUNDS = {"rss_bytes": 32 << 20, "fds": 2.0, "threads": 1.0,
                "disk_files": 40.0, "disk_bytes": 40 * 70_000}
# Which counter or log line shows each fault (any of them rising between the fault's
# start and the next fault's start, or the run's end).
EVIDENCE = {
    "enospc": ("disk_failed_blocks", "log_write_failed"),
    "damage": ("disk_failed_blocks", "log_unusable"),
    "remove": ("disk_failed_blocks", "log_read_failed"),
    "burst": ("probe_cpu_evicted", "num_preemptions"),
    "mooncake_freeze": ("mooncake_breaker_opens", "mooncake_timeouts", "log_breaker"),
    "mooncake_kill": ("mooncake_breaker_opens", "mooncake_failed_blocks", "log_breaker"),
}


@dataclass
class Check:
    name: str
    value: str
    bound: str
    ok: bool


def slope_per_1000(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 3 or max(xs) == min(xs):
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def after_warmup(rows: list[dict], cfg: SoakConfig) -> list[dict]:
    """Samples after ``warmup_s`` and after the disk tier, when it runs, first filled (a
    bounded cache grows until it is full: that is no leak; the files under
    ``disk_path`` are judged)."""
    if not rows:
        return []
    t0 = rows[0]["t"]
    full = next((r["t"] for r in rows
                 if (r.get("tier_index_disk") or 0) >= 0.95 * cfg.disk_blocks),
                None) if uses_disk(cfg) else t0
    start = max(t0 + cfg.warmup_s, full if full is not None else rows[-1]["t"])
    return [r for r in rows if r["t"] >= start]


def leak_checks(rows: list[dict], cfg: SoakConfig,
                reference: list[dict] | None = None) -> list[Check]:
    """Bounded caches and idle values vs just after warm-up; slopes per request.
    ``reference``: the reference engine's RSS samples under the same load
    (:mod:`.reference_load`), which the served server's RSS growth is judged against."""
    kept = after_warmup(rows, cfg)
    out = [Check("samples after warm-up (and a full disk tier, when it runs)",
                 f"{len(kept)} over {kept[-1]['requests'] - kept[0]['requests'] if kept else 0}"
                 " requests", ">= 5", len(kept) >= 5)]
    if uses_disk(cfg):
        most = max((r["disk_files"] for r in rows), default=0)
        out.append(Check("disk: most files under disk_path at any sample", str(most),
                         f"<= {cfg.disk_blocks + 16} (capacity + temporaries and locks)",
                         most <= cfg.disk_blocks + 16))
    if uses_mooncake(cfg):
        out += mooncake_checks(rows)
    if kept:
        first, last = kept[0], rows[-1]  # the last row is taken once the server is idle
        for key, slack in (("fds", 8), ("threads", 4)):
            out.append(Check(f"{key}: idle at the end vs after warm-up",
                             f"{last[key]} vs {first[key]}", f"<= +{slack}",
                             last[key] <= first[key] + slack))
        out.append(rss_check(first, last, cfg, reference))
    span = kept[-1]["requests"] - kept[0]["requests"] if kept else 0
    judged = span >= cfg.min_leak_requests
    bounds = {**SLOPE_BOUNDS, **cfg.leak_bounds}
    for key, bound in bounds.items():
        slope = slope_per_1000([r["requests"] for r in kept], [r[key] for r in kept])
        scale, unit = (1 / (1 << 20), " MiB") if key == "rss_bytes" else (1, "")
        out.append(Check(f"leak: {key} per 1000 requests", f"{slope * scale:+.2f}{unit}",
                         f"<= {bound * scale:g}{unit}" + ("" if judged else
                         f" (judged over >= {cfg.min_leak_requests} requests)"),
                         slope <= bound or not judged))
    return out


def rss_check(first: dict, last: dict, cfg: SoakConfig,
              reference: list[dict] | None) -> Check:
    """Idle RSS at the end vs after warm-up, within ``rss_slack_bytes``; with a
    reference, within that much more than the reference engine grew over the same
    span of requests (vLLM's CPU worker grows for its first thousands of requests,
    connector or not)."""
    mib = 1 << 20
    grew = last["rss_bytes"] - first["rss_bytes"]
    if reference is None:
        return Check("rss_bytes: idle at the end vs after warm-up",
                     f"{last['rss_bytes'] / mib:.0f} MiB vs {first['rss_bytes'] / mib:.0f} MiB",
                     f"<= +{cfg.rss_slack_bytes / mib:.0f} MiB", grew <= cfg.rss_slack_bytes)
    span = (first["requests"], last["requests"])
    ref_grew = rss_at(reference, span[1]) - rss_at(reference, span[0])
    return Check(f"rss_bytes: growth over requests {span[0]}-{span[1]}, idle at the end, "
                 "vs the reference engine's over the same requests",
                 f"{grew / mib:+.0f} MiB vs {ref_grew / mib:+.0f} MiB "
                 f"(reference reached {reference[-1]['requests']})",
                 f"<= reference + {cfg.rss_slack_bytes / mib:.0f} MiB",
                 grew <= ref_grew + cfg.rss_slack_bytes)


def token_checks(compared: list[tuple[list[int], list[int]]]) -> Check:
    equal = sum(1 for got, want in compared if got == want)
    return Check("tokens equal to the reference engine", f"{equal} of {len(compared)}",
                 "all, and >= 1", equal == len(compared) and equal > 0)


def outcome_checks(outcomes: list, cfg: SoakConfig) -> list[Check]:
    by = {s: [o for o in outcomes if o.status == s] for s in ("ok", "dropped", "error",
                                                              "late", "running")}
    worst = max((o.ended - o.started for o in outcomes if o.ended), default=0.0)
    errors = "; ".join(sorted({o.error for o in by["error"]})[:3])
    return [
        Check("requests completed / dropped by their client",
              f"{len(by['ok'])} / {len(by['dropped'])}", "> 0", len(by["ok"]) > 0),
        Check("HTTP or stream errors", f"{len(by['error'])}" + (f" ({errors})" if errors else ""),
              "0 (no fault here may cause one)", not by["error"]),
        Check("requests past the deadline or never ended",
              f"{len(by['late']) + len(by['running'])} (longest {worst:.1f} s)",
              f"0 (deadline {cfg.request_deadline_s:g} s)",
              not by["late"] and not by["running"]),
    ]


def mooncake_checks(rows: list[dict]) -> list[Check]:
    """The master's keys stay within what its segment holds, and the one worker's
    segment is mounted once, and again once idle after a master restart."""
    keys = [r["mooncake_keys"] for r in rows if r.get("mooncake_keys") is not None]
    most_keys = MOONCAKE_SEGMENT_BYTES // BLOCK_BYTES
    out = [Check("mooncake: most keys in the master at any sample",
                 str(int(max(keys, default=0))),
                 f"<= {most_keys} (a segment's capacity in blocks), sampled",
                 bool(keys) and max(keys) <= most_keys)]
    mounted = [r["mooncake_segment_bytes"] / MOONCAKE_SEGMENT_BYTES for r in rows
               if r.get("mooncake_segment_bytes") is not None]
    last = rows[-1].get("mooncake_segment_bytes") if rows else None
    last = None if last is None else last / MOONCAKE_SEGMENT_BYTES
    out.append(Check("mooncake: segments mounted, idle at the end / most at any sample",
                     f"{'no answer' if last is None else f'{last:g}'} / "
                     f"{max(mounted, default=0):g}",
                     "1 / 1 (the one worker's segment; a restarted master has none until "
                     "it mounts again)", last == 1 and max(mounted, default=0) == 1))
    return out


def cpu_balance(cfg: SoakConfig, probe: dict, metrics: dict) -> list[Check]:
    """Each block the CPU tier publishes was stored from the device or promoted from one
    secondary tier (a promotion is counted by the tier that served it, once)."""
    cpu_in = probe.get("cpu_published", 0)
    cpu_out = probe.get("cpu_resident", 0) + probe.get("cpu_evicted", 0)
    promoted = [f"blocks_from_{name}" for name in tier_names(cfg)]
    stored = metrics.get("blocks_stored", 0) + sum(metrics.get(k, 0) for k in promoted)
    return [Check("CPU tier: published = resident + evicted", f"{cpu_in} = {cpu_out}",
                  "equal", cpu_in == cpu_out),
            Check(f"CPU tier: published = blocks_stored + {' + '.join(promoted)}",
                  f"{cpu_in} = {stored:g}", "equal", cpu_in == stored),
            Check("CPU tier: pinned blocks when idle", str(probe.get("cpu_pinned")), "0",
                  probe.get("cpu_pinned") == 0)]


def tier_balance(name: str, probe: dict, metrics: dict) -> list[Check]:
    """One secondary tier's index and counters, at idle."""
    reserved, learned = (probe.get(f"tier_{k}_{name}", 0) for k in ("reserved", "learned"))
    index, evicted = probe.get(f"tier_index_{name}"), probe.get(f"tier_evicted_{name}", 0)
    written = metrics.get(f"blocks_to_{name}", 0)
    failed = metrics.get(f"{name}_failed_blocks", 0)
    return [Check(f"{name}: reserved + learned = resident + evicted (dropped included)",
                  f"{reserved} + {learned} = {index} + {evicted}", "equal",
                  index is not None and reserved + learned == index + evicted),
            Check(f"{name}: reserved - blocks_to_{name} <= {name}_failed_blocks",
                  f"{reserved} - {written:g} <= {failed:g}", "holds",
                  0 <= reserved - written <= failed)]


def balance_checks(cfg: SoakConfig, probe: dict, metrics: dict,
                   files_left: int | None) -> list[Check]:
    """At idle: each tier's blocks stored = resident + evicted (dropped ones included)."""
    running, expected = probe.get("tier_names"), list(tier_names(cfg))
    out = [Check("secondary tiers the scheduler runs, nearest first",
                 " -> ".join(running or ()) or "none", " -> ".join(expected),
                 running == expected),
           *cpu_balance(cfg, probe, metrics)]
    for name in expected:
        out += tier_balance(name, probe, metrics)
    if files_left is not None:
        out.append(Check("disk: files left after a clean shutdown (disk_retention=remove; "
                         "the shared setup lock stays)", str(files_left), "0",
                         files_left == 0))
    return out


def fault_checks(faults: list) -> list[Check]:
    reread = [f for f in faults if "read again" in f.detail]
    out = [Check("a damaged or removed prompt read again: the same tokens",
                 f"{sum(1 for f in reread if 'the same tokens' in f.detail)} of {len(reread)}",
                 "all", all("the same tokens" in f.detail for f in reread))]
    for kind in sorted({f.name for f in faults}):
        mine = [f for f in faults if f.name == kind]
        keys = EVIDENCE.get(kind, ())
        unseen = [f for f in mine if not any(f.after.get(k, 0) > f.before.get(k, 0)
                                             for k in keys)]
        missed = "; ".join(", ".join(f"{k} {f.before.get(k, 0):g}->{f.after.get(k, 0):g}"
                                     for k in keys) for f in unseen)
        out.append(Check(f"fault {kind}: shown by {' / '.join(keys)}",
                         f"{len(mine) - len(unseen)} of {len(mine)}"
                         + (f" (not shown: {missed})" if unseen else ""),
                         "all", not unseen))
    return out


def hook_stats(rows: list[dict]) -> tuple[float, float, int]:
    """p50 and p99 (ms) of the scheduler hooks' time per engine step, and the steps seen."""
    steps = sorted(s for r in rows for s in r.get("step_hook_s") or ())
    if not steps:
        return 0.0, 0.0, 0
    pick = lambda q: steps[min(len(steps) - 1, int(q * len(steps)))] * 1e3  # noqa: E731
    return pick(0.5), pick(0.99), len(steps)
