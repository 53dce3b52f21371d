import sys

from jaxckpt.agent.cli import main

sys.exit(main())
