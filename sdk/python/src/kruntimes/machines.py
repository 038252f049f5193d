"""The machines view (design document ``fn/machines/machines.go``): claim a machine, put
a file on it, run something, give it back. The sync twin of :mod:`kruntimes.aio.machines`, driven on the
client's event loop.

.. code-block:: python

    from kruntimes.kubernetes import from_kube_config
    from kruntimes.machines import ExecRequest, Machines, Spec

    with from_kube_config() as client:
        machines = Machines(client, "python")
        lease = machines.claim(Spec(org="acme", cls="exec", project="my-function"))
        machines.write(lease, "main.py", "print('hi')\\n")
        result = machines.exec(lease, ExecRequest(argv=["python3", "main.py"]))
        assert (result.exit_code, result.stdout) == (0, b"hi\\n")
        machines.release(lease)
"""

from __future__ import annotations

from ._sync import Client
from .aio.machines import CLASS_LABEL, CLASSES, PROJECT_LABEL, AsyncMachines, ExecRequest, ExecResult, Lease, Spec

__all__ = [
    "CLASSES",
    "CLASS_LABEL",
    "PROJECT_LABEL",
    "ExecRequest",
    "ExecResult",
    "Lease",
    "Machines",
    "Spec",
]


class Machines:
    """The machines of one Runtime (see :class:`kruntimes.aio.machines.AsyncMachines`)."""

    def __init__(self, client: Client, runtime: str) -> None:
        self._portal = client._portal
        self._inner = AsyncMachines(client._inner, runtime)
        self.runtime = runtime

    def claim(self, spec: Spec) -> Lease:
        """Claims a machine and waits until it is Ready."""
        return self._portal.call(self._inner.claim(spec))

    def write(self, lease: Lease, path: str, content: str | bytes) -> None:
        """Writes a file on the machine (its directories made)."""
        self._portal.call(self._inner.write(lease, path, content))

    def exec(self, lease: Lease, request: ExecRequest) -> ExecResult:
        """Runs an argv on the machine; a non-zero exit code is a result."""
        return self._portal.call(self._inner.exec(lease, request))

    def release(self, lease: Lease) -> None:
        """Gives the machine back: asked to end at once and deleted, not waited for."""
        self._portal.call(self._inner.release(lease))
