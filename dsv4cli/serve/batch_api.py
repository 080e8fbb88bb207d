"""The routes of OpenAI's Files and Batches API (`--batch-dir`): POST /v1/files (purpose batch), GET /v1/files/{id}
and its /content, POST /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel, GET /v1/batches.

An upload is multipart/form-data, the one POST body here that is not JSON: a web page may send that to any
address without asking (no CORS preflight), so an upload that carries a browser's Origin header is refused
unless --cors-origin allows that origin. It may be up to --max-file-bytes, refused by its Content-Length before
a byte is read and cut off as soon as it passes the limit without one; the file part is spooled to disk by
Starlette's parser (python-multipart), then moved into the batch directory.
"""
import contextlib
import errno
import json
from collections.abc import AsyncIterator, Iterator

from starlette.concurrency import run_in_threadpool
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dsv4cli.errors import UsageError
from dsv4cli.openai.requests import CHAT_URL, COMPLETIONS_URL, BadRequest, check_metadata

from .batches import ACTIVE, ApiBatch, Store, shown
from .errors import Refusal
from .server import ApiServer

BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
UPLOAD_FIELDS = {"file", "purpose"}     # and OpenAI's expires_after[...]: accepted, no effect (files are kept)


def given(value) -> str:
    """A value an error quotes: a string as JSON, anything else by its type (it may nest as deep as JSON goes)."""
    return json.dumps(value) if isinstance(value, str) else f"a {type(value).__name__}"


def routes(server: ApiServer) -> list[Route]:
    return [server.route("/v1/files", "POST", upload),
            server.route("/v1/files/{file_id}", "GET", file_info),
            server.route("/v1/files/{file_id}/content", "GET", file_content),
            server.route("/v1/batches", "POST", create_batch),
            server.route("/v1/batches", "GET", list_batches),
            server.route("/v1/batches/{batch_id}", "GET", get_batch),
            server.route("/v1/batches/{batch_id}/cancel", "POST", cancel_batch)]


def resume(server: ApiServer) -> None:
    """Batches a stopped server left unfinished: running again, or cancelled if they were being cancelled."""
    store = server.store
    for obj in list(store.batches.values()):
        if obj["status"] in ACTIVE:
            try:
                batch = ApiBatch(store, obj, server.loop.engine, server.parser, server.model)
            except UsageError as e:         # it alone fails: the server and the other batches go on
                store.fail(obj, f"cannot resume it: {e}")
                continue
            server.batches[obj["id"]] = batch
            if obj["status"] == "cancelling":
                batch.end("cancelled")
            else:
                server.loop.start_batch(batch)


@contextlib.contextmanager
def storing(store: Store) -> Iterator[None]:
    """Around a write into DIR: a full disk is answered with 507, any other failed write with 500, both naming
    DIR (what the write left there is removed: `Store`)."""
    try:
        yield
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise Refusal(507 if full else 500, f"the server's batch directory {store.root}: cannot write: "
                                            f"{e.strerror.lower()}", "insufficient_storage" if full else None) \
            from None


async def limited(request: Request, max_bytes: int) -> AsyncIterator[bytes]:
    """The request's body, refused once it passes `max_bytes`."""
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise Refusal(413, f"the upload is over {max_bytes} bytes (max_file_bytes)", "body_too_large")
        yield chunk


async def upload(server: ApiServer, request: Request) -> Response:
    origin, allowed = request.headers.get("origin"), server.options.cors_origins
    if origin is not None and origin not in allowed and "*" not in allowed:
        raise Refusal(403, f"an upload from a web page ({origin}) is not allowed; allow its origin with "
                           "--cors-origin", "origin_not_allowed")
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "multipart/form-data":
        raise Refusal(415, f"Content-Type must be multipart/form-data, got {media or 'none'}",
                      "unsupported_media_type")
    max_bytes, length = server.options.max_file_bytes, request.headers.get("content-length")
    if length is not None and int(length) > max_bytes:
        raise Refusal(413, f"the upload is {length} bytes; at most {max_bytes} (max_file_bytes)", "body_too_large")
    try:
        form = await MultiPartParser(request.headers, limited(request, max_bytes), max_files=1, max_fields=8).parse()
    except MultiPartException as e:
        raise BadRequest("invalid_request", f"the body: not multipart/form-data OpenAI's SDK sends: {e.message}") \
            from None
    try:
        extra = next((k for k in form if k not in UPLOAD_FIELDS and not k.startswith("expires_after")), None)
        if extra is not None:
            raise BadRequest("unsupported_parameter", f"{extra}: not a field of a file upload (file, purpose)")
        if form.get("purpose") != "batch":
            raise BadRequest("invalid_parameter", f"purpose: only batch files are taken here, got "
                                                  f"{json.dumps(form.get('purpose'))}")
        file = form.get("file")
        if file is None or isinstance(file, str):
            raise BadRequest("invalid_request", "file: missing; send the file as the multipart part `file`")
        with storing(server.store):
            obj = await run_in_threadpool(server.store.upload, file.file, file.filename or "upload.jsonl", "batch")
    finally:
        await form.close()
    return JSONResponse(obj)


