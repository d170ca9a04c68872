"""What training did to a Linformer checkpoint's sequence projections E / F.

A projected key or value row i is sum_j E[i, j] x_j. With a pooling E (row sums 1) and near-uniform attention a
query receives the mean of its values; if training drives F's row sums to 0, every projected value is a contrast
(window mean minus sequence mean) and the sequence mean — what a document classifier reads at the <s> token — is
gone from every layer. The report shows row sums and the distance to pooling; ``renormalise_rows`` writes a copy whose
chosen projections have row sums 1 again (each row shifted by a constant), the diagnostic that measured this effect
(docs/reproduction.md).
"""

import json
import shutil
from pathlib import Path

import torch

from hf_linear_attn import pooling_matrix
from hf_linear_attn.training.errors import UsageError
from hf_linear_attn.training.sources import check_model_source

PROJECTION_KINDS = ("key", "value", "shared")


def projection_kind(name: str) -> str | None:
    """'key', 'value' or 'shared' for a Linformer projection parameter name, else None."""
    for kind in PROJECTION_KINDS:
        if name.endswith(f"{kind}_projection.weight"):
            return kind
    return None


def _weights_file(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder; pass a saved Linformer model folder (config.json, model.safetensors)")
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise UsageError(
            f"{folder} has {len(files)} .safetensors files; expected one model.safetensors (a model saved with "
            "save_pretrained; sharded checkpoints are not supported here)"
        )
    return files[0]


def load_projections(folder: str | Path) -> dict[str, torch.Tensor]:
    """The E / F tensors (num_matrices, k, n_max) of a saved model, by parameter name; an error if there are none."""
    from safetensors import safe_open

    file = _weights_file(folder)
    try:
        with safe_open(str(file), framework="pt") as handle:
            projections = {name: handle.get_tensor(name).float() for name in handle.keys() if projection_kind(name)}
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise UsageError(f"cannot read {file}: {error}") from error
    _require_projections(projections, file)
    return projections


def _require_projections(names, file: Path) -> None:
    if not any(projection_kind(name) for name in names):
        raise UsageError(f"{file} has no Linformer projections (*_projection.weight): not a Linformer checkpoint")


def projection_statistics(name: str, weight: torch.Tensor) -> dict:
    """Row sums, in-window / off-window means and relative distance of one (P, k, n_max) projection to pooling."""
    _, k, max_length = weight.shape
    pooling = pooling_matrix(k, max_length)
    in_window = pooling > 0
    row_sums = weight.sum(-1)
    return {
        "name": name,
        "shape": list(weight.shape),
        "row_sum_mean": row_sums.mean().item(),
        "row_sum_min": row_sums.min().item(),
        "row_sum_max": row_sums.max().item(),
        "in_window_mean": weight[:, in_window].mean().item(),
        "off_window_mean": weight[:, ~in_window].mean().item() if (~in_window).any() else 0.0,
        "distance_to_pooling": ((weight - pooling).norm() / (pooling.norm() * weight.shape[0] ** 0.5)).item(),
    }


def report(folder: str | Path) -> list[dict]:
    """projection_statistics for every projection of a saved model, in parameter order."""
    return [projection_statistics(name, weight) for name, weight in load_projections(folder).items()]


def format_report(rows: list[dict]) -> str:
    width = max([len("projection")] + [len(row["name"]) for row in rows])
    header = f"{'projection':<{width}} {'row sum (mean / min / max)':>28} {'in-window':>10} {'off-window':>11} {'to pooling':>11}"
    lines = [header]
    for row in rows:
        sums = f"{row['row_sum_mean']:.3f} / {row['row_sum_min']:.3f} / {row['row_sum_max']:.3f}"
        lines.append(
            f"{row['name']:<{width}} {sums:>28} {row['in_window_mean']:>10.4f} {row['off_window_mean']:>11.4f} "
            f"{row['distance_to_pooling']:>11.3f}"
        )
    return "\n".join(lines)


def renormalise_rows(folder: str | Path, output_dir: str | Path, kinds: tuple[str, ...]) -> list[str]:
    """Copy a saved model to ``output_dir`` with the rows of its ``kinds`` projections shifted to sum to 1.

    Each row gets the same constant added to all of its n_max entries, so its pattern (which positions it prefers)
    is kept and only its sum changes. Returns the names of the changed tensors.
    """
    from safetensors.torch import load_file, save_file

    unknown = set(kinds) - set(PROJECTION_KINDS)
    if unknown or not kinds:
        raise UsageError(f"choose projections to renormalise among {', '.join(PROJECTION_KINDS)}, got {kinds}")
    check_model_source(str(folder), "the model folder")  # a truncated or missing config.json: the copy would not load
    folder, output_dir = Path(folder), Path(output_dir)
    file = _weights_file(folder)
    if output_dir.resolve() == folder.resolve():
        raise UsageError("--output_dir must differ from the model folder: the original weights are never overwritten")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise UsageError(f"{output_dir} is not empty; pass a new folder")
    try:
        state = load_file(str(file))
    except Exception as error:  # safetensors raises its own error types for damaged files
        raise UsageError(f"cannot read {file}: {error}") from error
    _require_projections(state, file)
    changed = []
    for name, tensor in state.items():
        if projection_kind(name) in kinds:
            weight = tensor.float()
            weight = weight + (1.0 - weight.sum(-1, keepdim=True)) / weight.shape[-1]
            state[name] = weight.to(tensor.dtype).contiguous()
            changed.append(name)
    if not changed:
        raise UsageError(f"{file} has no {' / '.join(kinds)} projections to renormalise")
    ignore = shutil.ignore_patterns("*.safetensors", "checkpoints", "checkpoint-*", "stage.json")
    shutil.copytree(folder, output_dir, ignore=ignore, dirs_exist_ok=True)
    save_file(state, str(output_dir / file.name), metadata={"format": "pt"})
    (output_dir / "renormalised.json").write_text(json.dumps({"source": str(folder), "tensors": changed}, indent=2))
    return changed
