"""SeqIO's offline cache of registered tasks, written by SeqIO's own Apache Beam transforms,
and the check a training input makes before it reads a cached task.

`cache_tasks` wires `seqio.beam_utils` (`PreprocessTask`, `WriteExampleTfRecord`,
`GetInfo`, `GetStats`, `WriteJson`) as `seqio/scripts/cache_tasks_main.py` does: each split
of a task is preprocessed up to the task's `seqio.CacheDatasetPlaceholder`, globally
shuffled (`beam.Reshuffle`), and written to SeqIO's layout

    <cache_dir>/<task>/<split>.tfrecord-NNNNN-of-MMMMM, info.<split>.json, stats.<split>.json
    <cache_dir>/<task>/COMPLETED                   (once every split of the task is written)

which `task.get_dataset(..., use_cached=True)` reads once `cache_dir` is one of SeqIO's
global cache directories (`require_cached` adds it). Unlike SeqIO's script, the splits are
chosen by the caller, and a task that cannot be cached (no placeholder, no such split, no
data file) or that is already cached raises before anything runs: nothing is skipped.

The pipeline runs on any Beam runner (`pipeline_options`, e.g. `--runner=DataflowRunner
--project=... --region=... --temp_location=gs://...`; docs/data.md); each worker sets the
data folder and bad-row policy of the submitting process before it reads a shard. Apache
Beam is the optional `ktx[cache]` dependency, imported only by `cache_tasks`.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Mapping, Sequence

import seqio
import tensorflow as tf

from ktx.data import files

__all__ = [
    "DEFAULT_SPLITS",
    "DEFAULT_MIN_SHARDS",
    "task_cache_dir",
    "cached_splits",
    "expand_task_names",
    "check_cacheable",
    "cache_tasks",
    "cache_stats",
    "require_cached",
]

DEFAULT_SPLITS = ("train", "validation")
DEFAULT_MIN_SHARDS = 64  # SeqIO's cache_tasks_main default (--min_shards)
_COMPLETED = "COMPLETED"


def task_cache_dir(cache_dir: str | os.PathLike, task_name: str) -> str:
    """`<cache_dir>/<task>`: where SeqIO keeps one task's cache."""
    return os.path.join(os.fspath(cache_dir), seqio.get_task_dir_from_name(task_name))


def cached_splits(cache_dir: str | os.PathLike, task_name: str) -> tuple[str, ...] | None:
    """The splits of a completed cache of `task_name` under `cache_dir` (those with an
    `info.<split>.json`); None when the task has no COMPLETED cache there."""
    folder = task_cache_dir(cache_dir, task_name)
    if not tf.io.gfile.exists(os.path.join(folder, _COMPLETED)):
        return None
    names = tf.io.gfile.listdir(folder)
    return tuple(sorted(n[len("info."):-len(".json")] for n in names
                        if n.startswith("info.") and n.endswith(".json")))


def _provider(name: str) -> seqio.Task | seqio.Mixture:
    try:
        return seqio.get_mixture_or_task(name)
    except ValueError as e:
        known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        raise ValueError(
            f"task {name!r} is not a registered SeqIO task or mixture"
            + (f"; close names: {', '.join(close)}" if close else "")
            + " (register it in a module the gin file imports: docs/adding_a_task.md)") from e


def expand_task_names(names: Sequence[str]) -> tuple[str, ...]:
    """Task names, each mixture replaced by its tasks (sub-mixtures flattened), first
    occurrence kept."""
    out: list[str] = []
    for name in names:
        provider = _provider(name)
        if isinstance(provider, seqio.Mixture):
            subs = expand_task_names([t.name for t in provider.tasks])
        else:
            subs = (provider.name,)
        out.extend(s for s in subs if s not in out)
    return tuple(out)


