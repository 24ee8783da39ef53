"""``kvsidecar webhook``'s typed configuration, and its command line: each field of
``WebhookConfig`` is one flag (``kvcore.options``: help, group and default written once), and
``--config FILE`` reads the same options from TOML. The injected sidecar's options are
``kvsidecar inject``'s own (``InjectOptions``, through ``option_of``); ``--sidecar-image`` is
also read from ``KVSIDECAR_SIDECAR_IMAGE``, which the Kubernetes manifest sets to the
webhook's own image."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvcore.logs import LogLevel
from kvcore.options import OptionParser, check_bounds, option, option_of
from kvsidecar.inject_options import InjectOptions

__all__ = ["SIDECAR_IMAGE_ENV", "WebhookConfig", "build_parser"]

SIDECAR_IMAGE_ENV = "KVSIDECAR_SIDECAR_IMAGE"  # the manifest sets the webhook's own image
_SERVE = "webhook"
_SIDECAR = "sidecar (the injected one)"


@dataclass(frozen=True, kw_only=True)
class WebhookConfig:
    """What the webhook serves with, and the sidecar it injects; validated when built."""

    host: str = option("0.0.0.0", group=_SERVE, help="listen address")
    port: int = option(8443, group=_SERVE, ge=0, le=65535,
                       help="HTTPS port; 0 picks a free one")
    tls_cert: Path = option(required=True, group=_SERVE, metavar="FILE",
                            help="PEM certificate chain")
    tls_key: Path = option(required=True, group=_SERVE, metavar="FILE", help="PEM private key")
    label: str = option("kvsidecar.io/inject=enabled", group=_SERVE, metavar="KEY=VALUE",
                        help="the pod label that opts a pod in")
    log_level: LogLevel = option(LogLevel.INFO, group=_SERVE,
                                 help="the least severe log records written to stderr")
    ready_file: Path | None = option(None, group=_SERVE, metavar="FILE",
                                     help="write {'url': ...} JSON here once serving")
    sidecar_image: str = option_of(InjectOptions, "sidecar_image", group=_SIDECAR,
                                   env=SIDECAR_IMAGE_ENV)
    sidecar_port: int = option_of(InjectOptions, "sidecar_port", group=_SIDECAR)
    store_capacity_bytes: str | None = option_of(InjectOptions, "store_capacity_bytes",
                                                 group=_SIDECAR)
    sidecar_args: tuple[str, ...] = option_of(InjectOptions, "sidecar_args", group=_SIDECAR)

    def __post_init__(self) -> None:
        check_bounds(self)
        key, sep, _ = self.label.partition("=")
        if not sep:
            raise ValueError(f"--label must be KEY=VALUE, got {self.label!r}")
        if not key:
            raise ValueError("--label needs a key: KEY=VALUE")
        self.inject  # noqa: B018  (the sidecar's options, checked before serving)

    @property
    def label_key(self) -> str:
        return self.label.partition("=")[0]

    @property
    def label_value(self) -> str:
        return self.label.partition("=")[2]

    @property
    def inject(self) -> InjectOptions:
        """The injection every opted-in pod gets (its annotations may override some)."""
        return InjectOptions(sidecar_image=self.sidecar_image, sidecar_port=self.sidecar_port,
                             store_capacity_bytes=self.store_capacity_bytes,
                             sidecar_args=self.sidecar_args)

    @classmethod
    def from_args(cls, argv: list[str] | None) -> WebhookConfig:
        """From the command line (and ``--config FILE``, and ``KVSIDECAR_SIDECAR_IMAGE``); a
        bad flag or an invalid config is an argparse error (exit 2)."""
        parser = build_parser()
        return parser.build(cls, parser.parse_args(argv))


def build_parser(environ: Mapping[str, str] | None = None) -> OptionParser:
    """The webhook's flags: ``WebhookConfig``'s options (``--sidecar-image``'s variable read
    from ``environ``, by default the process's environment)."""
    parser = OptionParser(
        prog="kvsidecar webhook", environ=environ,
        description="Serve the kvsidecar sidecar injection as a Kubernetes mutating admission "
        "webhook (HTTPS, AdmissionReview v1 on POST /mutate). Pods with the opt-in label get "
        "the sidecar; all others pass unchanged.",
    )
    parser.add_options(WebhookConfig)
    return parser
