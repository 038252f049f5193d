"""The async twin of :mod:`kruntimes`: the same classes and calls, awaited.

.. code-block:: python

    from kruntimes import AcquireOptions
    from kruntimes.aio import from_kube_config

    async with from_kube_config() as client:
        async with await client.runtime("default", "bash").acquire_sandbox(AcquireOptions()) as sb:
            result = await sb.exec(["echo", "hi"])
"""

from ._api import AsyncClient, AsyncRuntime, from_incluster, from_kube_config
from ._sandbox import AsyncSandbox
from ._session import AsyncSession
from ._work import AsyncFunction, AsyncTask

__all__ = [
    "AsyncClient",
    "AsyncFunction",
    "AsyncRuntime",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncTask",
    "from_incluster",
    "from_kube_config",
]
