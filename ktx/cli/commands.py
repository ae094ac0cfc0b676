"""The commands that are not a run: `ktx analyze`, `ktx params`, `ktx precompile`,
`ktx import` / `ktx export`, `ktx cache`, and the edge checks of a run's macros."""

from __future__ import annotations

import difflib
import logging
import pathlib
import shlex
import sys
import time
from collections.abc import Sequence

from ktx.cli.gin_config import (
    GinConfigError,
    _query_macro,
    _resolve_reference,
    absolute_path,
    parse_gin,
)
from ktx.runs.run_dir import RunDir


_ANALYZE_USAGE = (
    "`ktx analyze gradients RUN_DIR [--out PNG]` or `ktx analyze attention --gin_file=... "
    "--checkpoint=STEP_OR_PATH --task=TASK --out_dir=DIR [--split=validation] [--max_examples=100]`"
)


def _analyze(args, bindings: Sequence[tuple[str, str]] = ()) -> int:
    """`ktx analyze gradients RUN_DIR [--out PNG]`: per-task gradient magnitudes over
    training (from the run's metrics.jsonl) as in the MetaBalance paper's figures.
    `ktx analyze attention ...`: see `_analyze_attention`."""
    if args.args == ["attention"]:
        from ktx.cli import quiet

        quiet.quiet_backends()
        return _analyze_attention(args, bindings)
    if len(args.args) != 2 or args.args[0] != "gradients":
        raise GinConfigError(f"ktx analyze {' '.join(args.args)}: accepted: {_ANALYZE_USAGE}")
    from ktx.optim import plot_gradient_magnitudes

    run_dir = pathlib.Path(absolute_path(args.args[1]))
    out = pathlib.Path(absolute_path(args.out)) if args.out else run_dir / "gradient_magnitudes.png"
    path = plot_gradient_magnitudes(RunDir(run_dir).metrics, out)
    print(f"wrote {path}")
    return 0


def _analyze_attention(args, bindings: Sequence[tuple[str, str]]) -> int:
    """`ktx analyze attention`: per-layer attention mass on the hyper-prompts and entropy
    over the tokens (`ktx.analysis.attention`) of the gin-configured MODEL restored from
    `--checkpoint` (a step of MODEL_DIR, or a run / checkpoints / step directory), on the
    first `--max_examples` rows of `--task`'s `--split` (the task's `task_id` is its
    index in MIXTURE_OR_TASK_NAME; TASK_FEATURE_LENGTHS as in training)."""
    for flag in ("checkpoint", "task", "out_dir"):
        if not getattr(args, flag):
            raise GinConfigError(f"ktx analyze attention: --{flag} is required; usage: {_ANALYZE_USAGE}")
    if args.max_examples < 1:
        raise GinConfigError(f"--max_examples={args.max_examples}; accepted: an int >= 1")
    args.out_dir = absolute_path(args.out_dir)
    import gin

    parse_gin(args.gin_file, bindings, [p for p in args.gin_search_paths.split(",") if p])
    from ktx.data import files as data_files

    data_files.set_data_dir(_query_macro("DATA_DIR") or None)
    values = {m: _query_macro(m) for m in ("MODEL", "MIXTURE_OR_TASK_NAME", "TASK_FEATURE_LENGTHS")}
    unset = [m for m, v in values.items() if v is None or repr(v) == "%gin.REQUIRED"]
    if unset:
        raise GinConfigError(f"ktx analyze attention needs the gin macros {unset} (include a model "
                             "file and runs/train.gin, set them with --gin.NAME=...)")
    import seqio

    import ktx.tasks  # noqa: F401  (registers the tasks)
    from ktx.analysis import attention
    from ktx.data import feature_converter as fc
    from ktx.data.pipeline import mixture_task_names

    names = mixture_task_names(values["MIXTURE_OR_TASK_NAME"])
    if args.task not in names:
        raise GinConfigError(f"--task={args.task!r} is not in {values['MIXTURE_OR_TASK_NAME']!r}; "
                             f"accepted: {list(names)}")
    try:
        configurable = gin.get_configurable("ktx_analyze_attention")
    except ValueError:
        configurable = gin.configurable("ktx_analyze_attention")(lambda model=gin.REQUIRED: model)
    gin.parse_config("ktx_analyze_attention.model = %MODEL")
    model = configurable()
    lengths = dict(values["TASK_FEATURE_LENGTHS"])
    ds = seqio.get_mixture_or_task(args.task).get_dataset(
        sequence_length=lengths, split=args.split, shuffle=False, num_epochs=1,
        trim_output_features=True)
    rows = fc.tokens_from_dataset(ds.take(args.max_examples).as_numpy_iterator(), lengths,
                                  source=f"{args.task}/{args.split}")
    features = fc.widen(fc.add_task_id(fc.convert_enc_dec(
        rows, lengths["inputs"], lengths["targets"]), names.index(args.task)))
    step, path = (int(args.checkpoint), _query_macro("MODEL_DIR")) if args.checkpoint.isdigit() \
        else (None, absolute_path(args.checkpoint))
    if path is None or repr(path) == "%gin.REQUIRED":
        raise GinConfigError(f"--checkpoint={args.checkpoint} is a step: set --gin.MODEL_DIR")
    batches = [{k: v[i:i + 32] for k, v in features.items()}
               for i in range(0, rows.num_examples, 32)]
    report = attention.analyze_checkpoint(model, path, batches, task=args.task,
                                          out_dir=args.out_dir, step=step)
    for side in ("encoder", "decoder"):
        for layer in report.get(side, []):
            print(f"{side} layer {layer['layer']}: prompt mass {layer['prompt_mass']:.4f}, "
                  f"token entropy {layer['token_entropy']:.4f}")
    print(f"wrote {pathlib.Path(args.out_dir) / f'attention_{args.task}.json'} and .png "
          f"({report['num_examples']} examples)")
    return 0


