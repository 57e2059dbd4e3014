"""The soak's verdicts: tokens, errors and hangs, leak slopes, counter balance, faults
seen, and the cost of the connector's scheduler hooks."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from soak.config import SoakConfig, uses_disk

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
    """Samples after ``warmup_s`` and after the secondary tier first filled (a bounded
    cache grows until it is full: that is no leak)."""
    if not rows:
        return []
    t0 = rows[0]["t"]
    full = next((r["t"] for r in rows if (r.get("tier_index") or 0) >= 0.95 * cfg.disk_blocks),
                None) if uses_disk(cfg) else t0
    start = max(t0 + cfg.warmup_s, full if full is not None else rows[-1]["t"])
    return [r for r in rows if r["t"] >= start]


def leak_checks(rows: list[dict], cfg: SoakConfig) -> list[Check]:
    kept = after_warmup(rows, cfg)
    out = [Check("samples after warm-up (and a full secondary tier)",
                 f"{len(kept)} over {kept[-1]['requests'] - kept[0]['requests'] if kept else 0}"
                 " requests", ">= 5", len(kept) >= 5)]
    if uses_disk(cfg):
        most = max((r["disk_files"] for r in rows), default=0)
        out.append(Check("disk: most files under disk_path at any sample", str(most),
                         f"<= {cfg.disk_blocks + 16} (capacity + temporaries and locks)",
                         most <= cfg.disk_blocks + 16))
    if kept:
        first, last = kept[0], rows[-1]  # the last row is taken once the server is idle
        for key, slack in (("fds", 8), ("threads", 4), ("rss_bytes", cfg.rss_slack_bytes)):
            shown = (lambda v: f"{v / 2**20:.0f} MiB") if key == "rss_bytes" else str
            out.append(Check(f"{key}: idle at the end vs after warm-up",
                             f"{shown(last[key])} vs {shown(first[key])}",
                             f"<= +{shown(slack)}", last[key] <= first[key] + slack))
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


def balance_checks(probe: dict, metrics: dict, files_left: int | None) -> list[Check]:
    """At idle: each tier's blocks stored = resident + evicted (dropped ones included)."""
    cpu_in = probe.get("cpu_published", 0)
    cpu_out = probe.get("cpu_resident", 0) + probe.get("cpu_evicted", 0)
    stored = metrics.get("blocks_stored", 0) + metrics.get("blocks_from_disk", 0) \
        + metrics.get("blocks_from_mooncake", 0)
    out = [Check("CPU tier: published = resident + evicted", f"{cpu_in} = {cpu_out}",
                 "equal", cpu_in == cpu_out),
           Check("CPU tier: published = blocks_stored + promoted", f"{cpu_in} = {stored:g}",
                 "equal", cpu_in == stored),
           Check("CPU tier: pinned blocks when idle", str(probe.get("cpu_pinned")), "0",
                 probe.get("cpu_pinned") == 0)]
    if probe.get("tier_index") is not None:
        reserved, index = probe.get("tier_reserved", 0), probe["tier_index"]
        evicted = probe.get("tier_evicted", 0)
        out.append(Check("tier: reserved = resident + evicted (dropped included)",
                         f"{reserved} = {index} + {evicted}", "equal",
                         reserved == index + evicted))
        written = metrics.get("blocks_to_disk", metrics.get("blocks_to_mooncake", 0))
        failed = metrics.get("disk_failed_blocks", metrics.get("mooncake_failed_blocks", 0))
        out.append(Check("tier: reserved - written <= failed blocks",
                         f"{reserved} - {written:g} <= {failed:g}", "holds",
                         0 <= reserved - written <= failed))
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
        seen = sum(1 for f in mine if any(f.after.get(k, 0) > f.before.get(k, 0)
                                          for k in EVIDENCE.get(kind, ())))
        out.append(Check(f"fault {kind}: shown by {' / '.join(EVIDENCE.get(kind, ()))}",
                         f"{seen} of {len(mine)}", "all", seen == len(mine)))
    return out


def hook_stats(rows: list[dict]) -> tuple[float, float, int]:
    """p50 and p99 (ms) of the scheduler hooks' time per engine step, and the steps seen."""
    steps = sorted(s for r in rows for s in r.get("step_hook_s") or ())
    if not steps:
        return 0.0, 0.0, 0
    pick = lambda q: steps[min(len(steps) - 1, int(q * len(steps)))] * 1e3  # noqa: E731
    return pick(0.5), pick(0.99), len(steps)
