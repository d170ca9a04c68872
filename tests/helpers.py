"""What several test files share: tiny configs of every family and variant, small inputs, the real data paths
and the training scripts' command lines. Fixtures live in conftest.py."""

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
import transformers

from hf_linear_attn import LinearGPT2Config, LinearRobertaConfig, LinformerConfig, LinformerGPT2Config

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

TINY = dict(
    vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=66, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)

# (name, config factory): every sharing mode and feature map of the two families
FAMILY_VARIANTS = {
    "linformer-none": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_sharing": "none", **kw}),
    "linformer-headwise": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": [8, 12], **kw}),
    "linformer-key-value": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_sharing": "key-value", **kw}),
    "linformer-layerwise": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_sharing": "layerwise", **kw}),
    "linformer-rows": lambda **kw: LinformerConfig(**{**TINY, "linformer_k": 8, "linformer_normalize_rows": True, **kw}),
    "linear-elu": lambda **kw: LinearRobertaConfig(**{**TINY, **kw}),
    "linear-relu": lambda **kw: LinearRobertaConfig(**{**TINY, "feature_map": "relu", **kw}),
    "linear-favor": lambda **kw: LinearRobertaConfig(**{**TINY, "feature_map": "favor", "num_random_features": 32, **kw}),
    "linear-hedgehog": lambda **kw: LinearRobertaConfig(**{**TINY, "feature_map": "hedgehog", **kw}),
    # band + linear attention: |i - j| < 5 exact, chunks of 4, so the band straddles chunks
    "linear-window": lambda **kw: LinearRobertaConfig(
        **{**TINY, "attention_window": 5, "linear_attention_chunk_size": 4, **kw}
    ),
    # a hybrid schedule: a linear layer, then RoBERTa's softmax attention
    "linear-hybrid": lambda **kw: LinearRobertaConfig(**{**TINY, "layer_types": ["linear_attention", "full_attention"], **kw}),
}

# GPT-2-shaped decoders; token ids follow the test tokenizer (<s>=0, <pad>=1, </s>=2). A wider init than GPT-2's
# makes random models produce varied tokens, so generation comparisons are not trivially equal.
TINY_DECODER = dict(
    vocab_size=300, n_positions=128, n_embd=32, n_layer=2, n_head=4, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0,
    attn_pdrop=0.0, bos_token_id=0, eos_token_id=2, pad_token_id=1, initializer_range=0.3,
)

# (name, config factory): every feature map and every sharing mode of the two decoder families. The causal
# Linformer uses blocks of 8 and k = 4, so short sequences already span several blocks.
DECODER_VARIANTS = {
    "linear-elu": lambda **kw: LinearGPT2Config(**{**TINY_DECODER, "linear_attention_chunk_size": 8, **kw}),
    "linear-relu": lambda **kw: LinearGPT2Config(**{**TINY_DECODER, "feature_map": "relu", **kw}),
    "linear-favor": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "feature_map": "favor", "num_random_features": 32, "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-hedgehog": lambda **kw: LinearGPT2Config(**{**TINY_DECODER, "feature_map": "hedgehog", **kw}),
    # window + linear attention: W = 5 with chunks of 4, so windows straddle chunks and short prompts leave it
    "linear-window": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "attention_window": 5, "linear_attention_chunk_size": 4, **kw}
    ),
    # a hybrid schedule: GPT-2's softmax attention (key/value cache) in layer 0, linear attention in layer 1
    "linear-hybrid": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "layer_types": ["full_attention", "linear_attention"], "linear_attention_chunk_size": 8, **kw}
    ),
    # decaying states: fixed per-head rates (RetNet's form; one head undecayed) and GLA's per-feature gate (on
    # hedgehog's 2 x 8 features, wider than the head), with chunks of 4 so that decays cross chunk boundaries
    "linear-decay": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "state_decay": "fixed", "decay_rates": [0.5, 0.8, 0.95, 1.0],
           "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-gated": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "state_decay": "gated", "feature_map": "hedgehog", "gate_low_rank_dim": 8,
           "linear_attention_chunk_size": 4, **kw}
    ),
    # the delta rule (DeltaNet): chunks of 4, so that its triangular solves and carried state cross chunk boundaries
    "linear-delta": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "state_update": "delta", "linear_attention_chunk_size": 4, **kw}
    ),
    "linformer-none": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 4, "linformer_block_size": 8, "linformer_sharing": "none", **kw}
    ),
    "linformer-headwise": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 4, "linformer_block_size": 8, **kw}
    ),
    "linformer-key-value": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 3, "linformer_block_size": 5, "linformer_sharing": "key-value", **kw}
    ),
    "linformer-layerwise": lambda **kw: LinformerGPT2Config(
        **{**TINY_DECODER, "linformer_k": 4, "linformer_block_size": 8, "linformer_sharing": "layerwise", **kw}
    ),
}

