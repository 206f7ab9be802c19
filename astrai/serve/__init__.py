"""OpenAI-compatible HTTP server over the paged rollout engine: `python -m astrai.serve --checkpoint DIR`.

`app.create_app(engine, tokenizer, ...)` builds the FastAPI application (`/health`, `/v1/models[/{id}]`,
`/v1/completions`, `/v1/chat/completions`); `engine_loop` steps the engine in a worker thread, adding and aborting
requests between decode steps; `responses` turns a request's tokens into OpenAI bodies and server-sent events;
`protocol` holds the request schemas and sampling-parameter mapping; `detokenize` turns tokens into streamed text;
`logprobs` shapes log-probabilities as OpenAI does.
Needs the `serve` extra (`pip install 'astrai[serve]'`: fastapi, uvicorn). See docs/serve.md.
"""
