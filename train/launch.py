"""`wampipe-train`: torchrun (its library entry point, in this process) with this package's train/main.py as script.

    wampipe-train --nproc-per-node 2 --preset tiny --data.shards shards/droid
    wampipe-train --nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint node0:29400 --nproc-per-node 8 \\
        -- --preset droid-5b --data.shards s3://bucket/shards/droid

torchrun's options (`torchrun --help`) go to torchrun, every other argument and all after `--` to the trainer
(`wampipe-train -- --help` lists its flags). With no rendezvous option it runs --standalone (one node, a free port),
as `make train` does.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Options that place the run on nodes; without any, the launch is --standalone.
RENDEZVOUS = (
    "--standalone",
    "--nnodes",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
)


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, the trainer's): torchrun takes its own options and their values, the trainer the rest."""
    from torch.distributed.run import get_args_parser

    takes_value = {
        option: action.nargs != 0
        for action in get_args_parser()._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    }
    launcher, trainer = [], []
    args = iter(argv)
    for arg in args:
        name = arg.split("=", 1)[0]
        if arg == "--":
            trainer += args
        elif name in takes_value:
            launcher += [arg, next(args, "")] if takes_value[name] and "=" not in arg else [arg]
        else:
            trainer.append(arg)
    if not any(arg.split("=", 1)[0] in RENDEZVOUS for arg in launcher):
        launcher.insert(0, "--standalone")
    return launcher, trainer


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    launcher, trainer = split_arguments(sys.argv[1:] if argv is None else argv)
    # torchrun's own default for several processes a node, without its warning box; the environment's value wins
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec = importlib.util.find_spec("wampipe.train.main")
    assert spec is not None and spec.origin is not None  # a file of this package, which is running
    torchrun([*launcher, spec.origin, *trainer])


if __name__ == "__main__":
    main()
