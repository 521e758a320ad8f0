"""The frozen encoders, shared by the preprocessor (which runs them on every sample) and the trainer (which runs CLIP
itself when shards hold its input pixels). Imports neither half.

vae            Wan2.1 / Wan2.2 VAE (diffusers AutoencoderKLWan)
text_encoder   umT5-xxl encoder and its tokenizer (transformers), the tokenizer's text cleaning
image_encoder  CLIP ViT-H/14 vision tower (transformers)
weights        strict loading of every weight format, and the sha256 a build records per weight file or folder
"""