def _precompile_kwargs(topology: str) -> dict:
    """`precompile`'s keyword arguments from the parsed gin configuration (runs/train.gin's
    `train` bindings, BATCH_SIZE, TASK_FEATURE_LENGTHS); GinConfigError naming what is missing."""
    import gin
    import ktx.runs.train

    try:
        bound = gin.get_bindings(ktx.runs.train.train, resolve_references=False)
    except ValueError:
        bound = {}
    if "model" not in bound:
        raise GinConfigError("ktx precompile compiles the train step of a run: include runs/train.gin "
                             "and a model file (gin/models/*.gin)")
    unbound = lambda v: v is None or repr(v) == "%gin.REQUIRED"  # noqa: E731
    lengths = _query_macro("TASK_FEATURE_LENGTHS")
    batch_size = _query_macro("BATCH_SIZE")
    reader = bound.get("train_input")
    if unbound(batch_size) and isinstance(reader, gin.config.ConfigurableReference):
        # A run whose input names its own batch size (runs/recsys_train.gin's reader).
        batch_size = _resolve_reference(
            gin.get_bindings(reader.selector, resolve_references=False).get("batch_size"))
    if unbound(batch_size):
        raise GinConfigError("ktx precompile needs --gin.BATCH_SIZE=...")
    kwargs = {k: _resolve_reference(bound[k]) for k in (
        "model", "optimizer", "balancer", "num_partitions", "num_microbatches", "grad_method",
        "shared", "additional_rules", "parameter_partitioning_dims", "target_task",
        "weights_from_losses", "task_grad_dtype") if k in bound}
    if unbound(lengths):
        try:  # a model whose features have no length (the recommendation model) needs none
            kwargs["model"].input_spec(int(batch_size), None)
        except (ValueError, TypeError, AttributeError) as e:
            raise GinConfigError(f"ktx precompile needs --gin.TASK_FEATURE_LENGTHS=... "
                                 f"({type(kwargs['model']).__name__}: {e})") from None
    counts = _query_macro("PRECOMPILE_TASK_COUNTS")
    if not unbound(counts):  # the balanced step's rows per task (default: equal counts)
        from ktx.training.precompile import check_task_counts

        try:
            kwargs["task_counts"] = check_task_counts(
                counts, getattr(kwargs["model"], "num_tasks", 1), int(batch_size))
        except ValueError as e:
            raise GinConfigError(str(e)) from None
    return dict(topology=topology, batch_size=int(batch_size),
                task_feature_lengths=None if unbound(lengths) else dict(lengths), **kwargs)


def _precompile_setup(gin_files, bindings, search_paths, topology: str) -> dict:
    """In `ktx precompile`'s child process: the same quiet start and gin parse as the
    parent's, then `precompile`'s keyword arguments (`_precompile_kwargs`). Its backends are
    left alone: `topology_devices` sets libtpu's flags before libtpu loads."""
    from ktx.cli import quiet

    quiet.start()
    parse_gin(gin_files, bindings, search_paths)
    return _precompile_kwargs(topology)


# `ktx precompile`'s exit statuses besides 0 (fits, or no HBM figure) and 1/2 (a failure /
# a usage or gin error): the step does not fit the chips' HBM; the compiler crashed or ran
# over --timeout.
PRECOMPILE_DOES_NOT_FIT = 3
PRECOMPILE_COMPILER_DIED = 4


