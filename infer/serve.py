"""An OpenAI-compatible HTTP server over the continuous-batching engine:
``python -m infer.serve --port 8000`` serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health`` and ``/metrics``.

Without ``--target``, the embedded default model runs with its LongSpec draft, as ``python -m infer.main`` does
(``--no-draft`` for plain decoding, ``--draft DIR`` for another draft); a target without a tokenizer takes UTF-8
bytes as token ids. Once the engine is compiled and the socket listens, a ready line with the URL goes to stderr
(``--port 0`` picks a free port and names it there).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import socket
import sys
from pathlib import Path

from infer.engine import ROUNDS_PER_STEP, EngineConfig
from infer.generate import DEFAULT_PREFILL_CHUNK
from infer.main import (DTYPES, ByteTokenizer, _checked, _load, _positive_int, add_model_args, check_model_args,
                        load_draft_arg, model_dirs)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_port = _checked(int, "a port number", lambda v: 0 <= v < 65536, "in [0, 65535] (0: a free port)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m infer.serve", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=8000, help="0: a free port, named in the ready line")
    parser.add_argument("--max-batch", type=_positive_int, default=4, metavar="N",
                        help="requests decoded together (the engine's slots)")
    parser.add_argument("--max-context", type=_positive_int, default=4096, metavar="L",
                        help="tokens per request, prompt and output together")
    parser.add_argument("--max-queue", type=_positive_int, default=64, metavar="Q",
                        help="requests waiting for a slot at most; more are answered 429")
    parser.add_argument("--prefill-chunk", type=_positive_int, default=DEFAULT_PREFILL_CHUNK, metavar="C",
                        help="prompt tokens prefilled per engine step (a power of two; a prompt's last piece may be "
                             "a half or a quarter of it): larger is faster, and delays the running streams longer")
    parser.add_argument("--rounds-per-step", type=_positive_int, default=ROUNDS_PER_STEP, metavar="R",
                        help="speculative rounds per engine step, in one device loop (one round while a prompt "
                             "waits to be prefilled): more spend less time launching programs")
    parser.add_argument("--compile-on-demand", action="store_true",
                        help="compile each engine program when first needed instead of all before serving: a faster "
                             "start, and the first requests at each batch size wait for compilations")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--tensor-parallel", type=_positive_int, default=1, metavar="N",
                        help="shard the target over the first N devices (a mesh's model axis; 1: one device)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="the engine's seed (requests without a seed draw from it)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model's name in the API (default: the target directory's name)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level")
    return parser


def engine_config(args) -> EngineConfig:
    """The engine's configuration from the command line's arguments."""
    return EngineConfig(max_batch=args.max_batch, max_context=args.max_context, max_queue=args.max_queue,
                        prefill_chunk=args.prefill_chunk, rounds_per_step=args.rounds_per_step,
                        compile_ahead=not args.compile_on_demand)


def load_served(args):
    """Loads the models and starts the engine (compiling it); returns the app's :class:`Served` and a summary."""
    import jax.numpy as jnp

    from infer.engine import Engine
    from infer.serve_app import Served

    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
    target_dir, draft_dir = model_dirs(args)
    target, tokenizer, where = _load(args, target_dir, dtype)
    if args.tensor_parallel > 1:
        target = _sharded(target, args.tensor_parallel)
    draft = load_draft_arg(draft_dir, target, args.draft_vocab, prog="infer.serve") if draft_dir else None
    name = args.served_model_name or ("tiny-random" if target_dir is None else
                                      "longspec-default" if args.target is None else Path(target_dir).name)
    engine = Engine(target, draft, engine_config(args), seed=args.seed)
    engine.start(progress=lambda message: print(f"[infer.serve] {message}", file=sys.stderr, flush=True))
    decode = (tokenizer.decode if isinstance(tokenizer, ByteTokenizer)
              else functools.partial(tokenizer.decode, skip_special_tokens=True))
    served = Served(engine=engine, tokenizer=tokenizer, decode=decode, model_name=name,
                    max_context=args.max_context, vocab_size=target.config.vocab_size)
    summary = (f"model {name} ({where}, {args.dtype}), max-batch {args.max_batch}, max-context {args.max_context}, "
               f"draft {draft_dir or 'none'}, tensor-parallel {args.tensor_parallel}")
    return served, summary


def _sharded(target, devices: int):
    """The target sharded over the first ``devices`` devices (tensor parallel, :mod:`longspec_jax.mesh`)."""
    import jax

    from longspec_jax import make_mesh, shard_target

    available = jax.devices()
    if devices > len(available):
        raise ValueError(f"--tensor-parallel {devices}: only {len(available)} devices here")
    return shard_target(target, make_mesh(devices, 1, available[:devices]))


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def run_server(app, sock: socket.socket, summary: str, log_level: str) -> None:
    """Serves ``app`` on the listening ``sock`` until SIGINT / SIGTERM, printing the ready line once it accepts."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"

    async def main():
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not (server.started or serving.done()):
            await asyncio.sleep(0.02)
        if server.started:
            print(f"[infer.serve] ready: {url} ({summary})", file=sys.stderr, flush=True)
        await serving

    asyncio.run(main())


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_model_args(args, parser)
    try:
        sock = _listen(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    try:
        served, summary = load_served(args)
    except (ValueError, OSError) as e:  # LongSpecError is a ValueError: bad model dir, weights, limits, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    import prometheus_client

    from infer.serve_app import build_app

    prometheus_client.disable_created_metrics()  # no *_created series beside each counter and histogram
    try:
        run_server(build_app(served), sock, summary, args.log_level)
    finally:
        served.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
