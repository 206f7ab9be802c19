"""Command line: `python -m astrai.serve --checkpoint DIR [--host H] [--port P] [--max_batch N] ...`.

DIR is a published checkpoint (`outputs/ppo/checkpoints/step-00000004`), a run's output directory (its newest
complete checkpoint is served), or anything `astrai.models.load_pretrained` reads (a Hugging Face-format model
directory, a `.gguf` file, a model alias, a Hugging Face Hub id such as `Qwen/Qwen2.5-0.5B-Instruct` at
`--revision`, from the cache or downloaded). Bad arguments or an unloadable checkpoint (an id offline and not
cached included) exit with code 2 and a one-line error.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from astrai.deps import MissingDependencyError, import_optional

EXIT_BAD_INPUT = 2
DTYPES = ("auto", "float32", "bfloat16", "float16")

logger = logging.getLogger("astrai.serve")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The server's options (see `--help`)."""
    p = argparse.ArgumentParser(prog="python -m astrai.serve", allow_abbrev=False,
                                description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
                                            "/v1/models, /health) over astrai's paged engine, batching "
                                            "continuously (requests join and leave between decode steps).")
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory, run output directory (newest checkpoint), HF model dir, .gguf, "
                        "a model alias (smollm2-135m-instruct, gemma3-270m) or a Hugging Face Hub id (org/name)")
    p.add_argument("--revision", default=None,
                   help="the Hub id's branch, tag or commit hash (default: main), as vLLM's --revision")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--served_model_name", default=None,
                   help="model id clients send (default: the checkpoint as given on the command line, as vLLM; "
                        "its resolved path and folder name are accepted too)")
    p.add_argument("--max_batch", type=int, default=32,
                   help="most sequences decoded at once, also the most choices per request (default 32)")
    p.add_argument("--max_tokens", type=int, default=512,
                   help="response budget of chat requests that set none (default 512, capped by the context)")
    p.add_argument("--max_kv_tokens", type=int, default=32768, help="KV cache capacity in tokens (default 32768)")
    p.add_argument("--max_batch_tokens", type=int, default=2048,
                   help="tokens per engine step: prompt chunks of new requests + one per decoding sequence; smaller "
                        "spreads simultaneous prefills over steps (default 2048)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--engine", default="paged",
                   help="generation engine by registered name (default paged; it must stream requests)")
    p.add_argument("--adaptive_threads", default="true", choices=("true", "false"),
                   help="paged engine on a CPU: decode with fewer threads while other processes busy the cores "
                        "(default true; docs/kernels.md)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--log_level", default=os.environ.get("ASTR_LOG_LEVEL", "info"),
                   help="uvicorn and astrai log level (default: ASTR_LOG_LEVEL, else info)")
    args = p.parse_args(argv)
    for name in ("port", "max_batch", "max_tokens", "max_kv_tokens", "max_batch_tokens"):
        if getattr(args, name) < 1 or (name == "port" and args.port > 65535):
            p.error(f"--{name}: expected a positive integer{' <= 65535' if name == 'port' else ''}, "
                    f"got {getattr(args, name)}")
    return args


def resolve_checkpoint(path: str) -> Path:
    """A run output directory -> its newest complete checkpoint; anything else unchanged.

    Raises:
        FileNotFoundError: for a run directory whose `checkpoints/` holds no complete checkpoint.
    """
    from astrai.checkpoint import checkpoints_root, find_latest_checkpoint
    from astrai.models.loading import is_model_directory

    p = Path(path)
    if p.is_dir() and not is_model_directory(p) and checkpoints_root(p).is_dir():
        latest = find_latest_checkpoint(p)
        if latest is None:
            raise FileNotFoundError(f"--checkpoint {p}: no complete checkpoint under {checkpoints_root(p)}")
        return latest
    return p


