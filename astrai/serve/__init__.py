"""OpenAI-compatible HTTP server over the paged rollout engine: `python -m astrai.serve --checkpoint DIR`.

`app.create_app(engine, tokenizer, ...)` builds the FastAPI application (`/health`, `/v1/models`,
`/v1/completions`, `/v1/chat/completions`); `batcher` groups concurrent requests into engine calls; `protocol`
holds the request schemas and sampling-parameter mapping; `detokenize` turns tokens into streamed text.
Needs the `serve` extra (`pip install 'astrai[serve]'`: fastapi, uvicorn). See docs/serve.md.
"""
