"""The HTTP server around the app: uvicorn with the limits a server reachable by untrusted clients needs,
and a shutdown that lets running requests finish.

Connections: uvicorn closes a kept-alive connection idle for 5 s, but never one that has not sent a whole
request: one that sends nothing, or a header a byte at a time (slowloris), is held forever, and enough of
them use up the open-file limit, after which the server accepts nothing (and asyncio logs every failed
accept). So every request (head and body) must arrive within `read_timeout` of the connection opening or of
its previous reply, and at most `max_connections` are open: one more closes the oldest connection still
waiting for its request, so idle connections cannot lock out a client that sends one. The open-file limit
is raised as far as it goes, and connections are accepted at most BACKLOG at a time, so the bound applies
before that limit is reached. uvicorn's `limit_concurrency` is not used: it counts idle connections too, so
they would turn every real request into a 503.
"""
import asyncio
import resource
import signal
import sys

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .loop import EngineLoop

FILES_KEPT = 128        # open files left to the rest of the process (model files, sockets of --tp, ...)
# connections asyncio accepts in one go (also the listen backlog), before their connection_made runs, and those
# close a loop turn later: the bound on connections may be passed by twice this many, which the file limit allows
BACKLOG = 64


def connection_limit(wanted: int) -> int:
    """`wanted`, or fewer when the open-file limit does not allow that many connections. The soft limit is
    raised to the hard one first (many systems start processes at 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return max(1, min(wanted, soft - FILES_KEPT - 2 * BACKLOG)) if soft != resource.RLIM_INFINITY else wanted


def protocol(read_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request and a bound on connections (module doc)."""
    waiting: dict[H11Protocol, asyncio.TimerHandle] = {}   # those expecting a request, oldest first

    class Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                if not waiting:                 # every connection is busy with a request: refuse this one
                    transport.close()
                    return
                oldest = next(iter(waiting))
                waiting.pop(oldest).cancel()
                oldest.transport.close()
            self._expect_request()

        def _expect_request(self) -> None:
            if self in waiting:
                waiting.pop(self).cancel()
            waiting[self] = self.loop.call_later(read_timeout, self._too_slow)

        def _too_slow(self) -> None:
            waiting.pop(self, None)
            self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self in waiting and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):   # all of it came
                waiting.pop(self).cancel()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._expect_request()          # the next request (a pipelined one is handled just below)
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self in waiting:
                waiting.pop(self).cancel()
            super().connection_lost(exc)

    return Protocol


class Server(uvicorn.Server):
    """uvicorn's server, stopping the way a model server should: on SIGTERM or Ctrl-C it stops accepting
    connections, lets running requests finish for up to `shutdown_timeout` seconds (a second signal cuts
    that short), ends the rest with an error (an error event in a stream), stops the engine thread, and
    returns (exit code 0, or 130 after Ctrl-C) instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout = engine_loop, shutdown_timeout
        self.stopped_by: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        else:
            self.stopped_by, self.should_exit = sig, True

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()               # an idle one closes; a busy one closes after its reply
        tasks, loop = self.server_state.tasks, asyncio.get_running_loop()
        if tasks and self.stopped_by is not None:
            again = "Ctrl-C" if self.stopped_by == signal.SIGINT else "the signal"
            print(f"dsv4 serve: stopping; {len(tasks)} running requests get {self.shutdown_timeout:g} s to finish "
                  f"({again} again: now)", file=sys.stderr, flush=True)
        deadline = loop.time() + self.shutdown_timeout
        while tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.engine_loop.close("the server is stopping")
        deadline = loop.time() + 5      # for the ends to be sent; a client that reads nothing holds its reply
        while tasks and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.server_state.connections):
            connection.transport.close()
        # the engine thread delivers to this event loop: it ends before the loop does
        await asyncio.to_thread(self.engine_loop.stop)
