"""Decoding benchmarks, run through scripts/benchmark.py like the other suites (one fresh process per configuration):

- ``images``: generation throughput in the shape of "Transformers are RNNs" (Katharopoulos et al. 2020) Tables 1 and
  2: whole 784- and 3,072-token sequences (MNIST / CIFAR-10 image lengths, vocabulary 256) sampled from a 1-token
  start, images per second at the largest batch that fits, for GPT-2 (SDPA, its key/value cache), the linear
  decoder (elu + 1) and the causal Linformer, with the ratios to GPT-2 beside the paper's 317x and 4,462x.
- ``assisted``: plain greedy against assisted greedy (``assistant_model=`` a 2-layer linear draft of a 12-layer
  linear target, both pretrained here on WikiText-2 and cached under the output folder) and prompt-lookup decoding
  (``prompt_lookup_num_tokens``), at prompts of 256 and 4,096 tokens: tokens / s, the drafts' acceptance rate and a
  token-for-token check against plain greedy.
- ``compiled_step``: per-token latency of ``DecoderStateStep`` (the linear decoder's step on explicit state tensors)
  eager against ``torch.compile(fullgraph=True)``, at batch 1 and a larger batch.

suites.py registers the suites (``KINDS``, ``configurations``, ``tables``, ``plots``) and names the preset; this module
imports only measuring.py.
"""

import contextlib
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from .measuring import cache_bytes, decoder_model, failure, matmul_peak, rss_bytes, timed_call

SUITES = ("images", "assisted", "compiled_step")

# The paper's generation figures (images / s of linear attention over softmax, each at the largest batch that fits
# on one GPU), the anchors the images table cites beside its own ratios.
PAPER_IMAGES = {784: ("MNIST, Table 1", 317), 3072: ("CIFAR-10, Table 2", 4462)}
# The paper's models as we read its setup (approximate: from memory of the paper, not checked against its code):
# 8 layers (MNIST) / 16 layers (CIFAR-10), 8 heads, width 256, feed-forward 1024, a mixture of 10 logistics per
# pixel as the output (here: a 256-way softmax). We give our image models the same depths and widths.
PAPER_SETUP_NOTE = (
    "The paper's models, as we read its setup (approximate, from memory of the paper): 8 layers for MNIST and 16 "
    "for CIFAR-10, 8 heads, width 256, feed-forward 1024, a mixture of 10 logistics per pixel (here a 256-way "
    "softmax), timed on one GPU at the largest batch that fits. Whether its softmax baseline cached keys and values "
    "is not something we can confirm; ours does (GPT-2's own cache), so each new token costs it work linear in the "
    "prefix rather than quadratic, and ratios far below the paper's are expected, most of all on CPUs.")

PRESETS = {
    "smoke": dict(
        peak_size=256,
        images=dict(lengths={16: 2}, dims=dict(n_embd=32, n_head=2, n_inner=64), batch_sizes=[1, 2],
                    linformer_k=4, linformer_block=8, budget=20, repeats=1, memory_cap_gb=4),
        assisted=dict(contexts=[24], new_tokens=12, repeats=2, prompt_lookup_num_tokens=3, timeout=300,
                      target=dict(n_embd=64, n_layer=2, n_head=2, n_inner=128),
                      draft=dict(n_embd=64, n_layer=1, n_head=2, n_inner=128),
                      training=dict(vocab_size=512, train_lines=2000, valid_lines=200, batch_size=8,
                                    target_steps=30, draft_steps=30, learning_rate=1e-3, eval_rows=4)),
        compiled_step=dict(batch_sizes=[1, 4], context=8, warmup=2, steps=10, vocab_size=256,
                           dims=dict(n_embd=32, n_layer=2, n_head=2, n_inner=64)),
    ),
    "quick": dict(
        peak_size=2048,
        images=dict(lengths={784: 8, 3072: 16}, dims=dict(n_embd=256, n_head=8, n_inner=1024), batch_sizes=[1, 16],
                    linformer_k=32, linformer_block=128, budget=240, repeats=2, memory_cap_gb=16),
        assisted=dict(contexts=[256, 4096], new_tokens=64, repeats=3, prompt_lookup_num_tokens=10, timeout=3600,
                      target=dict(n_embd=256, n_layer=12, n_head=4, n_inner=1024),
                      draft=dict(n_embd=256, n_layer=2, n_head=4, n_inner=1024),
                      training=dict(vocab_size=8000, train_lines=None, valid_lines=None, batch_size=2,
                                    target_steps=24, draft_steps=24, learning_rate=1e-3, eval_rows=8)),
        compiled_step=dict(batch_sizes=[1, 16], context=128, warmup=4, steps=32, vocab_size=50257,
                           dims=dict(n_embd=768, n_layer=12, n_head=12, n_inner=3072)),
    ),
    "full": dict(
        peak_size=2048,
        images=dict(lengths={784: 8, 3072: 16}, dims=dict(n_embd=256, n_head=8, n_inner=1024),
                    batch_sizes=[1, 8, 64, 512], linformer_k=32, linformer_block=128, budget=600, repeats=2,
                    memory_cap_gb=64),
        assisted=dict(contexts=[256, 4096], new_tokens=128, repeats=5, prompt_lookup_num_tokens=10, timeout=4 * 3600,
                      target=dict(n_embd=256, n_layer=12, n_head=4, n_inner=1024),
                      draft=dict(n_embd=256, n_layer=2, n_head=4, n_inner=1024),
                      training=dict(vocab_size=8000, train_lines=None, valid_lines=None, batch_size=2,
                                    target_steps=150, draft_steps=150, learning_rate=1e-3, eval_rows=16)),
        compiled_step=dict(batch_sizes=[1, 16, 64], context=128, warmup=8, steps=64, vocab_size=50257,
                           dims=dict(n_embd=768, n_layer=12, n_head=12, n_inner=3072)),
    ),
}

