"""What every route of the server replies with, shared by app.py and its other routes (infill.py,
embeddings.py): JSON that always encodes, error replies, a request's prompt-cache salt."""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager

from starlette.responses import JSONResponse

from mixqrt.serving import protocol as oai
from mixqrt.errors import GenerationError, MixqrtError, RequestError
from mixqrt.serving.server.guard import HTTPError, Limits, api_keys


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a reply never fails to encode (and never 500s) whatever text
    it carries."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


# ============================================================================ prompt-cache isolation
def cache_salt(salt: str | None, authorization: str | None, limits: Limits) -> str | None:
    """The engine's cache salt for a request: with API keys configured, a hash of the request's
    key (checked by the Guard; the key itself is not kept) then its own salt, so that two keys
    never share cached prompts; without keys, the request's salt. One rule either way: an empty
    salt is no salt (the key's, or everyone's, shared cache). The Guard refuses a request with two
    Authorization headers, so the key hashed here is the key it checked."""
    salt = salt or None
    if not api_keys(limits):
        return salt
    token = (authorization or "").partition(" ")[2].strip()
    key = hashlib.sha256(b"mixqrt prompt-cache salt\0" + token.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{key}:{salt or ''}"


def error_response(e: HTTPError) -> JSONResponse:
    return SafeJSONResponse(e.body(), status_code=e.status, headers=e.headers)


def bad_request(e: RequestError) -> HTTPError:
    return HTTPError(400, str(e), param=e.field, code=e.code)


def engine_error(e: GenerationError) -> HTTPError:
    """An error a request's iteration raised: a 400 naming the field when it is a RequestError."""
    return bad_request(e) if isinstance(e, RequestError) else HTTPError(400, oai.safe_message(e))


@contextmanager
def submission_errors(invalid=(MixqrtError,)):
    """A request's admission to the engine, its refusals as HTTP errors: the engine busy -> 503 with
    Retry-After; a RequestError -> 400 naming its field; any other error of the `invalid` classes ->
    400 with its (safe) message; anything else propagates."""
    from mixqrt.generation.engine import EngineBusy
    try:
        yield
    except EngineBusy as e:
        raise HTTPError(503, f"server busy: {e}; retry later", "server_error", code="server_busy",
                        headers={"Retry-After": "1"}) from None
    except RequestError as e:
        raise bad_request(e) from None
    except invalid as e:
        raise HTTPError(400, oai.safe_message(e)) from None
