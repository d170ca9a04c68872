"""Attention distillation after conversion: train only the new parts so the student attends like its teacher.

Every layer is trained at once on the teacher's own inputs to that layer (its hidden states), as in Hedgehog
(Zhang et al. 2024), so one teacher forward gives the targets of all layers and a layer never chases the drift of
the layers below it:
- linear attention (a learnable feature map, e.g. hedgehog): the student's normalised rows
  phi(q_i).phi(k_j) / sum_j' phi(q_i).phi(k_j') against the teacher's softmax rows, by cross-entropy (reported as
  KL divergence, zero when they agree);
- Linformer (E / F): the layer output against the teacher's, by relative squared error.
A window's factor is first calibrated per head (calibrate_window_factors), and the "output" objective then trains
the same new parts end to end against the teacher's last hidden state (output_loss; output_agreement measures it).
The shared weights stay frozen; fine-tune the result with the pipeline scripts as any checkpoint.
"""

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from hf_linear_attn import family_of
from hf_linear_attn.training.errors import UsageError

from .convert import SOURCE_TYPES


@dataclass
class DistillationRows:
    """Distillation inputs: (N, n) token ids, their attention mask (1 = a real token) and, for sentence pairs, their
    token types. Packed text fills every row (mask all ones, token types None: all zero); sentence pairs
    ([CLS] a [SEP] b [SEP], as a classifier reads them) are padded, and a selection of rows drops the columns that
    are padding in all of them, so a batch of short pairs costs what its longest pair does."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    token_type_ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.attention_mask is None:
            self.attention_mask = torch.ones_like(self.input_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index) -> "DistillationRows":
        """The rows at `index` (an int, a slice or a tensor of indices), as a batch."""
        if isinstance(index, int):
            index = slice(index, index + 1 or None)
        mask = self.attention_mask[index]
        width = int(mask.any(0).nonzero().max()) + 1 if mask.any() else mask.shape[-1]  # padding is on the right
        types = None if self.token_type_ids is None else self.token_type_ids[index][:, :width]
        return DistillationRows(self.input_ids[index][:, :width], mask[:, :width], types)

    def inputs(self) -> dict:
        """The model's keyword arguments: the mask only where some token is padding, token types only where the rows
        have them (packed rows run exactly as plain ids do)."""
        mask = {} if bool(self.attention_mask.all()) else {"attention_mask": self.attention_mask}
        types = {} if self.token_type_ids is None else {"token_type_ids": self.token_type_ids}
        return {"input_ids": self.input_ids, **mask, **types}

    def targets(self, teacher):
        """The teacher's per-layer inputs and attention rows for these rows (teacher_targets)."""
        return teacher_targets(teacher, self.input_ids, self.attention_mask, self.token_type_ids)


def as_rows(rows) -> DistillationRows:
    """DistillationRows, or an (N, n) tensor of packed token ids (every token real)."""
    return rows if isinstance(rows, DistillationRows) else DistillationRows(rows)


def _is_encoder(model) -> bool:
    """A RoBERTa-style model: one of this package's encoders, or a RoBERTa-family teacher they convert from."""
    family = family_of(model)
    return family.kind == "encoder" if family else model.config.model_type in SOURCE_TYPES["encoder"]


def _layers(model):
    base = model.base_model
    return (base.encoder.layer, base.encoder.shared_projection) if _is_encoder(model) else (base.h, base.shared_projection)


def distillation_mode(model) -> str:
    """'attention' for linear-attention students, 'layer_output' for Linformer students (see ModelFamily)."""
    return family_of(model).distillation_mode


def trainable_parameters(model, new_names) -> list[torch.nn.Parameter]:
    """The parameters among the conversion's new tensors (E / F, feature maps); an error if there are none."""
    parameters = dict(model.named_parameters())
    trainable = [parameters[name] for name in new_names if name in parameters]
    if not trainable:
        feature_map = getattr(model.config, "feature_map", None)
        raise UsageError(
            f"Nothing to distill: the {model.config.model_type} student has no new learnable parameters"
            + (f" (feature map {feature_map!r} has none)" if feature_map else "")
            + ". Convert with a learnable feature map (feature_map='hedgehog') or skip distillation."
        )
    return trainable


