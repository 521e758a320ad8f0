"""`python -m preprocess <command> --help`. Each command lives in its own module with an `Args` dataclass and `run`.
The console scripts wampipe-<command> (pyproject.toml) are the same commands."""

from __future__ import annotations

import importlib
import importlib.util
import sys

COMMANDS = {
    "inspect": ("wampipe.preprocess.inspect", "summarize a LeRobot dataset and optionally decode every frame"),
    "stats": ("wampipe.preprocess.stats", "write DreamZero's metadata.json statistics for one or more datasets"),
    "shards": ("wampipe.preprocess.shards", "build WebDataset shards with precomputed encoder outputs"),
    "check": ("wampipe.preprocess.check", "verify a shard directory against its manifest"),
    "preview": (
        "wampipe.preprocess.preview",
        "decode stored samples to an MP4 and a PNG sheet each, to look at a build",
    ),
}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    from wampipe.configs.cli import cli

    argv = sys.argv[1:] if argv is None else argv
    available = {name: spec for name, spec in COMMANDS.items() if importlib.util.find_spec(spec[0]) is not None}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in available:
        lines = [f"  {name:<8} {help_}" for name, (_, help_) in available.items()]
        print("usage: python -m preprocess <command> [--help]\n\ncommands:\n" + "\n".join(lines))
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module = importlib.import_module(available[argv[0]][0])
    from wampipe.errors import entry_point
    from wampipe.preprocess.errors import OutOfSpace, out_of_space

    with entry_point():  # bad input, a broken encoder, a killed process, a full disk: one line, no traceback
        try:
            # the defaults too (shards' --config and --official-filters) refuse with the project's errors
            default = module.defaults(argv[1:]) if hasattr(module, "defaults") else None
            args = cli(
                module.Args,
                default=default,
                args=argv[1:],
                prog=prog or f"python -m preprocess {argv[0]}",
                description=module.__doc__,
            )
            status = module.run(args)  # an exit status (check, inspect) or None
        except OSError as err:
            if not out_of_space(err):
                raise
            raise OutOfSpace.from_os_error(err) from None
    if status:
        raise SystemExit(status)


def command_main(name: str):
    """The console script wampipe-<name>: `python -m preprocess <name>` with the script's arguments."""
    return lambda: main([name, *sys.argv[1:]], prog=f"wampipe-{name}")


shards_main, check_main, stats_main, inspect_main, preview_main = map(
    command_main, ("shards", "check", "stats", "inspect", "preview")
)


if __name__ == "__main__":
    main()
