"""`python -m jaxckpt`: the same command as the `jaxckpt` console script."""

import sys

from jaxckpt import cli

sys.exit(cli.main())
