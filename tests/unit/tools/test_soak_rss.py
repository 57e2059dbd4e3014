"""The soak's RSS verdict: the served server's growth after warm-up, alone or against the
reference engine's growth over the same span of requests (benchmarks/soak/)."""

from soak.checks import rss_check
from soak.config import SoakConfig

MIB = 1 << 20


def row(requests: int, rss_mib: int) -> dict:
    return {"requests": requests, "rss_bytes": rss_mib * MIB}


def test_growth_is_judged_against_what_the_reference_grew_over_the_same_requests():
    cfg = SoakConfig(rss_slack_bytes=128 * MIB)
    first, last = row(300, 2800), row(2000, 3100)  # +300 MiB, idle at the end
    # The reference grew 220 MiB between 300 and 2000 requests ended (samples before,
    # between and after the span; the last one idle).
    reference = [row(0, 2400), row(250, 2600), row(310, 2700), row(1200, 2850),
                 row(2010, 2920), row(2100, 2925)]
    ok = rss_check(first, last, cfg, reference)
    assert ok.ok, ok
    assert "+300 MiB vs +220 MiB" in ok.value

    # The same growth where the reference stayed flat is a leak.
    flat = [row(0, 2400), row(310, 2700), row(2010, 2710)]
    assert not rss_check(first, last, cfg, flat).ok


def test_a_reference_that_ended_fewer_requests_is_read_at_its_last_sample():
    cfg = SoakConfig(rss_slack_bytes=128 * MIB)
    first, last = row(300, 2800), row(2000, 3000)
    short = [row(310, 2700), row(900, 2760)]  # stopped by its time cap at 900 requests
    verdict = rss_check(first, last, cfg, short)
    assert "+200 MiB vs +60 MiB" in verdict.value and "reached 900" in verdict.value
    assert not verdict.ok  # 200 > 60 + 128


def test_without_a_reference_the_growth_has_its_own_bound():
    cfg = SoakConfig(rss_slack_bytes=256 * MIB)
    assert rss_check(row(300, 3000), row(2000, 3250), cfg, None).ok
    assert not rss_check(row(300, 3000), row(2000, 3260), cfg, None).ok
