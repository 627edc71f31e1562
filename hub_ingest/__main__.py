import sys

from hub_ingest.cli import main

sys.exit(main())
