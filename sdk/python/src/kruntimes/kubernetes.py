"""Connecting with Kubernetes credentials: :func:`from_kube_config` (a kubeconfig file,
with whatever credentials it names: bearer tokens, token files, client certificates, exec
plugins, all read by lightkube) and :func:`from_incluster` (a Pod's service account)."""

from ._sync import from_incluster, from_kube_config

__all__ = ["from_incluster", "from_kube_config"]
