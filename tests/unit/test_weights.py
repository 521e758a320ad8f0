from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wampipe.encoders.weights import (
    WeightsError,
    assign_loaded,
    check_keys,
    expect_kind,
    on_meta,
    read_state_dict,
    recognize,
)


def test_read_formats(tmp_path, tiny_checkpoints):
    state = {"a.weight": torch.ones(2, 3), "b": torch.zeros(4)}
    torch.save({"state_dict": state}, tmp_path / "x.pth")
    save_file(state, str(tmp_path / "x.safetensors"))
    for f in ("x.pth", "x.safetensors"):
        got = read_state_dict(tmp_path / f)
        assert set(got) == set(state) and torch.equal(got["a.weight"], state["a.weight"])
    sharded = read_state_dict(tiny_checkpoints / "umt5" / "text_encoder")  # via model.safetensors.index.json
    assert "encoder.final_layer_norm.weight" in sharded and "shared.weight" in sharded


def test_recognize_every_tiny_file(tiny_checkpoints):
    kinds = {
        "wan2.1/Wan2.1_VAE.pth": "wan2.1-vae",
        "wan2.2/Wan2.2_VAE.pth": "wan2.2-vae",
        "wan2.1/vae": "diffusers-vae",
        "wan2.2/vae": "diffusers-vae",
        "umt5/models_t5_umt5-xxl-enc-bf16.pth": "wan-umt5",
        "umt5/text_encoder": "hf-umt5",
        "clip/models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth": "wan-clip",
        "clip/image_encoder": "hf-clip-vision",
    }
    for rel, kind in kinds.items():
        assert recognize(read_state_dict(tiny_checkpoints / rel)) == kind, rel


def test_check_keys_message():
    state = {"a": torch.zeros(2), "b": torch.zeros(3), "extra": torch.zeros(1)}
    expected = {"a": torch.Size([2]), "b": torch.Size([4]), "c": torch.Size([1])}
    with pytest.raises(WeightsError) as err:
        check_keys("/w/model.pth", state, expected)
    assert str(err.value) == "/w/model.pth: missing keys: c; unexpected keys: extra; wrong shapes: b (3,) != (4,)"
    check_keys("/w/model.pth", {"a": torch.zeros(2)}, {"a": torch.Size([2]), "t": torch.Size([1])}, {"t"})


def test_wrong_kind_and_bad_files(tmp_path, tiny_checkpoints):
    state = read_state_dict(tiny_checkpoints / "wan2.1" / "Wan2.1_VAE.pth")
    with pytest.raises(WeightsError, match="this file is a Wan2.1 VAE .* but the text encoder needs a umT5"):
        expect_kind("f.pth", state, ("wan-umt5",), "text encoder")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="junk.pth: cannot read weights"):
        read_state_dict(tmp_path / "junk.pth")
    with pytest.raises(WeightsError, match="file does not exist"):
        read_state_dict(tmp_path / "missing.safetensors")
    torch.save({"a": 1}, tmp_path / "notstate.pth")
    with pytest.raises(WeightsError, match="not a state dict"):
        read_state_dict(Path(tmp_path / "notstate.pth"))


def test_weights_sha256_of_files_and_folders(tmp_path, tiny_checkpoints):
    """What inputs.json records per encoder: a file's sha256; a folder's sha256 over (relative name, file sha256)
    pairs in name order. Hashing several paths in one pool gives each path's own hash."""
    import hashlib

    from wampipe.encoders.weights import weights_sha256

    folder = tmp_path / "enc"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.bin").write_bytes(b"bb" * 1000)
    (folder / "sub" / "a.json").write_text("{}")
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in [("b.bin", b"bb" * 1000), ("sub/a.json", b"{}")]}
    want = hashlib.sha256(f"b.bin\0{sha['b.bin']}\0sub/a.json\0{sha['sub/a.json']}\0".encode()).hexdigest()
    assert weights_sha256(folder) == [want]
    assert weights_sha256(folder / "b.bin") == [sha["b.bin"]]
    paths = sorted(tiny_checkpoints.glob("*/*"))
    assert weights_sha256(*paths, folder, threads=3) == [weights_sha256(p)[0] for p in paths] + [want]


def test_a_module_built_on_meta_takes_the_files_tensors_and_names_what_the_file_left_empty(tmp_path):
    """Encoders are built on the meta device (no random init the file would overwrite) and take the file's tensors
    as they are; a tensor the file cannot fill (a buffer the module computes itself) is an error, not a silent hole."""
    state = {"weight": torch.randn(3, 2), "bias": torch.randn(3)}
    before = torch.random.get_rng_state()
    linear = on_meta(lambda: torch.nn.Linear(2, 3))
    assert torch.equal(torch.random.get_rng_state(), before)  # nothing drawn
    assign_loaded(linear, tmp_path / "w.safetensors", state)
    assert linear.weight.data_ptr() == state["weight"].data_ptr() and not linear.weight.is_meta  # taken, not copied

    class WithTable(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 3)
            self.register_buffer("table", torch.arange(4), persistent=False)

    with pytest.raises(WeightsError, match=r"w.safetensors: not filled from the file: table"):
        assign_loaded(on_meta(WithTable), tmp_path / "w.safetensors", state)
