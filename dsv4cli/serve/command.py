"""`dsv4 serve`: the model behind an OpenAI-compatible HTTP API (`mode = "serve"` of `dsv4 run` is
`run_serve`). Loads the engine, starts its thread, binds the socket, prints the URL, runs uvicorn."""
import ipaddress
import signal
import socket
import sys
from pathlib import Path

from dsv4cli.config import Settings
from dsv4cli.errors import RunError, UsageError, install_hint
from dsv4cli.options import CliOptions, model_options

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
SWITCH_INTERVAL = 0.0005    # seconds a thread holds the interpreter lock while another waits for it


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so --port 0 can report the free port it got."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


def answered_hosts(s: Settings, address: str) -> frozenset[str] | None:
    """The Host names the server answers to (None: any): --allowed-host, else on a loopback address only
    loopback names (so no page of another site reaches it by DNS rebinding), else any."""
    if s.allowed_hosts:
        return None if "*" in s.allowed_hosts else frozenset(h.lower() for h in s.allowed_hosts)
    ip = ipaddress.ip_address(address.partition("%")[0])
    return LOOPBACK_HOSTS | {f"[{ip}]" if ip.version == 6 else str(ip)} if ip.is_loopback else None


def run_serve(s: Settings) -> int:
    try:
        import uvicorn

        from .app import create_app
        from .http import BACKLOG, Server, connection_limit, protocol
        from .server import ApiServer, ServerOptions
        if s.batch_dir:
            import python_multipart  # noqa: F401 - the Batch API's uploads
    except ImportError as e:
        raise UsageError(f"dsv4 serve needs the serve extra ({e.name} is missing): "
                         f"{install_hint('serve')}") from None
    from dsv4cli.engine import drafter_label
    from dsv4cli.loading import load_engine, sampling_params
    from dsv4cli.openai.requests import BodyParser, BodyRules

    from .batches import Store
    from .loop import EngineLoop
    from .metrics import ServerMetrics

    sock = bind(s.host, s.port)     # before loading: a taken port fails in a second, not after the model
    if not s.api_key and not ipaddress.ip_address(sock.getsockname()[0].partition("%")[0]).is_loopback:
        print(f"warning: --host {s.host} listens beyond this machine with no --api-key: anyone who can reach it can "
              f"use the model", file=sys.stderr)
    store = Store(Path(s.batch_dir)) if s.batch_dir else None      # and a batch directory another server holds
    engine = load_engine(s, "serve")
    parser = BodyParser(engine.tok, sampling_params(s), engine.max_seq_len, BodyRules(
        s.thinking, s.reasoning_effort, s.max_messages, s.max_prompt_tokens, engine.model_info.vocab_size))
    metrics = ServerMetrics(engine.model_info.drafter if engine.draft_depth else None, engine.drafts,
                            engine.draft_depth, engine.verify)
    # an engine that cannot go on ends the server: a supervisor restarts it (a server up but broken would not be)
    loop = EngineLoop(engine, s.max_waiting, metrics, on_fatal=lambda: setattr(server, "should_exit", True),
                      batch_slots=min(s.batch_slots or max(1, engine.max_batch // 4), engine.max_batch))
    host, port = sock.getsockname()[:2]
    options = ServerOptions(s.model_name, s.api_key, s.log_prompts, max_body_bytes=s.max_body_bytes,
                            hosts=answered_hosts(s, host), cors_origins=tuple(s.cors_origins),
                            max_file_bytes=s.max_file_bytes, stored_responses_bytes=s.stored_responses_bytes)
    app = create_app(ApiServer(loop, parser, options, store))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", ws="none", backlog=BACKLOG,
                            http=protocol(s.read_timeout, connection_limit(s.max_connections)))
    server = Server(config, loop, s.shutdown_timeout)
    shown = f"[{host}]" if ":" in host else host
    key = ", API key required" if s.api_key else ""
    batches = f", batches in {s.batch_dir} ({loop.batch_slots} slots)" if store else ""
    print(f"dsv4 serve: {s.model_name} on http://{shown}:{port}/v1 (max batch {engine.max_batch}, "
          f"drafter {drafter_label(engine)}{key}{batches})", flush=True)
    # The engine thread holds the interpreter lock through each step's Python work, and a thread waiting for it
    # gets it only after the switch interval (5 ms by default): an HTTP request takes several hand-offs, so
    # under a busy engine each one cost an online request up to 5 ms of its TTFT (benchmarks/batch_api.py).
    sys.setswitchinterval(SWITCH_INTERVAL)
    loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
    if loop.error is not None:
        raise RunError(f"{loop.error}; the server stopped (exit code 1) so that a supervisor restarts it")
    print("dsv4 serve: stopped", file=sys.stderr)
    return 130 if server.stopped_by == signal.SIGINT else 0


@model_options("host", "port", "api_key", "max_waiting", "log_prompts", "thinking", "reasoning_effort",
               "served_model_name", "allowed_hosts", "cors_origins", "max_body_bytes", "max_messages",
               "max_prompt_tokens", "read_timeout", "max_connections", "shutdown_timeout", "batch_dir", "batch_slots",
               "max_file_bytes", "stored_responses_bytes")
def serve(opts: CliOptions) -> int:
    settings, _ = opts.resolve()
    return run_serve(settings)
