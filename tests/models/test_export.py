"""The decoders with their state as explicit tensors: torch.export of the step and of the prompt pass (dynamic batch
and length), ONNX export run by onnxruntime, torch.compile(fullgraph=True)."""

import pytest
import torch
from helpers import causal_lm, left_padded_batch, random_ids

from hf_linear_attn import DecoderPrefill, DecoderStateStep


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


@pytest.mark.parametrize("variant", ["linear-elu", "linear-favor", "linear-hedgehog", "linear-window", "linear-decay",
                                     "linear-gated", "linear-delta", "linear-conv", "linear-delta-conv",
                                     "linear-gated-delta-conv", "linear-kda-conv", "linear-hybrid-conv", "gpt2-conv"])
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
    "linear-elu", "linear-window", "linear-gated", "linear-conv", "linear-delta-conv", "linear-kda-conv",
    pytest.param("linear-favor", marks=pytest.mark.slow),
    pytest.param("linear-hedgehog", marks=pytest.mark.slow),
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
            # KDA's output norm divides each head's output by its rms, which magnifies the float32 rounding by which
            # the exported kernel (the decayed products unsplit) and the eager one (split at the chunk's middle) differ
            tolerance = 3e-5 if model.config.delta_output_norm else 1e-5
            torch.testing.assert_close(logits, want.logits, atol=tolerance, rtol=tolerance)
            for got, expected in zip(state, states_of(want.past_key_values), strict=True):
                # float32 sums of ~40 terms in two orders: an absolute bound relative to the state's largest entry
                # (states reach ~60 here, so 1e-5 absolute on an entry near 0 is below their rounding)
                scale = max(1.0, expected.float().abs().max().item())
                torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=1e-5)



@pytest.mark.slow
def test_torch_export_of_the_model_forward_without_cache_serves_every_length():
    """The causal LM's own forward (use_cache=False: logits only) exports with a dynamic batch and length too."""
    model = causal_lm("linear-elu")
    batch = torch.export.Dim("batch", min=1, max=64)
    length = torch.export.Dim("length", min=1, max=model.config.n_positions)
    exported = torch.export.export(
        model, (random_ids(2, 29),), kwargs={"use_cache": False},
        dynamic_shapes={"input_ids": {0: batch, 1: length}, "use_cache": None},
    ).module()
    ids = random_ids(3, 40, seed=3)
    with torch.no_grad():
        for rows, n in ((2, 29), (1, 1), (3, 8), (1, 40)):
            torch.testing.assert_close(
                exported(ids[:rows, :n], use_cache=False).logits, model(ids[:rows, :n]).logits, atol=1e-5, rtol=1e-5
            )

@pytest.mark.parametrize("variant", ["linear-elu", "linear-conv"])
def test_the_exported_prompt_pass_leaves_left_padding_out_of_the_state(variant):
    """A left-padded batch through the exported program: each row's logits and state equal the row run alone (with a
    short convolution, a row shorter than its buffer too)."""
    model = causal_lm(variant)
    exported = exported_prefill(model)
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 13, 2)]
    ids, mask = left_padded_batch(prompts)
    with torch.no_grad():
        logits, *state = exported(ids, mask)
        for row, prompt in enumerate(prompts):
            alone = model(prompt[None], use_cache=True)
            torch.testing.assert_close(logits[row, -len(prompt):], alone.logits[0], atol=1e-5, rtol=1e-5)
            for got, expected in zip(state, states_of(alone.past_key_values), strict=True):
                torch.testing.assert_close(got[row], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["linear-hedgehog", "linear-conv"])
