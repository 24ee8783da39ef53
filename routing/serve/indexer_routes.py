"""The KV indexer API on the gateway's port: other routers ask our index what each worker holds.

``POST /query`` and ``/query_by_hash`` (Mooncake's RFC #1403; ``docs/indexer-api.md``) answer
from the gateway's own prefix index, the one placement reads: the tokens are hashed as a
request's are (``kvcore.hashing`` under the namespace of model, LoRA adapter and salt), the
instances are the registry's workers grouped by sidecar (a DP rank each).

Tenants are the gateway's own (``--api-key-file``): a tenant's blocks live in its salted
namespace, so a query hashes under the caller's tenant salt and may ask only for the caller's
tenant (``tenant_id`` omitted: the caller's). Without keys there is one namespace, answered as
the RFC's tenant ``default``.

``/query_by_hash`` takes the RFC's XXH3-64 rolling hashes when the gateway keeps them
(``--xxh3-seed``: ``routing.indexer.rolling_hashes``, fed by the index at ingest), and our
canonical hashes (``hash_scheme: "kvsidecar-v1"``) always.

``POST /register`` and ``/unregister`` are parsed (a malformed body is told what is wrong)
and then refused: the gateway's workers come from its sidecars, each of which follows its
engine's own event stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcore import BlockHasher
from kvcore.errors import MODEL_NOT_FOUND, OpenAIError
from routing.indexer.answer import Rank, answer
from routing.indexer.requests import (
    DEFAULT_TENANT,
    IndexQuery,
    parse_query,
    parse_query_by_hash,
    parse_register,
    parse_unregister,
)
from routing.indexer.rolling_hashes import RollingHashMap
from routing.pipeline.admit import tenant_cache_salt
from routing.placement.kv_router import KvRouter
from routing.serve.auth import Tenant
from routing.workers.registry import WorkerRegistry

__all__ = ["INDEXER_PATHS", "REGISTRATION_NOT_SUPPORTED", "IndexerRoutes", "instance_of"]

INDEXER_PATHS = frozenset((b"/query", b"/query_by_hash", b"/register", b"/unregister"))
REGISTRATION_NOT_SUPPORTED = "registration_not_supported"


def instance_of(worker_id: str, dp_rank: int | None) -> str:
    """The instance a worker is a DP rank of: a sidecar names its ranks ``<base>/dp<rank>``
    when it has more than one (``adapters.base.worker_id_for``), else the base alone."""
    suffix = f"/dp{dp_rank}"
    if dp_rank is not None and worker_id.endswith(suffix) and len(worker_id) > len(suffix):
        return worker_id[: -len(suffix)]
    return worker_id


class IndexerRoutes:
    """Answers the indexer API's routes from the gateway's parts."""

    def __init__(
        self,
        router: KvRouter,
        workers: WorkerRegistry,
        hasher: BlockHasher,
        model_names: Callable[[], Sequence[str]],
        xxh3_seed: int | None = None,
    ) -> None:
        """``xxh3_seed``: keep the index's blocks' XXH3 rolling hashes too (``--xxh3-seed``),
        for ``/query_by_hash`` in the RFC's scheme; None: it takes our hashes only."""
        self._router = router
        self._workers = workers
        self._hasher = hasher
        self._model_names = model_names
        self.rolling = None if xxh3_seed is None else RollingHashMap(xxh3_seed)
        router.index.observer = self.rolling

    def answer(self, path: bytes, body: bytes, tenant: Tenant | None) -> bytes:
        """The JSON answer of one of ``INDEXER_PATHS``; raises ``OpenAIError``."""
        if path == b"/query":
            return self._query(parse_query(body), tenant)
        if path == b"/query_by_hash":
            return self._query(parse_query_by_hash(body), tenant)
        route = path.decode()
        registration = parse_register(body) if path == b"/register" else parse_unregister(body)
        raise OpenAIError(
            400,
            f"POST {route}: this gateway does not subscribe to event publishers: its workers "
            "are its sidecars' (--sidecar, --sidecar-file, --discover-k8s-selector), and a "
            "sidecar beside each engine follows that engine's own events (`kvsidecar sidecar "
            f"--engine vllm|sglang|trtllm`): instance {registration.instance_id!r} joins by "
            "starting one and naming it to the gateway. `kvsidecar indexer` takes "
            "registrations of ZMQ publishers",
            code=REGISTRATION_NOT_SUPPORTED,
        )

    def _query(self, query: IndexQuery, tenant: Tenant | None) -> bytes:
        names = self._model_names()
        if names and query.model not in names:
            raise OpenAIError(404, f"the model {query.model!r} is not indexed here; this "
                              f"gateway serves {list(names)}", param="model",
                              code=MODEL_NOT_FOUND)
        block_size = self._router.block_size
        if query.block_size != block_size:
            raise OpenAIError(400, f"'block_size' is {query.block_size}, but this index keeps "
                              f"blocks of {block_size} tokens (the engines' page size)",
                              param="block_size")
        tenant_id, salt = _namespace_salt(query, tenant)
        return answer(query, self._router.index, self._hasher, tenant_id, salt,
                      self._instances(), self.rolling,
                      " (start the gateway with --xxh3-seed 1337, Dynamo's seed, to keep them)")

    def _instances(self) -> dict[str, list[Rank]]:
        out: dict[str, list[Rank]] = {}
        for worker in self._workers:
            instance = instance_of(worker.worker_id, worker.dp_rank)
            rank = 0 if worker.dp_rank is None else worker.dp_rank
            out.setdefault(instance, []).append(Rank(rank, worker.worker_id))
        return out


def _namespace_salt(query: IndexQuery, tenant: Tenant | None) -> tuple[str, str | None]:
    """(the tenant answered for, the salt of the namespace its blocks are hashed in: the one a
    request of that tenant is salted with)."""
    if tenant is None:
        if query.tenant_id not in (None, DEFAULT_TENANT):
            raise OpenAIError(400, f"'tenant_id' is {query.tenant_id!r}, but this gateway has "
                              "no tenants (no --api-key-file): all blocks are in one "
                              f"namespace, answered as tenant {DEFAULT_TENANT!r}",
                              param="tenant_id")
        return DEFAULT_TENANT, query.cache_salt
    if query.tenant_id not in (None, tenant.name):
        raise OpenAIError(403, f"this API key is tenant {tenant.name!r}'s; it may query only "
                          f"that tenant's blocks, not {query.tenant_id!r}'s", param="tenant_id")
    return tenant.name, tenant_cache_salt(tenant.salt, query.cache_salt)