def teacher_targets(teacher, input_ids, attention_mask, token_type_ids=None):
    """The teacher's per-layer inputs (hidden states) and softmax attention rows, without gradients."""
    if getattr(teacher.config, "_attn_implementation", "eager") != "eager":
        teacher.set_attn_implementation("eager")  # SDPA and flash kernels return no attention weights
    with torch.no_grad():
        types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        out = teacher(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                      output_attentions=True, **types)
    if not out.attentions or any(a is None for a in out.attentions):
        raise UsageError("The teacher returned no attention weights; load it with attn_implementation='eager'.")
    return out.hidden_states, out.attentions


def _attention(student, layer):
    """A layer's attention module (the one holding the feature map and the window factor)."""
    return layer.attention.self if _is_encoder(student) else layer.attn


def _row_cross_entropy(student, layer, inputs, teacher_weights, key_mask, shared) -> torch.Tensor:
    """(B, H, n) cross-entropy of one layer's student attention rows against the teacher's rows."""
    if _is_encoder(student):
        _, weights = layer.attention.self(inputs, key_mask, True, shared)
    else:
        _, weights, _, _ = layer.attn(layer.ln_1(inputs), key_mask=key_mask, output_attentions=True,
                                      shared_projection=shared)
    return -(teacher_weights * torch.log(weights.float().clamp_min(1e-12))).sum(-1)


def layer_losses(student, hidden_states, attentions, attention_mask, mode: str) -> list[torch.Tensor]:
    """One loss per layer: attention cross-entropy (mode 'attention') or relative output error ('layer_output')."""
    layers, shared = _layers(student)
    key_mask = attention_mask.bool()
    real = key_mask[:, None, :].float()  # (B, 1, n): average over real query rows only
    losses = []
    for index, layer in enumerate(layers):
        inputs = hidden_states[index]
        if mode == "attention":
            rows = _row_cross_entropy(student, layer, inputs, attentions[index], key_mask, shared)
            losses.append((rows * real).sum() / (real.sum() * rows.shape[1]))
        else:
            if _is_encoder(student):
                output, _ = layer(inputs, key_mask=key_mask, shared_projection=shared)
            else:
                output, _, _, _ = layer(inputs, key_mask=key_mask, shared_projection=shared)
                if index == len(layers) - 1:  # the teacher's last hidden state is after its final LayerNorm
                    output = student.base_model.ln_f(output)
            target = hidden_states[index + 1]
            error = ((output - target) ** 2).sum(-1) * key_mask
            losses.append(error.sum() / ((target**2).sum(-1) * key_mask).sum())
    return losses


CALIBRATION_GRID = tuple(float(x) for x in range(-16, 17))  # theta from -16 to 16, then refined (below)
CALIBRATION_REFINEMENT = (-0.75, -0.5, -0.25, 0.25, 0.5, 0.75)  # around each head's best grid value


