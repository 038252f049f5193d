"""kruntimes: sandboxes, tasks and functions on kruntimes warm pools, from Python.

The sync client lives here; :mod:`kruntimes.aio` is its async twin, of the same shape.

.. code-block:: python

    from kruntimes import AcquireOptions
    from kruntimes.kubernetes import from_kube_config

    with from_kube_config() as client:
        runtime = client.runtime("default", "bash")
        with runtime.acquire_sandbox(AcquireOptions(lease_timeout_seconds=60)) as sandbox:
            print(sandbox.exec(["echo", "hello"]).stdout)
"""

from ._sync import (
    Client,
    Function,
    Runtime,
    Sandbox,
    Session,
    Task,
    from_incluster,
    from_kube_config,
)
from .errors import (
    Conflict,
    Forbidden,
    InvalidRequest,
    InvocationError,
    KruntimesError,
    NotFound,
    OperationTimeout,
    OutcomeUnknown,
    RequestConflict,
    RequestIdReserved,
    RunStateError,
    SandboxStateError,
    SessionClosed,
    SessionSuspended,
    SessionSuspending,
    SessionWaking,
    SnapshotStateError,
    Superseded,
    TooManyRequests,
    Unauthorized,
    Unavailable,
)
from .models import (
    AcquireOptions,
    Checkpoint,
    Command,
    Event,
    ExecResult,
    FileEntry,
    FilePage,
    Invocation,
    ListFilesOptions,
    Operation,
    SandboxStatus,
    TaskResult,
    Uploaded,
    request_run_name,
)

__version__ = "0.1.0"

__all__ = [
    "AcquireOptions",
    "Checkpoint",
    "Client",
    "Command",
    "Conflict",
    "Event",
    "ExecResult",
    "FileEntry",
    "FilePage",
    "Forbidden",
    "Function",
    "InvalidRequest",
    "Invocation",
    "InvocationError",
    "KruntimesError",
    "ListFilesOptions",
    "NotFound",
    "Operation",
    "OperationTimeout",
    "OutcomeUnknown",
    "RequestConflict",
    "RequestIdReserved",
    "RunStateError",
    "Runtime",
    "Sandbox",
    "SandboxStateError",
    "SandboxStatus",
    "Session",
    "SessionClosed",
    "SessionSuspended",
    "SessionSuspending",
    "SessionWaking",
    "SnapshotStateError",
    "Superseded",
    "Task",
    "TaskResult",
    "TooManyRequests",
    "Unauthorized",
    "Unavailable",
    "Uploaded",
    "from_incluster",
    "from_kube_config",
    "request_run_name",
]