# Transformers' own defaults for a draft model, set explicitly so that every row records what the draft did.
ASSISTANT_SETTINGS = dict(num_assistant_tokens=20, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.4)
IMAGE_VOCABULARY = 256
DEFAULT_DATA_DIR = "../shared/data"  # beside the checkout, as configs/pretrain/cpu-clm.json reads it


# ------------------------------------------------------------------------------------------------ configurations


def wikitext_files(data_dir) -> dict[str, Path]:
    """The WikiText-2 train / validation files under data_dir (the shared data folder)."""
    folder = Path(data_dir or DEFAULT_DATA_DIR).expanduser().resolve() / "wikitext-2"
    return {"train": folder / "wiki.train.tokens", "validation": folder / "wiki.valid.tokens"}


def data_problem(data_dir) -> str | None:
    """Why the assisted suite cannot train its models from data_dir (and the fix), or None."""
    missing = [str(p) for p in wikitext_files(data_dir).values() if not p.is_file()]
    if missing:
        return (f"WikiText-2 not found ({', '.join(missing)}): pass --data_dir pointing at the folder that holds "
                "wikitext-2/wiki.train.tokens and wiki.valid.tokens (e.g. ../shared/data)")
    return None


def configurations(preset_name: str, dtype: str, data_dir=None, output_dir=None) -> list[dict]:
    """Every configuration of the decoding suites for the suites.py preset of this name (none for a preset not named
    here)."""
    if preset_name not in PRESETS:
        return []
    sizes = PRESETS[preset_name]
    return (_image_configurations(sizes, dtype) + _assisted_configurations(sizes, dtype, data_dir, output_dir)
            + _compiled_step_configurations(sizes, dtype))


def _image_configurations(sizes: dict, dtype: str) -> list[dict]:
    images = sizes["images"]
    k, block = images["linformer_k"], images["linformer_block"]
    models = (("gpt2 sdpa (key/value cache)", "gpt2", {}), ("linear attention (elu, state)", "linear_gpt2", {}),
              (f"causal linformer k={k} b={block}", "linformer_gpt2", {"k": k, "block": block}))
    specs = []
    for n, layers in images["lengths"].items():
        # no bos / eos inside a 256-symbol vocabulary: every sequence runs to its full length
        dims = {**images["dims"], "n_layer": layers, "bos_token_id": None, "eos_token_id": None}
        for method, model, extra in models:
            specs.append({"kind": "images", "n": n, "method": method, "model": model, "dtype": dtype,
                          "vocab_size": IMAGE_VOCABULARY, "dims": dims, "n_layer": layers,
                          "n_embd": images["dims"]["n_embd"], "dropout": False,
                          "batch_sizes": images["batch_sizes"], "budget": images["budget"],
                          "repeats": images["repeats"], "memory_cap_gb": images["memory_cap_gb"],
                          "peak_size": sizes["peak_size"], **extra})
    return specs


def _assisted_configurations(sizes: dict, dtype: str, data_dir, output_dir) -> list[dict]:
    assisted = sizes["assisted"]
    # both models are trained at this length: the longest prompt, the new tokens, and the candidates a draft or a
    # lookup proposes past the last new token before the target verifies them (a quick run at 4,096 hit that)
    overshoot = max(ASSISTANT_SETTINGS["num_assistant_tokens"], assisted["prompt_lookup_num_tokens"])
    positions = max(assisted["contexts"]) + assisted["new_tokens"] + overshoot
    problem = data_problem(data_dir)
    # the first context's process trains both models (unless cached): it may run past the preset's usual timeout
    common = {"kind": "assisted", "method": "greedy / assisted / prompt lookup", "dtype": dtype,
              "timeout": assisted["timeout"],
              "new_tokens": assisted["new_tokens"], "repeats": assisted["repeats"],
              "prompt_lookup_num_tokens": assisted["prompt_lookup_num_tokens"], "assistant": ASSISTANT_SETTINGS,
              "target": {**assisted["target"], "n_positions": positions},
              "draft": {**assisted["draft"], "n_positions": positions}, "training": assisted["training"],
              "data_dir": str(Path(data_dir or DEFAULT_DATA_DIR).expanduser().resolve()),
              "cache_dir": str((Path(output_dir or "outputs/benchmarks") / "assisted_models").resolve()),
              **({"skipped": problem} if problem else {})}
    return [{**common, "context": context} for context in assisted["contexts"]]


def _compiled_step_configurations(sizes: dict, dtype: str) -> list[dict]:
    step = sizes["compiled_step"]
    return [{"kind": "compiled_step", "context": step["context"], "batch": batch, "model": "linear_gpt2",
             "method": "DecoderStateStep: eager vs torch.compile(fullgraph=True)", "dtype": dtype,
             "dims": {**step["dims"], "bos_token_id": None, "eos_token_id": None},  # random tokens, no text
             "n_layer": step["dims"]["n_layer"], "n_embd": step["dims"]["n_embd"],
             "vocab_size": step["vocab_size"], "dropout": False, "warmup": step["warmup"], "steps": step["steps"],
             "peak_size": sizes["peak_size"]} for batch in step["batch_sizes"]]


# ----------------------------------------------------------------------------------------------------- helpers


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _resident_bytes() -> int:
    return rss_bytes("VmRSS")


