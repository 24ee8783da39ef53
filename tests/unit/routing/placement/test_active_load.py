"""Active-load bookkeeping through a request's lifecycle."""

from __future__ import annotations

import pytest

from routing.placement.active_load import ActiveLoad, UnknownRequestError


def blocks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(1, n + 1)]


class TestLifecycle:
    def test_dispatch_first_token_generate_finish(self) -> None:
        """Prefill counts until the first token; output grows by whole blocks; finish frees."""
        load = ActiveLoad(block_size=16)
        load.add("r1", "w", blocks(4), prompt_tokens=70, cached_tokens=32)
        first = load.load("w")
        assert (first.active_prefill_tokens, first.decode_blocks, first.in_flight) == (38, 4, 1)
        load.first_token("r1")
        assert load.load("w").active_prefill_tokens == 0
        load.tokens_generated("r1", 9)  # 70 + 9 = 79 tokens: still 4 full blocks
        assert load.load("w").decode_blocks == 4
        load.tokens_generated("r1", 20)  # 99 tokens: 6 full blocks, 2 from output
        assert load.load("w").decode_blocks == 6
        load.finish("r1")
        assert load.load("w").decode_blocks == 0 and load.load("w").in_flight == 0

    def test_generated_token_implies_first_token(self) -> None:
        """A generated token before first_token releases prefill tokens too."""
        load = ActiveLoad(16)
        load.add("r", "w", blocks(2), prompt_tokens=40)
        load.tokens_generated("r")
        assert load.load("w").active_prefill_tokens == 0

    def test_abort_before_first_token_releases_prefill(self) -> None:
        """Finishing (aborting) a request mid-prefill releases its prefill tokens."""
        load = ActiveLoad(16)
        load.add("r", "w", blocks(2), prompt_tokens=40)
        load.finish("r")
        assert load.load("w").active_prefill_tokens == 0

    def test_shared_prefix_blocks_count_once(self) -> None:
        """Requests on one worker sharing prompt blocks hold those blocks once."""
        load = ActiveLoad(16)
        load.add("a", "w", blocks(10), prompt_tokens=160)
        load.add("b", "w", blocks(6) + blocks(4, base=100), prompt_tokens=160)
        assert load.load("w").decode_blocks == 14
        load.finish("a")
        assert load.load("w").decode_blocks == 10

    def test_candidate_counts_only_new_blocks(self) -> None:
        """A candidate's decode blocks include only the request's blocks not already active."""
        load = ActiveLoad(16)
        load.add("a", "w1", blocks(10), prompt_tokens=160)
        w1, w2 = load.loads(["w1", "w2"], blocks(12))
        assert (w1.decode_blocks, w2.decode_blocks) == (12, 12)
        w1, w2 = load.loads(["w1", "w2"], blocks(6))
        assert (w1.decode_blocks, w2.decode_blocks) == (10, 6)

    def test_unknown_and_duplicate_requests(self) -> None:
        """Lifecycle calls for unknown ids raise; a duplicate add is rejected."""
        load = ActiveLoad(16)
        with pytest.raises(UnknownRequestError):
            load.finish("nope")
        with pytest.raises(UnknownRequestError):
            load.first_token("nope")
        load.add("r", "w", blocks(1), 16)
        with pytest.raises(ValueError, match="already in flight"):
            load.add("r", "w", blocks(1), 16)

    def test_forget_worker(self) -> None:
        """A dead worker's requests are dropped and returned."""
        load = ActiveLoad(16)
        load.add("a", "w1", blocks(2), 32)
        load.add("b", "w2", blocks(2), 32)
        assert load.forget_worker("w1") == ["a"]
        assert load.worker_of("a") is None and load.in_flight() == 1
