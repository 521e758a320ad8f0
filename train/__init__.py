"""`python -m train ...` from a checkout imports this package as `train`; it then stands in for `wampipe.train`, the one
module of this folder, so no file of it loads under two names (docs/IMPORTS.md)."""

import importlib
import sys

if __name__ != "wampipe.train":
    sys.modules[__name__] = importlib.import_module("wampipe.train")
