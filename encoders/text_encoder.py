"""umT5-xxl text encoder (transformers UMT5EncoderModel) + its tokenizer, as DreamZero runs it on each prompt.

Reference (docs/REFERENCE.md#4-prompts and #6-frozen-encoder-outputs): clean the text (ftfy, html.unescape twice,
whitespace collapse), tokenize with EOS, truncate to 512, run the encoder with the attention mask, cast to bf16, zero
every position past the prompt's own length. We store only the real rows (`[n_tokens, 4096]`); the trainer pads to 512.
Padding keys are masked, so encoding a batch padded to its longest prompt gives the same rows as padding to 512.
The reference's batch-minimum zeroing bug (fixed upstream by dreamzero0/dreamzero#71) is not reproduced: every
prompt keeps its own length.

Loads a Diffusers `text_encoder/` folder (or any transformers UMT5 folder) and Wan's
`models_t5_umt5-xxl-enc-bf16.pth` (keys renamed here); tokenizer from a `tokenizer/` (google/umt5-xxl) folder.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import cast

import ftfy
import torch

from wampipe.encoders.weights import (
    WeightsError,
    check_keys,
    expect_kind,
    folder_config,
    load_strict,
    on_meta,
    read_state_dict,
)

MAX_LENGTH = 512
# umt5-xxl, as built by Wan's T5 encoder (24 layers, d 4096, ffn 10240, 64 heads of 64, 32 buckets, vocab 256384)
UMT5_XXL = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    dropout_rate=0.1,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    tie_word_embeddings=False,
)
_WAN_TO_HF = [  # Wan T5 encoder name -> transformers UMT5EncoderModel name
    (r"^token_embedding\.weight$", "shared.weight"),
    (r"^norm\.weight$", "encoder.final_layer_norm.weight"),
    (r"^blocks\.(\d+)\.norm1\.weight$", r"encoder.block.\1.layer.0.layer_norm.weight"),
    (r"^blocks\.(\d+)\.attn\.([qkvo])\.weight$", r"encoder.block.\1.layer.0.SelfAttention.\2.weight"),
    (
        r"^blocks\.(\d+)\.pos_embedding\.embedding\.weight$",
        r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias.weight",
    ),
    (r"^blocks\.(\d+)\.norm2\.weight$", r"encoder.block.\1.layer.1.layer_norm.weight"),
    (r"^blocks\.(\d+)\.ffn\.gate\.0\.weight$", r"encoder.block.\1.layer.1.DenseReluDense.wi_0.weight"),  # GELU branch
    (r"^blocks\.(\d+)\.ffn\.fc1\.weight$", r"encoder.block.\1.layer.1.DenseReluDense.wi_1.weight"),
    (r"^blocks\.(\d+)\.ffn\.fc2\.weight$", r"encoder.block.\1.layer.1.DenseReluDense.wo.weight"),
]
TIED = {"encoder.embed_tokens.weight": "shared.weight"}


def clean_text(text: str) -> str:
    """ftfy fix, HTML-unescape twice, collapse whitespace, strip (the umT5 tokenizer wrapper's 'whitespace' clean)."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def hf_umt5_key(wan_key: str) -> str | None:
    for pattern, repl in _WAN_TO_HF:
        if re.match(pattern, wan_key):
            return re.sub(pattern, repl, wan_key)
    return None


def wan_umt5_key(hf_key: str) -> str | None:
    """Inverse of `hf_umt5_key` (the Wan name of a transformers key), used to write Wan-layout files."""
    for pattern, repl in _WAN_TO_HF:
        hf_pattern = "^" + re.escape(repl).replace(r"\\1", r"(\d+)").replace(r"\\2", r"([qkvo])") + "$"
        m = re.match(hf_pattern, hf_key)
        if m:
            wan = pattern.strip("^$")
            for group in m.groups():
                wan = re.sub(r"\(\\d\+\)|\(\[qkvo\]\)", group, wan, count=1)
            return wan.replace("\\.", ".")
    return None


def _config_from_wan_state(state: dict[str, torch.Tensor]):
    from transformers import UMT5Config

    vocab, d_model = state["token_embedding.weight"].shape
    heads = state["blocks.0.pos_embedding.embedding.weight"].shape[1]
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    return UMT5Config(
        **{
            **UMT5_XXL,
            "vocab_size": vocab,
            "d_model": d_model,
            "num_heads": heads,
            "d_kv": state["blocks.0.attn.q.weight"].shape[0] // heads,
            "d_ff": state["blocks.0.ffn.fc1.weight"].shape[0],
            "num_layers": layers,
            "relative_attention_num_buckets": state["blocks.0.pos_embedding.embedding.weight"].shape[0],
        }
    )


class TextEncoder:
    """Frozen umT5 encoder. `encode(prompts)` -> one bf16 `[n_tokens, d_model]` tensor per prompt."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.device = torch.device(device)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cleaned prompts -> `input_ids`, `attention_mask` [B, 512] exactly as the reference's collate builds them."""
        out = self.tokenizer(
            [clean_text(p) for p in prompts],
            padding="max_length",
            truncation=True,
            max_length=MAX_LENGTH,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return out["input_ids"], out["attention_mask"]

    @torch.no_grad()
    def encode(self, prompts: list[str], batch_size: int = 8) -> list[torch.Tensor]:
        ids, mask = self.tokenize(prompts)
        lengths = mask.sum(dim=1).tolist()
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), batch_size):
            n = max(lengths[i : i + batch_size])  # padding keys are masked: trimming the batch to its longest is exact
            hidden = self.model(
                input_ids=ids[i : i + batch_size, :n].to(self.device),
                attention_mask=mask[i : i + batch_size, :n].to(self.device),
            ).last_hidden_state
            hidden = hidden.to(torch.bfloat16).cpu()
            out.extend(hidden[j, : lengths[i + j]].clone() for j in range(hidden.shape[0]))
        return out


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir() or not any((path / f).exists() for f in ("tokenizer.json", "spiece.model")):
        raise WeightsError(
            path,
            "not a tokenizer folder (needs tokenizer.json or spiece.model; pass the "
            "tokenizer/ or google/umt5-xxl/ folder)",
        )
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise WeightsError(path, "tokenizer has no EOS or PAD token; not a umT5 tokenizer")
    return tok


