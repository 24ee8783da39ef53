"""Where a sidecar's engine is reached from outside its pod (the endpoint picker's pick)."""

from __future__ import annotations

from routing.workers.discovery import engine_address


class TestEngineAddress:
    def test_a_loopback_engine_is_at_the_sidecars_host(self) -> None:
        """An engine on the sidecar's loopback is reached at the sidecar's host, its port."""
        for host in ("127.0.0.1", "localhost", "0.0.0.0", "[::1]", "127.0.0.53"):
            engine = engine_address("http://10.1.2.3:9000", f"http://{host}:30000")
            assert engine is not None, host
            assert (engine.host, engine.port) == ("10.1.2.3", 30000), host

    def test_an_engine_with_its_own_address_keeps_it(self) -> None:
        """An engine the sidecar reaches by a routable address is reached there."""
        engine = engine_address("http://10.1.2.3:9000", "http://10.1.2.4:8000/prefix")
        assert engine is not None
        assert (engine.host, engine.port, engine.base_path) == ("10.1.2.4", 8000, "/prefix")

    def test_an_ipv6_sidecar_host_stays_one_host(self) -> None:
        """An IPv6 sidecar address keeps its brackets through the substitution."""
        engine = engine_address("http://[fd00::5]:9000", "http://127.0.0.1:30000")
        assert engine is not None
        assert (engine.host, engine.port) == ("fd00::5", 30000)

    def test_no_or_bad_engine_url_is_none(self) -> None:
        """An older sidecar (no engine_url) or a bad one gives no address, not an error."""
        assert engine_address("http://10.1.2.3:9000", None) is None
        assert engine_address("http://10.1.2.3:9000", 42) is None
        assert engine_address("http://10.1.2.3:9000", "https://10.0.0.1:1") is None
