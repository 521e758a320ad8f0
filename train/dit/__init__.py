"""The DiT and its official formats: the causal Wan transformer with its action and state heads (model.py,
attention.py), the flow-matching loss (loss.py), LoRA (lora.py), the umT5 rows it reads (text.py), its FLOPs
(flops.py), the official weight files it loads (weights.py) and the folder it exports (export.py). Nothing here
knows about the training loop: of the trainer it imports only its options (train/config.py)."""
