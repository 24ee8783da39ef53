"""The simulated device's timeline (``refengine.executor.SimExecutor``): a busy replica
steps once per modelled duration, the host's work between steps hidden behind the step
before it as under an overlapping scheduler; idle time is never hidden."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from refengine.config import EngineConfig
from refengine.engine import Engine
from refengine.executor import SimExecutor
from refengine.launcher import load_model_config
from refengine.request import Request, SamplingParams
from refengine.scheduler import PrefillChunk, Step, StepKind
from refengine.timing import SimModel, TimingModel
from refengine.tokenizer import ChatTokenizer

MODEL = Path(__file__).resolve().parents[3] / "refengine" / "models" / "tiny"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_host_work_hides_behind_the_step_before_it_and_idle_time_does_not() -> None:
    clock = _Clock()
    device = SimExecutor(TimingModel(), [1], [2], clock=clock)
    assert device.device_idle
    assert device.lay_out(0.100) == pytest.approx(0.100)  # issued at 0: ends at 0.1
    clock.now = 0.130  # 30 ms of host work after it: hidden behind the 100 ms step
    assert device.lay_out(0.100) == pytest.approx(0.200)
    clock.now = 0.450  # 250 ms of host work: 100 ms of it hidden, the rest delays
    assert device.lay_out(0.100) == pytest.approx(0.450)
    clock.now = 0.460  # issued before the device is free: it queues behind the step
    assert device.lay_out(0.050) == pytest.approx(0.500)
    device.idle()  # out of work: the next step starts when issued, however soon
    assert device.device_idle
    clock.now = 0.510
    assert device.lay_out(0.100) == pytest.approx(0.610)
    assert device.busy_s == pytest.approx(0.450)


async def test_the_engine_tells_its_device_when_it_runs_out_of_work() -> None:
    """A request runs to its end; the engine's loop then parks, and its device is idle, so
    the next request's first step is not laid out in the past."""
    cfg = EngineConfig(model_path=MODEL, compute="sim", page_size=16,  # type: ignore[arg-type]
                       max_total_tokens=64 * 16, speedup=1000.0)
    tokenizer = ChatTokenizer.from_model_path(MODEL)
    engine = Engine(cfg, tokenizer, load_model_config(cfg, tokenizer.vocab_size))
    async with engine:
        device = engine.executor
        assert isinstance(device, SimExecutor)
        async for _ in engine.generate(Request("a", list(range(10, 42)),
                                               SamplingParams(4, 0.0))):
            assert not device.device_idle  # a step was laid out for each token
        for _ in range(1000):  # the loop parks on its next turn
            if device.device_idle:
                break
            await asyncio.sleep(0)
        assert device.device_idle


def test_the_mockers_tokens_leave_after_the_prefill_part_and_the_device_stays_busy() -> None:
    """The mocker emits a pass's tokens after its prefill part, before its decode part: the
    executor returns then, and the next step still starts after the whole step."""
    clock = _Clock()
    timing = TimingModel(shape=SimModel.MOCKER)
    device = SimExecutor(timing, [1], [2], clock=clock)
    before, after = timing.step_parts([(3000, 3000)], [], yields=True, kv_attended=0.2)
    assert before == pytest.approx(timing.step([(3000, 3000)], [], yields=False,
                                               kv_attended=0.0))
    assert before + after == pytest.approx(timing.step([(3000, 3000)], [], yields=True,
                                                       kv_attended=0.2))
    assert after > 0
    linear = TimingModel()
    assert linear.step_parts([(64, 64)], [100], yields=True, kv_attended=0.0)[1] == 0.0

    async def drive() -> None:
        step = Step(StepKind.PREFILL, prefill=(PrefillChunk(
            Request("a", list(range(3000)), SamplingParams(2, 0.0)), 0, 3000),),
            kv_attended=0.2)
        await device.run(step)

    asyncio.run(drive())  # the virtual clock stays at 0: the step was issued at 0
    assert device.lay_out(0.010) == pytest.approx(before + after + 0.010)
    device.idle()  # out of work while the decode part still runs: the next step waits
    clock.now = before  # for it all the same
    assert device.lay_out(0.010) == pytest.approx(before + after + 0.020)
