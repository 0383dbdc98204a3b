"""Checkpoint lineage (pure): which committed checkpoints the current training state descends from.

Built from the store's manifests (tag, step, created, `parent`, meta.attempt), the quarantine markers
(damaged tags and why) and, where known, the head (the tag training runs from now: the one a restore chose
or the one just committed) and resume events ({"attempt", "from_tag"}: which attempt resumed from which
tag). Restore, retention, `latest` and the report all read it:

- `live`: the chain head -> parent -> ... (newest first), the training state's ancestry;
- `newest_intact`: the first not-quarantined tag of that chain (what a restore tries first);
- `quarantined`: damaged tags with their reasons (never restored);
- `deletable(keep_last)`: what retention may delete; never the newest intact checkpoint of the live chain.

A manifest's parent is, in order of trust: its own `parent` field (written at commit; None means the
attempt started fresh), the previous checkpoint of the same attempt, the tag its attempt resumed from
(resume events), else the previous checkpoint by step (manifests written before lineage existed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

NO_PARENT = object()  # sentinel: a manifest without a `parent` field


@dataclass(frozen=True)
class Checkpoint:
    tag: str
    step: int
    created: float
    attempt: str | None
    parent: str | None


@dataclass(frozen=True)
class Lineage:
    checkpoints: tuple[Checkpoint, ...]          # every committed tag, quarantined ones included
    quarantined: tuple[tuple[str, str], ...]     # (tag, reason), newest first
    head: str | None
    live: tuple[str, ...]                        # head and its ancestors, newest first

    @property
    def damaged(self) -> frozenset[str]:
        return frozenset(tag for tag, _ in self.quarantined)

    @property
    def intact_live(self) -> tuple[str, ...]:
        return tuple(t for t in self.live if t not in self.damaged)

    @property
    def newest_intact(self) -> str | None:
        """The newest not-quarantined checkpoint of the live lineage: what a restore tries first."""
        intact = self.intact_live
        return intact[0] if intact else None

    @property
    def restore_order(self) -> tuple[str, ...]:
        """Restore candidates, best first: the live lineage's intact checkpoints, newest first."""
        return self.intact_live

    def parent(self, tag: str) -> str | None:
        return next((c.parent for c in self.checkpoints if c.tag == tag), None)

    def descends_from(self, tag: str, ancestor: str) -> bool:
        """True when `ancestor` is `tag` or on its parent chain."""
        return ancestor in _chain(tag, {c.tag: c for c in self.checkpoints})

    def deletable(self, keep_last: int) -> tuple[str, ...]:
        """Committed tags retention may delete (keep_last 0 keeps everything): everything but the newest
        `keep_last` intact checkpoints of the live lineage and the newest `keep_last` quarantined ones
        (kept for inspection). Dead branches (intact tags off the live chain) go."""
        if keep_last <= 0:
            return ()
        keep = set(self.intact_live[:keep_last]) | {t for t, _ in self.quarantined[:keep_last]}
        if self.head is None and not self.live:
            # nothing is known to be live (no commit yet after a fresh start): delete nothing intact
            keep |= {c.tag for c in self.checkpoints if c.tag not in self.damaged}
        by_age = sorted(self.checkpoints, key=lambda c: (c.created, c.step), reverse=True)
        return tuple(c.tag for c in by_age if c.tag not in keep)


def _chain(tag: str | None, by_tag: Mapping[str, Checkpoint]) -> tuple[str, ...]:
    out: list[str] = []
    while tag is not None and tag in by_tag and tag not in out:
        out.append(tag)
        tag = by_tag[tag].parent
    return tuple(out)


def _attempt_of(manifest: Mapping) -> str | None:
    meta = manifest.get("meta") or {}
    attempt = meta.get("attempt", manifest.get("attempt"))
    return None if attempt is None else str(attempt)


def _resolve_parents(manifests: Mapping[str, Mapping], damaged: set[str],
                     resumed_from: Mapping[str, str | None]) -> dict[str, Checkpoint]:
    order = sorted(manifests, key=lambda t: (int(manifests[t]["step"]), float(manifests[t].get("created", 0))))
    out: dict[str, Checkpoint] = {}
    for i, tag in enumerate(order):
        m = manifests[tag]
        step, attempt = int(m["step"]), _attempt_of(m)
        explicit = m.get("parent", NO_PARENT)
        earlier = order[:i]
        if explicit is not NO_PARENT:
            parent = explicit
        elif attempt is not None and any(_attempt_of(manifests[t]) == attempt for t in earlier):
            parent = [t for t in earlier if _attempt_of(manifests[t]) == attempt][-1]
        elif attempt is not None and attempt in resumed_from:
            parent = resumed_from[attempt]
        else:
            older = [t for t in earlier if t not in damaged and int(manifests[t]["step"]) < step]
            parent = older[-1] if older else None
        out[tag] = Checkpoint(tag, step, float(m.get("created", 0)), attempt, parent)
    return out


def _resolve_head(by_tag: Mapping[str, Checkpoint], damaged: set[str], head: str | None,
                  resumes: list[Mapping]) -> str | None:
    if head is not None and head in by_tag:
        if head not in damaged:
            return head
        # A damaged head: a newer intact commit that shares its ancestry was made after a restore skipped
        # it (the pointer was not moved); else the head's own chain leads to its intact ancestors.
        ancestors = set(_chain(by_tag[head].parent, by_tag))
        later = [c for c in by_tag.values() if c.tag not in damaged and c.created > by_tag[head].created
                 and ancestors & set(_chain(c.tag, by_tag))]
        return max(later, key=lambda c: (c.created, c.step)).tag if later else head
    if resumes:
        last = resumes[-1]
        attempt = None if last.get("attempt") is None else str(last["attempt"])
        own = [c for c in by_tag.values() if attempt is not None and c.attempt == attempt]
        if own:
            return max(own, key=lambda c: (c.step, c.created)).tag
        start = last.get("from_tag")
        return start if start in by_tag else None
    intact = [c for c in by_tag.values() if c.tag not in damaged]
    return max(intact, key=lambda c: (c.created, c.step)).tag if intact else None


def build_lineage(manifests: Mapping[str, Mapping], quarantined: Mapping[str, str] | None = None,
                  head: str | None = None, resumes: Iterable[Mapping] = ()) -> Lineage:
    """`manifests`: tag -> manifest of every committed tag (quarantined included); `quarantined`: tag ->
    reason; `head`: the tag training runs from, when the caller knows it (a just-committed tag, the
    `latest` pointer); `resumes`: resume events in order, {"attempt", "from_tag"} (None: a fresh start)."""
    quarantined = dict(quarantined or {})
    damaged = set(quarantined)
    resumes = list(resumes)
    resumed_from = {str(r["attempt"]): r.get("from_tag") for r in resumes if r.get("attempt") is not None}
    by_tag = _resolve_parents(manifests, damaged, resumed_from)
    top = _resolve_head(by_tag, damaged, head, resumes)
    age = {t: (c.created, c.step) for t, c in by_tag.items()}
    q = tuple(sorted(quarantined.items(), key=lambda kv: age.get(kv[0], (0.0, 0)), reverse=True))
    return Lineage(tuple(sorted(by_tag.values(), key=lambda c: (c.step, c.created), reverse=True)), q, top,
                   _chain(top, by_tag))
