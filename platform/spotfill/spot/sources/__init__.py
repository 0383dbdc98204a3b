"""Notice sources: one module per platform, one registry line each (module, class).

A new platform is a module with a pure ``reading(...) -> spot.notice.Reading`` and a class implementing
spot.notice.NoticeSource, plus its line here (and a DMI or environment hint in :func:`detect` if it can be
recognised from inside the machine).
"""
from __future__ import annotations

import importlib
import logging
from typing import Mapping

logger = logging.getLogger(__name__)

REGISTRY = {
    "aws": ("spotfill.spot.sources.aws", "AwsSource"),
    "gcp": ("spotfill.spot.sources.gcp", "GcpSource"),
    "azure": ("spotfill.spot.sources.azure", "AzureSource"),
    "kubernetes": ("spotfill.spot.sources.kubernetes", "KubernetesSource"),
}
CHOICES = ("auto", *REGISTRY)
DMI_VENDOR = "/sys/class/dmi/id/sys_vendor"
DMI_PRODUCT = "/sys/class/dmi/id/product_name"


def detect(env: Mapping[str, str], vendor: str = "", product: str = "") -> tuple[str, str]:
    """(source name, why) from what the machine says about itself: a pod (KUBERNETES_SERVICE_HOST) ->
    kubernetes; DMI vendor/product (Amazon EC2, Google Compute Engine, Microsoft Virtual Machine) -> that
    cloud; otherwise aws (spot-watch's behaviour before sources existed), said in the reason."""
    if env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes", "KUBERNETES_SERVICE_HOST is set (running in a pod)"
    v, p = vendor.strip().lower(), product.strip().lower()
    if "amazon" in v or p.startswith("amazon ec2"):
        return "aws", f"DMI sys_vendor {vendor.strip()!r}"
    if v == "google" or "google compute engine" in p:
        return "gcp", f"DMI sys_vendor {vendor.strip()!r}"
    if "microsoft" in v and "virtual machine" in p:
        return "azure", f"DMI {vendor.strip()!r} / {product.strip()!r}"
    return "aws", f"no platform recognised (DMI {vendor.strip()!r} / {product.strip()!r}): defaulting to aws"


def read_dmi(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(256)
    except OSError:
        return ""


def source_class(name: str):
    """The class registered as ``name`` (a key of REGISTRY)."""
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def default_endpoint(name: str) -> str:
    return getattr(importlib.import_module(REGISTRY[name][0]), "DEFAULT_ENDPOINT", "")