@torch.no_grad()
def calibrate_window_factors(student, teacher, rows, grid=CALIBRATION_GRID,
                             refinement=CALIBRATION_REFINEMENT) -> list[list[float]] | None:
    """Set every head's window factor theta (g = exp(theta)) to the value whose attention rows are nearest the
    teacher's on `rows` (the grid, then steps of 0.25 around each head's best); returns the thetas per layer (None
    for layers without a window), or None without a window.

    Why: the window's exact terms are g exp(q.k / sqrt(d)) and the terms beyond it phi(q).phi(k), one normaliser for
    both, so g sets how much of each row the window takes. The right g depends on the feature map's scale against
    the teacher's scores, by orders of magnitude (hedgehog's phi(q).phi(k) is below 1, a pretrained model's
    exp(q.k / sqrt(d)) often far above), while distillation at lr 1e-2 moves theta by less than 1 in 100 steps, so
    from theta = 0 a converted MiniLM kept its band's keys far too heavy (docs/pretrained.md has the distances). A
    head's rows depend on its own theta only, so each pass sets every head at once (the same grid value for all, then
    each head's own refinement) and keeps each head's best.
    """
    layers, shared = _layers(student)
    factors = [getattr(_attention(student, layer), "window_factor", None) for layer in layers]
    if all(factor is None for factor in factors):
        return None
    was_training = student.training
    student.eval()
    batch = as_rows(rows)
    hidden, attentions = batch.targets(teacher)
    key_mask = batch.attention_mask.bool()
    real = key_mask[:, None, :].float()  # (B, 1, n): average over real query rows only
    chosen = []
    for index, (layer, factor) in enumerate(zip(layers, factors)):
        if factor is None:  # a full-attention layer of a hybrid, or a layer without a window
            chosen.append(None)
            continue
        theta = factor.log_factor

        def best_of(candidates: torch.Tensor) -> torch.Tensor:
            """(C, H) thetas -> (H,): each head's candidate with the least cross-entropy (the first on a tie)."""
            losses = []
            for values in candidates:
                theta.copy_(values)
                entropy = _row_cross_entropy(student, layer, hidden[index], attentions[index], key_mask, shared)
                losses.append((entropy * real).sum((0, 2)) / real.sum((0, 2)))  # per head
            return candidates.gather(0, torch.stack(losses).argmin(0)[None])[0]

        heads = theta.numel()
        coarse = best_of(torch.tensor(grid, dtype=theta.dtype)[:, None].expand(-1, heads))
        steps = torch.tensor((0.0, *refinement), dtype=theta.dtype)[:, None]  # 0 first: the coarse value wins ties
        best_theta = best_of(coarse[None] + steps)
        theta.copy_(best_theta)
        chosen.append([float(x) for x in best_theta])
    student.train(was_training)
    return chosen


def attention_entropy(attentions, attention_mask) -> float:
    """Mean entropy of the teacher's attention rows over real query positions (cross-entropy minus KL)."""
    real = attention_mask.bool()[:, None, :].float()
    total = 0.0
    for weights in attentions:
        rows = -(weights * torch.log(weights.clamp_min(1e-12))).sum(-1)
        total += float((rows * real).sum() / (real.sum() * rows.shape[1]))
    return total / len(attentions)


@torch.no_grad()
def distillation_distance(student, teacher, rows, batch_size: int = 8) -> float:
    """Mean over layers and rows: attention KL(teacher || student) in nats, or relative layer-output error."""
    mode = distillation_mode(student)
    rows = as_rows(rows)
    student_was_training = student.training
    student.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        hidden, attentions = batch.targets(teacher)
        losses = layer_losses(student, hidden, attentions, batch.attention_mask, mode)
        value = sum(float(v) for v in losses) / len(losses)
        if mode == "attention":
            value -= attention_entropy(attentions, batch.attention_mask)
        total, count = total + value * len(batch), count + len(batch)
    student.train(student_was_training)
    return total / count


