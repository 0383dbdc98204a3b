"""The `spotfill` command line: one module per subcommand (thin)."""
from spotfill.cli.main import main  # noqa: F401
