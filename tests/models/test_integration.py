"""Works where RoBERTa / GPT-2 work: pipelines and Trainer (with gradient accumulation) on saved checkpoints."""

import pytest
import torch
from helpers import CORPUS, DECODER_VARIANTS, FAMILY_VARIANTS
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    DataCollatorForLanguageModeling,
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
    pipeline,
)


@pytest.mark.parametrize("variant", ["linformer-headwise", "linear-favor"])
def test_fill_mask_pipeline_from_a_saved_folder_matches_the_model(variant, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(FAMILY_VARIANTS[variant]()).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    fill = pipeline("fill-mask", model=str(tmp_path), top_k=3)
    text = "The quick brown <mask> jumps over the lazy dog."
    predictions = fill(text)
    inputs = tokenizer(text, return_tensors="pt")
    position = (inputs.input_ids[0] == tokenizer.mask_token_id).nonzero().item()
    with torch.no_grad():
        probs = model(**inputs).logits[0, position].softmax(-1)
    top = probs.topk(3)
    assert [p["token"] for p in predictions] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([p["score"] for p in predictions]), top.values, atol=1e-5, rtol=1e-4)


def test_text_classification_pipeline_matches_the_model(tokenizer):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(FAMILY_VARIANTS["linformer-layerwise"]()).eval()
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)
    texts = ["This movie was wonderful.", "A terrible film: boring, too long and badly written."]
    results = classify(texts)  # a padded batch of two lengths
    for text, result in zip(texts, results):
        with torch.no_grad():
            probs = model(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1)
        scores = {r["label"]: r["score"] for r in result}
        torch.testing.assert_close(torch.tensor([scores["LABEL_0"], scores["LABEL_1"]]), probs, atol=1e-5, rtol=1e-4)


def _train_one_step(tokenizer, tmp_path, batch_size, accumulation):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(FAMILY_VARIANTS["linear-elu"]())
    texts = CORPUS[:4]
    encoded = tokenizer(texts, truncation=True, max_length=32)
    dataset = [{"input_ids": ids, "attention_mask": m, "labels": i % 2}
               for i, (ids, m) in enumerate(zip(encoded["input_ids"], encoded["attention_mask"]))]
    args = TrainingArguments(
        output_dir=str(tmp_path / f"bs{batch_size}"), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_drop_last=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=DataCollatorWithPadding(tokenizer))
    trainer.train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trainer_gradient_accumulation_matches_a_full_batch(tokenizer, tmp_path):
    """Two micro-batches of 2 with accumulation must update exactly like one batch of 4 (same examples, same loss)."""
    full = _train_one_step(tokenizer, tmp_path, batch_size=4, accumulation=1)
    accumulated = _train_one_step(tokenizer, tmp_path, batch_size=2, accumulation=2)
    torch.manual_seed(0)
    initial = dict(AutoModelForSequenceClassification.from_config(FAMILY_VARIANTS["linear-elu"]()).named_parameters())
    moved = max((full[n] - initial[n]).abs().max().item() for n in full)
    assert moved > 1e-3  # the step really changed the weights
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["linear-elu", "linformer-headwise"])
def test_text_generation_pipeline_from_a_saved_folder_matches_generate(variant, tokenizer, tmp_path):
    from helpers import causal_lm

    model = causal_lm(variant)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), trust_remote_code=True)
    prompt = "Linear attention replaces the softmax"
    text = generator(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=False)[0]["generated_text"]
    inputs = tokenizer(prompt, return_tensors="pt")
    ids = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=1)
    assert text == tokenizer.decode(ids[0], skip_special_tokens=True)
    assert len(ids[0]) == inputs.input_ids.shape[1] + 10


def _train_causal_lm_one_step(tokenizer, tmp_path, batch_size, accumulation):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DECODER_VARIANTS["linformer-headwise"]())
    texts = [CORPUS[0], CORPUS[1] + " " + CORPUS[2], CORPUS[3], CORPUS[5]]  # very different lengths
    dataset = [{"input_ids": ids} for ids in tokenizer(texts, truncation=True, max_length=64)["input_ids"]]
    args = TrainingArguments(
        output_dir=str(tmp_path / f"clm-bs{batch_size}"), per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_drop_last=True,
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)  # right padding, labels -100 at pads
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator).train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trainer_accumulation_of_a_causal_lm_weights_every_token_like_one_batch(tokenizer, tmp_path):
    """Micro-batches with different token counts: the loss must be averaged over all tokens, not per micro-batch."""
    full = _train_causal_lm_one_step(tokenizer, tmp_path, batch_size=4, accumulation=1)
    accumulated = _train_causal_lm_one_step(tokenizer, tmp_path, batch_size=2, accumulation=2)
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], atol=1e-5, rtol=1e-4)
