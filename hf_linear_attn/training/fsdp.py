"""FSDP (fully sharded data parallel) through accelerate, on GPUs and on machines without GPUs.

accelerate 1.15 runs FSDP on GPUs only. On a machine without GPUs, `accelerate launch` with an FSDP config starts N
gloo processes whose `Accelerator(cpu=True)` is plain data parallel (DistributedType.MULTI_CPU): the FSDP settings
are dropped without a word, and accelerate's FSDP1 plugin refuses outright ("no available devices"). torch's FSDP2
(`fully_shard`) does run on gloo (FSDP1 does not: "FSDP needs a non-CPU accelerator device"), and accelerate's FSDP2
code (prepare, sharded `save_state` / `load_state`, `get_state_dict`) has nothing GPU-specific, so `use_fsdp_on_cpu`
switches such a run to FSDP2 with the launcher's settings. The configs are configs/accelerate/fsdp-*.yaml.
"""

import os
from contextlib import contextmanager

from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .errors import UsageError

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


def use_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Turn a CPU run that the launcher meant for FSDP (and accelerate set up as plain data parallel) into FSDP2."""
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise UsageError("the accelerate config asks for FSDP1 (fsdp_version 1), which needs GPUs (torch: 'FSDP "
                         "needs a non-CPU accelerator device'); on a machine without GPUs use fsdp_version: 2, as "
                         "configs/accelerate/fsdp-encoder.yaml and fsdp-decoder.yaml do")
    plugin = FullyShardedDataParallelPlugin()  # reads the launcher's FSDP_* settings, as accelerate does on GPUs
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


def check_wrap_classes(accelerator: Accelerator, model: nn.Module) -> None:
    """Refuse, before any training, an FSDP config naming layer classes this model does not have (accelerate stops
    with 'Could not find the transformer layer class' and no word on which config fits)."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    named = accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in named or [] if name not in present]
    if missing:
        found = ",".join(layer_classes(model)) or "none found"
        raise UsageError(f"the accelerate FSDP config wraps {', '.join(missing)}, which this {model.config.model_type} "
                         f"model does not have (its layers: {found}): use configs/accelerate/fsdp-encoder.yaml for "
                         "encoders, fsdp-decoder.yaml for decoders, or add --fsdp_transformer_layer_cls_to_wrap "
                         f"{found} to accelerate launch")


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
