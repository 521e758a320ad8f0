"""A random-weight DreamZero checkpoint folder in the official layout, for `--model.init-from` and
`--checkpoint.export-base` in tests, `make demo` and the load benchmark.

    python scripts/make_tiny_base.py --out build/demo/base --shards build/demo/droid --also libero_sim  # the demo's
    python scripts/make_tiny_base.py --out /scratch/base-14b --preset droid-14b              # full-size DiT, 33 GB bf16

The layout written is listed in devtools/tiny_base.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # devtools/: fixtures of a checkout, not installed

from wampipe.configs.cli import cli
from wampipe.errors import entry_point
from devtools.tiny_base import Args, write_base


def main(args: Args) -> None:
    out = write_base(args)
    print(f"wrote {out}: DiT {args.preset} in the official layout ({len(list(out.glob('*.safetensors')))} files)")


if __name__ == "__main__":
    with entry_point():  # the project's errors: their one line and exit status, no traceback
        main(cli(Args, description=__doc__))