def check_cacheable(
    task_names: Sequence[str],
    cache_dir: str | os.PathLike,
    splits: Sequence[str] = DEFAULT_SPLITS,
    *,
    overwrite: bool = False,
) -> tuple[str, ...]:
    """The tasks (mixtures expanded) that `cache_tasks` would cache, after checking each
    one: it has a `seqio.CacheDatasetPlaceholder`, every split in `splits` and that split's
    data files, and no cache (complete or interrupted) under `cache_dir` unless `overwrite`.

    Raises:
      ValueError: naming the task, the split or the folder, and what to do.
    """
    if isinstance(splits, str) or not splits or not all(isinstance(s, str) and s for s in splits):
        raise ValueError(f"splits={splits!r}; accepted: a non-empty list of split names")
    if len(set(splits)) != len(splits):
        raise ValueError(f"splits={list(splits)} names a split twice")
    names = expand_task_names(task_names)
    if not names:
        raise ValueError("no task to cache: name at least one task or mixture")
    for name in names:
        task = seqio.get_mixture_or_task(name)
        if not task.supports_caching:
            raise ValueError(
                f"task {name!r} cannot be cached: its preprocessors have no "
                "seqio.CacheDatasetPlaceholder() (SeqIO caches the output of the steps before it; "
                "docs/data.md)")
        for split in splits:
            if split not in task.splits:
                raise ValueError(f"task {name!r} has no split {split!r}; splits: {tuple(task.splits)} "
                                 "(choose them with --splits)")
            try:
                shards = task.source.list_shards(split)
            except (OSError, ValueError) as e:
                raise ValueError(f"task {name!r} split {split!r} cannot be read: {e}") from e
            if not shards:
                raise ValueError(f"task {name!r} split {split!r} has no input shards")
        folder = task_cache_dir(cache_dir, name)
        if overwrite or not tf.io.gfile.exists(folder):
            continue
        done = cached_splits(cache_dir, name)
        if done is not None:
            raise ValueError(f"task {name!r} is already cached in {folder} (splits {list(done)}); "
                             "pass --overwrite to rebuild it")
        raise ValueError(f"{folder} exists without a {_COMPLETED} file (an interrupted ktx cache?); "
                         "pass --overwrite to remove and rebuild it")
    return names


def _worker_setup(data_dir: str | None, on_bad_row: str) -> None:
    """Run by each Beam worker before it reads a shard: the submitting process's data folder
    and bad-row policy (DirectRunner workers share the process; remote ones do not)."""
    files.set_data_dir(data_dir)
    files.set_on_bad_row(on_bad_row)


def cache_tasks(
    task_names: Sequence[str],
    cache_dir: str | os.PathLike,
    splits: Sequence[str] = DEFAULT_SPLITS,
    pipeline_options: Sequence[str] = ("--runner=DirectRunner",),
    *,
    overwrite: bool = False,
    min_shards: int = DEFAULT_MIN_SHARDS,
    modules_to_import: Sequence[str] = ("ktx.tasks",),
) -> dict[str, str]:
    """Caches `splits` of each task (mixtures expanded) under `cache_dir` with one Beam
    pipeline; returns `{task: its cache folder}`.

    Args:
      task_names: registered SeqIO tasks or mixtures.
      cache_dir: the cache root (a local path or a `gs://` URL the workers can write).
      splits: the splits to cache; every task must have each of them.
      pipeline_options: Beam pipeline flags (`--runner=...` and the runner's own).
      overwrite: remove an existing cache of a task (complete or not) and rebuild it.
      min_shards: output files per split: `max(input shards, min_shards)`.
      modules_to_import: imported by each worker to register the tasks.

    Raises:
      ValueError: see `check_cacheable`; ModuleNotFoundError without Apache Beam.
    """
    if not isinstance(min_shards, int) or isinstance(min_shards, bool) or min_shards < 1:
        raise ValueError(f"min_shards={min_shards!r}; accepted: an int >= 1")
    names = check_cacheable(task_names, cache_dir, splits, overwrite=overwrite)
    try:
        import apache_beam as beam
        from seqio import beam_utils
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"ktx cache runs SeqIO's Apache Beam pipeline and needs {e.name!r}: "
            "pip install -e '.[cache]' (apache-beam[tfrecord])") from e

    try:
        data_dir = str(files.resolve_data_dir())
    except files.DataFileError:
        data_dir = None  # tasks that read no data folder (their check above passed)
    setup_fn = functools.partial(_worker_setup, data_dir, files.get_on_bad_row())
    folders = {name: task_cache_dir(cache_dir, name) for name in names}
    for folder in folders.values():
        if tf.io.gfile.exists(folder):  # only with overwrite (check_cacheable)
            tf.io.gfile.rmtree(folder)
    tf.io.gfile.makedirs(os.fspath(cache_dir))
    options = beam.options.pipeline_options.PipelineOptions(list(pipeline_options))
    # DirectRunner workers run `_worker_setup` in this process: keep its settings.
    with files.settings_kept(), beam.Pipeline(options=options) as pipeline:
        for name, folder in folders.items():
            task = seqio.get_mixture_or_task(name)
            written = []
            for split in splits:
                label = f"{name}_{split}"
                preprocess = beam_utils.PreprocessTask(
                    task, split, setup_fn=setup_fn, modules_to_import=list(modules_to_import))
                num_shards = max(len(preprocess.shards), min_shards)
                examples = (
                    pipeline
                    | f"{label}_pat" >> preprocess
                    # A global shuffle of the examples, as SeqIO's script does.
                    | f"{label}_global_example_shuffle" >> beam.Reshuffle()
                )
                written.append(
                    examples
                    | f"{label}_write_tfrecord" >> beam_utils.WriteExampleTfRecord(
                        seqio.get_cached_tfrecord_prefix(folder, split), num_shards=num_shards))
                written.append(
                    examples
                    | f"{label}_info" >> beam_utils.GetInfo(num_shards)
                    | f"{label}_write_info" >> beam_utils.WriteJson(
                        seqio.get_cached_info_path(folder, split)))
                written.append(
                    examples
                    | f"{label}_stats" >> beam_utils.GetStats(task.output_features)
                    | f"{label}_write_stats" >> beam_utils.WriteJson(
                        seqio.get_cached_stats_path(folder, split)))
            # COMPLETED is written after every split of the task (an empty file).
            _ = (
                written
                | f"{name}_flatten_completion_values" >> beam.Flatten()
                | f"{name}_discard_completion_values" >> beam.Filter(lambda _: False)
                | f"{name}_write_completed_file" >> beam.io.textio.WriteToText(
                    os.path.join(folder, _COMPLETED), append_trailing_newlines=False,
                    num_shards=1, shard_name_template="", header="")
            )
    return folders


