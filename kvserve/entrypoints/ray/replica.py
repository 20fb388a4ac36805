"""One engine replica of ``kvserve serve --data-parallel-size N`` (``KVServeReplica``, a Ray Serve deployment
class) and the names the ingress and the router share with it (see the package docstring)."""

from __future__ import annotations

import os
from typing import Optional

from ray import serve

from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.metrics import PrometheusStatLogger
from kvserve.sampling_params import SamplingParams

APP_NAME = "kvserve"
DEPLOYMENT_NAME = "KVServeReplica"
MAX_ATTEMPTS = 3  # tries of a request whose replica died before accepting it
ACCEPTED = "accepted"  # the first item of every generate stream: the replica queued the request


class KVServeReplica:
    """One engine replica (a Ray Serve deployment class; see ``deploy``).

    Args:
        engine_args: ``LLMEngine.from_engine_args`` keywords.
        model_name: the ``model_name`` label of its metrics.
    """

    def __init__(self, engine_args: dict, model_name: str):
        self.stat_logger = PrometheusStatLogger(model_name)
        self.llm = AsyncLLM.from_engine_args(stat_logger=self.stat_logger, **engine_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, token_ids: list, sampling_params: SamplingParams, request_id: str, priority: int = 0,
                       replica: Optional[str] = None):
        """Yield ``ACCEPTED`` once the request is queued, then its ``RequestOutput``s (the last ``finished``).
        Cancelled (the client went away): the request is aborted and its blocks freed.

        Raises:
            ValueError: the engine rejected the request. EngineShutdownError, EngineDeadError: as ``AsyncLLM``.
        """
        await self.llm.start()
        stream = await self.llm.add_request(token_ids, sampling_params, request_id, priority=priority)
        try:
            yield ACCEPTED
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def info(self, replica: Optional[str] = None) -> dict:
        """``replica_id``, ``max_model_len``, ``num_blocks``, ``block_size``, ``pid``, and the model's ``tokenizer``,
        ``vocab_size``, ``eos_token_ids``, ``chat_template`` (``--chat-template`` or ``None``), ``chat_format`` and
        ``model_path`` (what the ingress's ``RayEngineClient`` needs to tokenize and validate, without loading the weights)."""
        await self.llm.start()
        e = self.llm.engine
        return {"replica_id": self.replica_id, "max_model_len": e.max_model_len, "num_blocks": e.num_blocks,
                "block_size": e.block_size, "pid": os.getpid(), "tokenizer": e.tokenizer,
                "vocab_size": e.arch.vocab_size, "eos_token_ids": list(e.eos_token_ids),
                "chat_template": e.chat_template, "chat_format": e.chat_format, "model_path": str(e.model_path)}

    async def metrics(self, replica: Optional[str] = None) -> bytes:
        """This replica's Prometheus text (``PrometheusStatLogger.exposition``)."""
        return self.stat_logger.exposition()

    def record_routing_stats(self) -> dict:
        """Serve's routing-stats hook: ``num_running``, ``num_waiting``, ``kv_usage`` (0..1), ``num_blocks`` (the
        pool's size, which bounds what its prefix cache can hold)."""
        e = self.llm.engine
        stats = e.kv_cache_stats()
        return {"num_running": e.scheduler.num_running, "num_waiting": e.scheduler.num_waiting,
                "kv_usage": stats.usage, "num_blocks": stats.num_blocks}

    def check_health(self) -> None:
        """Serve's health check: raises once the engine loop has failed (Serve then replaces the replica)."""
        if self.llm.dead_error is not None:
            raise RuntimeError(f"the engine loop failed: {self.llm.dead_error!r}")
