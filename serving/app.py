"""`serve run serving.app:app checkpoint=...` and serving/config.yaml's import path: spotfill's Serve generation
app, which lives in the package (spotfill/serving/app.py) so it deploys from an installed spotfill too."""
from spotfill.serving.app import app

__all__ = ["app"]
