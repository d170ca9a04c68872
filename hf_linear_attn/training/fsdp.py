"""FSDP (fully sharded data parallel) through accelerate, on GPUs and on machines without GPUs.

accelerate 1.15 runs FSDP on GPUs only. On a machine without GPUs, `accelerate launch` with an FSDP config starts N
gloo processes whose `Accelerator(cpu=True)` is plain data parallel (DistributedType.MULTI_CPU): the FSDP settings
are dropped without a word, and accelerate's FSDP1 plugin refuses outright ("no available devices"). torch's FSDP2
(`fully_shard`) does run on gloo (FSDP1 does not: "FSDP needs a non-CPU accelerator device"), and accelerate's FSDP2
code (prepare, sharded `save_state` / `load_state`, `get_state_dict`) has nothing GPU-specific, so `use_fsdp_on_cpu`
switches such a run to FSDP2 with the launcher's settings. The configs are configs/accelerate/fsdp-*.yaml.

Fine-tuning (Trainer) asks for FSDP either the same way or with Trainer's own `--fsdp --fsdp_config ...`; Trainer
builds its Accelerator, and reads whether FSDP is on from it, inside `create_accelerator_and_postprocess`.
`TrainerFSDPMixin` switches that Accelerator the same way, so Trainer's own FSDP paths run (sharded checkpoints,
their resume), and saves the final model whole with the model's own class.
"""

import os
from contextlib import contextmanager

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from .errors import UsageError
from .launch import without_gpus

# What accelerate's save_state writes for the model and the optimizer under FSDP, by fsdp_state_dict_type:
# SHARDED_STATE_DICT: torch.distributed.checkpoint folders (.metadata and one __R_0.distcp per process), checked
# file by file against their .metadata (`checkpoints.file_problem`); FULL_STATE_DICT: whole files from process 0.
FSDP_STATE_PIECES = {
    "SHARDED_STATE_DICT": {"model weights": ["pytorch_model_fsdp_0"], "optimizer state": ["optimizer_0"]},
    "FULL_STATE_DICT": {"model weights": ["pytorch_model_fsdp.bin"], "optimizer state": ["optimizer.bin"]},
}


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP (`accelerate launch` with an FSDP config, or --use_fsdp)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def refuse_fsdp1_without_gpus(trainer_plugin_args: dict | None = None) -> None:
    """Refuse FSDP1 on a machine without GPUs, naming the fix: torch's FSDP1 stops there ("FSDP needs a non-CPU
    accelerator device") and accelerate's FSDP1 plugin before it ("There are currently no available devices
    found"). `trainer_plugin_args`: Trainer's `TrainingArguments.fsdp_plugin_args` (from --fsdp / --fsdp_config),
    which take the place of the launcher's config, as in Trainer."""
    if not without_gpus():
        return
    if trainer_plugin_args:
        if int(trainer_plugin_args.get("fsdp_version", 2)) == 1:
            raise UsageError("--fsdp_config asks for FSDP1 (version 1), which needs GPUs (torch: 'FSDP needs a "
                             "non-CPU accelerator device'); on a machine without GPUs use version 2, the default")
    elif fsdp_requested() and os.environ.get("FSDP_VERSION", "1") != "2":
        raise UsageError("the accelerate config asks for FSDP1 (fsdp_version 1), which needs GPUs (torch: 'FSDP "
                         "needs a non-CPU accelerator device'); on a machine without GPUs use fsdp_version: 2, as "
                         "configs/accelerate/fsdp-encoder.yaml and fsdp-decoder.yaml do")


def use_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None = None) -> None:
    """Turn a CPU run that the launcher (or Trainer's --fsdp flags: their `plugin`) meant for FSDP, and accelerate
    set up as plain data parallel, into FSDP2."""
    if plugin is None:
        refuse_fsdp1_without_gpus()
        plugin = FullyShardedDataParallelPlugin()  # reads the launcher's FSDP_* settings, as accelerate does on GPUs
    elif plugin.fsdp_version != 2:
        refuse_fsdp1_without_gpus({"fsdp_version": plugin.fsdp_version})
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    # accelerate keeps the distributed type in two places: PartialState's is copied into AcceleratorState whenever
    # one is made (save_state makes one), so both must say FSDP.
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def checkpoint_layout(accelerator: Accelerator) -> str | None:
    """The fsdp_state_dict_type of this run's checkpoints (which files hold model and optimizer); None without
    FSDP (model.safetensors and optimizer.bin)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    return accelerator.state.fsdp_plugin.state_dict_type.name


def layer_classes(model: nn.Module) -> list[str]:
    """Names of the classes stacked in the model's layer list (one entry per hidden layer)."""
    depth = model.config.num_hidden_layers  # GPT-2 configs map it to n_layer
    return sorted({type(layer).__name__ for module in model.modules()
                   if isinstance(module, nn.ModuleList) and len(module) == depth for layer in module})


