import sys

from spotfill.cli.main import main

sys.exit(main())
