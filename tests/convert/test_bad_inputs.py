"""Bad checkpoints and arguments: each gives a clear error and writes nothing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from ktx import cli, convert
from ktx.training.checkpoints import CheckpointShapeError
from ktx.training.initial_params import load_initial_params
from tests.convert.conftest import checkpoint_fixture


def _copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(checkpoint_fixture(name), dst)
    for f in dst.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    dst.chmod(0o755)
    return dst


def _tensors(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _import_fails(source, tmp_path, error, match):
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        convert.import_checkpoint(source, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


def test_missing_directory(tmp_path):
    _import_fails(f"hf:{tmp_path / 'nope'}", tmp_path, FileNotFoundError, "does not exist")
    _import_fails(f"t5x:{tmp_path / 'nope'}", tmp_path, FileNotFoundError, "does not exist")


def test_not_a_source(tmp_path):
    _import_fails(str(tmp_path), tmp_path, ValueError, "accepted: 'hf:DIR'")


def test_unknown_feed_forward_proj(tmp_path):
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["feed_forward_proj"] = "gated-swiglu"
    (folder / "config.json").write_text(json.dumps(cfg))
    _import_fails(f"hf:{folder}", tmp_path, ValueError, r"feed_forward_proj='gated-swiglu'.*accepted")


def test_missing_tensor_is_named(tmp_path):
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    tensors = _tensors(folder)
    del tensors["decoder.block.1.layer.2.DenseReluDense.wi_1.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    _import_fails(f"hf:{folder}", tmp_path, ValueError,
                  r"tensor decoder\.block\.1\.layer\.2\.DenseReluDense\.wi_1\.weight is missing "
                  r"\(expected shape \[128, 64\]\)")


def test_missing_untied_head_is_named(tmp_path):
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    tensors = _tensors(folder)
    del tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    _import_fails(f"hf:{folder}", tmp_path, ValueError, r"tensor lm_head\.weight is missing")


def test_wrong_shape_is_named(tmp_path):
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    tensors = _tensors(folder)
    tensors["encoder.block.0.layer.0.SelfAttention.q.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    _import_fails(f"hf:{folder}", tmp_path, ValueError,
                  r"tensor encoder\.block\.0\.layer\.0\.SelfAttention\.q\.weight has shape "
                  r"\[32, 64\], expected \[64, 64\]")


def test_config_tensor_mismatch(tmp_path):
    """A config that says d_ff=256 names every MLP tensor with both shapes."""
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["d_ff"] = 256
    (folder / "config.json").write_text(json.dumps(cfg))
    _import_fails(f"hf:{folder}", tmp_path, ValueError,
                  r"d_ff=256.*\n.*DenseReluDense\.wi_0\.weight has shape \[128, 64\], expected \[256, 64\]")


def test_truncated_safetensors(tmp_path):
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    _import_fails(f"hf:{folder}", tmp_path, ValueError, r"model\.safetensors: truncated or malformed safetensors file")
    (folder / "model.safetensors").write_bytes(data[:4])
    _import_fails(f"hf:{folder}", tmp_path, ValueError, "truncated")


def test_pytorch_bin_only_is_refused_unread(tmp_path):
    """The .bin is never opened: its bytes here are not even a valid pickle."""
    folder = tmp_path / "pt"
    folder.mkdir()
    shutil.copy(checkpoint_fixture("hf_t5_v1_1_tiny") / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    _import_fails(f"hf:{folder}", tmp_path, ValueError,
                  r"only pytorch_model\.bin \(a pickle.*Convert it to safetensors")


def test_sharded_index(tmp_path):
    """model.safetensors.index.json shards read like one file; a missing shard is named."""
    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    tensors = _tensors(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = convert.read_hf_t5(folder)
    single = convert.read_hf_t5(checkpoint_fixture("hf_t5_v1_1_tiny"))
    for k, v in convert.flatten(single.params).items():
        np.testing.assert_array_equal(convert.flatten(sharded.params)[k], v)
    (folder / "model-00002-of-00002.safetensors").unlink()
    _import_fails(f"hf:{folder}", tmp_path, FileNotFoundError, r"shard model-00002-of-00002")


def test_t5x_checkpoint_of_another_architecture(tmp_path):
    from flax import serialization

    folder = tmp_path / "checkpoint_5"
    folder.mkdir()
    target = {"dense": {"kernel": np.zeros((4, 4), np.float32)},
              "token_embedder": {"embedding": np.zeros((8, 4), np.float32)}}
    (folder / "checkpoint").write_bytes(serialization.msgpack_serialize(
        {"version": 3, "optimizer": {"target": target, "state": {"step": np.int32(5)}}}))
    _import_fails(f"t5x:{folder}", tmp_path, ValueError,
                  r"not a T5 encoder-decoder.*encoder/relpos_bias/rel_embedding.*dense/kernel")
    (folder / "checkpoint").write_bytes(b"\x00garbage")
    _import_fails(f"t5x:{tmp_path}", tmp_path, ValueError, "not a T5X msgpack checkpoint|no optimizer/target")


def test_output_exists_is_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="already exists"):
        convert.import_checkpoint(f"hf:{checkpoint_fixture('hf_t5_v1_1_tiny')}", out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_export_of_conditioning_parameters_names_them(tmp_path):
    imported = convert.read_hf_t5(checkpoint_fixture("hf_t5_v1_1_tiny"))
    params = dict(imported.params, conditioning={"prompts": {"embedding": np.zeros((2, 3), np.float32)}})
    with pytest.raises(ValueError, match=r"1 parameters have no Hugging Face T5 counterpart: "
                                         r"conditioning/prompts/embedding"):
        convert.write_hf_t5(params, imported.config, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_initial_checkpoint_source_that_does_not_fit_the_model(tmp_path):
    """An hf: source whose shapes differ from the model's, or a model parameter outside
    the conditioning scope that the source lacks: CheckpointShapeError naming them."""
    import jax

    imported = convert.read_hf_t5(checkpoint_fixture("hf_t5_v1_0_tiny"))  # tied: no logits_dense
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), imported.params)
    abstract["decoder"]["logits_dense"] = {"kernel": jax.ShapeDtypeStruct((64, 512), np.float32)}
    abstract["token_embedder"]["embedding"] = jax.ShapeDtypeStruct((384, 64), np.float32)
    init = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
    with pytest.raises(CheckpointShapeError) as e:
        load_initial_params(f"hf:{checkpoint_fixture('hf_t5_v1_0_tiny')}", abstract, init)
    assert "token_embedder/embedding: checkpoint (512, 64), model (384, 64)" in str(e.value)
    assert "decoder/logits_dense/kernel: model (64, 512), missing in checkpoint" in str(e.value)


def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["import", "hf:missing_dir", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing_dir" in err[0] and "does not exist" in err[0]
    assert not (tmp_path / "out").exists()
    assert cli.main(["import", "hf:a"]) == 2
    assert "usage: ktx import" in capsys.readouterr().err
    assert cli.main(["export", "nowhere", "hf:x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["export", "nowhere", "t5x:x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["export", "nowhere", "onnx:x"]) == 2
    assert "accepted: 'hf:DIR'" in capsys.readouterr().err


def test_absolute_path_keeps_source_prefixes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.absolute_path("hf:ckpt") == f"hf:{tmp_path / 'ckpt'}"
    assert cli.absolute_path("t5x:a/checkpoint_1") == f"t5x:{tmp_path / 'a' / 'checkpoint_1'}"


def test_bfloat16_safetensors(tmp_path):
    """A bfloat16 file (written here byte by byte from the format's description) imports
    as the float32 values of its bfloat16 tensors."""
    import struct

    import ml_dtypes

    folder = _copy("hf_t5_v1_1_tiny", tmp_path)
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(folder).items()}
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        data = value.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    imported = convert.read_hf_t5(folder)
    assert imported.params["token_embedder"]["embedding"].dtype == np.float32
    np.testing.assert_array_equal(imported.params["token_embedder"]["embedding"],
                                  tensors["shared.weight"].astype(np.float32))
    np.testing.assert_array_equal(imported.params["decoder"]["logits_dense"]["kernel"],
                                  tensors["lm_head.weight"].astype(np.float32).T)
