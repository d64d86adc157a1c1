"""``python -m paratrain.cli``: the same as the ``paratrain`` command."""

import sys

from paratrain.cli import main

sys.exit(main())
