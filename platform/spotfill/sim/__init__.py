"""The scenario runner: embedded local Ray cluster, timeline events, outcomes and invariants."""