def _available_bytes() -> int | None:
    """MemAvailable of the machine (Linux), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _matmul_peak(spec: dict, device: str) -> float:
    return matmul_peak(getattr(torch, spec["dtype"]), device, size=spec["peak_size"])


# ------------------------------------------------------------------------------------------------------- images


class GenerationGuard:
    """A generate() stopping criterion that ends a run over its time budget or its memory cap, and says which.

    On CPU the cap is on the process's resident set: stopping there is how a CPU run finds "the largest batch that
    fits" without being killed. On CUDA an out-of-memory error ends the run instead (caught by the caller). Given
    the number of tokens to generate, it also stops a run whose pace over its first 5% of tokens (at least 8)
    already projects past the budget: a batch that cannot fit costs that much, not the whole budget. The
    projection assumes a constant cost per token, which underestimates where the cost grows (a key/value cache),
    and the caller runs it after a warm-up generation, so the first tokens are not slower than the rest.
    """

    def __init__(self, budget: float, memory_cap: int | None, device: str, new_tokens: int | None = None,
                 clock=time.perf_counter):
        self.budget, self.memory_cap, self.device, self.new_tokens, self.clock = (budget, memory_cap, device,
                                                                                  new_tokens, clock)
        self.start, self.stopped, self.tokens = clock(), None, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.tokens += 1  # called once per generated token
        elapsed = self.clock() - self.start
        if self.stopped is not None:
            pass  # the first reason stands
        elif elapsed > self.budget:
            self.stopped = f"over the {self.budget:.0f} s budget"
        elif self.device == "cpu" and self.memory_cap and _resident_bytes() > self.memory_cap:
            self.stopped = f"resident set over the {self.memory_cap / 2**30:.1f} GiB cap"
        elif self.new_tokens and self.tokens >= max(8, self.new_tokens // 20):
            projected = elapsed * self.new_tokens / self.tokens
            if projected > self.budget:
                self.stopped = (f"projected {projected:.0f} s at the pace of its first {self.tokens} tokens, over the "
                                f"{self.budget:.0f} s budget")
        return torch.full((input_ids.shape[0],), self.stopped is not None, dtype=torch.bool, device=input_ids.device)


def _generate_images(model, batch: int, spec: dict, device: str, memory_cap: int | None) -> dict:
    """Images / s of whole sequences at one batch size: median of up to `repeats` sampled generations after a
    short warm-up generation, or why the batch did not fit (time budget, memory cap, out of memory)."""
    from transformers import StoppingCriteriaList

    n = spec["n"]
    start = torch.zeros((batch, 1), dtype=torch.long, device=device)
    # top_k=0: sample from the whole distribution, as the paper samples pixels; pad 0 with an explicit mask, so no
    # start token is taken for padding
    kwargs = dict(attention_mask=torch.ones_like(start), do_sample=True, top_k=0, pad_token_id=0,
                  return_dict_in_generate=True)
    times, completed = [], None
    try:
        with torch.no_grad():
            model.generate(start, max_new_tokens=min(8, n - 1), **kwargs)  # warm-up: every code path, short
            while True:
                torch.manual_seed(len(times))
                guard = GenerationGuard(spec["budget"], memory_cap, device, new_tokens=n - 1)
                _synchronize(device)
                began = time.perf_counter()
                out = model.generate(start, max_new_tokens=n - 1, stopping_criteria=StoppingCriteriaList([guard]),
                                     **kwargs)
                _synchronize(device)
                seconds = time.perf_counter() - began
                if guard.stopped and times:
                    break  # a repeat slower than the first (a busy machine): the completed runs stand
                if guard.stopped:
                    return {"batch": batch, "stopped": f"{guard.stopped} after {out.sequences.shape[1]} of {n} tokens"}
                if out.sequences.shape != (batch, n):
                    raise RuntimeError(f"generated {tuple(out.sequences.shape)}, expected {(batch, n)}")
                times.append(seconds)
                completed = out
                # the budget bounds the timed runs too: at least one, more while they fit
                if len(times) >= spec["repeats"] or sum(times) + seconds > spec["budget"]:
                    break
    except torch.OutOfMemoryError:
        if device == "cuda":
            torch.cuda.empty_cache()
        return {"batch": batch, "stopped": "out of memory"}
    seconds = statistics.median(times)
    return {"batch": batch, "seconds": seconds, "images_per_second": batch / seconds, "timed_runs": len(times),
            "cache_bytes": cache_bytes(completed.past_key_values)}


def _images(spec: dict, device: str) -> dict:
    """Images / s at each batch size of the list, smallest first, until one does not fit; the headline figure is
    the one at the largest batch that fitted (the paper's rule), the best over batches is kept beside it."""
    model = decoder_model(spec, device, spec["n"]).to(getattr(torch, spec["dtype"])).eval()
    memory_cap = None
    if device == "cpu":
        available = _available_bytes()
        # the cap counts the whole process; never above 80% of what the machine has free at the start
        memory_cap = int(min(spec["memory_cap_gb"] * 2**30, 0.8 * (available + _resident_bytes()) if available
                             else float("inf")))
    runs = []
    for batch in spec["batch_sizes"]:
        runs.append(_generate_images(model, batch, spec, device, memory_cap))
        if "stopped" in runs[-1]:
            break  # a larger batch needs more time and memory still
    result = {"runs": runs, "memory_cap_bytes": memory_cap, "matmul_peak_gflops": _matmul_peak(spec, device)}
    fitted = [r for r in runs if "images_per_second" in r]
    if not fitted:
        return {**result, "failed": f"batch {runs[0]['batch']} did not fit: {runs[0]['stopped']}"}
    largest, best = fitted[-1], max(fitted, key=lambda r: r["images_per_second"])
    return {**result, "largest_batch": largest["batch"], "seconds": largest["seconds"],
            "images_per_second": largest["images_per_second"], "cache_bytes": largest["cache_bytes"],
            "best_images_per_second": best["images_per_second"], "best_batch": best["batch"],
            "next_batch_stopped": runs[-1].get("stopped")}


# ----------------------------------------------------------------------------------------------------- assisted


def _folder_name(role: str, config: dict, training: dict) -> str:
    """A cache folder name that changes whenever the model or its training would (so a preset reuses only its own)."""
    digest = hashlib.sha256(json.dumps([config, training], sort_keys=True).encode()).hexdigest()[:10]
    return f"{role}-{config['n_layer']}x{config['n_embd']}-{digest}"


def _data_slice(files: dict[str, Path], training: dict, cache_dir: Path) -> dict[str, Path]:
    """The training files, or the first lines of each when the preset asks for a slice (smoke)."""
    if training["train_lines"] is None:
        return files
    folder = cache_dir / f"wikitext-2-first-{training['train_lines']}-{training['valid_lines']}-lines"
    folder.mkdir(parents=True, exist_ok=True)
    sliced = {}
    for split, lines in (("train", training["train_lines"]), ("validation", training["valid_lines"])):
        sliced[split] = folder / files[split].name
        if not sliced[split].is_file():
            with files[split].open(encoding="utf-8") as source:
                sliced[split].write_text("".join(line for _, line in zip(range(lines), source)), encoding="utf-8")
    return sliced


def pretrain_flags(folder: Path, model_config: Path, files: dict[str, Path], training: dict, steps: int,
                   positions: int, tokenizer: Path | None) -> list[str]:
    """scripts/pretrain.py flags for one of the two models (the draft reuses the target's tokenizer)."""
    flags = ["--output_dir", str(folder), "--model_config", str(model_config), "--train_file", str(files["train"]),
             "--validation_file", str(files["validation"]), "--tokenizer_vocab_size", str(training["vocab_size"]),
             "--max_seq_length", str(positions), "--per_device_train_batch_size", str(training["batch_size"]),
             "--per_device_eval_batch_size", str(training["batch_size"]), "--max_steps", str(steps),
             "--learning_rate", str(training["learning_rate"]), "--eval_steps", str(steps),
             "--save_steps", str(max(1, steps // 4)), "--max_eval_samples", str(training["eval_rows"]),
             "--logging_steps", str(max(1, steps // 10)), "--seed", "42"]
    return flags + (["--tokenizer_name_or_path", str(tokenizer)] if tokenizer else [])


def trained_models(spec: dict) -> dict:
    """The target and the draft, pretrained with scripts/pretrain.py's code on WikiText-2 (in this process) unless
    the cache folder already holds them; an interrupted training resumes from its last checkpoint on the next run.

    Returns {"target": record, "draft": record}, each with the folder, the pretrain.py command, the validation
    perplexity, the training seconds and whether this run trained it."""
    from hf_linear_attn.training.arguments import parse_arguments
    from hf_linear_attn.training.pretraining import PretrainArguments, checkpoints_in, run_pretraining

    cache_dir, training = Path(spec["cache_dir"]), spec["training"]
    files = _data_slice(wikitext_files(spec["data_dir"]), training, cache_dir)
    records, tokenizer = {}, None
    for role in ("target", "draft"):
        # the special ids of the tokenizer pretrain.py trains (<s> 0, <pad> 1, </s> 2); it sets them again itself
        config = {"model_type": "linear_gpt2", "feature_map": "elu", "vocab_size": training["vocab_size"],
                  "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                  "attn_pdrop": 0.0, **spec[role]}
        folder = cache_dir / _folder_name(role, config, {**training, "files": [str(f) for f in files.values()]})
        steps = training[f"{role}_steps"]
        model_config = cache_dir / f"{folder.name}.json"
        flags = pretrain_flags(folder, model_config, files, training, steps, spec[role]["n_positions"], tokenizer)
        trained_now, resumed = not (folder / "train_results.json").is_file(), False
        if trained_now:
            cache_dir.mkdir(parents=True, exist_ok=True)
            model_config.write_text(json.dumps(config, indent=2))
            resumed = bool(checkpoints_in(folder))
            # a folder without a checkpoint is a run killed before its first save: start it again
            extra = ["--resume", "True"] if resumed else ["--overwrite_output_dir", "True"] if folder.exists() else []
            args, _ = parse_arguments((PretrainArguments,), flags + extra)
            run_pretraining(args)
        results = json.loads((folder / "train_results.json").read_text())
        records[role] = {"folder": str(folder), "command": "python scripts/pretrain.py " + " ".join(flags),
                         "resumed_from_checkpoint": resumed,
                         "steps": steps, "batch_size": training["batch_size"], "sequence_length":
                         spec[role]["n_positions"], "perplexity": results.get("perplexity"),
                         "seconds": results.get("seconds_this_session"), "mixed_precision":
                         results.get("mixed_precision"), "trained_in_this_run": trained_now,
                         "data": {split: str(path) for split, path in files.items()}}
        tokenizer = folder  # the draft shares the target's vocabulary, or assisted decoding cannot compare tokens
    return records


@contextlib.contextmanager
def counting_drafts(model):
    """Count, while generate() runs on `model`, the draft tokens proposed and accepted and the verifying forwards.

    Wraps this model's candidate generator's update_candidate_strategy, which generate() calls once per verifying
    forward with the scores of the candidate tokens plus one (so candidates = scores.shape[1] - 1) and the number
    of them the target accepted."""
    counts = {"proposed": 0, "accepted": 0, "verifications": 0}
    original = model._get_candidate_generator

    def counted_generator(*args, **kwargs):
        generator = original(*args, **kwargs)
        update = generator.update_candidate_strategy

        def counted_update(input_ids, scores, num_matches):
            counts["proposed"] += scores.shape[1] - 1
            counts["accepted"] += int(num_matches)
            counts["verifications"] += 1
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = counted_update
        return generator

    model._get_candidate_generator = counted_generator  # this instance only; the class is left alone
    try:
        yield counts
    finally:
        del model._get_candidate_generator


def _first_difference(tokens: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _timed_calls(fn, repeats: int, device: str) -> tuple[list, float]:
    """(outputs of a warm-up call and `repeats` timed calls, median seconds of the timed ones)."""
    outputs, times = [fn()], []
    for _ in range(repeats):
        _synchronize(device)
        began = time.perf_counter()
        outputs.append(fn())
        _synchronize(device)
        times.append(time.perf_counter() - began)
    return outputs, statistics.median(times)


def held_out_prompt(tokenizer, validation: Path, context: int) -> list[int]:
    """The first `context` tokens of the validation text (tokenized line by line, only as far as needed)."""
    ids = []
    with validation.open(encoding="utf-8") as lines:
        for line in lines:
            ids += tokenizer(line, add_special_tokens=False).input_ids
            if len(ids) >= context:
                return ids[:context]
    raise ValueError(f"{validation} has {len(ids)} tokens, fewer than the {context}-token prompt: lower the context")


def _assisted(spec: dict, device: str) -> dict:
    """Greedy, assisted greedy and prompt-lookup greedy after the same real-text prompt, in one process (the three
    share the trained models and the greedy reference their tokens are checked against)."""
    if spec.get("skipped"):
        return {"skipped": spec["skipped"]}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_linear_attn  # noqa: F401  (registers the models)

    trained = trained_models(spec)
    dtype = getattr(torch, spec["dtype"])
    target = AutoModelForCausalLM.from_pretrained(trained["target"]["folder"]).to(device, dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(trained["draft"]["folder"]).to(device, dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(trained["target"]["folder"])
    context, new = spec["context"], spec["new_tokens"]
    prompt = torch.tensor([held_out_prompt(tokenizer, Path(trained["target"]["data"]["validation"]), context)],
                          device=device)
    # min_new_tokens: every method writes exactly `new` tokens (an end-of-text token would stop one early)
    common = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                  pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        _, prefill_seconds = _timed_calls(lambda: target.generate(prompt, **{**common, "max_new_tokens": 1,
                                                                             "min_new_tokens": 1}),
                                          spec["repeats"], device)
        methods, reference = [], None
        layers = spec["draft"]["n_layer"]
        # Transformers' default confidence threshold (0.4) ends a draft at the first token the draft is less sure
        # of; a briefly trained draft is rarely that sure (top probability about 0.02 here), so its drafts stay
        # short. The second assisted row drafts num_assistant_tokens every time (threshold 0).
        for method, extra, threshold in (
                ("greedy", {}, None),
                (f"assisted ({layers}-layer draft)", {"assistant_model": draft}, None),
                (f"assisted ({layers}-layer draft, confidence threshold 0)", {"assistant_model": draft}, 0.0),
                (f"prompt lookup ({spec['prompt_lookup_num_tokens']} tokens)",
                 {"prompt_lookup_num_tokens": spec["prompt_lookup_num_tokens"]}, None)):
            draft.generation_config.update(**{**spec["assistant"], **(
                {} if threshold is None else {"assistant_confidence_threshold": threshold})})
            with counting_drafts(target) as counts:
                outputs, seconds = _timed_calls(lambda: target.generate(prompt, **common, **extra), spec["repeats"],
                                                device)
            continuations = [o[0, context:].tolist() for o in outputs]
            reference = reference or continuations[0]
            differences = [_first_difference(c, reference) for c in continuations]
            row = {"method": method, "seconds": seconds, "tokens_per_second": new / seconds,
                   "tokens_per_second_after_prompt": (new - 1) / max(seconds - prefill_seconds, 1e-9),
                   "calls": len(outputs), "tokens_equal_greedy": all(d is None for d in differences),
                   "first_difference": next((d for d in differences if d is not None), None)}
            if extra:
                row.update(counts, acceptance_rate=counts["accepted"] / counts["proposed"] if counts["proposed"]
                           else None)
            methods.append(row)
    greedy = methods[0]
    for row in methods:
        row["speedup"] = row["tokens_per_second"] / greedy["tokens_per_second"]
        row["speedup_after_prompt"] = row["tokens_per_second_after_prompt"] / greedy["tokens_per_second_after_prompt"]
    return {"prefill_seconds": prefill_seconds, "methods": methods, "trained": trained,
            "greedy_distinct_fraction": len(set(reference)) / len(reference),
            "greedy_text": tokenizer.decode(reference)[:300]}


# ------------------------------------------------------------------------------------------------ compiled_step


def _per_token_seconds(step, ids, positions, state, start: int, warmup: int, steps: int, device: str) -> float:
    """Median seconds of one single-token step over `steps` tokens after `warmup` tokens, carrying the state."""
    times = []
    for t in range(start, start + warmup + steps):
        _synchronize(device)
        began = time.perf_counter()
        _, *state = step(ids[:, t:t + 1], positions[:, t:t + 1], *state)
        _synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times[warmup:])


def _weight_read_floor(model, device: str) -> dict:
    """A decoding step at a small batch reads every weight once (the tied output layer reads the whole embedding),
    so memory bandwidth bounds it from below: the weights' bytes over the read rate of a matrix-vector product with
    the output layer (median of 9 after a warm-up), measured here. No compiler takes a step under this floor."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    matrix = model.get_output_embeddings().weight.detach()
    vector = torch.randn(matrix.shape[1], device=device, dtype=matrix.dtype)
    with torch.no_grad():
        times = [timed_call(lambda: matrix @ vector, device) for _ in range(10)]
    bandwidth = matrix.numel() * matrix.element_size() / statistics.median(times[1:])
    return {"weight_bytes": weight_bytes, "read_bytes_per_second": bandwidth,
            "weight_read_floor_seconds": weight_bytes / bandwidth}


def _compiled_step(spec: dict, device: str) -> dict:
    """Per-token latency of DecoderStateStep, eager then compiled (fullgraph=True), from the same prefilled state;
    the compiled logits are checked against eager on the same inputs."""
    from hf_linear_attn import DecoderStateStep
    batch, context, warmup, steps = spec["batch"], spec["context"], spec["warmup"], spec["steps"]
    length = context + warmup + steps
    model = decoder_model(spec, device, length).to(getattr(torch, spec["dtype"])).eval()
    step = DecoderStateStep(model).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab_size"], (batch, length), generator=generator).to(device)
    positions = torch.arange(length, device=device).expand(batch, length)
    result = {"matmul_peak_gflops": _matmul_peak(spec, device), **_weight_read_floor(model, device)}
    with torch.no_grad():
        _, *state = step(ids[:, :context], positions[:, :context], *step.initial_state(batch))  # prefill
        eager = _per_token_seconds(step, ids, positions, state, context, warmup, steps, device)
        result.update(eager_seconds_per_token=eager, eager_tokens_per_second=batch / eager)
        try:
            compiled = torch.compile(step, fullgraph=True)
            _synchronize(device)
            began = time.perf_counter()
            got = compiled(ids[:, context:context + 1], positions[:, context:context + 1], *state)
            _synchronize(device)
            result["compile_seconds"] = time.perf_counter() - began  # the first call traces and compiles
        except Exception as error:  # noqa: BLE001  (no C++ compiler, an unsupported backend: the row says so)
            return {**result, "compiled_failed": f"{type(error).__name__}: {str(error)[:200]}"}
        want = step(ids[:, context:context + 1], positions[:, context:context + 1], *state)
        scale = want[0].float().abs().max().item()
        result["compiled_max_difference"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        result["compiled_relative_difference"] = (got[0].float() - want[0].float()).abs().max().item() / scale
        seconds = _per_token_seconds(compiled, ids, positions, state, context, warmup, steps, device)
    return {**result, "compiled_seconds_per_token": seconds, "compiled_tokens_per_second": batch / seconds,
            "speedup": eager / seconds}


KINDS = {"images": _images, "assisted": _assisted, "compiled_step": _compiled_step}


# ------------------------------------------------------------------------------------------------ tables, plots


def _cell(row: dict, key: str, fmt) -> str:
    value = row.get(key)
    return fmt(value) if value is not None else failure(row, key)


def _ratio_cell(value, reference) -> str:
    return f"{value / reference:,.2f}x" if value is not None and reference else "-"


def image_ratios(results: list[dict]) -> dict[tuple[int, str], float]:
    """{(n, method): images / s over GPT-2's at the same n}, each model at its own largest batch that fitted."""
    rows = [r for r in results if r["kind"] == "images"]
    gpt2 = {r["n"]: r.get("images_per_second") for r in rows if r["model"] == "gpt2"}
    return {(r["n"], r["method"]): r["images_per_second"] / gpt2[r["n"]] for r in rows
            if r.get("images_per_second") and gpt2.get(r["n"])}


def _megabytes(value: int) -> str:
    return f"{value / 2**20:.3g}"  # significant digits: small models' caches are kilobytes


def _image_tables(rows: list[dict]) -> list[str]:
    ratios = image_ratios(rows)
    first = rows[0]
    out = ["### Image generation, \"Transformers are RNNs\" Tables 1-2 shape: images / s (vocabulary 256, whole "
           "sequences sampled from a 1-token start, GPT-2 = 1x)", "",
           f"Largest batch that fits: batch sizes {first['batch_sizes']} are tried in order, each in the same process "
           "for one model and length, until one does not fit; a batch fits when its whole generation finishes within "
           f"the {first['budget']} s budget and, on CPU, with the process's resident set under "
           f"{first['memory_cap_gb']} GiB (and under 80% of the memory free at the start); on CUDA, without running "
           "out of memory; a run whose pace over its first 5% of tokens projects past the budget is stopped there "
           "(the projection assumes a constant cost per token, an underestimate for GPT-2's growing one). Images / s "
           f"is the batch over the median time of its generations (up to {first['repeats']}, within the budget) after "
           "an 8-token warm-up generation. Each model is compared at its own largest batch, as the paper does. "
           + PAPER_SETUP_NOTE, "",
           "| n | method | layers x width | largest batch | s / batch | images / s | x GPT-2 | paper: linear x softmax "
           "| best images / s (batch) | cache MB at the end | next batch |", "|---" * 11 + "|"]
    for r in rows:
        anchor = PAPER_IMAGES.get(r["n"])
        paper = f"{anchor[1]:,}x ({anchor[0]})" if anchor and r["model"] == "linear_gpt2" else "-"
        best = (f"{r['best_images_per_second']:.3g} ({r['best_batch']})" if "best_images_per_second" in r
                else _failure_of(r))
        ratio = ratios.get((r["n"], r["method"]))
        out.append(f"| {r['n']} | {r['method']} | {r['n_layer']} x {r['n_embd']} | {_cell(r, 'largest_batch', str)} | "
                   f"{_cell(r, 'seconds', lambda v: f'{v:.2f}')} | "
                   f"{_cell(r, 'images_per_second', lambda v: f'{v:.3g}')} | "
                   f"{f'{ratio:,.2f}x' if ratio else '-'} | {paper} | {best} | "
                   f"{_cell(r, 'cache_bytes', _megabytes)} | {r.get('next_batch_stopped') or '-'} |")
    out += ["", "### Image generation: every batch size tried", "",
            "| n | method | batch | s / batch | images / s | cache MB at the end | did not fit |", "|---" * 7 + "|"]
    for r in rows:
        for run in r.get("runs", []):
            out.append(f"| {r['n']} | {r['method']} | {run['batch']} | "
                       f"{_cell(run, 'seconds', lambda v: f'{v:.2f}')} | "
                       f"{_cell(run, 'images_per_second', lambda v: f'{v:.3g}')} | "
                       f"{_cell(run, 'cache_bytes', _megabytes)} | {run.get('stopped', '')} |")
    return out + [""]


def _failure_of(row: dict) -> str:
    return row.get("failed") or row.get("skipped") or "-"


def _assisted_tables(rows: list[dict]) -> list[str]:
    out = ["### Assisted decoding: linear decoder, batch 1, greedy (tokens / s after a real-text prompt of `context` "
           "tokens)", "",
           "Tokens / s: new tokens over the median `generate()` time, prompt included; after the prompt: the new "
           "tokens but one over that time less the target's own prefill (a 1-token `generate()`), so the assisted "
           "row also pays its draft's prefill there. Acceptance: draft tokens the target accepted over those "
           "proposed, from the candidate generator's own update calls; tokens = greedy: every call's tokens equal "
           "plain greedy's (else the first position that differs). The draft runs with Transformers' defaults, set "
           f"explicitly: {ASSISTANT_SETTINGS}; the row named \"confidence threshold 0\" drafts "
           f"{ASSISTANT_SETTINGS['num_assistant_tokens']} tokens every time instead of stopping at the first token "
           "the draft is less sure of than the threshold.", "",
           "| context | method | s / call | tokens / s | x greedy | tokens / s after the prompt | x greedy | "
           "acceptance | accepted / proposed | verifying forwards | tokens = greedy |", "|---" * 11 + "|"]
    for r in rows:
        if "methods" not in r:
            out.append(f"| {r['context']} | {r['method']} | {_failure_of(r)} |" + " |" * 8)
            continue
        for m in r["methods"]:
            acceptance = f"{m['acceptance_rate']:.1%}" if m.get("acceptance_rate") is not None else "-"
            counts = f"{m['accepted']} / {m['proposed']}" if "proposed" in m else "-"
            equal = "yes" if m["tokens_equal_greedy"] else f"no (from token {m['first_difference']})"
            out.append(f"| {r['context']} | {m['method']} | {m['seconds']:.3f} | {m['tokens_per_second']:.1f} | "
                       f"{m['speedup']:.2f}x | {m['tokens_per_second_after_prompt']:.1f} | "
                       f"{m['speedup_after_prompt']:.2f}x | {acceptance} | {counts} | {m.get('verifications', '-')} | "
                       f"{equal} |")
    trained = next((r["trained"] for r in rows if "trained" in r), None)
    if trained:
        out += ["", "What was trained (scripts/pretrain.py's code, run in the benchmark's process, cached under the "
                "output folder and reused by later runs; linear attention, elu feature map, no dropout):", ""]
        for role in ("target", "draft"):
            record, dims = trained[role], rows[0][role]
            perplexity = f"{record['perplexity']:.1f}" if record.get("perplexity") else "-"
            layers = f"{dims['n_layer']} layer{'s' if dims['n_layer'] != 1 else ''}"
            when = ("in this run" if record["trained_in_this_run"] else "in an earlier run, reused") + (
                ", resumed from a checkpoint: the seconds are its last session's" if record["resumed_from_checkpoint"]
                else "")
            out.append(f"- {role}: {layers} x {dims['n_embd']}, {record['steps']} steps x batch "
                       f"{record['batch_size']} x {record['sequence_length']} tokens of WikiText-2 "
                       f"({record['data']['train']}), {record['seconds']} s of training ({when}; "
                       f"{record['mixed_precision']} mixed precision), validation perplexity {perplexity}; "
                       f"`{record['command']}`")
        samples = [r for r in rows if "greedy_text" in r]
        if samples:
            out += ["", "Small, briefly trained models write repetitive text, which a draft and a lookup predict more "
                    "easily than varied text: read the acceptance rates with that in mind. Share of distinct tokens "
                    "in the greedy continuation: "
                    + ", ".join(f"{r['greedy_distinct_fraction']:.0%} (context {r['context']})" for r in samples)
                    + f". Greedy continuation at context {samples[-1]['context']}: "
                    f"`{samples[-1]['greedy_text'][:160]!r}`"]
    return out + [""]


def _compiled_step_tables(rows: list[dict]) -> list[str]:
    first = rows[0]
    out = [f"### Compiled step: `DecoderStateStep` ({first['n_layer']} x {first['n_embd']} linear decoder, vocabulary "
           f"{first['vocab_size']}), eager vs `torch.compile(fullgraph=True)`", "",
           f"Per-token latency: one step adds a token to each of the batch's sequences; median over {first['steps']} "
           f"steps after {first['warmup']} warm-up steps, from the same state after a {first['context']}-token "
           "prefill; tokens / s: batch over that latency; compile s: the first compiled call (shorter when "
           "Inductor's on-disk cache already holds the graph); difference: largest |compiled - eager| of the logits "
           "over their largest |value| (same inputs); weight-read floor: the weights' bytes over the read rate of a "
           "matrix-vector product with the output layer, measured in the same process (a step reads every weight "
           "once, so no compiler goes under it).", "",
           "| context | batch | eager ms / step | compiled ms / step | speed-up | tokens / s eager | tokens / s "
           "compiled | compile s | difference | weights MB | read GB/s | weight-read floor ms |", "|---" * 12 + "|"]
    for r in rows:
        out.append(f"| {r['context']} | {r['batch']} | "
                   f"{_cell(r, 'eager_seconds_per_token', lambda v: f'{1000 * v:.3f}')} | "
                   f"{_cell(r, 'compiled_seconds_per_token', lambda v: f'{1000 * v:.3f}')} | "
                   f"{_cell(r, 'speedup', lambda v: f'{v:.2f}x')} | "
                   f"{_cell(r, 'eager_tokens_per_second', lambda v: f'{v:.1f}')} | "
                   f"{_cell(r, 'compiled_tokens_per_second', lambda v: f'{v:.1f}')} | "
                   f"{_cell(r, 'compile_seconds', lambda v: f'{v:.1f}')} | "
                   f"{_cell(r, 'compiled_relative_difference', lambda v: f'{v:.1e}')} | "
                   f"{_cell(r, 'weight_bytes', lambda v: f'{v / 2**20:,.0f}')} | "
                   f"{_cell(r, 'read_bytes_per_second', lambda v: f'{v / 1e9:.1f}')} | "
                   f"{_cell(r, 'weight_read_floor_seconds', lambda v: f'{1000 * v:.1f}')} |")
    return out + [""]


def tables(results: list[dict]) -> str:
    """Markdown tables of the decoding suites present in results ("" when none is)."""
    out = []
    for kind, render in (("images", _image_tables), ("assisted", _assisted_tables),
                         ("compiled_step", _compiled_step_tables)):
        rows = [r for r in results if r["kind"] == kind]
        if rows:
            out += render(rows)
    return "\n".join(out)


def plots(results: list[dict], folder: Path) -> list[Path]:
    """images.png (images / s against batch, one panel per length), assisted.png (tokens / s per method and context,
    acceptance written on the bars), compiled_step.png (ms / token, eager and compiled, per batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(figure, name):
        figure.tight_layout()
        figure.savefig(folder / name, dpi=120)
        plt.close(figure)
        written.append(folder / name)

    images = [r for r in results if r["kind"] == "images"]
    if images:
        lengths = sorted({r["n"] for r in images})
        figure, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False)
        for axis, n in zip(axes[0], lengths):
            for r in (r for r in images if r["n"] == n):
                points = [(run["batch"], run["images_per_second"]) for run in r.get("runs", [])
                          if "images_per_second" in run]
                if points:
                    axis.plot(*zip(*points), marker="o", label=r["method"])
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("batch")
            axis.set_ylabel("images / s")
            anchor = PAPER_IMAGES.get(n)
            axis.set_title(f"n = {n}" + (f" ({anchor[0].split(',')[0]}; paper: linear {anchor[1]:,}x)" if anchor
                                         else ""), fontsize=9)
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=7)
        save(figure, "images.png")

    assisted = [r for r in results if r["kind"] == "assisted" and "methods" in r]
    if assisted:
        figure, axis = plt.subplots(figsize=(7, 4))
        names = [m["method"] for m in assisted[0]["methods"]]
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            for j, r in enumerate(assisted):
                m = next(m for m in r["methods"] if m["method"] == name)
                bar = axis.bar(j + i * width, m["tokens_per_second"], width, color=f"C{i}",
                               label=name if j == 0 else None)
                if m.get("acceptance_rate") is not None:
                    axis.bar_label(bar, labels=[f"{m['acceptance_rate']:.0%}"], fontsize=7)
        axis.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(assisted))],
                        [f"context {r['context']}" for r in assisted])
        axis.set_ylabel("tokens / s (prompt included)")
        axis.set_title("greedy vs assisted vs prompt lookup (label: acceptance)", fontsize=9)
        axis.legend(fontsize=7)
        save(figure, "assisted.png")

    compiled = [r for r in results if r["kind"] == "compiled_step" and "eager_seconds_per_token" in r]
    if compiled:
        figure, axis = plt.subplots(figsize=(6, 4))
        for i, (key, label) in enumerate((("eager_seconds_per_token", "eager"),
                                          ("compiled_seconds_per_token", "torch.compile(fullgraph=True)"))):
            axis.bar([j + i * 0.4 for j in range(len(compiled))], [1000 * r.get(key, 0) for r in compiled], 0.4,
                     label=label)
        axis.set_xticks([j + 0.2 for j in range(len(compiled))], [f"batch {r['batch']}" for r in compiled])
        axis.set_ylabel("ms / step (a token for each sequence)")
        axis.set_title("DecoderStateStep per-token latency", fontsize=9)
        axis.legend(fontsize=7)
        save(figure, "compiled_step.png")
    return written
