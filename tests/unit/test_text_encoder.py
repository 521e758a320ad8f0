import pytest
import torch

from wampipe.encoders.text_encoder import MAX_LENGTH, clean_text, load_text_encoder
from wampipe.encoders.weights import WeightsError, read_state_dict

PROMPTS = [
    "Pick up the red cup and put it in the sink.",
    "put the bowl on the stove",
    "A multi-view video shows that a robot open the drawer The robot open the drawer",
    "put the bowl on the stove",
]


def encoders(tiny_checkpoints):
    tok = tiny_checkpoints / "umt5" / "tokenizer"
    return (
        load_text_encoder(tiny_checkpoints / "umt5" / "models_t5_umt5-xxl-enc-bf16.pth", tok),
        load_text_encoder(tiny_checkpoints / "umt5" / "text_encoder", tok),
    )


def test_clean_text():
    assert clean_text("  put&amp;amp;the\n\tcup   down ") == "put&the cup down"
    assert clean_text("caf\u00c3\u00a9 table") == "café table"  # ftfy repairs mojibake
    assert clean_text("a&lt;b") == "a<b"


def test_tokenize_like_reference(tiny_checkpoints):
    enc, _ = encoders(tiny_checkpoints)
    ids, mask = enc.tokenize(PROMPTS[:2])
    assert ids.shape == mask.shape == (2, MAX_LENGTH)
    for row, m in zip(ids, mask):
        n = int(m.sum())
        assert row[n - 1] == enc.tokenizer.eos_token_id == 1 and torch.all(row[n:] == 0) and torch.all(m[:n] == 1)
    long_ids, long_mask = enc.tokenize(["cup " * 1000])
    assert long_mask.sum() == MAX_LENGTH and long_ids[0, -1] == 1  # truncated, EOS kept


def test_formats_shapes_and_batch_invariance(tiny_checkpoints):
    wan, folder = encoders(tiny_checkpoints)
    out = wan.encode(PROMPTS, batch_size=4)
    _, mask = wan.tokenize(PROMPTS)
    for emb, m in zip(out, mask):
        assert emb.shape == (int(m.sum()), 32) and emb.dtype == torch.bfloat16
    for a, b in zip(out, folder.encode(PROMPTS, batch_size=4)):
        assert torch.equal(a, b)
    # one by one, no padding at all. The bf16 outputs reach |3|, where one bf16 step is 0.016, and batched and
    # unbatched CPU matmuls round differently (2-3 steps seen); a padding leak would move values by O(1).
    for a, b in zip(out, wan.encode(PROMPTS, batch_size=1)):
        torch.testing.assert_close(a.float(), b.float(), atol=0.06, rtol=0.02)
    assert all(torch.equal(a, b) for a, b in zip(out, wan.encode(PROMPTS, batch_size=4)))  # deterministic


def test_strict_errors(tiny_checkpoints, tmp_path):
    tok = tiny_checkpoints / "umt5" / "tokenizer"
    state = read_state_dict(tiny_checkpoints / "umt5" / "models_t5_umt5-xxl-enc-bf16.pth")
    del state["blocks.1.ffn.fc2.weight"]
    torch.save(state, tmp_path / "t5.pth")
    with pytest.raises(WeightsError) as err:
        load_text_encoder(tmp_path / "t5.pth", tok)
    assert str(err.value) == f"{tmp_path / 't5.pth'}: missing keys: blocks.1.ffn.fc2.weight"
    with pytest.raises(
        WeightsError, match="this file is a open-clip xlm-roberta ViT-H/14, Wan layout, but the text encoder"
    ):
        load_text_encoder(tiny_checkpoints / "clip" / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth", tok)
    with pytest.raises(WeightsError, match="not a tokenizer folder"):
        load_text_encoder(tiny_checkpoints / "umt5" / "text_encoder", tmp_path)