def embedding_holders(model: nn.Module) -> set[str]:
    """Names of the classes of the modules that hold the model's input embeddings below them (the root excepted)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        return set()
    return {type(module).__name__ for module in model.modules()
            if module is not model and module is not embeddings and any(m is embeddings for m in module.modules())}


def check_wrap_classes(accelerator: Accelerator, model: nn.Module, trainer_flags: bool = False) -> None:
    """Refuse, before any training, FSDP wrap classes that accelerate (1.15) would stop on, naming the fix; with none
    named (Trainer's bare --fsdp), wrap the model's layers. `trainer_flags`: the classes came from Trainer's
    --fsdp_config, not from the launcher's config.

    - a class the model does not have: accelerate stops with 'Could not find the transformer layer class' and no
      word on which config fits;
    - a class holding the word embeddings (RobertaEmbeddings and this package's RobertaStyleEmbeddings):
      accelerate's FSDP2 shards the embeddings once more as a unit of their own, and torch's `fully_shard` stops on
      the already sharded weight ("Invariant encountered: value was None when it should not be"; nothing in that is
      CPU-specific). Without named classes accelerate wraps the model's `_no_split_modules`, which for RoBERTa-style
      encoders (stock ones too) list the embeddings: so a bare --fsdp failed so on every encoder; it wraps the
      layers instead.
    """
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    named = plugin.transformer_cls_names_to_wrap
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)  # a partial once prepared
    found = ",".join(layer_classes(model)) or "none found"
    if named is None:
        holders = embedding_holders(model) & set(getattr(model, "_no_split_modules", None) or [])
        if policy is transformer_auto_wrap_policy and holders and layer_classes(model):
            plugin.transformer_cls_names_to_wrap = layer_classes(model)
            if accelerator.is_main_process:
                print(f"FSDP: wrapping {found} (the model's layers), not accelerate's default, the model's "
                      f"_no_split_modules: with {', '.join(sorted(holders))} among them accelerate stops")
        return
    fix = (f"name {found} in --fsdp_config's transformer_layer_cls_to_wrap" if trainer_flags else
           "use configs/accelerate/fsdp-encoder.yaml for encoders, fsdp-decoder.yaml for decoders, or add "
           f"--fsdp_transformer_layer_cls_to_wrap {found} to accelerate launch")
    where = "--fsdp_config" if trainer_flags else "the accelerate FSDP config"
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in named if name not in present]
    if missing:
        raise UsageError(f"{where} wraps {', '.join(missing)}, which this {model.config.model_type} model does not "
                         f"have (its layers: {found}): {fix}")
    holding = [name for name in named if name in embedding_holders(model)]
    if holding:
        raise UsageError(f"{where} wraps {', '.join(holding)}, which holds the word embeddings: accelerate then "
                         "shards them once more on their own and torch stops ('Invariant encountered: value was "
                         f"None when it should not be'); wrap the layers only: {fix}")


def gathered_state_dict(accelerator: Accelerator, trained: nn.Module, model: nn.Module) -> dict | None:
    """Under FSDP: the whole model's weights gathered from every shard onto the main process (every process must
    call this; the others get {}), keyed as `model.state_dict()`; None without FSDP, where the model saves itself.
    `trained` is the prepared module, `model` itself or a module holding it (the masked-tokens loss)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    state = accelerator.get_state_dict(trained)
    if trained is not model:
        prefix = next(name for name, module in trained.named_modules() if module is model) + "."
        state = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    # Tied weights (the LM head's and the embeddings') come back as separate copies; save_pretrained recognises a
    # tie by shared storage, so point every name of one parameter at one tensor, as in an unsharded state dict.
    names_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for first, *others in names_of.values():
        for name in others:
            if first in state and name in state:
                state[name] = state[first]
    return state


@contextmanager
def original_class(model: nn.Module):
    """`model` with its own class for the duration (to be saved): FSDP2 makes a sharded module an instance of a
    class FSDP<Name> defined in torch, which save_pretrained would take for the model's code (auto_map pointing
    into torch's files, copied beside the weights)."""
    sharded = type(model)
    if isinstance(model, FSDPModule):
        model.__class__ = next(c for c in sharded.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = sharded


def trainer_checkpoint_layout(training) -> str | None:
    """The fsdp_state_dict_type of the checkpoints a Trainer run with these TrainingArguments will write, known
    before Trainer exists (to check the checkpoint it resumes from); None without FSDP, which a single process
    never runs (accelerate sets it up without FSDP)."""
    from transformers.training_args import ParallelMode

    if training.parallel_mode != ParallelMode.DISTRIBUTED or not (training.fsdp_plugin_args or fsdp_requested()):
        return None
    refuse_fsdp1_without_gpus(training.fsdp_plugin_args)  # the plugin below would fail obscurely
    # The plugin settles the type as Trainer's Accelerator will: Trainer's flags, else the launcher's settings
    plugin_args = training.fsdp_plugin_args or {}
    return FullyShardedDataParallelPlugin(**plugin_args).state_dict_type.name


def sharding_report(model: nn.Module, num_processes: int) -> str:
    """One line saying how a prepared model is sharded: its FSDP units and the share of its parameter values this
    process holds (under FSDP2 every parameter is a DTensor whose local part is this process's shard)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    units = sum(isinstance(module, FSDPModule) for module in model.modules())
    whole = sum(not isinstance(p, DTensor) for p in params)
    return (f"FSDP: {type(model).__name__} sharded over {num_processes} processes in {units} units: this process "
            f"holds {local:,} of {total:,} parameter values ({whole} parameters unsharded)")


class ShardingReport(TrainerCallback):
    """Prints `sharding_report` from the main process when training starts (the model is prepared by then): the
    log shows that the run is sharded, not silently data parallel."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and model is not None:
            print(sharding_report(model, args.world_size), flush=True)


class TrainerFSDPMixin:
    """For a transformers Trainer subclass: FSDP where the launcher or Trainer's --fsdp flags ask for it, also on a
    machine without GPUs (where accelerate would run plain data parallel), its layer classes checked before any
    training; and the final model (`save_model` outside checkpoints) saved whole, with the model's own class,
    whatever fsdp_state_dict_type the checkpoints use (Trainer saves no model at all under SHARDED_STATE_DICT)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_fsdp_enabled:
            self.add_callback(ShardingReport())

    def create_accelerator_and_postprocess(self) -> None:
        refuse_fsdp1_without_gpus(self.args.fsdp_plugin_args)  # else accelerate's "no available devices found"
        super().create_accelerator_and_postprocess()
        plugin_args = self.args.fsdp_plugin_args
        # Trainer's --fsdp flags also set ACCELERATE_USE_FSDP (its Accelerator does, given their plugin)
        if self.accelerator.distributed_type == DistributedType.MULTI_CPU and fsdp_requested():
            use_fsdp_on_cpu(self.accelerator, FullyShardedDataParallelPlugin(**plugin_args) if plugin_args else None)
            # Trainer reads whether FSDP is on (is_fsdp_enabled) and checks its FSDP settings right after making its
            # Accelerator: it makes one again, which now finds the shared accelerator state saying FSDP (and keeps
            # its plugin), so Trainer sets up exactly as under FSDP on GPUs
            super().create_accelerator_and_postprocess()
        check_wrap_classes(self.accelerator, self.model, trainer_flags=bool(plugin_args))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self.is_fsdp_enabled:
            return super().save_model(output_dir, _internal_call)
        if _internal_call:  # a checkpoint: Trainer's FSDP files; under FULL_STATE_DICT also a model folder
            with original_class(self.model):
                return super().save_model(output_dir, _internal_call)
        # The final model: every process sends its shards, the main process writes one ordinary model folder
        state = gathered_state_dict(self.accelerator, self.model, self.model)
        with original_class(self.model):
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)
        if self.args.push_to_hub:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
