"""`python -m dsr1 serve`'s options and the server's settings (`ServerConfig`), without importing the
HTTP stack: `dsr1.__main__` builds its parser from here and imports the server only to run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os

__all__ = ["API_KEY_ENV", "ServerConfig", "add_serve_arguments", "bind_refusal", "is_loopback", "origins"]

API_KEY_ENV = "DSR1_API_KEY"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the HTTP layer needs besides the engine.

    Args:
      model_name: the id clients pass as `model` (and `GET /v1/models` lists).
      api_key: required as `Authorization: Bearer <key>` on every route but `/health` (None: open).
      max_waiting: requests queued beyond the engine's batch slots; more are answered 429.
      default_max_tokens: a chat request's budget when it sets none (capped by the context left);
        `/v1/completions` defaults to 16, as OpenAI's does.
      shutdown_timeout: seconds in-flight requests get to finish after SIGTERM before they are cancelled.
      allowed_origins: browser origins allowed by CORS (`"*"`: any); empty: no CORS headers.
      stall_timeout: seconds the engine may have work without finishing a step before `/health` fails.
      max_reasoning_tokens: the reasoning budget of a constrained reply (tool_choice `required` or
        named, structured outputs) to a prompt that opens R1's `<think>`, when the request sets no
        `max_reasoning_tokens`: `</think>` is then forced, so the constrained answer always comes.
        At most a quarter of the request's `max_tokens` in any case.
    """

    model_name: str
    api_key: str | None = None
    max_waiting: int = 256
    default_max_tokens: int = 4096
    shutdown_timeout: float = 30.0
    allowed_origins: tuple[str, ...] = ()
    stall_timeout: float = 120.0
    max_reasoning_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout}")
        if self.max_reasoning_tokens < 0:
            raise ValueError(f"max_reasoning_tokens must be >= 0, got {self.max_reasoning_tokens}")


def origins(text: str) -> list[str]:
    """`--allowed-origins`: a JSON list (vLLM's spelling, e.g. '["*"]') or comma-separated origins."""
    if text.strip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list of origins: {e}") from None
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise argparse.ArgumentTypeError("a JSON list of origin strings is expected")
        return value
    return [o.strip() for o in text.split(",") if o.strip()]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP options, the engine's sizes and the server's limits (the model options are
    `dsr1.options.add_model_options`')."""
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default: 127.0.0.1; any other address needs an API key)")
    http.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    http.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                      help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")
    http.add_argument("--served-model-name", metavar="NAME",
                      help="the model id clients use (default: the checkpoint folder's name or the preset)")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    http.add_argument("--allowed-origins", type=origins, default=[], metavar="ORIGINS",
                      help="CORS: browser origins allowed to call the API, as a JSON list ('[\"*\"]' for any) or "
                           "comma-separated (default: none, no CORS headers)")
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-seqs", type=int, default=8,
                        help="decode rows: requests decoding at once; --prefill-rows more are prefilled ahead "
                             "(default: 8)")
    engine.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default: 16)")
    engine.add_argument("--num-pages", type=int, default=512, help="pages in the device pool (default: 512)")
    engine.add_argument("--prefill-chunk", type=int, default=64,
                        help="prompt tokens per request per step (default: 64)")
    engine.add_argument("--prefill-rows", type=int, default=2,
                        help="requests prefilling per step, and batch slots beyond --max-seqs (default: 2)")
    engine.add_argument("--decode-steps", type=int, default=4,
                        help="decode steps per engine decode call (default: 4)")
    engine.add_argument("--draft-tokens", type=int, default=0, metavar="K",
                        help="MTP speculative decoding: K tokens drafted per decode iteration by the model's MTP "
                             "module, verified in one step (default: 0, off; the model needs an MTP layer)")
    engine.add_argument("--host-cache-bytes", type=int, default=0,
                        help="host memory for evicted prefix-cache pages (default: 0, no offload)")
    engine.add_argument("--max-seq-len", type=int,
                        help="longest prompt + output (default: the model's limit or the pool's size)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="prefill every prompt in full")
    engine.add_argument("--redundant-experts", type=int, default=0, metavar="R",
                        help="EPLB: R extra expert slots per MoE layer holding copies of the hottest experts, "
                             "placed from the routing the engine counts (default: 0, off; needs an expert axis "
                             "of more than one device; docs/layouts.md)")
    engine.add_argument("--rebalance-every", type=int, default=1000, metavar="STEPS",
                        help="with --redundant-experts: place the copies again every STEPS engine steps "
                             "(default: 1000)")
    engine.add_argument("--no-warmup", action="store_true", help="compile on the first requests instead of at start")
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-waiting", type=int, default=256,
                        help="requests queued beyond the batch slots (--max-seqs + --prefill-rows); more are "
                             "answered 429 (default: 256)")
    limits.add_argument("--default-max-tokens", type=int, default=4096,
                        help="a chat request's token budget when it sets none (default: 4096); a request "
                             "reserves pages for its prompt and its whole budget, so size --num-pages to match")
    limits.add_argument("--max-reasoning-tokens", type=int, default=512, metavar="N",
                        help="reasoning budget of a constrained reply (tool_choice required or named, structured "
                             "outputs) when the request sets no max_reasoning_tokens: </think> is forced after N "
                             "tokens, and after a quarter of the request's max_tokens in any case (default: 512)")
    limits.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM (default: 30)")
    limits.add_argument("--health-stall-timeout", type=float, default=120.0, metavar="SECONDS",
                        help="/health answers 503 once the engine has had work this long without finishing a step "
                             "(default: 120; the first steps may compile when --no-warmup)")


def is_loopback(host: str) -> bool:
    """Whether `host` is only reachable from this machine (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def bind_refusal(host: str, api_key: str | None) -> str | None:
    """Why binding `host` without a key is refused (None when it is allowed)."""
    if is_loopback(host) or api_key:
        return None
    return (f"refusing to serve on {host!r} without an API key: anyone who can reach it could use the model. "
            f"Pass --api-key KEY (or set ${API_KEY_ENV}), or bind 127.0.0.1.")
