"""Development fixtures, importable from a checkout and used by tests/ and scripts/, never by the product (not part
of the wheel): sample LeRobot datasets, tiny encoder checkpoints and DiT bases in the official formats, synthetic
shards of a recipe's sample shapes, and the trainer benchmark harness.
"""
