import sys

from jaxckpt.agent.commands.cli import main

sys.exit(main())
