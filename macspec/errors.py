"""One error hierarchy: the CLI prints `Error: <message>` (exit 1); the server maps `http_status`."""


class MacspecError(Exception):
    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, for API error bodies


class ProfileError(MacspecError):
    """A profile file that is missing, malformed or has an invalid key or value."""

    http_status = 400
    error_type = "invalid_profile"


class ModelLoadError(MacspecError):
    """A model directory or Hugging Face id that cannot be loaded."""


class IncompatibleDraftError(MacspecError):
    """A draft whose tokenizer differs from the target's: its proposals would never be accepted."""


class UnsupportedModelError(MacspecError):
    """A model/cache combination speculation cannot roll back, or an MTP head it cannot run."""


class RequestError(MacspecError):
    """A generation request with invalid parameters."""

    http_status = 400
    error_type = "invalid_request_error"


class NotFoundError(MacspecError):
    """A model or route the server does not have."""

    http_status = 404
    error_type = "not_found_error"


class QueueFullError(MacspecError):
    """The waiting queue is full; the client should retry later (HTTP 429 + Retry-After)."""

    http_status = 429
    error_type = "rate_limit_error"


class EngineUnavailableError(MacspecError):
    """The engine stopped or failed; requests cannot be served (HTTP 503)."""

    http_status = 503
    error_type = "server_unavailable"
