"""The sidecar's engine API key: where it comes from, and that it is never shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.zmq_events.endpoints import rank_address as rank_endpoint
from sidecar.config import ENGINE_API_KEY_ENV, SidecarConfig

BASE = ["--engine-url", "http://127.0.0.1:30000", "--worker-id", "r0"]


def test_the_key_comes_from_its_file_first_then_the_environment(tmp_path: Path) -> None:
    """A key file wins over the environment; without either there is no key."""
    key_file = tmp_path / "key"
    key_file.write_text("  from-file \n")
    env = {ENGINE_API_KEY_ENV: "from-env"}
    assert SidecarConfig.from_args([*BASE, "--engine-api-key-file", str(key_file)],
                                   env).engine_api_key == "from-file"
    assert SidecarConfig.from_args(BASE, env).engine_api_key == "from-env"
    assert SidecarConfig.from_args(BASE, {}).engine_api_key is None


def test_the_key_is_never_in_the_configs_repr(tmp_path: Path) -> None:
    """Logging or printing the config shows no key."""
    cfg = SidecarConfig.from_args(BASE, {ENGINE_API_KEY_ENV: "sk-secret"})
    assert "sk-secret" not in repr(cfg)


@pytest.mark.parametrize(("content", "message"), [(None, "No such file"), ("", "is empty")])
def test_a_missing_or_empty_key_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    """A key file that cannot be read, or holds nothing, stops the sidecar with its path."""
    key_file = tmp_path / "key"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(SystemExit):
        SidecarConfig.from_args([*BASE, "--engine-api-key-file", str(key_file)], {})
    err = capsys.readouterr().err
    assert str(key_file) in err and message in err


def test_lora_adapters_parse_and_bad_specs_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--lora-adapter NAME=ID[:PATH]``, repeatable; a malformed or duplicate one stops the
    sidecar naming the flag."""
    cfg = SidecarConfig.from_args(
        [*BASE, "--lora-adapter", "ad=1:/ckpt/ad", "--lora-adapter", "b=2"], {}
    )
    assert [(a.name, a.int_id, a.path) for a in cfg.lora_adapters] == [
        ("ad", 1, "/ckpt/ad"), ("b", 2, "")]
    for specs, message in ((["ad"], "expected NAME=ID[:PATH]"), (["ad=x"], "integer ID"),
                           (["ad=1", "ad=2"], "share names"), (["a=1", "b=1"], "share ids")):
        with pytest.raises(SystemExit):
            SidecarConfig.from_args([*BASE, *(f"--lora-adapter={s}" for s in specs)], {})
        assert message in capsys.readouterr().err


def test_events_via_nats_and_its_limits(capsys: pytest.CaptureFixture[str]) -> None:
    """--events-via nats goes with --nats (kept out of the repr: it may hold a password);
    the stream's limits parse sizes; a half-given pair stops the sidecar."""
    cfg = SidecarConfig.from_args([*BASE, "--events-via", "nats", "--nats",
                                   "nats://u:pw@h:4222", "--events-max-bytes", "2GiB"], {})
    assert (cfg.events_via, cfg.events_max_bytes, cfg.events_max_age_s) == (
        "nats", 2 << 30, 3600.0)
    assert "pw" not in repr(cfg)
    for flags in (["--events-via", "nats"], ["--nats", "nats://h:4222"]):
        with pytest.raises(SystemExit):
            SidecarConfig.from_args([*BASE, *flags], {})
        assert "go together" in capsys.readouterr().err


def test_publish_zmq_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--publish-zmq* build the republisher's config (also from --config); a replay endpoint
    without a PUB one, a non-ZMQ endpoint or an unknown hash scheme is refused."""
    assert SidecarConfig.from_args(BASE, {}).zmq_publish.endpoint is None
    cfg = SidecarConfig.from_args([*BASE, "--publish-zmq", "tcp://*:5557", "--publish-zmq-replay",
                                   "tcp://*:5558", "--publish-zmq-hash", "xxhash_cbor"], {})
    z = cfg.zmq_publish
    assert (z.endpoint, z.replay_endpoint, z.hash_algo, z.hash_seed, z.topic) == (
        "tcp://*:5557", "tcp://*:5558", "xxhash_cbor", "0", "")
    toml = tmp_path / "sidecar.toml"
    toml.write_text('publish-zmq = "ipc:///tmp/kv"\npublish_zmq_hash_seed = "7"\n')
    from_file = SidecarConfig.from_args([*BASE, "--config", str(toml)], {}).zmq_publish
    assert (from_file.endpoint, from_file.hash_seed) == ("ipc:///tmp/kv", "7")
    for bad in (["--publish-zmq-replay", "tcp://*:5558"], ["--publish-zmq", "http://x:1"],
                ["--publish-zmq", "tcp://*:1", "--publish-zmq-hash", "md5"]):
        with pytest.raises(SystemExit):
            SidecarConfig.from_args([*BASE, *bad], {})
    assert "--publish-zmq" in capsys.readouterr().err


def test_each_rank_publishes_on_its_own_port() -> None:
    """Worker i binds the port plus i, as vLLM offsets its DP ranks; a wildcard stays one."""
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"
    # ipc: the publishers' _dp<r> suffix (one path cannot be bound twice)
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_kv_event_ranks_name_every_ranks_endpoints() -> None:
    """``--kv-events-ranks``: rank r's ZMQ endpoints at the base ports plus r; a polled
    TensorRT-LLM URL stands for every rank; more than one rank needs an endpoint."""
    from adapters.base import EventEndpoint

    cfg = SidecarConfig(engine="trtllm", engine_url="http://e:8000",
                        kv_events_endpoint="tcp://e:5557",
                        kv_events_replay_endpoint="tcp://e:5600", kv_events_ranks=2)
    assert cfg.event_endpoints() == (EventEndpoint(0, "tcp://e:5557", "tcp://e:5600"),
                                     EventEndpoint(1, "tcp://e:5558", "tcp://e:5601"))
    polled = SidecarConfig(engine="trtllm", engine_url="http://e:8000",
                           kv_events_endpoint="http://e:8000", kv_events_ranks=2)
    assert [ep.endpoint for ep in polled.event_endpoints()] == ["http://e:8000"] * 2
    assert SidecarConfig(engine_url="http://e:8000").event_endpoints() == ()
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        SidecarConfig(engine_url="http://e:8000", kv_events_ranks=2)
    with pytest.raises(ValueError, match="past port"):
        SidecarConfig(engine_url="http://e:8000", kv_events_endpoint="tcp://e:65535",
                      kv_events_ranks=2)
