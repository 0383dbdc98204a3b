import sys

from spotfill.cli import main

sys.exit(main())
