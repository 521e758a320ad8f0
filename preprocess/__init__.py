"""`python -m preprocess ...` from a checkout imports this package as `preprocess`; it then stands in for
`wampipe.preprocess`, the one module of this folder, so no file of it loads under two names (docs/IMPORTS.md)."""

import importlib
import sys

if __name__ != "wampipe.preprocess":
    sys.modules[__name__] = importlib.import_module("wampipe.preprocess")
