"""Data for the training scripts, by what it is for: `files` (reading local files or a Hub dataset, the checks every
loader shares), `corpus` (pretraining text, its tokenizer and packing), `tasks` (a label per text: GLUE / IMDB or any
columns), `token_tasks` (a label per word, CoNLL-style), `qa_tasks` (extractive question answering, SQuAD format)
and `choice_tasks` (multiple choice, SWAG-style).

The names below keep the addresses `hf_linear_attn.training.data.X` that code outside the training package imports
(conversion, the experiments, older scripts); new code imports from the module that defines a name. `UsageError`
lives in `hf_linear_attn.training.errors`: it is here only for those older imports.
"""

from ..errors import UsageError  # noqa: F401  (old address; import it from training.errors)
from .corpus import load_text_corpus, pack_corpus, train_bpe_tokenizer  # noqa: F401
from .files import refuse_sources_inside  # noqa: F401
from .tasks import TASKS, Task, custom_task, encode_task, get_task, load_task_data  # noqa: F401
from .token_tasks import TokenTask, align_word_labels, encode_token_task  # noqa: F401
