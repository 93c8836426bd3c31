"""`planner-server` / `python -m planner_server`: run the planner."""

from __future__ import annotations

import logging
import sys

from planner_server.config import config_from_args
from planner_server.logging_setup import configure_logging


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    configure_logging(config.log_level, config.log_format)
    from planner_server.server import serve  # after logging: importing Megatron-Core takes seconds

    try:
        serve(config)
    except (OSError, ValueError, RuntimeError) as exc:
        logging.getLogger("planner_server").error("cannot start: %s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
