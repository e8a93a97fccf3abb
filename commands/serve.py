"""serve: an OpenAI-compatible HTTP server on the session's decoder (server/); the flags and the start line."""
from __future__ import annotations

import os

from .flags import add_model_flags, add_sampling_flags, batch_size
from .generate import check_sampling_flags, model_sampling, open_session

API_KEY_ENV = "SPECSTREAM_API_KEY"


def add_parsers(commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions), "
                                              "streamed, concurrent requests sharing each pass")
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 opens it to the network (default: 127.0.0.1, this "
                            "machine only)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"ask every /v1 request for 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, "
                            "else none)")
    group.add_argument("--batch-size", default="auto", type=batch_size,
                       help="requests decoded together (KV cache slots), sharing every streamed layer: N, or auto: "
                            "the most whose KV cache the plan fits (default: auto)")
    group.add_argument("--max-queue", type=int, default=32,
                       help="requests waiting for a slot; one more gets 429 (default: 32)")
    group.add_argument("--max-connections", type=int, default=64,
                       help="open connections at once; more get 503 (default: 64)")
    group.add_argument("--max-body", default="1MiB", help="largest request body; larger gets 413 (default: 1MiB)")
    add_model_flags(serve)
    add_sampling_flags(serve, model_defaults=True, max_new_tokens=1024,
                       max_new_tokens_help="the most tokens one answer may ask for (more: 400), and what a "
                                           "request naming no max_tokens gets")


def cmd_serve(args, console) -> int:
    from offload.byte_units import parse_bytes
    from server import ServeConfig, SpecstreamServer
    check_sampling_flags(args)
    config = ServeConfig(args.host, args.port, args.api_key, args.max_new_tokens, parse_bytes(args.max_body),
                         args.max_queue, args.max_connections)
    with open_session(args, console, batch_size=args.batch_size) as session:
        defaults, explicit = model_sampling(args, session, console)
        server = SpecstreamServer(session, config, defaults, explicit, args.stop)
        console.print(f"serving {session.model_name} at {config.url}: {session.batch_size} slots, queue "
                      f"{config.max_queue}, API key {'required' if config.api_key else 'off'}; Ctrl-C stops",
                      highlight=False, soft_wrap=True)
        server.run()
    console.print("[dim]server stopped[/dim]")
    return 0


COMMANDS = {"serve": cmd_serve}
