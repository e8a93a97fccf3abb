"""commands/: every command's flags and handler (flags -> config objects -> library calls -> output); the
only code that prints. One module per command family, each with add_parsers(commands) and COMMANDS."""
from __future__ import annotations

import argparse

from . import bench, distill, generate, judge, plan, quant, serve

FAMILIES = (generate, serve, plan, distill, quant, judge, bench)
COMMANDS = {name: handler for family in FAMILIES for name, handler in family.COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     description="Run large language models on one consumer GPU or a CPU.")
    commands = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.add_parsers(commands)
    return parser
