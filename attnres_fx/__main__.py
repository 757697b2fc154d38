"""``python -m attnres_fx``: the ``attnres-fx`` command."""

import sys

from .cli import main

sys.exit(main())
