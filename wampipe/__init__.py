"""wampipe: the import name of the product's packages, `wampipe.configs`, `wampipe.encoders`, `wampipe.preprocess`,
`wampipe.shardformat` and `wampipe.train`, so an installed wampipe claims one name in site-packages and no file of a
user's (a `train.py` of their own) shadows it.

In a checkout the packages stand at the top level, where the layout shows the architecture; this folder holds a
relative symbolic link to each, so tools that follow files (pyright, an editor's go-to-definition) resolve
`wampipe.train.config` to train/config.py, and a checkout's root on the path is all it takes to import them.
Installed, pyproject.toml maps each folder into this package. docs/IMPORTS.md says why.
"""
