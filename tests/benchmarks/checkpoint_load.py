"""Time and peak host memory of starting a run from a T5.1.1-Large-shaped checkpoint.

Makes a random T5.1.1-Large checkpoint (783M parameters, 3.1 GB in float32) in the
Hugging Face layout (sharded safetensors + index, as the hub ships large models) and in
T5X's layout (`ktx.convert.t5x.write_t5x`), then, each in a fresh process with 8 CPU
devices as a 2x4 (data x model) mesh, starts a train state from it the way `ktx train`
does with `INITIAL_CHECKPOINT_PATH` (`ktx.runs.train._restore_or_init`: parameters placed
with the mesh's shardings, Adafactor state initialized):

* `hf`, `t5x`: the source read shard by shard (`ktx.convert.lazy`);
* `ktx`: the same parameters after `ktx import` (orbax, restored into the shardings);
* `eager`: the whole source converted in host memory first, then placed (what ktx did
  before the lazy readers), for comparison;
* `import`: `ktx import hf:... OUT` itself.

For each: wall time; the process's peak anonymous memory (RssAnon, sampled every 10 ms)
and peak mapped file pages (RssFile: the memory-mapped safetensors files' page cache,
which the kernel can drop); anonymous memory before loading; and the distinct host
buffers of the placed train state (on CPU, device memory *is* host memory).
`overhead` = peak anonymous - before - placed: memory the load needed beyond the state.

Last line: one JSON object.

    .venv/bin/python tests/benchmarks/checkpoint_load.py [--dir /tmp/ktx_large] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

GiB = 1024**3
MODES = ("hf", "t5x", "eager", "import", "ktx")


def _large_config():
    from ktx.models.t5 import T5Config

    return T5Config(vocab_size=32128, emb_dim=1024, num_heads=16, num_encoder_layers=24,
                    num_decoder_layers=24, head_dim=64, mlp_dim=2816,
                    mlp_activations=("gelu", "linear"), logits_via_embedding=False)


def make(folder: pathlib.Path) -> dict:
    """Writes `folder/hf` (sharded safetensors, ~1 GB shards) and `folder/t5x`."""
    import numpy as np

    from ktx.convert import hf_t5, layout, t5x
    from ktx.convert.safetensors_io import write_safetensors

    config = _large_config()
    rng = np.random.default_rng(0)
    shapes = layout.expected_shapes(config)
    params = {p: (rng.standard_normal(s, dtype=np.float32) * 0.05).astype(np.float32)
              for p, s in shapes.items()}
    n = sum(a.size for a in params.values())
    hf_dir = folder / "hf"
    hf_dir.mkdir(parents=True)
    (hf_dir / "config.json").write_text(json.dumps(hf_t5.hf_config(config), indent=2))
    tensors = {name: hf_t5._to_hf(params[p], kind) for name, (p, kind) in hf_t5._mapping(config).items()}
    shards, current, size = [], {}, 0
    for name, a in tensors.items():
        if size + a.nbytes > GiB and current:
            shards.append(current)
            current, size = {}, 0
        current[name] = a
        size += a.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(hf_dir / file, shard, {"format": "pt"})
        weight_map.update({name: file for name in shard})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}))
    del tensors
    t5x.write_t5x(layout.unflatten(params), config, folder / "t5x")
    return {"parameters": int(n), "float32_bytes": int(4 * n)}


def _memory() -> dict[str, int]:
    """RSS of this process by kind (bytes): anonymous memory and mapped file pages."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class _PeakSampler:
    """Samples `_memory()` every 10 ms in a thread; keeps each kind's maximum."""

    def __init__(self):
        import threading

        self.peak = _memory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.01):
            for k, v in _memory().items():
                self.peak[k] = max(self.peak.get(k, 0), v)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def measure(mode: str, folder: pathlib.Path) -> dict:
    """One measurement (run in its own process)."""
    import jax
    import numpy as np
    import optax

    from ktx import convert, partitioning
    from ktx.models.seq2seq import EncoderDecoderModel
    from ktx.runs.run_dir import RunDir
    from ktx.runs.train import _restore_or_init
    from ktx.training.checkpoints import CheckpointManager
    from ktx.training.trainer import Trainer, TrainState
    from ktx.treepath import name as param_path

    mesh = partitioning.create_mesh(4)  # 8 devices: 2 (data) x 4 (model)
    config = _large_config()
    trainer = Trainer(EncoderDecoderModel(config=config, num_tasks=1), optax.adafactor(1e-3), mesh=mesh)
    batch = {"encoder_input_tokens": np.zeros((8, 32), np.int32),
             "decoder_input_tokens": np.zeros((8, 8), np.int32),
             "decoder_target_tokens": np.zeros((8, 8), np.int32),
             "decoder_loss_weights": np.zeros((8, 8), np.float32),
             "task_id": np.zeros((8,), np.int32)}
    abstract, _ = trainer.create_abstract_state(batch)
    source = {"hf": f"hf:{folder / 'hf'}", "t5x": f"t5x:{folder / 't5x'}", "eager": None,
              "ktx": str(folder / "ktx"), "import": None}[mode]
    if mode == "import":
        shutil.rmtree(folder / "ktx", ignore_errors=True)
    before = _memory()
    sampler = _PeakSampler()
    start = time.perf_counter()
    if mode == "import":
        convert.import_checkpoint(f"hf:{folder / 'hf'}", folder / "ktx")
        state = None
    elif mode == "eager":  # the whole conversion in host memory, then device_put
        imported = convert.load_source(f"hf:{folder / 'hf'}")
        flat = convert.flatten(imported.params)
        params = jax.tree_util.tree_map_with_path(
            lambda p, a: jax.device_put(np.asarray(flat[param_path(p)], a.dtype), a.sharding),
            abstract.params)
        del imported, flat
        opt_state = jax.jit(trainer.init_opt_state, out_shardings=trainer.state_shardings.opt_state)(params)
        state = TrainState(step=np.int32(0), params=params, opt_state=opt_state)
    else:
        with tempfile.TemporaryDirectory() as run_dir:
            run = RunDir(run_dir)
            state, _ = _restore_or_init(trainer, run, batch, 0, source,
                                        CheckpointManager(run_dir, save_period=1))
    if state is not None:
        jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    buffers = {}  # device buffers by address: replicas that alias one host buffer count once
    if state is not None:
        for leaf in jax.tree.leaves(state):
            if isinstance(leaf, jax.Array):
                for shard in leaf.addressable_shards:
                    buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    placed = sum(buffers.values())
    return {"mode": mode, "seconds": round(seconds, 1),
            "peak_anon_gib": round(peak["RssAnon"] / GiB, 2),
            "peak_file_gib": round(peak["RssFile"] / GiB, 2),
            "anon_before_gib": round(before["RssAnon"] / GiB, 2),
            "placed_gib": round(placed / GiB, 2),
            "overhead_gib": round((peak["RssAnon"] - before["RssAnon"] - placed) / GiB, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="ktx_large_")).absolute()
    if args._measure:
        print(json.dumps(measure(args._measure, folder)), flush=True)
        return 0
    results = {"model": "T5.1.1-Large shapes, random weights", "mesh": "2x4 (data x model), 8 CPU devices"}
    made = folder / "hf" / "model.safetensors.index.json"
    if not made.is_file():
        start = time.perf_counter()
        results["checkpoint"] = make(folder)
        results["checkpoint"]["make_seconds"] = round(time.perf_counter() - start, 1)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    runs = []
    for mode in args.modes.split(","):
        if mode == "ktx" and not (folder / "ktx").is_dir():
            continue
        out = subprocess.run([sys.executable, __file__, "--dir", str(folder), "--_measure", mode],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{mode}: failed\n{out.stderr[-3000:]}")
        line = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(line), flush=True)
        runs.append(line)
    results["runs"] = runs
    if not args.keep and args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