def _check_precompile_flags(args) -> None:
    """`ktx precompile`'s checks of its own flags, made before the gin files are parsed
    (which imports the data pipeline, and TensorFlow with it)."""
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not timeout > 0:
        raise GinConfigError(f"--timeout={timeout:g}; accepted: seconds > 0 (default: no limit)")
    if not args.gin_file:
        raise GinConfigError("ktx precompile compiles the train step of a run: give its gin files "
                             "(--gin_file=models/t5_1_1_base.gin --gin_file=runs/train.gin ...)")


def _precompile_command(args, bindings: Sequence[tuple[str, str]] = ()) -> int:
    """`ktx precompile --topology=NAME [--timeout=SECONDS]`: the train step of the
    gin-configured run (`runs/train.gin` + model + conditioning + optim files) compiled
    ahead of time for a TPU topology (`ktx.training.precompile`) in a child process; exit 3
    when it does not fit the chips' HBM, 4 when the compiler crashed (its process killed
    by a signal) or ran over `--timeout` seconds."""
    from ktx.training import precompile as precompile_lib

    _check_precompile_flags(args)
    topology = args.topology or _query_macro("TOPOLOGY")
    if not topology:
        raise GinConfigError("ktx precompile needs --topology=NAME (e.g. v4:4x4x4, v5e:16x16) or a "
                             "gin file binding TOPOLOGY (gin/pods/*.gin)")
    timeout = getattr(args, "timeout", None)
    kwargs = _precompile_kwargs(topology)  # the parent checks the configuration first
    search_paths = [p for p in args.gin_search_paths.split(",") if p]
    try:
        report = precompile_lib.precompile_in_child(
            _precompile_setup, (list(args.gin_file), list(bindings), search_paths, topology),
            topology=topology, num_partitions=int(kwargs.get("num_partitions", 1)), timeout=timeout)
    except precompile_lib.DoesNotFitError as e:
        print(f"ktx precompile: {e}", file=sys.stderr)
        return PRECOMPILE_DOES_NOT_FIT
    except precompile_lib.CompileDiedError as e:
        print(f"ktx precompile: {e}", file=sys.stderr)
        return PRECOMPILE_COMPILER_DIED
    print(report.format())
    return PRECOMPILE_DOES_NOT_FIT if report.fits is False else 0


_CACHE_USAGE = ("ktx cache --tasks=NAME[,NAME...] --cache_dir=DIR [--splits=train,validation] "
                 "[--pipeline_options=\"--runner=DirectRunner ...\"] [--min_shards=64] [--overwrite] "
                 "[--gin_file=... --gin.DATA_DIR=...]")


def _cache_command(args) -> int:
    """`ktx cache`: SeqIO's offline cache of the named tasks (mixtures expanded) and splits,
    written by SeqIO's Beam transforms (`ktx.data.seqio_cache.cache_tasks`) on the runner
    of `--pipeline_options`; the data folder is the gin DATA_DIR (else $KTX_DATA_DIR)."""
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    for flag, value in (("tasks", names), ("cache_dir", args.cache_dir), ("splits", splits)):
        if not value:
            raise GinConfigError(f"ktx cache needs --{flag}; usage: {_CACHE_USAGE}")
    try:
        options = shlex.split(args.pipeline_options)
    except ValueError as e:
        raise GinConfigError(f"--pipeline_options={args.pipeline_options!r}: {e}") from e
    cache_dir = absolute_path(args.cache_dir)
    import ktx.tasks  # noqa: F401  (registers the tasks)
    from ktx.data import seqio_cache

    # Beam's BigQuery client warns at import that apitools is missing: ktx cache uses no BigQuery.
    root = logging.getLogger()
    drop = lambda record: not record.getMessage().startswith("apitools not found")  # noqa: E731
    root.addFilter(drop)
    try:
        import apache_beam  # noqa: F401
    except ModuleNotFoundError:
        pass  # cache_tasks names the extra to install
    finally:
        root.removeFilter(drop)
    start = time.perf_counter()
    folders = seqio_cache.cache_tasks(names, cache_dir, splits, options, overwrite=args.overwrite,
                                      min_shards=args.min_shards)
    for name, folder in folders.items():
        counts = ", ".join(f"{split} {seqio_cache.cache_stats(cache_dir, name, split)['examples']}"
                           for split in splits)
        print(f"cached {name} ({counts} examples) in {folder}")
    print(f"{len(folders)} task(s) cached in {time.perf_counter() - start:.0f} s; train on them with "
          f"--gin.pipeline.MultiTaskInput.use_cached=True "
          f"--gin.pipeline.MultiTaskInput.seqio_cache_dir=\"'{cache_dir}'\"")
    return 0


