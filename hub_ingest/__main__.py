"""``python -m hub_ingest``, and the file spark-submit runs for ``hub-ingest run`` on a
cluster: ``spark-submit --master spark://HOST:7077 …/hub_ingest/__main__.py run --once``."""

import os
import sys

if not __package__:
    # Run as a file, whose directory Python puts first on sys.path: the package's modules
    # (config, table, source, …) would shadow any top-level ones of the same name.
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]

from hub_ingest.cli.main import main

sys.exit(main())
