"""The exception hierarchy. Catch the narrowest class that is the fault tolerance you mean."""


class AstraflowError(Exception):
    """Base of every error astraflow raises on purpose."""


class ConfigError(AstraflowError):
    """A recipe, env var or override is invalid; the message names the field and the source."""


class RuleError(ValueError):
    """A settings rule was broken (raised in a validator, so pydantic reports it); `field` is the dotted
    setting to change, which the settings' error message names instead of the validator's section."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class BusError(AstraflowError):
    """The Redis Streams bus refused or failed an operation."""


class BusConnectionError(BusError):
    """Redis stayed unreachable past the reconnect budget."""


class UnknownRunError(AstraflowError):
    """A command names a run that does not exist on its Redis."""


class MessageTooLarge(BusError):
    """An entry is larger than `streams.max_entry_bytes`."""


class WorkerUnhealthy(AstraflowError):
    """A worker cannot be trusted to go on (a handler hung past `streams.handler_timeout_s`): its process
    exits non-zero so that its supervisor restarts it."""


class DecodeError(AstraflowError):
    """A stream entry or hash could not be decoded; the message names the offending field."""


class WeightIntegrityError(AstraflowError):
    """Weight bytes do not match the digest in their manifest."""


class NonFiniteWeights(WeightIntegrityError):
    """Weights to be published hold NaN or inf: they are never served."""


class ForeignAdapterError(WeightIntegrityError):
    """A version is a LoRA adapter of a base other than the weights this process holds: never loaded."""


class SandboxUnavailable(AstraflowError):
    """Tool calls should run in namespaces (`raas.sandbox: namespaces`) and this machine cannot start one:
    the message names the probe's own error."""


class RedisServerError(AstraflowError):
    """The embedded redis-server could not be found, started or stopped."""


class RunExistsError(AstraflowError):
    """A fresh run was asked for, and keys of a run of that name already exist (or nothing to resume)."""


class RunDirError(AstraflowError):
    """A run directory holds files of an earlier run (or the user's), or a live run holds it."""


class WorkerFailed(AstraflowError):
    """A worker of `astraflow run` died more often than its restart budget allows; the message ends
    with its last error line."""

    def __init__(self, message: str, worker: str, error: str | None) -> None:
        super().__init__(message)
        self.worker, self.error = worker, error


class ForeignCheckpointError(AstraflowError):
    """A trainer checkpoint belongs to another run (another nonce) than the one being trained."""


def describe(error: BaseException) -> str:
    """An error as a log line says it: its type and message (redis-py's own repr of its errors, e.g.
    `server:ResponseError`, leaves the message out)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
