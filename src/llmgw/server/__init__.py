"""The control plane and gateway: node registry, fleet service, reconciler, gateway, API."""
