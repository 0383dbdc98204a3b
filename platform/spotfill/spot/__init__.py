"""Spot interruption notices: AWS IMDS client, watcher, Ray drain."""
