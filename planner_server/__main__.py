import sys

from planner_server.cli import main

sys.exit(main())