# linear_gpt2 with a short convolution on q, k, v (use_short_conv), combined with each kind of linear layer; chunks of
# 4 so that the convolution's context crosses chunk boundaries. Not in DECODER_VARIANTS: the whole decoder matrix
# costs ~25 s per variant, so the suites that want one name it (tests/models/test_short_conv.py covers them all).
CONV_VARIANTS = {
    "linear-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-window-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "attention_window": 5, "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-decay-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "conv_size": 3, "state_decay": "fixed",
           "decay_rates": [0.5, 0.8, 0.95, 1.0], "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-gated-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "state_decay": "gated", "gate_low_rank_dim": 8,
           "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-delta-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "state_update": "delta", "linear_attention_chunk_size": 4, **kw}
    ),
    # Gated DeltaNet: the delta rule with a per-head gate from the input, and the convolution, as its layers have
    "linear-gated-delta-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "state_update": "delta", "state_decay": "gated",
           "linear_attention_chunk_size": 4, **kw}
    ),
    # Kimi Delta Attention: the delta rule with a gate per key feature (delta_gate="feature"), the convolution, and
    # the output norm and sigmoid gate fla's KDA layer has
    "linear-kda-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "state_update": "delta", "state_decay": "gated",
           "delta_gate": "feature", "delta_output_norm": "rms_gated", "linear_attention_chunk_size": 4, **kw}
    ),
    "linear-hybrid-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "layer_types": ["full_attention", "linear_attention"],
           "linear_attention_chunk_size": 4, **kw}
    ),
    # GPT-2 + short conv: every layer softmax attention, each with the convolution (short_conv_on_full_attention)
    "gpt2-conv": lambda **kw: LinearGPT2Config(
        **{**TINY_DECODER, "use_short_conv": True, "short_conv_on_full_attention": True,
           "layer_types": ["full_attention", "full_attention"], **kw}
    ),
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Linear attention replaces the softmax by a feature map, so its cost grows linearly with the length.",
    "Linformer projects keys and values along the sequence to a fixed number of rows.",
    "This movie was wonderful, the acting was great and the story moved me.",
    "A terrible film: boring, too long and badly written.",
    "Transformers are RNNs: a causal linear attention model generates with a state of constant size.",
] * 20


