"""The long-range runner (scripts/long_range.py): every stage of a preset run or reused (`run`), each by the kind of
stage it is (efficiency in a fresh measuring process, copy, classification), then the report; `profile` prints where
a training step's time goes."""

import json
import shlex
import sys
import time
from pathlib import Path

from hf_linear_attn.training.errors import UsageError

from .models import DECODERS, ENCODERS, Dims, build_decoder, build_encoder
from .preset import load_preset, plan, select, task_notes
from .stages import (
    Stage, StageFailed, checkpoint_file, checkpoint_scores_file, load_records, run_stages, whole_command, write_atomic,
)
from .tasks import (
    BYTES_VOCAB_SIZE, COPY_VOCAB_SIZE, LISTOPS_VOCAB_SIZE, digest_of, encode_bytes, encode_listops, generate_listops,
    generate_listops_sized, load_imdb,
)


class DataCache:
    """Builds each task's examples once per process (ListOps generation, IMDB reading) and their digests."""

    def __init__(self, dataset: str, data_dir: Path | None):
        self.dataset, self.data_dir, self.cache = dataset, data_dir, {}

    def examples(self, args: dict) -> tuple[list, list, dict]:
        key = json.dumps({k: v for k, v in args.items() if k not in ("model", "optimizer", "steps", "batch_size",
                                                                      "log_every", "dropout", "pooling")}, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = self._build(args)
        return self.cache[key]

    def _build(self, a: dict):
        n = a["length"]
        if a["task"] == "listops":
            generate = generate_listops if a.get("generator", "sized") == "lra" else generate_listops_sized
            lo, hi = a["min_tokens"], min(a["max_tokens"], n - 2)
            train = [(encode_listops(t), v) for t, v in generate(a["train_size"], a["seed"], lo, hi)]
            evaluation = [(encode_listops(t), v) for t, v in generate(a["eval_size"], a["seed"] + 10_000, lo, hi)]
            info = {"eval": f"ListOps, {a['eval_size']} expressions from a separate seed", "train": digest_of(train),
                    "eval_digest": digest_of(evaluation)}
            return train, evaluation, info
        imdb = load_imdb(self.dataset, self.data_dir, a["eval_size"], a["seed"])
        train = imdb["train"][: a.get("train_size") or None]
        train = [(encode_bytes(text, n), label) for text, label in train]
        evaluation = [(encode_bytes(text, n), label) for text, label in imdb["eval"]]
        return train, evaluation, {"eval": imdb["eval_name"], "source": imdb["digest"], "train": digest_of(train)}


def _runner(data: DataCache, best: list[float], output_dir: Path | None = None, log=print, device: str = "cpu"):
    """run_stage(stage) -> metrics; `best` holds the best availability probe on record and grows with this run's. A
    copy stage with `checkpoint_every` among its options checkpoints into output_dir/checkpoints/ and resumes from
    there. Copy stages train on `device` (the record names it); the other tasks choose their own."""
    import torch

    from .efficiency import contended, measure_isolated, measurement_spec, probe_of
    from .training import Checkpointing, device_name, train_classifier, train_copy

    def run_stage(stage: Stage) -> dict:
        a = stage.args
        if stage.kind == "efficiency":
            spec = measurement_spec(a)
            result = measure_isolated(spec, a["timeout"])
            best[0] = max(best[0], probe_of(result) or 0.0)
            for _ in range(a.get("retries", 0)):  # other jobs took our cores: measure again, keep the least disturbed
                if not contended(result, best[0]):
                    break
                time.sleep(30)
                again = measure_isolated(spec, a["timeout"])
                best[0] = max(best[0], probe_of(again) or 0.0)
                if "failed" not in again and (probe_of(again) or 0.0) > (probe_of(result) or 0.0):
                    result = again
            if contended(result, best[0]):
                result["contended"] = True
            reason = result.get("failed", "")
            if reason and not reason.startswith(("out of memory", "over ")):  # OOM and timeouts are findings
                raise StageFailed(reason)
            return result
        dims = Dims(**a["dims"])
        torch.manual_seed(a["seed"])
        if stage.kind == "copy":
            model = build_decoder(a["model"], dims, a["length"], COPY_VOCAB_SIZE, a["dropout"],
                                  a.get("activation")).to(device)
            every = stage.options.get("checkpoint_every")
            checkpointing = (Checkpointing(checkpoint_file(output_dir, stage.key), every, a,
                                           log=lambda s, key=stage.key: log(f"    {key}: {s}"))
                             if every and output_dir is not None else None)
            metrics = train_copy(model, a["length"], a["steps"], a["batch_size"], a["optimizer"], a["seed"],
                                 a["log_every"], variant=a.get("variant", "fixed"),
                                 precision=a.get("precision", "float32"), checkpointing=checkpointing)
            if device != "cpu":  # CPU records (all of them before --device) name no device
                metrics["device"] = device_name(device)
            scores = checkpoint_scores_file(output_dir, stage.key) if output_dir is not None else None
            if scores is not None and scores.is_file():  # the running checkpoints scored (--eval_running), then the end
                metrics["eval_history"] = scored_history(scores, a["steps"], metrics)
            return metrics
        train, evaluation, info = data.examples(a)
        stage.digests = info
        vocab, labels = (LISTOPS_VOCAB_SIZE, 10) if a["task"] == "listops" else (BYTES_VOCAB_SIZE, 2)
        torch.manual_seed(a["seed"])
        model = build_encoder(a["model"], dims, a["length"], vocab, labels, a["dropout"], a.get("position_table"),
                              pooling=a.get("pooling", "first"))
        metrics = train_classifier(model, train, evaluation, a["length"], a["steps"], a["batch_size"],
                                   a["optimizer"], a["seed"], a.get("log_every", 10), a.get("eval_batch_size"))
        metrics["parameters"] = sum(p.numel() for p in model.parameters())
        if a["model"] == "bigbird":
            metrics["bigbird_attention"] = model.bert.attention_type
        return metrics

    return run_stage


def profile(preset_path: Path, models, n: int, log=print, rows: int = 15) -> None:
    """Print where each model's training step goes at length n (the preset's efficiency settings): the `rows`
    operators taking the most self time, from torch.profiler in this process. Measures nothing for the tables."""
    from .efficiency import measurement_spec, profile_training_step

    preset = select(load_preset(preset_path), ["efficiency"], models)
    if "efficiency" not in preset["tasks"]:
        raise UsageError(f"{Path(preset_path).name} has no efficiency task with the models {models}: name models of "
                         "its efficiency task with --models")
    stages = [s for s in plan(preset) if s.args["n"] == n]
    if not stages:
        raise UsageError(f"--profile {n}: the preset's efficiency lengths are "
                         f"{preset['tasks']['efficiency']['lengths']}; profile one of them")
    for stage in stages:
        spec = measurement_spec(stage.args)
        log(f"## {stage.args['model']} at n = {n}: one training step, batch {spec['batch_size']}")
        log(profile_training_step(spec, rows=rows))


def time_copy_steps(preset_path: Path, models, steps: int, lengths=None, log=print, warmup: int = 2) -> list[dict]:
    """Print (and return) the seconds of one copy-task training step of each model of the preset's copy task (or
    `models`) at each of its lengths (or `lengths`), in float32 and under bf16 autocast, with the preset's dims,
    batch, task and optimizer. The two precisions run on two copies of one model, step by step in turn on the same
    batches, so that other jobs on shared cores slow both alike; the median of `steps` timed steps after `warmup`. A
    float32 matmul probe before and after says how free the cores were. Measures nothing for the tables."""
    import statistics

    import torch

    from .efficiency import availability_probe
    from .tasks import copy_task_batch
    from .training import PRECISIONS, _step, autocast_for, make_optimizer

    preset = select(load_preset(preset_path), ["copy"], models)
    if "copy" not in preset["tasks"]:
        raise UsageError(f"{Path(preset_path).name} has no copy task with the models {models}: name models of its "
                         "copy task with --models")
    stages = [s for s in plan(preset) if not lengths or s.args["length"] in lengths]
    if not stages:
        raise UsageError(f"--time_lengths {lengths}: the preset's copy lengths are "
                         f"{[s['length'] for s in preset['tasks']['copy']['settings']]}")
    log(f"matmul probe before: {availability_probe('cpu'):.0f} GFLOP/s float32")
    rows = []
    for stage in stages:
        a = stage.args
        runs = {}
        for precision in PRECISIONS:
            torch.manual_seed(a["seed"])
            model = build_decoder(a["model"], Dims(**a["dims"]), a["length"], COPY_VOCAB_SIZE, a["dropout"],
                                  a.get("activation"))
            optimizer, scheduler = make_optimizer(model, a["optimizer"], a["steps"])
            model.train()
            runs[precision] = (model, optimizer, scheduler, autocast_for(model, precision), [], [])
        generator = torch.Generator().manual_seed(a["seed"])
        for i in range(warmup + steps):
            ids, labels = copy_task_batch(a.get("variant", "fixed"), a["batch_size"], a["length"], generator)
            for precision in PRECISIONS if i % 2 == 0 else PRECISIONS[::-1]:
                model, optimizer, scheduler, autocast, times, losses = runs[precision]
                start = time.perf_counter()
                losses.append(_step(model, optimizer, scheduler, dict(input_ids=ids, labels=labels),
                                    a["optimizer"].get("grad_clip", 1.0), autocast))
                if i >= warmup:
                    times.append(time.perf_counter() - start)
        row = {"stage": stage.key, "steps": a["steps"],
               **{f"{p}_seconds": statistics.median(runs[p][4]) for p in PRECISIONS},
               **{f"{p}_losses": runs[p][5] for p in PRECISIONS}}
        rows.append(row)
        fp, bf = row["float32_seconds"], row["bf16_seconds"]
        log(f"{stage.key}: float32 {fp:.3f} s/step ({1 / fp:.3f} steps/s), bf16 {bf:.3f} s/step ({1 / bf:.3f} "
            f"steps/s), bf16 {fp / bf:.2f}x faster; {a['steps']} steps: {a['steps'] * fp / 3600:.1f} h float32, "
            f"{a['steps'] * bf / 3600:.1f} h bf16 (median of {steps} steps, batch {a['batch_size']})")
    log(f"matmul probe after: {availability_probe('cpu'):.0f} GFLOP/s float32")
    return rows


def _hardware(finished: dict) -> list[str]:
    """The stages' hardware lines, saying how many stages recorded it where not all did (older records have none)."""
    from benchmarks.measuring import hardware_of_records

    texts = hardware_of_records(finished.values())
    recorded = sum(1 for r in finished.values() if r.get("hardware"))
    if texts and recorded < len(finished):
        texts[-1] += f"; recorded by {recorded} of the {len(finished)} finished stages, the others predate the record"
    return texts


def run(preset_path: Path, output_dir: Path, tasks=None, models=None, dataset="local", data_dir=None,
        dry_run=False, report_only=False, argv=None, log=print, seed=None, eval_running=False, lengths=None,
        device="cpu") -> dict:
    """Run (or reuse) the preset's stages (only `tasks` / `models` where given: a slice), then report every finished
    stage of the whole preset, so that a slice adds its rows to the folder's tables instead of replacing them with
    the slice's (`lengths`: only the stages at these sequence lengths); returns the report's summary. `device`:
    where the copy stages train ("cuda" needs a GPU and a preset slice of the copy task only). `seed` replaces the
    preset's seed (model initialisation, batch order, ListOps generation, the IMDB held-out split). `eval_running`
    (with report_only) also scores the running copy stages' checkpoints (evaluate_running_copies)."""
    from benchmarks.measuring import describe_hardware, describe_machine

    from .report import write_report

    full = load_preset(preset_path)
    if seed is not None:
        full["seed"] = seed
    preset = select(full, tasks, models, lengths)
    stages = plan(preset)
    if device != "cpu" and not dry_run and (eval_running or not report_only):
        check_copy_device(device, preset)
    whole = plan(full)
    if dry_run:
        for stage in stages:
            log(f"{stage.key}: {json.dumps(stage.args)}")
            if stage.options:
                log(f"    runs with {json.dumps(stage.options)}")
        log(f"{len(stages)} stages")
        return {}
    output_dir = Path(output_dir)
    machine = describe_machine()
    if "text" in preset["tasks"] and not report_only and dataset == "local":
        path = Path(data_dir or "") / "imdb" / "train.jsonl"
        if data_dir is None or not path.is_file():
            raise UsageError(f"IMDB not found at {path}: pass --data_dir pointing at the folder holding "
                             "imdb/train.jsonl (e.g. ../shared/data), or --dataset hub where the Hub is reachable")
    output_dir.mkdir(parents=True, exist_ok=True)
    if report_only:
        records = load_records(output_dir)
        if (output_dir / "records.json").is_file():  # fold in stage files finished after it (another run's)
            write_atomic(output_dir / "records.json", json.dumps(records, indent=1))
        for stage in whole:  # refuse a report mixing stages run with other arguments
            from .stages import check_reuse
            check_reuse(stage, records, output_dir)
    else:
        # An efficiency measurement whose probe falls under the best on record (or that has none) is taken again;
        # a later, better probe can turn an earlier one contended, so this is judged on every run and in the report.
        from .efficiency import best_probe, contended

        best = [best_probe(load_records(output_dir))]
        records = run_stages(stages, _runner(DataCache(dataset, data_dir), best, output_dir, log, device), output_dir,
                             machine,
                             log, retake=lambda r: r["kind"] == "efficiency" and contended(r["metrics"], best[0]),
                             hardware=describe_hardware())
    keys = {stage.key for stage in whole}
    finished = {k: r for k, r in records.items() if k in keys}
    if eval_running:
        evaluate_running_copies(whole, finished, output_dir, log, device)
    # the report's rows: every model with a finished stage, and the models this run ran (pending ones too)
    ran = set() if report_only else {stage.key for stage in stages}
    reported = [stage for stage in whole if stage.key in ran or stage.key in finished]
    meta = {"preset": Path(preset_path).stem, "machine": machine,
            "stage_machines": sorted({r["machine"] for r in finished.values()}),
            # each stage's instruction sets and matmul peaks (none in records made before they were recorded)
            **({"hardware": hw} if (hw := _hardware(finished)) else {}),
            "command": "python scripts/long_range.py " + shlex.join(
                whole_command(sys.argv[1:] if argv is None else argv, ("--models", "--tasks", "--lengths"))),
            "report_only": report_only,
            "date": time.strftime("%Y-%m-%d"), "finished": len(finished), "total": len(whole),
            "encoders": [m for m in ENCODERS if any(s.args.get("model") == m for s in reported)],
            "decoders": [m for m in DECODERS if any(s.args.get("model") == m for s in reported)],
            "efficiency_models": [m for m in ENCODERS if any(s.kind == "efficiency" and s.args.get("model") == m
                                                             for s in reported)],
            "task_notes": task_notes(full), "dataset": dataset, "tasks": list(full["tasks"]),
            "in_progress": copy_in_progress(whole, finished, output_dir)}
    return write_report(output_dir, meta, finished)


def check_copy_device(device: str, preset: dict) -> None:
    """Refuse, before any work, a slice with other tasks than the copy task on a device, or a device the copy
    stages cannot train on (training.check_device)."""
    from .training import check_device

    others = sorted(set(preset["tasks"]) - {"copy"})
    if others:
        raise UsageError(f"--device {device} trains the copy task only; the slice also holds {', '.join(others)}: "
                         "add --tasks copy (the efficiency task measures on the GPU by itself where there is one)")
    check_device(device)


def _running_copy_stages(stages, finished: dict):
    """The copy stages not yet finished that checkpoint (and so may be running)."""
    return [s for s in stages if s.kind == "copy" and s.key not in finished and s.options.get("checkpoint_every")]


def scored_history(scores: Path, step: int, metrics: dict) -> list[list]:
    """The eval history kept in a checkpoint's scores file before `step`, then [step, eval loss, copy accuracy] of
    `metrics` (the token accuracy for the fixed task, which has no copy-alone score)."""
    history = json.loads(scores.read_text()).get("history", []) if scores.is_file() else []
    return [h for h in history if h[0] < step] + [
        [step, metrics["eval_loss"], metrics.get("eval_copy_accuracy", metrics["eval_token_accuracy"])]]


def copy_in_progress(stages, finished: dict, output_dir: Path) -> dict:
    """The copy stages not yet finished that have a checkpoint of their own arguments in output_dir: key -> length,
    model, steps and the checkpoint's progress (training.checkpoint_progress), and `eval`, the held-out scores of
    that very checkpoint where evaluate_running_copies has written them. A multi-session run shows its curves in the
    report while it goes on; nothing here enters the tables of finished stages or the goals."""
    from .training import checkpoint_progress

    out = {}
    for stage in _running_copy_stages(stages, finished):
        progress = checkpoint_progress(checkpoint_file(output_dir, stage.key), stage.args)
        if progress is not None:
            out[stage.key] = {"length": stage.args["length"], "model": stage.args["model"],
                              "steps": stage.args["steps"], **progress}
            scores = checkpoint_scores_file(output_dir, stage.key)
            if scores.is_file():
                cached = json.loads(scores.read_text())
                if cached["step"] == progress["step"]:  # of this checkpoint; a later one has no scores yet
                    out[stage.key]["eval"] = cached["metrics"]
                out[stage.key]["eval_history"] = cached.get("history", [])
    return out


def evaluate_running_copies(stages, finished: dict, output_dir: Path, log=print, device: str = "cpu") -> None:
    """Score each running copy stage's checkpoint as the stage will be scored when it finishes (float32, the same
    4 held-out batches: training.evaluate_copy with the stage's seed + 1), and keep the scores beside the checkpoint
    (stages.checkpoint_scores_file, with its step, and the history of every checkpoint scored so far: step, eval
    loss, copy accuracy) for the report. A few seconds a stage; the run itself is not touched (the checkpoint is
    read, never written)."""
    from .training import Checkpointing, evaluate_copy, load_checkpoint

    for stage in _running_copy_stages(stages, finished):
        a, path = stage.args, checkpoint_file(output_dir, stage.key)
        try:
            state = load_checkpoint(Checkpointing(path, 1, a))
        except UsageError:  # another run's checkpoint
            continue
        if state is None:
            continue
        model = build_decoder(a["model"], Dims(**a["dims"]), a["length"], COPY_VOCAB_SIZE, a["dropout"],
                              a.get("activation")).to(device)
        model.load_state_dict(state["model"])
        metrics = evaluate_copy(model, a["length"], a["batch_size"], 4, a["seed"] + 1, a.get("variant", "fixed"))
        scores = checkpoint_scores_file(output_dir, stage.key)
        history = scored_history(scores, state["step"], metrics)
        write_atomic(scores, json.dumps({"step": state["step"], "metrics": metrics, "history": history}, indent=1))
        log(f"{stage.key}: scored the checkpoint at step {state['step']}: eval loss {metrics['eval_loss']:.4f}")
