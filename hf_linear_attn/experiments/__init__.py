"""Experiments on the models: benchmarks, the paper reproduction, long-range tasks and the Linformer projection
report, behind the scripts of the same names. Each writes its results into a folder of results/."""

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