def checkpoint_version(path: Path) -> int:
    """The `policy_version` a published checkpoint records in trainer_state.json (0 for other model sources)."""
    try:
        version = json.loads((path / "trainer_state.json").read_text(encoding="utf-8")).get("policy_version", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return version if isinstance(version, int) and version >= 0 else 0


def build_engine(args: argparse.Namespace):
    """(engine, tokenizer, model name) for the parsed arguments; raises one-line errors for bad input."""
    import torch

    from astrai.checkpoint import load_model
    from astrai.rollout.engine import StreamingEngine, attention_backend, build_engine

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available")
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    path = resolve_checkpoint(args.checkpoint)
    model, tokenizer = load_model(str(path), dtype=getattr(torch, dtype_name), device=device,
                                  revision=args.revision)
    if tokenizer.pad_token_id is None:
        raise ValueError(f"{path}: the tokenizer has neither a pad nor an eos token")
    engine = build_engine(args.engine, model, pad_token_id=tokenizer.pad_token_id, max_num_seqs=args.max_batch,
                          max_kv_tokens=args.max_kv_tokens, max_batch_tokens=args.max_batch_tokens,
                          policy_version=checkpoint_version(path),
                          attention_backend=attention_backend(None),
                          **({"adaptive_threads": args.adaptive_threads == "true"} if args.engine == "paged" else {}))
    if not isinstance(engine, StreamingEngine):
        raise ValueError(f"--engine {args.engine}: the server needs an engine that streams (submit / step); this "
                         "one generates whole batches only")
    given = str(args.checkpoint)
    name = given if args.served_model_name is None else args.served_model_name
    local = path.exists()  # a Hub id has no resolved path or folder name to be asked by
    aliases = () if args.served_model_name is not None or not local else (str(path), path.name, str(path.resolve()))
    return engine, tokenizer, name, aliases


HOST_ERRNOS = frozenset({errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL})
"""bind() failures that are the address's fault, not the port's (not an address of this machine, an address family
it lacks, an IPv6 link-local address without its %interface): reported against --host. Any other (EADDRINUSE,
EACCES for a privileged port, ...) is --port's."""


def check_port(host: str, port: int) -> None:
    """Raise ValueError (one line naming --host or --port) unless this process can listen on (`host`, `port`) now,
    as uvicorn will (SO_REUSEADDR): checked before the model loads, so a bad address fails in a second, not after it.

    --host is named for a name that does not resolve and for an address this machine cannot bind
    (`HOST_ERRNOS`: EADDRNOTAVAIL, EAFNOSUPPORT, EINVAL); --port for a port in use or not permitted.
    """
    import socket

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as err:
        if err.errno in HOST_ERRNOS:
            raise ValueError(f"--host {host}: cannot listen on {where} ({err.strerror}); expected an address "
                             "of this machine (127.0.0.1, 0.0.0.0 for all, or one of its interfaces)") from None
        raise ValueError(f"--port {port}: cannot listen on {where} ({err.strerror}); choose another --port "
                         "or stop what uses it") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Load the checkpoint and serve until interrupted; returns the exit code."""
    args = parse_args(argv)
    from astrai.runtime_env import configure_logging, log_level

    try:
        configure_logging(log_level(args.log_level))
        uvicorn = import_optional("uvicorn", needed_by="astrai.serve", install="pip install 'astrai[serve]'")
        import_optional("fastapi", needed_by="astrai.serve", install="pip install 'astrai[serve]'")
        from astrai.serve.app import create_app
    except MissingDependencyError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as err:
        print(f"error: --log_level: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        check_port(args.host, args.port)
        engine, tokenizer, name, aliases = build_engine(args)
    except (FileNotFoundError, NotADirectoryError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    app = create_app(engine, tokenizer, model_name=name, max_tokens=args.max_tokens, aliases=aliases)
    from astrai.data.prompt_format import uses_chat_template

    if not uses_chat_template(tokenizer):
        logger.info("%s has no chat template: /v1/chat/completions answers 400, /v1/completions takes raw text", name)
    logger.info("serving %s (%s on %s) at http://%s:%d/v1", name, engine.dtype, engine.device, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    import warnings

    from astrai.outputs import show_warning

    warnings.showwarning = show_warning  # "warning: MESSAGE" in one line, as python -m astrai.train says them
    sys.exit(main())
