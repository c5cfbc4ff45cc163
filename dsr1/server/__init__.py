"""An OpenAI-compatible HTTP server over the serving engine (`dsr1.serving.Engine`): what
`python -m dsr1 serve` runs. One concept per module:

- `options`: the command line's options and `ServerConfig` (no HTTP imports: `dsr1.__main__` uses it).
- `protocol`: the OpenAI wire format (pydantic), strict parsing with errors naming the field.
- `errors`: OpenAI-style errors `{"error": {"message", "type", "param", "code"}}`.
- `prepare`: a parsed request checked against the model and limits, encoded into prompts and samplings.
- `logprobs`: the engine's token log-probabilities in OpenAI's chat and completions forms.
- `reasoning`: R1's `<think>` text split into `reasoning_content` and `content`, streamed or not.
- `runner`: the engine's background thread, the queue cap and draining.
- `completions`: the two completion endpoints, whole or streamed (server-sent events).
- `messages_protocol`, `messages`: Anthropic's Messages API (`/v1/messages`, `count_tokens`) over
  the chat machinery, with Anthropic's events and error shape.
- `metrics`: Prometheus metrics (a registry per app).
- `app`: `create_app(engine, config)`, the FastAPI app.
- `lifecycle`: uvicorn in the foreground with a graceful SIGTERM, or `BackgroundServer` on a thread.
- `cli`: `python -m dsr1 serve`.

In Python::

    engine = dsr1.serving.Engine(model, max_seqs=16, tokenizer=dsr1.load_tokenizer(path))
    engine.warm_up()
    app = create_app(engine, ServerConfig(model_name="DeepSeek-R1"))
    with BackgroundServer(app) as server:        # or lifecycle.serve(app, host=..., port=..., ...)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

`import dsr1` does not import this package (FastAPI and uvicorn load only when a server is built).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackgroundServer", "ServerConfig", "create_app"]

_LAZY = {"BackgroundServer": "lifecycle", "ServerConfig": "options", "create_app": "app"}


def __getattr__(name: str) -> Any:
    # Lazy, so that `dsr1.server.options` (argument parsing) never pulls in FastAPI.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
