"""Client API keys and the tenants they name (``--api-key-file``).

The file has one key a line: ``KEY TENANT`` or ``sha256:HEX TENANT`` (the key's SHA-256 in
hex, so the file need not hold it in clear), optionally followed by the tenant's own limits
``rps=N`` and ``tps=N`` and its share ``weight=W`` of a busy fleet (default 1: a tenant with
weight 2 gets twice the tokens of one with weight 1 while requests wait for workers,
``routing.pipeline.admission``); blank lines and ``#`` comments are ignored. Several keys
may name one tenant. The file is re-read when its inode, mtime or size changes, checked at
most once a second; a file that fails to parse keeps the keys loaded before (and says so in
the log).

A presented key is hashed with SHA-256 and looked up by digest, then confirmed with
``hmac.compare_digest``: timing reveals at most something about a digest, never the key.

Each tenant has a salt, ``HMAC-SHA256(secret, tenant)``: it joins the client's own
``cache_salt`` (``"<tenant salt>:<client salt>"``), so the engines and the gateway's index keep
every tenant's blocks in its own namespace, whatever salt a client sends.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from routing.serve.rate_limit import RateLimits, TenantBuckets

__all__ = ["ApiKeys", "Tenant", "hash_key", "parse_key_file", "tenant_salt"]

log = structlog.get_logger(component="gateway")
_RELOAD_CHECK_S = 1.0
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_TENANT = re.compile(r"[A-Za-z0-9._@:/+-]{1,128}")
_SALT_DOMAIN = b"kvsidecar-tenant-salt\x00"


def hash_key(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The tenant's cache salt (hex, so ``:`` cannot occur in it)."""
    return hmac.new(secret, _SALT_DOMAIN + tenant.encode(), hashlib.sha256).hexdigest()[:32]


class Tenant:
    """One tenant: its name, salt and rate-limit buckets."""

    __slots__ = ("buckets", "name", "salt", "weight")

    def __init__(self, name: str, salt: str, limits: RateLimits, weight: float = 1.0) -> None:
        self.name = name
        self.salt = salt
        self.buckets = TenantBuckets(limits)
        self.weight = weight

    def take_request(self) -> float:
        """0.0 when a request may pass now, else the seconds to wait."""
        return self.buckets.take_request()

    def take_tokens(self, tokens: int) -> float:
        """0.0 when ``tokens`` may pass now, else the seconds to wait."""
        return self.buckets.take_tokens(tokens)


@dataclass(frozen=True, slots=True)
class KeyLine:
    digest: bytes
    tenant: str
    requests_per_s: float | None
    tokens_per_s: float | None
    weight: float | None = None


def parse_key_file(text: str, where: str) -> list[KeyLine]:
    """The lines of a key file; ``ValueError`` naming the line for anything malformed."""
    out: list[KeyLine] = []
    seen: set[bytes] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) < 2:
            raise ValueError(f"{where}:{number}: expected 'KEY TENANT [rps=N] [tps=N] [weight=W]'")
        key, tenant, *extra = fields
        if key.startswith("sha256:"):
            hexdigest = key[len("sha256:"):]
            if not _HEX64.fullmatch(hexdigest):
                raise ValueError(f"{where}:{number}: sha256: needs 64 hex digits")
            digest = bytes.fromhex(hexdigest)
        else:
            digest = hash_key(key.encode())
        if not _TENANT.fullmatch(tenant):
            raise ValueError(
                f"{where}:{number}: tenant {tenant!r} must be 1-128 of [A-Za-z0-9._@:/+-]"
            )
        if digest in seen:
            raise ValueError(f"{where}:{number}: this key is listed twice")
        seen.add(digest)
        limits: dict[str, float] = {}
        for item in extra:
            name, sep, value = item.partition("=")
            if not sep or name not in ("rps", "tps", "weight"):
                raise ValueError(
                    f"{where}:{number}: unknown column {item!r} (rps=N, tps=N, weight=W)")
            try:
                limits[name] = float(value)
            except ValueError:
                raise ValueError(f"{where}:{number}: {name} must be a number") from None
            if not limits[name] > 0 or limits[name] == float("inf"):
                raise ValueError(f"{where}:{number}: {name} must be a finite number > 0")
        out.append(KeyLine(digest, tenant, limits.get("rps"), limits.get("tps"),
                           limits.get("weight")))
    if not out:
        raise ValueError(f"{where} lists no key")
    return out


class ApiKeys:
    """The keys of ``--api-key-file`` → tenants, reloaded when the file changes."""

    def __init__(
        self,
        path: Path,
        defaults: RateLimits,
        salt_secret: bytes = b"",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.defaults = defaults
        self.salt_secret = salt_secret
        self._clock = clock
        self._by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        self._tenants: dict[str, Tenant] = {}
        self._signature: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self.reloads = 0
        self._load(self._stat())  # a bad file at start is an error, not a log line

    @property
    def tenants(self) -> list[str]:
        return sorted(self._tenants)

    def authenticate(self, headers: dict[bytes, bytes]) -> Tenant | None:
        """The tenant of the request's key (``Authorization: Bearer`` or ``x-api-key``)."""
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + _RELOAD_CHECK_S
            self._maybe_reload()
        raw = headers.get(b"authorization")
        if raw is not None:
            if raw[:7].lower() != b"bearer ":
                return None
            key = raw[7:].strip()
        else:
            key = headers.get(b"x-api-key", b"").strip()
        if not key:
            return None
        digest = hash_key(key)
        entry = self._by_digest.get(digest)
        if entry is None:
            return None
        stored, tenant = entry
        return tenant if hmac.compare_digest(stored, digest) else None

    # --- loading ----------------------------------------------------------------------

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _maybe_reload(self) -> None:
        try:
            signature = self._stat()
            if signature != self._signature:
                self._load(signature)
                self.reloads += 1
        except (OSError, ValueError) as exc:
            # Keep serving with the keys loaded before: a half-written file must not lock
            # every client out. Fixing the file (or its mode) takes effect within a second.
            self._signature = None
            log.error("api_keys_reload_failed", path=str(self.path), error=str(exc),
                      tenants=len(self._tenants))

    def _load(self, signature: tuple[int, int, int]) -> None:
        lines = parse_key_file(self.path.read_text(), str(self.path))
        tenants: dict[str, Tenant] = {}
        by_digest: dict[bytes, tuple[bytes, Tenant]] = {}
        weights: dict[str, float] = {}
        for line in lines:
            weight = line.weight
            if weight is not None and weights.setdefault(line.tenant, weight) != weight:
                raise ValueError(f"{self.path}: tenant {line.tenant!r} is given two weights, "
                                 f"{weights[line.tenant]:g} and {weight:g}")
        for line in lines:
            tenant = tenants.get(line.tenant)
            if tenant is None:
                limits = RateLimits(
                    line.requests_per_s or self.defaults.requests_per_s,
                    line.tokens_per_s or self.defaults.tokens_per_s,
                    self.defaults.burst_s,
                )
                old = self._tenants.get(line.tenant)
                # A tenant whose limits did not change keeps its buckets across a reload.
                if old is not None and old.buckets.limits == limits:
                    tenant = old
                else:
                    tenant = Tenant(line.tenant, tenant_salt(self.salt_secret, line.tenant),
                                    limits)
                tenant.weight = weights.get(line.tenant, 1.0)
                tenants[line.tenant] = tenant
            by_digest[line.digest] = (line.digest, tenant)
        self._tenants, self._by_digest, self._signature = tenants, by_digest, signature
        log.info("api_keys_loaded", path=str(self.path), keys=len(by_digest),
                 tenants=len(tenants))