def cache_stats(cache_dir: str | os.PathLike, task_name: str, split: str) -> Mapping[str, int | float]:
    """SeqIO's `stats.<split>.json` of a cached split (`examples`, token counts)."""
    path = seqio.get_cached_stats_path(task_cache_dir(cache_dir, task_name), split)
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def require_cached(task_name: str, split: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Makes SeqIO read `task_name` from its cache and returns the task's cache folder.

    `cache_dir` (the root `ktx cache --cache_dir` wrote) is added to SeqIO's global cache
    directories and must hold the task; None: the task must be found in the directories
    already there (`seqio.add_global_cache_dirs`).

    Raises:
      ValueError: the task cannot be cached, is not cached, or lacks `split`, naming the
        `ktx cache` command that builds it; or SeqIO already reads it from another folder.
    """
    task = seqio.get_mixture_or_task(task_name)
    if not task.supports_caching:
        raise ValueError(
            f"task {task_name!r} was asked for cached (pipeline.MultiTaskInput.use_cached=True) "
            "but cannot be cached: its preprocessors have no seqio.CacheDatasetPlaceholder(); "
            "set use_cached=False")
    root = "DIR" if cache_dir is None else os.fspath(cache_dir)
    command = f"ktx cache --tasks={task_name} --splits={split} --cache_dir={root}"
    if cache_dir is not None:
        done = cached_splits(cache_dir, task_name)
        if done is None:
            raise ValueError(
                f"task {task_name!r} is not cached in {root}: build the cache with `{command}` "
                "(plus this run's --gin_file/--gin.DATA_DIR), or set "
                "pipeline.MultiTaskInput.use_cached=False")
        if split not in done:
            raise ValueError(
                f"task {task_name!r} is cached in {root} without split {split!r} (cached: "
                f"{list(done)}): rebuild it with `ktx cache --tasks={task_name} "
                f"--splits={','.join([*done, split])} --cache_dir={root} --overwrite`")
        seqio.add_global_cache_dirs([root])
    found = task.cache_dir  # SeqIO's search of its global cache directories (kept once found)
    if found is None:
        raise ValueError(
            f"task {task_name!r} is not cached in SeqIO's cache directories "
            f"{list(seqio.get_global_cache_dirs())}: build the cache with `{command}` and set "
            "pipeline.MultiTaskInput.seqio_cache_dir=DIR, or set use_cached=False")
    if cache_dir is not None and os.path.normpath(found) != os.path.normpath(task_cache_dir(root, task_name)):
        raise ValueError(
            f"task {task_name!r} is read from the cache in {found}, which SeqIO found first in "
            f"this process, not from {root}: one cache folder per task and process")
    if not tf.io.gfile.exists(seqio.get_cached_info_path(found, split)):
        raise ValueError(f"task {task_name!r} is cached in {found} without split {split!r}: "
                         f"rebuild it with `{command} --overwrite` naming every split it needs")
    return found
