"""Spot interruption notices: one source per platform (spot.sources: aws, gcp, azure, kubernetes) behind one
interface (spot.notice), the watcher loop and the Ray drain (spot.watcher), early-warning records
(spot.early_warning). docs/spot-notices.md."""
