"""The decoders with their state as explicit tensors: torch.export of the step and of the prompt pass (dynamic batch
and length), ONNX export run by onnxruntime, torch.compile(fullgraph=True)."""

import pytest
import torch
from helpers import causal_lm, left_padded_batch, random_ids

from hf_linear_attn.modeling_gpt2_style import DecoderPrefill, DecoderStateStep


def prefill_then_step(variant="linear-elu", batch=2, n=10):
    model = causal_lm(variant)
    step = DecoderStateStep(model).eval()
    ids = random_ids(batch, n + 1)
    positions = torch.arange(n + 1).expand(batch, n + 1)
    with torch.no_grad():
        logits, *state = step(ids[:, :n], positions[:, :n], *step.initial_state(batch))
    return model, step, ids, positions, state


def test_the_explicit_state_step_equals_the_cached_forward():
    model, step, ids, positions, state = prefill_then_step()
    with torch.no_grad():
        logits = step(ids[:, 10:], positions[:, 10:], *state)[0]
    torch.testing.assert_close(logits[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["linear-elu", "linear-favor", "linear-hedgehog"])
def test_torch_export_of_the_step_with_a_dynamic_batch_equals_eager(variant):
    model, step, ids, positions, state = prefill_then_step(variant)
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(
        step, (ids[:, 10:], positions[:, 10:], *state),
        dynamic_shapes=({0: batch}, {0: batch}, tuple({0: batch} for _ in state)),
    ).module()
    with torch.no_grad():
        for rows in (slice(0, 2), slice(1, 2)):  # the traced batch and another one
            args = (ids[rows, 10:], positions[rows, 10:], *(t[rows] for t in state))
            for got, want in zip(exported(*args), step(*args)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_step_compiles_as_one_graph_and_equals_eager():
    model, step, ids, positions, state = prefill_then_step()
    explanation = torch._dynamo.explain(step)(ids[:, 10:], positions[:, 10:], *state)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        for got, want in zip(compiled(ids[:, 10:], positions[:, 10:], *state), step(ids[:, 10:], positions[:, 10:], *state)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_cached_forward_has_no_graph_break_from_position_checks():
    """The old forward read int(position_ids.max()) on every call: a graph break (and a host sync) per forward."""
    model = causal_lm("linear-elu")
    ids = random_ids(2, 12)
    explanation = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explanation.graph_break_count == 0


def exported_prefill(model, example_batch=2, example_length=29):
    """torch.export of the prompt pass with a dynamic batch and length, traced at one (batch, length)."""
    prefill = DecoderPrefill(model).eval()
    ids = random_ids(example_batch, example_length)
    batch = torch.export.Dim("batch", min=1, max=64)
    length = torch.export.Dim("length", min=1, max=model.config.n_positions)
    return torch.export.export(
        prefill, (ids, torch.ones_like(ids)), dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length})
    ).module()


def states_of(cache):
    return [t for layer in cache.layers for t in layer.state]


@pytest.mark.parametrize("variant", [
    "linear-elu", pytest.param("linear-favor", marks=pytest.mark.slow), pytest.param("linear-hedgehog", marks=pytest.mark.slow),
])
def test_torch_export_of_the_prompt_pass_serves_every_length_from_one_program(variant):
    """One exported program (traced at batch 2, length 29) against the model's eager forward (the chunked scan form)
    at lengths on and off the chunk size (8), one token included, and other batch sizes."""
    model = causal_lm(variant)
    exported = exported_prefill(model)
    ids = random_ids(3, 40, seed=1)
    with torch.no_grad():
        for batch, n in ((2, 29), (1, 1), (3, 8), (2, 9), (3, 17), (1, 40)):
            logits, *state = exported(ids[:batch, :n], torch.ones(batch, n, dtype=torch.long))
            want = model(ids[:batch, :n], use_cache=True)
            torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-5)
            for got, expected in zip(state, states_of(want.past_key_values), strict=True):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_exported_prompt_pass_leaves_left_padding_out_of_the_state():
    """A left-padded batch through the exported program: each row's logits and state equal the row run alone."""
    model = causal_lm("linear-elu")
    exported = exported_prefill(model)
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 13, 9)]
    ids, mask = left_padded_batch(prompts)
    with torch.no_grad():
        logits, *state = exported(ids, mask)
        for row, prompt in enumerate(prompts):
            alone = model(prompt[None], use_cache=True)
            torch.testing.assert_close(logits[row, -len(prompt):], alone.logits[0], atol=1e-5, rtol=1e-5)
            for got, expected in zip(state, states_of(alone.past_key_values), strict=True):
                torch.testing.assert_close(got[row], expected[0], atol=1e-5, rtol=1e-5)