def random_ids(batch, n, vocab=TINY["vocab_size"], seed=0):
    """Random non-special token ids (batch, n)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, n), generator=g)


def normal(generator: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    """torch.randn in ``dtype`` from a (CPU) generator, moved to the default device: the same numbers on every
    device."""
    return torch.randn(*shape, generator=generator, device=generator.device, dtype=dtype).to(torch.get_default_device())


def draw(generator: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    """float32 draws of :func:`normal`, then cast to ``dtype`` (bf16 inputs that round the float32 numbers)."""
    return normal(generator, *shape).to(dtype)


def uniform(generator: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    """torch.rand in ``dtype`` from a (CPU) generator, moved to the default device."""
    return torch.rand(*shape, generator=generator, device=generator.device, dtype=dtype).to(torch.get_default_device())


def qkv(b=2, h=3, n=10, d=8, seed=0, dtype=torch.float32):
    """Random queries, keys and values (b, h, n, d), on the default device."""
    g = torch.Generator().manual_seed(seed)
    return [draw(g, b, h, n, d, dtype=dtype) for _ in range(3)]


# Every Auto class an encoder checkpoint must open with.
AUTO_HEADS = [getattr(transformers, name) for name in (
    "AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification", "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering", "AutoModelForMultipleChoice")]


def causal_lm(variant, seed=0, **overrides):
    """A tiny causal LM of ``variant``; learned maps are perturbed from their identity start so they matter."""
    torch.manual_seed(seed)
    make = DECODER_VARIANTS[variant] if variant in DECODER_VARIANTS else CONV_VARIANTS[variant]
    model = transformers.AutoModelForCausalLM.from_config(make(**overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "feature_map" in name or "window_factor" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def left_padded_batch(prompts, pad_id=TINY_DECODER["pad_token_id"]):
    """Prompts of different lengths, left-padded into (ids, attention_mask)."""
    width = max(p.shape[-1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[-1]:] = prompt
        mask[row, width - prompt.shape[-1]:] = 1
    return ids, mask


# ------------------------------------------------------------------------------------- the training scripts

# Reviews for tiny fine-tuning runs (the base_model and review_files fixtures)
POSITIVE = ["a wonderful film, great acting", "I loved the story, moving and warm", "great, great fun",
            "the best movie this year", "beautifully acted and well written", "a gripping tale, superb"]
NEGATIVE = ["a terrible film, boring", "too long and badly written", "I hated every minute", "dull and slow",
            "the worst script ever", "awful acting, a waste of time"]


def write_rows(path, rows, delimiter=","):
    """Rows (the first one the header) into a CSV / TSV file without quoting; returns the path."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, delimiter=delimiter, quoting=csv.QUOTE_NONE, escapechar="\\")
        writer.writerows(rows)
    return path


WIKITEXT = SHARED_DATA / "wikitext-2"
GLUE = SHARED_DATA / "glue"


def data_missing(*paths) -> bool:
    """Whether a test needing these files or folders of ../shared/data may skip: only where one is absent and CI is not
    set (the data is always there in CI, so a missing file there fails the test instead of skipping it)."""
    return os.environ.get("CI", "").lower() != "true" and not all(Path(path).exists() for path in paths)


needs_data = pytest.mark.skipif(data_missing(WIKITEXT / "wiki.train.tokens", GLUE / "sst2"),
                                reason=f"real data not found at {SHARED_DATA} (see ../shared/data/README.md)")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PRESET_ENCODER_SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
PRESET_DECODER_SIZE = dict(n_embd=64, n_layer=2, n_head=2, n_inner=128)


def tiny_preset(tmp_path, preset: str, **overrides):
    """A configs/models/cpu preset shrunk for tests (same model type and attention settings)."""
    config = json.loads((REPO_ROOT / "configs" / "models" / "cpu" / f"{preset}.json").read_text())
    config.update(PRESET_DECODER_SIZE if "gpt2" in preset else PRESET_ENCODER_SIZE, **overrides)
    path = tmp_path / f"{preset}.json"
    path.write_text(json.dumps(config))
    return path


def pretrain_args(corpus, config, output_dir, *extra):
    """scripts/pretrain.py arguments for a tiny run on the ``corpus`` fixture."""
    return ["--model_config", str(config), "--output_dir", str(output_dir), "--train_file", str(corpus / "train.txt"),
            "--validation_file", str(corpus / "valid.txt"), "--tokenizer_vocab_size", "400", "--max_seq_length", "32",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "16", "--max_eval_samples", "32",
            "--logging_steps", "2", "--mixed_precision", "no", *map(str, extra)]


def replaced(args, **flags):
    """A copy of an argument list with the values of some flags replaced."""
    args = list(args)
    for flag, value in flags.items():
        args[args.index(f"--{flag}") + 1] = str(value)
    return args


def run_fresh_python(*args, cwd, timeout=300, **env) -> str:
    """``python ARGS`` in a fresh process, offline, run from ``cwd`` with an empty PYTHONPATH (as a user of a saved
    checkpoint runs it, without this checkout); ``env``: more variables. Its stdout; a non-zero exit fails the test."""
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**ENV, "PYTHONPATH": "", **env}, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_pretrain(args, launcher=(sys.executable,), check=True):
    """scripts/pretrain.py in a fresh process, as users run it."""
    proc = subprocess.run([*launcher, str(REPO_ROOT / "scripts" / "pretrain.py"), *args], capture_output=True,
                          text=True, timeout=600, env=ENV)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def weights(folder):
    """The state dict of a saved model folder."""
    return load_file(str(folder / "model.safetensors"))


