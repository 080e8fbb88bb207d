"""A handler waiting on its request's job: the next delta (or the client going away first), all of its
sequences finished, and the error a failed request answers with. Every API's routes wait the same way."""
import asyncio

from starlette.types import Receive

from dsv4cli.engine import Sequence

from .errors import Refusal
from .loop import Delta, EngineLoop, Job


def failure(delta: Delta) -> Refusal:
    """The request's end when the engine failed it (500) or the server stopped first (503)."""
    return Refusal(delta.status, delta.error, "server_shutting_down" if delta.status == 503 else None)


async def disconnect(receive: Receive) -> None:
    """Returns when the client goes away (the body is already read, so only http.disconnect is left)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def next_delta(job: Job, gone: asyncio.Task) -> tuple[int, Delta] | None:
    """The request's next (sequence index, delta), or None when its client went away first."""
    get = asyncio.ensure_future(job.queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None


async def finished(loop: EngineLoop, job: Job, gone: asyncio.Task, count: int) -> list[Sequence] | None:
    """The job's `count` sequences once all ended, or None when the client went away first; a failed request
    raises its Refusal. The job is cancelled unless it ended."""
    seqs: list[Sequence | None] = [None] * count
    left = count
    try:
        while left:
            item = await next_delta(job, gone)
            if item is None:            # the client went away: nobody reads the answer
                return None
            index, delta = item
            if delta.error is not None:
                raise failure(delta)
            if delta.done is not None:
                seqs[index], left = delta.done, left - 1
    finally:
        gone.cancel()
        if left:
            loop.cancel(job)
    return seqs
