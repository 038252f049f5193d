"""Connecting with Kubernetes credentials (async): :func:`from_kube_config`,
:func:`from_incluster`."""

from ._api import from_incluster, from_kube_config

__all__ = ["from_incluster", "from_kube_config"]
