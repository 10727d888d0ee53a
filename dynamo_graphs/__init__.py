"""Serving Beam through NVIDIA Dynamo: graphs (YAML), the launcher, k8s manifests, the worker."""
