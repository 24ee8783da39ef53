"""A request's targets: the gateway's unless its headers name its own, each checked; and
how a served request is judged against them."""

from __future__ import annotations

import pytest

from routing.pipeline.slo import Outcome, Slo, judge, parse_slo

DEFAULT = Slo(ttft_s=2.0, itl_s=0.1)


def test_headers_override_the_gateways_targets_one_by_one() -> None:
    assert parse_slo({}, DEFAULT) is DEFAULT
    assert parse_slo({b"x-kvsidecar-slo-ttft-ms": b"500"}, DEFAULT) == Slo(0.5, 0.1)
    assert parse_slo({b"x-kvsidecar-slo-itl-ms": b"25.5"}, DEFAULT) == Slo(2.0, 0.0255)


@pytest.mark.parametrize("raw", [b"fast", b"0", b"-5", b"nan", b"inf", b"3600001"])
def test_a_bad_target_names_its_header(raw: bytes) -> None:
    with pytest.raises(ValueError, match="x-kvsidecar-slo-itl-ms must be a number"):
        parse_slo({b"x-kvsidecar-slo-itl-ms": raw}, DEFAULT)


def test_a_request_is_judged_on_both_targets() -> None:
    assert judge(DEFAULT, 1.0, 0.05) is Outcome.MET
    assert judge(DEFAULT, 1.0, None) is Outcome.MET  # not streamed: no ITL to miss
    assert judge(DEFAULT, 2.5, 0.05) is Outcome.MISSED_TTFT
    assert judge(DEFAULT, 1.0, 0.2) is Outcome.MISSED_ITL
    assert judge(DEFAULT, 2.5, 0.2) is Outcome.MISSED_BOTH


def test_the_gateways_targets_are_checked() -> None:
    with pytest.raises(ValueError, match="--slo-itl-ms"):
        Slo(2.0, 0.0)
