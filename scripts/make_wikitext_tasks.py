"""Build small question answering and multiple choice sets from real WikiText-2 text, for trying
`scripts/finetune.py --task_type question_answering / multiple_choice` offline. Synthetic tasks over real text
(cloze questions; the true next sentence among four), not SQuAD or SWAG: see experiments/wikitext_tasks.py.

    python scripts/make_wikitext_tasks.py --output_dir outputs/wikitext_tasks
    # -> outputs/wikitext_tasks/qa/{train,validation}.jsonl, choice/{train,validation}.csv, provenance.json

The data stays out of the checkout: write it under outputs/ (ignored by git) or a temporary folder.
"""

import argparse
import sys
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is beside scripts/, outside the package)

from experiments.wikitext_tasks import build_sets
from hf_linear_attn.training.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=str(REPO / "outputs" / "wikitext_tasks"))
    parser.add_argument("--data_dir", default=str(REPO.parent / "shared" / "data" / "wikitext-2"),
                        help="folder holding wiki.train.tokens and wiki.valid.tokens (default: ../shared/data)")
    parser.add_argument("--qa_train", type=int, default=2000, help="question answering training rows")
    parser.add_argument("--qa_validation", type=int, default=300)
    parser.add_argument("--choice_train", type=int, default=2000, help="multiple choice training rows")
    parser.add_argument("--choice_validation", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        counts = (args.qa_train, args.qa_validation, args.choice_train, args.choice_validation)
        if min(counts) < 1:
            raise UsageError(f"every row count must be at least 1 (got {counts})")
        written = build_sets(Path(args.data_dir), Path(args.output_dir), (args.qa_train, args.qa_validation),
                             (args.choice_train, args.choice_validation), args.seed)
    except UsageError as error:
        sys.exit(f"error: {error}")
    for name, path in written.items():
        print(f"{name}: {path}")
    return written


if __name__ == "__main__":
    main()
