from __future__ import annotations

import sys

from streamer.cli.app import main

sys.exit(main())
