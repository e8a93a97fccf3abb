"""specstream's entry point: parse flags (commands/), run the command, turn a user error into one line."""
from __future__ import annotations

import os
import sys

# Idle OpenMP workers spin briefly, then sleep (set before torch starts its pool; a user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins). A decode step is hundreds of small ops back to back: sleeping
# at once (PASSIVE) made a batch-1 draft step 1.6x slower; unbounded spinning starves the layer loader
# thread and neighbours on an oversubscribed machine (10-25x slower there).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

EXIT_USER_ERROR = 2


def build_parser():
    from commands import build_parser as build
    return build()


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from commands import COMMANDS
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)      # the command line, as results record it
    console = Console(stderr=True)
    try:
        return COMMANDS[args.command](args, console)
    except KeyboardInterrupt:
        console.print("[dim]interrupted[/dim]")
        return 130
    except Exception as err:  # user errors: one clear line; SPECSTREAM_DEBUG=1 shows the traceback
        if os.environ.get("SPECSTREAM_DEBUG") or not _is_user_error(err):
            raise
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        return EXIT_USER_ERROR


def _is_user_error(err: Exception) -> bool:
    from offload.weights.disk_errors import is_storage_error
    from runtime import UserError
    return isinstance(err, (UserError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError)) or \
        is_storage_error(err)       # StorageFullError, or a full disk no writer named (one line either way)


if __name__ == "__main__":
    sys.exit(main())