def test_the_step_continues_from_the_prompt_pass():
    model = causal_lm("linear-hedgehog")
    prefill, step = DecoderPrefill(model).eval(), DecoderStateStep(model).eval()
    ids = random_ids(2, 12)
    with torch.no_grad():
        _, *state = prefill(ids[:, :11], torch.ones(2, 11, dtype=torch.long))
        logits = step(ids[:, 11:], torch.full((2, 1), 11), *state)[0]
        torch.testing.assert_close(logits[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ ONNX, run by onnxruntime

def greedy_decode_onnx(prefill_session, step_session, input_ids, attention_mask, max_new_tokens, eos_token_id,
                       pad_token_id):
    """The greedy loop of docs/deployment.md on the two ONNX programs: prompt pass, then one step per new token;
    a row that has emitted EOS continues with pads, as generate() does. Returns the prompt and new tokens."""
    import numpy as np

    logits, *state = prefill_session.run(None, {"input_ids": input_ids, "attention_mask": attention_mask})
    step_inputs = [node.name for node in step_session.get_inputs()]
    position = attention_mask.sum(-1, keepdims=True)  # each row's next position: its count of real tokens
    finished = np.zeros(len(input_ids), dtype=bool)
    tokens = input_ids
    for _ in range(max_new_tokens):
        next_token = logits[:, -1].argmax(-1)
        next_token = np.where(finished, pad_token_id, next_token)[:, None]
        tokens = np.concatenate([tokens, next_token], axis=1)
        finished |= next_token[:, 0] == eos_token_id
        if finished.all():
            break
        logits, *state = step_session.run(None, dict(zip(step_inputs, [next_token, position, *state])))
        position = position + 1
    return tokens


def state_names(step, prefix):
    per_layer = len(step.initial_state(1)) // step.num_layers
    return [f"{prefix}.{layer}.{i}" for layer in range(step.num_layers) for i in range(per_layer)]


@pytest.fixture(scope="module")
def onnx_programs(tmp_path_factory):
    """The tiny linear-elu decoder's prompt pass and step exported to ONNX (dynamo) once, with onnxruntime sessions."""
    ort = pytest.importorskip("onnxruntime", reason="ONNX parity needs the onnx extra: pip install 'hf-linear-attn[onnx]'")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the onnx extra)")
    folder = tmp_path_factory.mktemp("onnx")
    model = causal_lm("linear-elu")
    prefill, step = DecoderPrefill(model).eval(), DecoderStateStep(model).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    length = torch.export.Dim("length", min=1, max=model.config.n_positions)
    ids = random_ids(2, 29)
    torch.onnx.export(
        prefill, (ids, torch.ones_like(ids)), folder / "prefill.onnx", dynamo=True, verbose=False,
        input_names=["input_ids", "attention_mask"], output_names=["logits", *state_names(step, "present")],
        dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}),
    )
    state = step.initial_state(2)
    torch.onnx.export(
        step, (ids[:, :1], torch.zeros(2, 1, dtype=torch.long), *state), folder / "step.onnx", dynamo=True,
        verbose=False, input_names=["input_ids", "position_ids", *state_names(step, "past")],
        output_names=["logits", *state_names(step, "present")],
        dynamic_shapes=({0: batch}, {0: batch}, tuple({0: batch} for _ in state)),
    )
    sessions = [ort.InferenceSession(folder / name, providers=["CPUExecutionProvider"]) for name in ("prefill.onnx", "step.onnx")]
    return model, prefill, step, *sessions


@pytest.mark.slow
def test_onnx_prompt_pass_equals_eager_at_every_length(onnx_programs):
    model, prefill, _, prefill_session, _ = onnx_programs
    ids = random_ids(3, 40, seed=2)
    with torch.no_grad():
        for batch, n in ((2, 29), (1, 1), (3, 8), (3, 17), (1, 40)):
            got = prefill_session.run(None, {"input_ids": ids[:batch, :n].numpy(), "attention_mask": torch.ones(batch, n, dtype=torch.long).numpy()})
            want = model(ids[:batch, :n], use_cache=True)
            torch.testing.assert_close(torch.from_numpy(got[0]), want.logits, atol=1e-5, rtol=1e-5)
            for onnx_state, expected in zip(got[1:], states_of(want.past_key_values), strict=True):
                torch.testing.assert_close(torch.from_numpy(onnx_state), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_onnx_steps_chained_equal_eager_steps(onnx_programs):
    """State in, logits and new state out, for three steps in a row, at the traced batch (2) and another (3)."""
    model, prefill, step, _, step_session = onnx_programs
    names = [node.name for node in step_session.get_inputs()]
    for batch in (2, 3):
        ids = random_ids(batch, 13, seed=batch)
        with torch.no_grad():
            _, *state = prefill(ids[:, :10], torch.ones(batch, 10, dtype=torch.long))
            onnx_state = [t.numpy() for t in state]
            for t in range(10, 13):
                token, position = ids[:, t : t + 1], torch.full((batch, 1), t)
                logits, *state = step(token, position, *state)
                onnx_logits, *onnx_state = step_session.run(None, dict(zip(names, [token.numpy(), position.numpy(), *onnx_state])))
                torch.testing.assert_close(torch.from_numpy(onnx_logits), logits, atol=1e-5, rtol=1e-5)
                for got, expected in zip(onnx_state, state, strict=True):
                    torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-5, rtol=1e-5)
            # and the eager step is the model's own cached forward: the last logits of the whole sequence
            torch.testing.assert_close(logits[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_greedy_decoding_on_onnxruntime_equals_generate(onnx_programs):
    """The documented loop on the two ONNX programs, on a left-padded batch, gives generate()'s greedy tokens."""
    model, _, _, prefill_session, step_session = onnx_programs
    ids, mask = left_padded_batch([random_ids(1, n, seed=n)[0] for n in (6, 11, 3)])
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    got = greedy_decode_onnx(
        prefill_session, step_session, ids.numpy(), mask.numpy(), 12, model.config.eos_token_id, model.config.pad_token_id
    )
    assert got.shape[1] > ids.shape[1] + 3  # several tokens generated, not an early stop
    assert got.tolist() == want.tolist()
