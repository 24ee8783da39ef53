"""Start-up of a serving process: tokenizer, model config, engines, HTTP sites, ready lines,
graceful shutdown. Kept apart from ``__main__`` so flag errors are reported before torch loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import orjson
import structlog
from aiohttp import web

from refengine.config import EngineConfig
from refengine.engine import Engine, set_torch_threads
from refengine.presets import ModelConfig
from refengine.server import build_app
from refengine.tokenizer import ChatTokenizer

__all__ = ["serve"]

SHUTDOWN_TIMEOUT_S = 10.0


def load_model_config(cfg: EngineConfig, vocab_size: int) -> ModelConfig:
    model_cfg = ModelConfig.from_model_path(cfg.model_path)
    if cfg.model_preset:
        model_cfg = model_cfg.with_preset(cfg.model_preset)
    if model_cfg.vocab_size < vocab_size:
        raise ValueError(
            f"config.json vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size}"
        )
    return model_cfg


async def serve(cfg: EngineConfig) -> None:
    log = structlog.get_logger(component="refengine")
    tokenizer = ChatTokenizer.from_model_path(cfg.model_path)
    model_cfg = load_model_config(cfg, tokenizer.vocab_size)
    cfg = cfg.with_model(model_cfg.kv_bytes_per_token)
    set_torch_threads(cfg.torch_threads)
    log.info(
        "config_loaded",
        compute=cfg.compute.value,
        replicas=cfg.replicas,
        page_size=cfg.page_size,
        max_total_tokens=cfg.max_total_tokens,
        kv_bytes_per_token=model_cfg.kv_bytes_per_token,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        engines: list[Engine] = []
        runners: list[web.AppRunner] = []
        lines = []
        for r in range(cfg.replicas):
            engine = await stack.enter_async_context(Engine(cfg, tokenizer, model_cfg, replica=r))
            engines.append(engine)
            # handler_cancellation: a client that hangs up cancels its handler, which
            # aborts its request in the engine (streaming or not).
            runner = web.AppRunner(
                build_app(engine),
                access_log=None,
                shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                handler_cancellation=True,
            )
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, cfg.host, cfg.port + r if cfg.port else 0)
            await site.start()
            port = runner.addresses[0][1]
            pub = engine.publisher
            line = {
                "event": "server_started",
                "replica": r,
                "host": cfg.host,
                "port": port,
                "url": f"http://{cfg.host}:{port}",
                "kv_events_endpoint": pub.bound_endpoint if pub else None,
                "kv_replay_endpoint": pub.bound_replay_endpoint if pub else None,
            }
            lines.append(line)
            log.info("server_started", **{k: v for k, v in line.items() if k != "event"})
        text = "".join(orjson.dumps(line).decode() + "\n" for line in lines)
        if cfg.ready_file:
            cfg.ready_file.write_text(text)
        sys.stdout.write(text)
        sys.stdout.flush()
        await stop.wait()
        log.info("shutdown_started")
        for engine in engines:
            engine.accepting = False
        for runner in runners:
            await runner.cleanup()
    log.info("shutdown_finished")
