"""Experiments on the models, each behind a script of scripts/ and writing into a folder of results/:

- `reproduction/`: the Linformer paper's Table 2 comparison (scripts/reproduce.py, docs/reproduction.md);
- `long_range/`: LRA-style ListOps and Text, the copy task, training efficiency (scripts/long_range.py,
  docs/long_range.md);
- `demo.py`: what the two quick demos share (scripts/demo_encoders.py, scripts/demo_decoders.py);
- `projection_report.py`: what a Linformer checkpoint's projections do (scripts/inspect_linformer.py);
- `wikitext_tasks.py`: small synthetic question answering and multiple choice sets from WikiText-2 text
  (scripts/make_wikitext_tasks.py, docs/training.md).

Outside the installed package, beside scripts/: an experiment may need the checkout (presets in configs/, data in
../shared/data, the training scripts it launches); the wheel never does. A new experiment gets its own folder here,
named for what it is, with its runner in a module (not in `__init__.py`), its presets in configs/<name>/, its
results in results/<name>/ and its page in docs/. Speed and memory suites live in benchmarks/.
"""

from pathlib import Path

from hf_linear_attn.training.errors import UsageError


def find_preset(name: str, folder) -> Path:
    """A preset given by name (``folder/NAME.json``) or as a JSON file; a UsageError naming the known ones if none."""
    preset = Path(name)
    if not preset.suffix:
        preset = Path(folder) / f"{name}.json"
    if not preset.is_file():
        known = sorted(path.stem for path in Path(folder).glob("*.json"))
        raise UsageError(f"no preset {name!r}: use one of {known} or a JSON file")
    return preset
