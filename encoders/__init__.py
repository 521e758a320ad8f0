"""The frozen encoders and their strict weight loading, shared by the preprocessor (which runs them on every sample)
and the trainer (which runs CLIP itself when shards hold its input pixels). Imports neither half.

vae            Wan2.1 / Wan2.2 VAE (diffusers AutoencoderKLWan)     weights   strict loading, weight-file sha256
text_encoder   umT5-xxl encoder + tokenizer (transformers)           image_encoder   CLIP ViT-H/14 vision tower
"""