def test_the_step_continues_from_the_prompt_pass(variant):
    model = causal_lm(variant)
    prefill, step = DecoderPrefill(model).eval(), DecoderStateStep(model).eval()
    ids = random_ids(2, 12)
    with torch.no_grad():
        _, *state = prefill(ids[:, :11], torch.ones(2, 11, dtype=torch.long))
        logits = step(ids[:, 11:], torch.full((2, 1), 11), *state)[0]
        torch.testing.assert_close(logits[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ hybrid schedules: full-attention layers in slots

@pytest.mark.parametrize("variant", ["linear-hybrid", "linear-hybrid-conv"])
def test_the_hybrid_step_keeps_fixed_shapes_and_equals_the_model(variant):
    """A full-attention layer then a linear one: 20 tokens one step at a time from the empty state, then 5 at once,
    give the whole-sequence forward's logits at every position (its full layer is GPT-2's attention over the growing
    sequence: an independent path), and no state shape changes on the way."""
    model = causal_lm(variant)
    step = DecoderStateStep(model).eval()
    ids = random_ids(2, 25, seed=3)
    state = step.initial_state(2)
    assert step.state_sizes[0] == 3 and state[0].shape[2] == model.config.n_positions
    with torch.no_grad():
        logits, after = step_through(step, ids[:, :20], state)
        more, *final = step(ids[:, 20:], torch.arange(20, 25).expand(2, 5), *after)
        want = model(ids).logits
    torch.testing.assert_close(torch.cat([logits, more], dim=1), want, atol=1e-5, rtol=1e-5)
    assert [t.shape for t in final] == [t.shape for t in state] and final[2].tolist() == [25, 25]


def test_the_hybrid_prompt_pass_exports_leaves_pads_out_and_the_exported_step_continues_it():
    """One exported prompt pass (dynamic batch and length) on a left-padded batch: each row's logits are the row's
    alone; the exported step then continues every row as the model continues the unpadded row."""
    model = causal_lm("linear-hybrid")
    prefill, step = exported_prefill(model), DecoderStateStep(model).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    example = step.initial_state(2)
    step_program = torch.export.export(
        step, (random_ids(2, 1), torch.zeros(2, 1, dtype=torch.long), *example),
        dynamic_shapes=({0: batch}, {0: batch}, tuple({0: batch} for _ in example)),
    ).module()
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 13, 2)]
    ids, mask = left_padded_batch(prompts)
    following = random_ids(3, 3, seed=9)
    with torch.no_grad():
        logits, *state = prefill(ids, mask)
        position = mask.sum(-1, keepdim=True)
        steps = []
        for t in range(3):
            out, *state = step_program(following[:, t : t + 1], position + t, *state)
            steps.append(out)
        for row, prompt in enumerate(prompts):
            whole = torch.cat([prompt, following[row]])[None]
            alone = model(whole).logits[0]
            torch.testing.assert_close(logits[row, -len(prompt):], alone[: len(prompt)], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.cat(steps, dim=1)[row], alone[len(prompt):], atol=1e-5, rtol=1e-5)
    assert state[2].tolist() == [len(p) + 3 for p in prompts]


def test_gpt2_with_short_conv_steps_in_slots_and_continues_the_prompt_pass_with_pads_left_out():
    """GPT-2 + short conv (short_conv_on_full_attention): each layer's explicit state is its key / value slots and the
    convolution's buffer (4 tensors). Stepping token by token from the empty state, then 5 at once, gives the whole
    forward's logits with no shape change; a left-padded prompt pass (DecoderPrefill) then the step continue every row
    as the model continues the row alone (a row shorter than the buffer too)."""
    model = causal_lm("gpt2-conv")
    step = DecoderStateStep(model).eval()
    ids = random_ids(2, 25, seed=3)
    state = step.initial_state(2)
    assert step.state_sizes == [4, 4] and state[0].shape[2] == model.config.n_positions and state[3].shape == (2, 3, 96)
    with torch.no_grad():
        logits, after = step_through(step, ids[:, :20], state)
        more, *final = step(ids[:, 20:], torch.arange(20, 25).expand(2, 5), *after)
        torch.testing.assert_close(torch.cat([logits, more], dim=1), model(ids).logits, atol=1e-5, rtol=1e-5)
    assert [t.shape for t in final] == [t.shape for t in state] and final[2].tolist() == [25, 25]
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 13, 2)]
    padded, mask = left_padded_batch(prompts)
    following = random_ids(3, 3, seed=9)
    with torch.no_grad():
        prompt_logits, *state = DecoderPrefill(model).eval()(padded, mask)
        position, outs = mask.sum(-1, keepdim=True), []
        for t in range(3):
            out, *state = step(following[:, t : t + 1], position + t, *state)
            outs.append(out)
        for row, prompt in enumerate(prompts):
            alone = model(torch.cat([prompt, following[row]])[None]).logits[0]
            torch.testing.assert_close(prompt_logits[row, -len(prompt):], alone[: len(prompt)], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.cat(outs, dim=1)[row], alone[len(prompt):], atol=1e-5, rtol=1e-5)


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
    return [f"{prefix}.{layer}.{i}" for layer, size in enumerate(step.state_sizes) for i in range(size)]


@pytest.fixture(scope="module")
def onnx_programs(tmp_path_factory):
    """The tiny linear-elu decoder's prompt pass and step exported to ONNX (dynamo) once, with onnxruntime sessions."""
    return export_to_onnx("linear-elu", tmp_path_factory.mktemp("onnx"))


