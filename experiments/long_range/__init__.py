"""Long-range evidence (issue 26): LRA-style ListOps and byte-level Text, the copy task of "Transformers are RNNs",
and LRA Table 2-style training efficiency, for this package's models against Transformers' own efficient models.

A preset (configs/long_range/NAME.json) gives each task one width / depth / heads / feed-forward width, its data,
budget and the models to compare; every model of a task is built by `models.build_encoder` / `build_decoder` from
those dims, trained by the one loop in `training` with the preset's optimizer and schedule and seed. The run is a
list of stages (`stages`), recorded in <output_dir>/records.json, so it resumes stage by stage; `report` writes
results.md / results.json / PNG plots from whatever has finished.

The code: `preset` (read, check, plan), `stages` (run, reuse, record), `tasks` (data), `models` (one builder per
compared model), `training` (the one loop), `efficiency` (one measurement in a fresh process), `report`, and
`runner`, which runs the stages and writes the report.
"""

from hf_linear_attn.training.errors import UsageError

from .models import DECODERS, ENCODERS
from .preset import TASKS, load_preset, plan, select
from .runner import profile, run, time_copy_steps

__all__ = ["ENCODERS", "DECODERS", "TASKS", "UsageError", "load_preset", "plan", "profile", "run", "select",
           "time_copy_steps"]