def load_text_encoder(
    path: str | Path, tokenizer: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> TextEncoder:
    """Load a transformers/Diffusers `text_encoder/` folder or Wan's `models_t5_umt5-xxl-enc-bf16.pth`, strictly."""
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path)
    tok = load_tokenizer(tokenizer)
    if path.is_dir():
        config_dict = folder_config(path, "model_type", ("umt5",), "a text_encoder/ folder")
        state = read_state_dict(path)
        expect_kind(path, state, ("hf-umt5",), "text encoder")
        model = on_meta(lambda: UMT5EncoderModel(UMT5Config.from_dict(config_dict)))
        load_strict(model, path, state, aliases=TIED)
    else:
        state = read_state_dict(path)
        expect_kind(path, state, ("wan-umt5", "hf-umt5"), "text encoder")
        if "token_embedding.weight" not in state:
            raise WeightsError(path, "a transformers-layout umT5 file needs its config.json: pass the folder")
        model = on_meta(lambda: UMT5EncoderModel(_config_from_wan_state(state)))
        # Wan name -> transformers key: _WAN_TO_HF names every key of the model but the tied one
        table = cast(dict[str, str], {wan_umt5_key(k): k for k in model.state_dict() if k not in TIED})
        check_keys(path, state, {wk: model.state_dict()[hk].shape for wk, hk in table.items()})
        converted = {hk: state[wk] for wk, hk in table.items()}
        load_strict(model, path, converted, aliases=TIED)
    if model.config.vocab_size < len(tok):
        raise WeightsError(path, f"vocabulary of {model.config.vocab_size} is smaller than the tokenizer's {len(tok)}")
    return TextEncoder(model, tok, device, dtype)
