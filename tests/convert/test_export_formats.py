"""`ktx export` to T5X and to Hugging Face BERT: compared with what T5X and transformers
wrote themselves (the shared fixtures), read back bit-identically."""

from __future__ import annotations

import numpy as np
import pytest
from flax import serialization
from safetensors import safe_open

from ktx import cli, convert
from ktx.convert import hf_bert, t5x
from tests.convert.conftest import checkpoint_fixture, load_expected, load_inputs


def _msgpack(step_dir):
    return serialization.msgpack_restore((step_dir / "checkpoint").read_bytes())


def _assert_same_layout(ours, theirs, where=""):
    """Same tree; inline arrays equal (dtype, shape, values); TensorStore specs equal but
    for the chunking of arrays over 64 MiB (none here)."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), where
        for k in theirs:
            _assert_same_layout(ours[k], theirs[k], f"{where}/{k}")
    else:
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        np.testing.assert_array_equal(ours, theirs, err_msg=where)


def test_t5x_export_matches_what_t5x_wrote(tmp_path):
    """The fixture's checkpoint_0 is T5X's own (Adafactor, min_dim_size_to_factor=32, step
    0): the export of its parameters with the same factoring is the same checkpoint."""
    fixture = checkpoint_fixture("t5x_t5_1_1_tiny") / "checkpoint_0"
    imported = convert.read_t5x(fixture)
    step_dir = t5x.write_t5x(imported.params, imported.config, tmp_path / "t5x",
                             min_dim_size_to_factor=32)
    assert step_dir == tmp_path / "t5x" / "checkpoint_0"
    _assert_same_layout(_msgpack(step_dir), _msgpack(fixture))
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(p.name for p in fixture.iterdir())
    for folder in fixture.iterdir():
        if folder.is_dir():
            assert (folder / ".zarray").read_text() == (step_dir / folder.name / ".zarray").read_text()
    again = convert.read_t5x(step_dir)
    for k, v in convert.flatten(imported.params).items():
        np.testing.assert_array_equal(convert.flatten(again.params)[k], v, err_msg=k)


def test_ktx_export_t5x_roundtrip_and_default_factoring(tmp_path):
    src = checkpoint_fixture("t5x_t5_1_1_tiny") / "checkpoint_1"
    ktx_dir = convert.import_checkpoint(f"t5x:{src}", tmp_path / "ktx")
    assert cli.main(["export", str(ktx_dir), f"t5x:{tmp_path / 'out'}"]) == 0
    step_dir = tmp_path / "out" / "checkpoint_0"
    state = _msgpack(step_dir)["optimizer"]["state"]
    # At d_model 64 T5X's default min_dim_size_to_factor=128 factors nothing: full v.
    v = state["param_states"]["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]["v"]
    assert v["metadata"]["shape"] == [64, 128]
    a, b = convert.read_t5x(src), convert.read_t5x(step_dir)
    fa, fb = convert.flatten(a.params), convert.flatten(b.params)
    assert fa.keys() == fb.keys() and a.config == b.config
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_t5x_chunking_follows_t5x():
    # 64 MiB of float32 = 16M elements; the largest axis steps down its divisors first.
    assert t5x._chunk_shape((32128, 4096), 16 * 1024 * 1024) == [4016, 4096]
    assert t5x._chunk_shape((4096, 10240), 16 * 1024 * 1024) == [4096, 2560]
    assert t5x._chunk_shape((64,), 16) == [16]
    assert t5x._factored_dims((512, 64), 32) == (1, 0)
    assert t5x._factored_dims((64, 16), 32) is None


def _tensors(path):
    with safe_open(str(path), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_bert_export_is_what_transformers_wrote(tmp_path):
    folder = checkpoint_fixture("hf_bert_tiny")
    ktx_dir = convert.import_checkpoint(f"hf:{folder}", tmp_path / "ktx")
    assert cli.main(["export", str(ktx_dir), f"hf:{tmp_path / 'hf'}"]) == 0
    ours, theirs = _tensors(tmp_path / "hf" / "model.safetensors"), _tensors(folder / "model.safetensors")
    # transformers stores the tied decoder bias once more; the position_ids buffer is not a weight.
    theirs.pop("bert.embeddings.position_ids", None)
    assert sorted(ours) == sorted(k for k in theirs if k != "cls.predictions.decoder.bias")
    for k, v in ours.items():
        np.testing.assert_array_equal(v, theirs[k], err_msg=k)
    back = hf_bert.read_hf_bert(tmp_path / "hf")
    first = hf_bert.read_hf_bert(folder)
    assert back.config == first.config
    for k, v in convert.flatten(first.params).items():
        np.testing.assert_array_equal(convert.flatten(back.params)[k], v, err_msg=k)


def test_bert_export_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed (not a ktx[test] dependency)")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    folder = checkpoint_fixture("hf_bert_tiny")
    hf_bert.write_hf_bert(hf_bert.read_hf_bert(folder).params, hf_bert.read_hf_bert(folder).config,
                          tmp_path / "hf")
    model = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    inputs = {k: torch.tensor(v, dtype=torch.long) for k, v in load_inputs(folder).items()}
    with torch.no_grad():
        logits = model(**inputs).logits.numpy()
    expected = load_expected(folder)["mlm_logits"]
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)


def test_export_names_what_has_no_counterpart(tmp_path, capsys):
    """A BERT classifier's task heads: refused by name, or left out (and named) with
    --backbone_only; a T5 with conditioning parameters likewise for t5x:."""
    from ktx.training.checkpoints import CheckpointManager
    from ktx.training.trainer import TrainState

    imported = hf_bert.read_hf_bert(checkpoint_fixture("hf_bert_tiny"))
    flat = convert.flatten(imported.params)
    flat["task_heads/task_0/kernel"] = np.ones((64, 2), np.float32)
    manager = CheckpointManager(tmp_path / "run", save_period=1)
    manager.save(TrainState(step=np.int32(7), params=convert.unflatten(flat), opt_state=()),
                 force=True, meta={"bert_config": hf_bert.config_to_dict(imported.config)})
    manager.close()
    with pytest.raises(ValueError, match=r"1 parameters .* no Hugging Face BERT counterpart: task_heads/task_0/kernel"):
        convert.export_checkpoint(tmp_path / "run", f"hf:{tmp_path / 'a'}")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="exports to 'hf:DIR' only"):
        convert.export_checkpoint(tmp_path / "run", f"t5x:{tmp_path / 'b'}")
    assert cli.main(["export", str(tmp_path / "run"), f"hf:{tmp_path / 'c'}", "--backbone_only"]) == 0
    assert "left out (no Hugging Face BERT counterpart): task_heads/task_0/kernel" in capsys.readouterr().out
    assert "task_heads" not in str(sorted(_tensors(tmp_path / "c" / "model.safetensors")))

    t5 = convert.read_hf_t5(checkpoint_fixture("hf_t5_v1_1_tiny"))
    params = dict(t5.params, conditioning={"prompts": {"embedding": np.zeros((2, 3), np.float32)}})
    with pytest.raises(ValueError, match="1 parameters have no place in T5X's T5: conditioning/prompts"):
        t5x.write_t5x(params, t5.config, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_export_of_a_scanned_checkpoint_is_the_unrolled_export(tmp_path):
    """A run with scanned layers exports the same Hugging Face and T5X checkpoints as its
    unrolled twin (the formats hold one tensor per layer)."""
    import dataclasses

    from ktx.models import scan_layout
    from ktx.training.checkpoints import CheckpointManager
    from ktx.training.trainer import TrainState

    imported = convert.read_hf_t5(checkpoint_fixture("hf_t5_v1_1_tiny"))
    stacked = scan_layout.convert_layout(imported.params, scanned=True)
    manager = CheckpointManager(tmp_path / "run", save_period=1)
    manager.save(TrainState(step=np.int32(3), params=stacked, opt_state=()), force=True)
    manager.close()
    config = dataclasses.replace(imported.config, scan_layers=True)
    convert.export_checkpoint(tmp_path / "run", f"hf:{tmp_path / 'hf'}", config=config)
    convert.write_hf_t5(imported.params, imported.config, tmp_path / "hf_unrolled")
    ours, theirs = _tensors(tmp_path / "hf" / "model.safetensors"), _tensors(tmp_path / "hf_unrolled" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    step_dir = convert.export_checkpoint(tmp_path / "run", f"t5x:{tmp_path / 't5x'}", config=config)
    back = convert.flatten(convert.read_t5x(step_dir).params)
    for k, v in convert.flatten(imported.params).items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
