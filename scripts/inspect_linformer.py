"""Report what training did to a Linformer checkpoint's projections E / F; optionally renormalise their rows.

    python scripts/inspect_linformer.py outputs/reproduce/cpu/pretrain/linformer-k-32
    python scripts/inspect_linformer.py outputs/reproduce/cpu/pretrain/linformer-k-32 \
        --renormalise value --output_dir /tmp/linformer-k-32-value-rows-1

The report gives, per projection, the row sums (1 for the pooling init), the mean weight inside and outside each
row's pooling window and the relative distance to pooling. --renormalise writes a copy whose chosen projections
(key, value, shared) have row sums 1 again, to fine-tune and compare (docs/reproduction.md). The
figures are of the stored E / F: a model with linformer_normalize_rows=True projects with their rows shifted to sum
1 over each example's tokens.
"""

import argparse
import json
import sys

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

from hf_linear_attn.training.errors import UsageError
from experiments.projection_report import PROJECTION_KINDS, format_report, renormalise_rows, report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a saved Linformer model folder (config.json, model.safetensors)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--renormalise", nargs="+", choices=PROJECTION_KINDS, help="projections to give row sums 1")
    parser.add_argument("--output_dir", help="where --renormalise writes the changed copy (a new folder)")
    args = parser.parse_args(argv)
    if args.renormalise and not args.output_dir:
        parser.error("--renormalise needs --output_dir (the original model is never overwritten)")
    try:
        rows = report(args.model)
        print(json.dumps(rows, indent=2) if args.json else format_report(rows))
        if args.renormalise:
            changed = renormalise_rows(args.model, args.output_dir, tuple(args.renormalise))
            print(f"wrote {args.output_dir}: row sums set to 1 in {len(changed)} tensors")
    except UsageError as error:
        sys.exit(f"error: {error}")
    return rows


if __name__ == "__main__":
    main()
