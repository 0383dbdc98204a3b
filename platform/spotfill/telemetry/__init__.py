"""Telemetry: event log, metrics, report."""