def export_to_onnx(variant, folder):
    """(model, prefill, step, prefill session, step session): the variant's prompt pass and step in ONNX."""
    ort = pytest.importorskip("onnxruntime", reason="ONNX parity needs the onnx extra: pip install 'hf-linear-attn[onnx]'")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the onnx extra)")
    model = causal_lm(variant)
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


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["linear-window-conv", "linear-hybrid-conv", "gpt2-conv"])
def test_window_hybrid_and_short_conv_decoders_greedy_on_onnxruntime_equal_generate(variant, tmp_path):
    """Window + linear attention (W = 5), or a full-attention layer (its keys and values in slots) before a linear
    one, or GPT-2 + conv (every layer full attention, the convolution on it too), each with a short convolution on
    q, k, v (K = 4): the prompt pass (the window's quadratic form under export) and the step (the window and the
    convolution's buffer shifting by one slot; the full layer's next slot) in ONNX;
    the documented greedy loop on a left-padded batch gives generate()'s tokens, with prompts shorter than the
    convolution, shorter and longer than the window. (One export for both: each costs ~20 s.)"""
    model, _, _, prefill_session, step_session = export_to_onnx(variant, tmp_path)
    ids, mask = left_padded_batch([random_ids(1, n, seed=n)[0] for n in (2, 11, 7)])
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    got = greedy_decode_onnx(
        prefill_session, step_session, ids.numpy(), mask.numpy(), 12, model.config.eos_token_id, model.config.pad_token_id
    )
    assert got.shape[1] > ids.shape[1] + 3
    assert got.tolist() == want.tolist()


# ------------------------------------------------------------------ causal block Linformer: fixed-capacity state

def linformer_step_inputs(variant="linformer-headwise", batch=2, n=30):
    model = causal_lm(variant)
    step = DecoderStateStep(model).eval()
    return model, step, random_ids(batch, n)


def step_through(step, ids, state, first_position=0):
    """Feed ``ids`` one token per call; returns the logits (B, n, vocab) and the final state."""
    logits = []
    for t in range(ids.shape[1]):
        out, *state = step(ids[:, t : t + 1], torch.full((ids.shape[0], 1), first_position + t), *state)
        logits.append(out)
    return torch.cat(logits, dim=1), state


