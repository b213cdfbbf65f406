"""``python -m omniwire.bench`` is ``omniwire bench``."""

import sys

from . import main

sys.exit(main())
