"""wampipe: the import namespace of the product's packages, `wampipe.configs`, `wampipe.encoders`,
`wampipe.preprocess`, `wampipe.shardformat` and `wampipe.train`, so an installed wampipe claims one name in
site-packages and no file of a user's (a `train.py` of their own) shadows it.

Installed, the packages lie inside this one (pyproject.toml maps them). In a checkout they stand at the top level,
where the layout shows the architecture, beside this folder: the checkout's root joins this package's search path,
so `python -m preprocess ...`, `torchrun train/main.py` and the scripts run from a checkout with nothing installed.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parents[1]
if (_checkout / "pyproject.toml").is_file() and (_checkout / "train" / "main.py").is_file():
    __path__.append(str(_checkout))