@pytest.mark.parametrize("variant", ["linformer-headwise", "linformer-key-value"])
def test_the_linformer_step_keeps_fixed_shapes_and_equals_the_model(variant):
    """30 tokens (several completed blocks) one step at a time from the fixed-capacity state: the logits of the
    whole-sequence forward at every position, and not one state shape changes on the way."""
    model, step, ids = linformer_step_inputs(variant)
    state = step.initial_state(2)
    capacity = model.config.n_positions // model.config.linformer_block_size
    assert state[0].shape[2] == capacity and state[2].dtype == torch.bool and state[5].dtype == torch.long
    with torch.no_grad():
        logits, final = step_through(step, ids, state)
        torch.testing.assert_close(logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert [t.shape for t in final] == [t.shape for t in state]
    assert int(final[2].sum(-1).max()) == 30 // model.config.linformer_block_size  # the completed blocks were stored


def test_the_linformer_step_compiles_as_one_graph():
    model, step, ids = linformer_step_inputs()
    with torch.no_grad():
        _, state = step_through(step, ids[:, :10], step.initial_state(2))
        explanation = torch._dynamo.explain(step)(ids[:, 10:11], torch.full((2, 1), 10), *state)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.slow
def test_the_linformer_step_exports_with_a_dynamic_batch_and_runs_on_onnxruntime():
    """torch.export traced mid-block at batch 2; run from the empty state over three blocks at batches 1 to 3 (the
    block completions happen in the exported program), then the same program through ONNX where installed."""
    model, step, _ = linformer_step_inputs()
    ids = random_ids(3, 30, seed=4)
    with torch.no_grad():
        _, state = step_through(step, ids[:2, :10], step.initial_state(2))
        batch = torch.export.Dim("batch", min=1, max=64)
        program = torch.export.export(
            step, (ids[:2, 10:11], torch.full((2, 1), 10), *state),
            dynamic_shapes=({0: batch}, {0: batch}, tuple({0: batch} for _ in state)),
        )
        want = model(ids).logits
        for rows in (3, 1, 2):
            logits, _ = step_through(program.module(), ids[:rows], step.initial_state(rows))
            torch.testing.assert_close(logits, want[:rows], atol=1e-5, rtol=1e-5)

    ort = pytest.importorskip("onnxruntime", reason="ONNX parity needs the onnx extra: pip install 'hf-linear-attn[onnx]'")
    pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the onnx extra)")
    session = ort.InferenceSession(
        torch.onnx.export(program, dynamo=True, verbose=False).model_proto.SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    names = [node.name for node in session.get_inputs()]
    state = [t.numpy() for t in step.initial_state(2)]
    for t in range(30):
        logits, *state = session.run(None, dict(zip(names, [ids[:2, t : t + 1].numpy(), torch.full((2, 1), t).numpy(), *state])))
        torch.testing.assert_close(torch.from_numpy(logits)[:, 0], want[:2, t], atol=1e-5, rtol=1e-5)


def test_a_full_fixed_capacity_state_is_refused_with_the_fix():
    from hf_linear_attn.block_linformer import block_linformer_step, empty_block_linformer_state

    g = torch.Generator().manual_seed(0)
    q = k = v = torch.randn(1, 2, 1, 4, generator=g)
    projection = torch.randn(1, 2, 3, generator=g)  # blocks of 3 tokens into 2 rows
    state = empty_block_linformer_state(1, 2, 4, 2, 3, torch.float32, "cpu", capacity=1)
    for _ in range(3):  # the first block fills the only slot
        _, state = block_linformer_step(q, k, v, state, projection, projection, grow=False)
    assert state.summary_valid.tolist() == [[True]]
    for _ in range(2):
        _, state = block_linformer_step(q, k, v, state, projection, projection, grow=False)
    with pytest.raises(ValueError, match="holds 1 block summaries.*capacity"):
        block_linformer_step(q, k, v, state, projection, projection, grow=False)


def test_the_prompt_pass_export_refuses_the_linformer_with_the_fix():
    with pytest.raises(ValueError, match="Feed the prompt to DecoderStateStep"):
        DecoderPrefill(causal_lm("linformer-headwise"))


# ------------------------------------------------------------------------- generate() with a compile configuration

def test_generate_with_a_compile_config_decodes_with_the_compiled_forward():
    """generate() compiles the forward for its decoding steps when the cache is compileable (the linear decoder's
    fixed-shape state cache is). A counting backend proves the compiled graphs ran, fullgraph=True that there was no
    graph break, and the tokens equal eager greedy decoding."""
    from transformers import CompileConfig

    model = causal_lm("linear-elu")
    ids, mask = left_padded_batch([random_ids(1, n, seed=n)[0] for n in (6, 11, 3)])
    want = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, min_new_tokens=10)

    graphs, runs = [], []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)

        def run(*args):
            runs.append(len(graphs))
            return graph_module.forward(*args)

        return run

    config = CompileConfig(backend=counting_backend, mode=None, fullgraph=True)
    # transformers compiles on accelerators only; this flag of its CompileConfig (for tests) lifts that on CPU
    config._compile_all_devices = True
    torch._dynamo.reset()  # other tests' compilations of the same forward must not count against the recompile limit
    got = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, min_new_tokens=10, compile_config=config)
    assert got.tolist() == want.tolist()
    assert len(runs) == 9  # every decoding step after the eager prompt pass ran a compiled graph
    # one graph for the first step's cache length, one with that length symbolic for every later step: no
    # recompilation per token
    assert len(graphs) <= 2



def test_a_growing_block_linformer_state_still_grows_under_torch_compile():
    """The generation cache's growing state keeps its value checks when the step is compiled (graph breaks), rather
    than the fixed-capacity path, which would overwrite the last summary once the slots in use are full."""
    from hf_linear_attn.block_linformer import block_linformer_step, empty_block_linformer_state

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 4, generator=g) for _ in range(3))
    projection = torch.randn(1, 2, 3, generator=g)  # blocks of 3 tokens into 2 rows
    compiled_step = torch.compile(block_linformer_step, backend="eager")
    torch._dynamo.reset()
    eager = compiled = empty_block_linformer_state(2, 2, 4, 2, 3, torch.float32, "cpu")
    for t in range(7):  # blocks complete at tokens 3 and 6
        token = [x[:, :, t : t + 1] for x in (q, k, v)]
        want, eager = block_linformer_step(*token, eager, projection, projection)
        got, compiled = compiled_step(*token, compiled, projection, projection)
        torch.testing.assert_close(got, want)
    assert compiled.summary_valid.shape[1] == 2
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)