def known_file(server: ApiServer, request: Request) -> dict:
    obj = server.store.files.get(request.path_params["file_id"])
    if obj is None:
        raise Refusal(404, f"No such file: {request.path_params['file_id']}", "file_not_found")
    return obj


async def file_info(server: ApiServer, request: Request) -> Response:
    return JSONResponse(known_file(server, request))


async def file_content(server: ApiServer, request: Request) -> Response:
    return FileResponse(server.store.path(known_file(server, request)["id"]), media_type="application/octet-stream")


def new_batch(server: ApiServer, body) -> ApiBatch:
    """The batch a POST /v1/batches body asks for, created in the store."""
    if not isinstance(body, dict):
        raise BadRequest("invalid_request", "the body must be a JSON object")
    extra = next((k for k in body if k not in BATCH_FIELDS), None)
    if extra is not None:
        raise BadRequest("unsupported_parameter",
                         f"{extra}: not a field of a batch ({', '.join(sorted(BATCH_FIELDS))})")
    if body.get("endpoint") not in (CHAT_URL, COMPLETIONS_URL):
        raise BadRequest("invalid_parameter", f"endpoint: must be {CHAT_URL} or {COMPLETIONS_URL}, got "
                                              f"{given(body.get('endpoint'))}")
    if body.get("completion_window") != "24h":
        raise BadRequest("invalid_parameter", f"completion_window: must be 24h, got "
                                              f"{given(body.get('completion_window'))}")
    check_metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    file = server.store.files.get(file_id) if isinstance(file_id, str) else None
    if file is None or file["purpose"] != "batch":
        raise BadRequest("invalid_parameter", f"input_file_id: no uploaded batch file {given(file_id)}")
    return ApiBatch.create(server.store, body, server.loop.engine, server.parser, server.model)


async def create_batch(server: ApiServer, request: Request) -> Response:
    with storing(server.store):
        batch = await server.parsed(request, lambda body: new_batch(server, body))
    server.batches[batch.batch["id"]] = batch
    server.loop.start_batch(batch)
    return JSONResponse(batch.object())


def known_batch(server: ApiServer, request: Request) -> dict:
    batch_id, running = request.path_params["batch_id"], server.batches
    if batch_id in running:
        if not running[batch_id].ended:
            return running[batch_id].object()
        del running[batch_id]       # stored as it ended
    if batch_id in server.store.batches:
        return shown(server.store.batches[batch_id])
    raise Refusal(404, f"No such batch: {batch_id}", "batch_not_found")


async def get_batch(server: ApiServer, request: Request) -> Response:
    return JSONResponse(known_batch(server, request))


async def cancel_batch(server: ApiServer, request: Request) -> Response:
    obj = known_batch(server, request)
    if obj["status"] not in ACTIVE:
        raise BadRequest("invalid_request", f"batch_id: cannot cancel a batch whose status is {obj['status']}")
    batch = server.batches[obj["id"]]
    with storing(server.store):
        cancelling = await run_in_threadpool(batch.cancelling)
    if cancelling:
        server.loop.cancel_batch(batch)
    return JSONResponse(batch.object())


async def list_batches(server: ApiServer, request: Request) -> Response:
    try:
        limit = int(request.query_params.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest("invalid_parameter", "limit: must be an integer in [1, 100]")
    ids = list(reversed(server.store.batches))             # newest first
    after = request.query_params.get("after")
    if after is not None:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    running = server.batches
    page = [running[i].object() if i in running and not running[i].ended else shown(server.store.batches[i])
            for i in ids[:limit]]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(ids) > limit})
