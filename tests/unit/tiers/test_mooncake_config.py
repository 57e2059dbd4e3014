"""The Mooncake tier's keys in kv_connector_extra_config: parsed once, refused with one line."""

import pytest

from kvoffload_hal.config import OffloadConfig

MASTER = {"mooncake_master": "127.0.0.1:50051"}


def test_defaults_and_values_are_parsed():
    assert OffloadConfig.from_extra_config({}).tiers == ()
    cfg = OffloadConfig.from_extra_config({
        **MASTER, "mooncake_protocol": "rdma", "mooncake_segment_bytes": 16 << 20,
        "mooncake_timeout_s": 0.5, "mooncake_required": True}).tiers[0].config
    assert cfg.master_host_port == ("127.0.0.1", 50051) and cfg.protocol == "rdma"
    assert cfg.local_hostname == "127.0.0.1" and cfg.segment_bytes == 16 << 20
    assert cfg.timeout_s == 0.5 and cfg.required


@pytest.mark.parametrize("extra, message", [
    ({"mooncake_master": "nohost"}, r"\['mooncake_master'\]='nohost': expected host:port"),
    ({"mooncake_master": "h:99999"}, "expected host:port"),
    ({**MASTER, "mooncake_protocol": "udp"}, "expected one of tcp, rdma, ascend"),
    ({**MASTER, "mooncake_segment_bytes": 0}, r"\['mooncake_segment_bytes'\]=0"),
    ({**MASTER, "mooncake_segment_bytes": (16 << 20) - 1},
     r"\['mooncake_segment_bytes'\]=16777215: the Mooncake client needs a segment of at "
     r"least 16777216 bytes \(16 MiB\)"),
    ({**MASTER, "mooncake_timeout_s": True}, "expected a number of seconds"),
    ({**MASTER, "mooncake_required": "yes"}, "expected true or false"),
    ({"mooncake_timeout_s": 1.0}, "'mooncake_master' is not"),
    ({"mooncake_master": "10.0.0.5:50051"}, "mooncake_local_hostname"),
    ({**MASTER, "disk_path": "/tmp/kv", "disk_bytes_to_use": 1 << 20, "tiers": ["mooncake"]},
     "leaves out the disk tier, which 'disk_path' turns on"),
])
def test_a_wrong_value_is_refused_naming_the_key(extra, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config(extra)


def test_mooncake_keys_are_not_reported_as_unknown(caplog):
    OffloadConfig.from_extra_config({**MASTER, "mooncake_protocol": "tcp"})
    assert not any("unknown key" in r.getMessage() for r in caplog.records)


def test_a_disk_tier_goes_in_front_of_the_mooncake_tier(tmp_path):
    extra = {**MASTER, "disk_path": str(tmp_path), "disk_bytes_to_use": 1 << 20}
    assert [t.name for t in OffloadConfig.from_extra_config(extra).tiers] == ["disk", "mooncake"]