def _last_hidden_states(student, teacher, batch: DistillationRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(the student's, the teacher's) last hidden state in float32, each running its own whole stack; the teacher's
    without gradients."""
    with torch.no_grad():
        theirs = teacher.base_model(**batch.inputs()).last_hidden_state.float()
    return student.base_model(**batch.inputs()).last_hidden_state.float(), theirs


def output_loss(student, teacher, rows) -> torch.Tensor:
    """Relative squared error of the student's last hidden state against the teacher's over the real tokens, the
    student running its whole stack on its own states (end to end)."""
    batch = as_rows(rows)
    ours, target = _last_hidden_states(student, teacher, batch)
    real = batch.attention_mask[..., None].float()
    return (((ours - target) ** 2) * real).sum() / ((target**2) * real).sum()


OBJECTIVES = ("layers", "output")


def distill(student, teacher, new_names, rows, steps: int, batch_size: int = 8, lr: float = 1e-2,
            seed: int = 0, progress: bool = True, objective: str = "layers") -> list[float]:
    """Train the student's new parameters for `steps` batches of `rows` (DistillationRows, or (N, n) packed token
    ids); returns the loss of each step.

    objective "layers": every layer at once on the teacher's own inputs to it (attention rows or layer outputs, the
    family's distillation mode); "output": the last hidden state against the teacher's, end to end, so the new
    parts of each layer also learn to correct what the layers below them got wrong (per-layer distillation cannot
    see how the layers' errors add up: after it a converted MiniLM's last hidden state kept a cosine of 0.90 with
    MiniLM's, docs/pretrained.md). Everything else in the student stays frozen (and is restored to trainable
    afterwards); both models run in evaluation mode (no dropout), the teacher without gradients.
    """
    if objective not in OBJECTIVES:
        raise UsageError(f"Unknown distillation objective {objective!r}: use one of {', '.join(OBJECTIVES)}.")
    if steps < 1 or batch_size < 1:
        raise UsageError(f"steps and batch_size must be positive, got {steps} and {batch_size}.")
    rows = as_rows(rows)
    if len(rows) == 0:
        raise UsageError("No distillation rows: the text corpus is empty or shorter than one row.")
    mode = distillation_mode(student)
    trainable = trainable_parameters(student, new_names)
    trainable_ids = {id(p) for p in trainable}
    frozen = [p for p in student.parameters() if p.requires_grad and id(p) not in trainable_ids]
    for parameter in frozen:
        parameter.requires_grad_(False)
    teacher.eval()
    student_was_training = student.training
    student.eval()
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(seed)
    history = []
    try:
        bar = tqdm(range(steps), desc=f"distilling ({mode if objective == 'layers' else objective})",
                   disable=not progress)
        for _ in bar:
            batch = rows[torch.randint(len(rows), (batch_size,), generator=generator)]
            if objective == "output":
                loss = output_loss(student, teacher, batch)
            else:
                hidden, attentions = batch.targets(teacher)
                losses = layer_losses(student, hidden, attentions, batch.attention_mask, mode)
                loss = torch.stack(losses).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            history.append(loss.item())
            bar.set_postfix(loss=f"{history[-1]:.4f}")
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
        student.train(student_was_training)
    return history


@torch.no_grad()
def output_agreement(student, teacher, rows, batch_size: int = 8) -> float:
    """Mean cosine similarity of the student's last hidden state to the teacher's, over every real token of `rows`: how
    close the whole converted stack is to its source. The attention distance is per layer and reads each layer on
    the teacher's own inputs, so it does not show how the layers' errors add up; this does (a pretrained encoder's
    fine-tuning starts from these states)."""
    student_was_training, teacher_was_training = student.training, teacher.training
    student.eval()
    teacher.eval()
    rows = as_rows(rows)
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        ours, theirs = _last_hidden_states(student, teacher, batch)
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)[batch.attention_mask.bool()]
        total, count = total + float(cosine.sum()), count + cosine.numel()
    student.train(student_was_training)
    teacher.train(teacher_was_training)
    return total / count


@torch.no_grad()
def language_model_quality(model, rows, tokenizer, batch_size: int = 8, seed: int = 0) -> dict:
    """Masked-LM (15% of non-special tokens replaced by <mask>, fixed seed) or causal-LM loss, perplexity, accuracy."""
    was_training = model.training
    model.eval()
    causal = not _is_encoder(model)
    generator = torch.Generator().manual_seed(seed)
    loss_sum, correct, count = 0.0, 0, 0
    rows = as_rows(rows)
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        ids, real = batch.input_ids, batch.attention_mask.bool()
        if causal:
            logits = model(**batch.inputs()).logits[:, :-1]
            labels = ids[:, 1:]
            chosen = real[:, 1:]
        else:
            special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
            chosen = (torch.rand(ids.shape, generator=generator) < 0.15) & ~special & real
            logits = model(**{**batch.inputs(), "input_ids": torch.where(chosen, tokenizer.mask_token_id, ids)}).logits
            labels = ids
        picked, targets = logits[chosen].float(), labels[chosen]
        loss_sum += float(torch.nn.functional.cross_entropy(picked, targets, reduction="sum"))
        correct += int((picked.argmax(-1) == targets).sum())
        count += int(chosen.sum())
    model.train(was_training)
    loss = loss_sum / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50)), "accuracy": correct / max(count, 1), "tokens": count}