def _params_command(files, bindings) -> None:
    import gin
    from ktx.analysis import params as params_lib

    ref = _query_macro("MODEL")
    if ref is None:
        raise GinConfigError("`ktx params` needs a gin file binding the MODEL macro (gin/models/*.gin)")

    try:  # registered by an earlier `ktx params` in this process
        configurable = gin.get_configurable("ktx_params_command")
    except ValueError:
        configurable = gin.configurable("ktx_params_command")(lambda model=gin.REQUIRED: model)
    gin.parse_config("ktx_params_command.model = %MODEL")
    model = configurable()
    report = params_lib.count_parameters(model)
    print(params_lib.format_report(report, name=type(model).__name__))


def _check_run_macros(command: str) -> None:
    """Edge checks whose library error would name an inner argument instead of the flag."""
    steps = _query_macro("TRAIN_STEPS")
    if command == "train" and steps is not None and repr(steps) != "%gin.REQUIRED":
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise GinConfigError(f"TRAIN_STEPS={steps!r}; accepted: an integer >= 1 "
                                 "(--gin.TRAIN_STEPS=1000)")
    name = _query_macro("MIXTURE_OR_TASK_NAME")
    if isinstance(name, str):
        import seqio

        import ktx.tasks  # noqa: F401  (registers the tasks)

        known = sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names()))
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
            raise GinConfigError(
                f"MIXTURE_OR_TASK_NAME={name!r} is not a registered SeqIO task or mixture"
                + (f"; close names: {', '.join(close)}" if close else "")
                + " (register it in a module the gin file imports: docs/adding_a_task.md)")


def _convert_command(args) -> int:
    """`ktx import hf:DIR|t5x:DIR OUT`: a ktx checkpoint directory (orbax step 0 +
    `model.gin`) from a Hugging Face or T5X checkpoint. `ktx export SRC hf:OUT
    [--checkpoint STEP] [--backbone_only]`: a ktx run / checkpoint directory as a Hugging
    Face T5 or BERT directory (`t5x:OUT`: a T5X checkpoint); the model's config comes from
    the run's `config.gin` when there is one
    (else what `ktx import` recorded, else the shapes). See ktx.convert and
    docs/checkpoints.md."""
    from ktx import convert

    usage = {"import": "ktx import hf:DIR|t5x:DIR|camtl:DIR|pals:DIR OUT_DIR",
             "export": "ktx export RUN_OR_CHECKPOINT_DIR hf:OUT_DIR|t5x:OUT_DIR|conditioning:FILE "
                       "[--checkpoint STEP] [--backbone_only]"}
    if len(args.args) != 2:
        raise ValueError(f"ktx {args.command} takes 2 arguments, got {args.args}; "
                         f"usage: {usage[args.command]}")
    src, out = (absolute_path(a) for a in args.args)
    if args.command == "import":
        path = convert.import_checkpoint(src, out)
        print(f"wrote {path} (model.gin, checkpoints/0); start a run from it with "
              f"--gin_file={path}/model.gin --gin.INITIAL_CHECKPOINT_PATH=\"'{path}'\"")
        return 0
    if args.checkpoint is not None and not args.checkpoint.isdigit():
        raise ValueError(f"--checkpoint={args.checkpoint!r}; accepted: a step number")
    step = int(args.checkpoint) if args.checkpoint is not None else None
    if out.startswith("conditioning:"):  # the task-conditioned parameters alone
        from ktx.convert.conditioning import export_conditioning

        path = export_conditioning(src, out[len("conditioning:"):], step=step)
        print(f"wrote {path} (task-conditioned parameters; load them on a backbone with "
              "ktx.convert.conditioning.load_conditioning)")
        return 0
    config = None
    src_dir = pathlib.Path(src)
    run = RunDir.containing(src_dir)
    run_gin = None if run is None else run.config
    if run_gin is not None:  # the run's operative config: the model it trained
        import gin

        parse_gin([str(run_gin)])
        try:
            configurable = gin.get_configurable("ktx_export_command")
        except ValueError:
            configurable = gin.configurable("ktx_export_command")(lambda model=gin.REQUIRED: model)
        gin.parse_config("ktx_export_command.model = %MODEL")
        config = configurable().config
    path = convert.export_checkpoint(src, out, step=step, config=config,
                                     backbone_only=args.backbone_only)
    print(f"wrote {path}" + (f" (model from {run_gin})" if run_gin else ""))
    return 0
