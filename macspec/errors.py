"""One error hierarchy: the CLI prints `Error: <message>` (exit 1); the server maps `http_status`."""


class MacspecError(Exception):
    http_status = 500
    error_type = "server_error"


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
