"""`GET /internal/artifacts/<sha256>`: an artifact's bytes for nodes that cannot read the artifact storage
(another machine's disk), authenticated by the node token (FERRY_NODE_TOKEN).

Content-addressed: no database query, so nodes can still fetch while PostgreSQL is down, and the node
checks the bytes against the name it asked for (serving.dataplane.node.artifact_cache). Streamed in chunks
from the storage, never read whole into memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import BinaryIO

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponseBase, JsonResponse, StreamingHttpResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.http import require_GET

from serving import artifacts
from serving.artifacts import CHUNK
from serving.dataplane.node.artifact_cache import SHA256, ArtifactUnavailable


@require_GET
async def artifact(request: HttpRequest, sha256: str) -> HttpResponseBase:
    token = settings.FERRY_NODE_TOKEN
    if not token:
        return JsonResponse(
            {"error": "artifact distribution is off: set FERRY_NODE_TOKEN on web and nodes"}, status=403
        )
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not constant_time_compare(given.strip(), token):
        response = JsonResponse(
            {"error": "a node token is required (Authorization: Bearer <FERRY_NODE_TOKEN>)"}, status=401
        )
        response["WWW-Authenticate"] = "Bearer"
        return response
    if not SHA256.fullmatch(sha256):
        return JsonResponse({"error": f"no artifact {sha256}"}, status=404)
    box, name = artifacts.storage(), artifacts.name_for(sha256)
    try:
        size = await sync_to_async(box.size)(name)
        f = await sync_to_async(artifacts.open_file)(sha256)
    except (FileNotFoundError, ArtifactUnavailable):
        return JsonResponse({"error": f"no artifact {sha256}"}, status=404)
    response = StreamingHttpResponse(_chunks(f), content_type="application/octet-stream")
    response["Content-Length"] = str(size)
    return response


async def _chunks(f: BinaryIO) -> AsyncIterator[bytes]:
    """The file in chunks, each read off the event loop: an async iterator, which Django streams as it goes
    (a plain one it would read whole into memory first under ASGI). A client that leaves cancels this
    between reads or during one; the file is closed once no read is running on it."""
    loop = asyncio.get_running_loop()
    read: asyncio.Future[bytes] | None = None
    try:
        while True:
            read = loop.run_in_executor(None, f.read, CHUNK)
            chunk = await asyncio.shield(read)
            if not chunk:
                return
            yield chunk
    finally:
        if read is not None and not read.done():
            await asyncio.wait([read])
        f.close()
