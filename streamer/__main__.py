from __future__ import annotations

import sys

from streamer.cli import main

sys.exit(main())