def script_error(main, argv) -> str:
    """The message a script's main(argv) stops with (its sys.exit("error: ...")); fails the test if it runs on."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return str(exit_info.value.code)


# ------------------------------------------------------------------------- several processes, FSDP (accelerate)

ACCELERATE = shutil.which("accelerate", path=str(Path(sys.executable).parent))
SHARDED_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp"]  # FSDP's sharded checkpoint folders: one per process


def launch_command(launch_flags: list[str], script: str, args: list[str]) -> list[str]:
    """`accelerate launch FLAGS scripts/SCRIPT ARGS` as documented (run from the repository root), on a free port:
    other runs on this machine may hold accelerate's default 29500."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [ACCELERATE, "launch", *launch_flags, "--main_process_port", str(port), f"scripts/{script}", *map(str, args)]


def fsdp_command(config_name: str, args: list[str], script: str = "pretrain.py") -> list[str]:
    """The documented FSDP command: `accelerate launch --config_file configs/accelerate/CONFIG scripts/SCRIPT ...`."""
    return launch_command(["--config_file", f"configs/accelerate/{config_name}"], script, args)


def run_launch(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    """A launcher command (`launch_command`, `fsdp_command`) run from the repository root, offline."""
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=ENV, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def run_fsdp(config_name: str, args: list[str], script: str = "pretrain.py") -> str:
    """scripts/SCRIPT under FSDP with 2 processes (the configs' num_processes); returns what it printed."""
    proc = run_launch(fsdp_command(config_name, args, script))
    return proc.stdout + proc.stderr


def load_in_fresh_process(folder, auto_class: str, out_file, texts: list[str] | None = None) -> dict:
    """from_pretrained in a new Python process that never imports this package (the model's code comes from the
    folder, as on the Hub); its weights are written to `out_file`, what it saw is returned. `texts`: also their
    logits (the folder's tokenizer, padded to the longest), as lists of floats under "logits"."""
    code = f"""
import json, sys, torch, transformers
from safetensors.torch import save_file
model, info = transformers.{auto_class}.from_pretrained(sys.argv[1], trust_remote_code=True, output_loading_info=True)
save_file({{k: v.clone() for k, v in model.state_dict().items()}}, sys.argv[2])
texts = json.loads(sys.argv[3])
logits = None
if texts:
    tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model.eval()(**batch).logits.tolist()
print(json.dumps({{"class": type(model).__name__, "module": type(model).__module__,
                   "package_imported": "hf_linear_attn" in sys.modules, "logits": logits,
                   "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}}))
"""
    env = {**ENV, "PYTHONPATH": ""}  # the package is not importable there: the folder must hold the model's code
    proc = subprocess.run([sys.executable, "-c", code, str(folder), str(out_file), json.dumps(texts or [])],
                          capture_output=True, text=True, timeout=300, env=env, cwd=folder, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fla_stand_in(calls):
    """A stand-in for fla.ops.linear_attn.chunk_linear_attn with its interface ((B, T, H, K) layout, scale,
    initial_state, output_final_state, normalize), computed by this package's parallel form: the dispatch (layouts,
    state, masking, normaliser) is tested wherever the real kernel cannot run."""
    import hf_linear_attn.linear_attention as la

    def kernel(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True):
        calls.append(dict(shape=tuple(q.shape), scale=scale, normalize=normalize, dtype=q.dtype,
                          state_dtype=None if initial_state is None else initial_state.dtype,
                          keys=k.detach().clone(), values=v.detach().clone()))
        if initial_state is None:  # fla starts from a zero state
            initial_state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
        out, _ = la._chunkwise_parallel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), initial_state, 16)
        # fla sums the state in float32 (bf16 tiles multiplied into a float32 accumulator), with no bf16 rounding of
        # each chunk's K^T V as the parallel form's bf16 products have
        s_n = initial_state.float() + torch.einsum("bthk,bthv->bhkv", k.float(), v.float())
        return out.transpose(1, 2).to(v.dtype), (s_n if output_final_state else None)

    return kernel
